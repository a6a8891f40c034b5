"""bf16 backward weights on avx512_bf16 without AMX (issue 16): cpu_brgemm_bwd_weights' (id 82)
native path on such CPUs (`own_kernel`), the C++ in cpu_wgrad_src.cpp.

Reduction over positions: dW_f[g] = sum over valid output positions q of X_{rho_f}[q + off_f, g]^T
dy[q, g], on cpu_tap's phase grid as before (x staged channel-major, dy packed straight from its
own layout into VNNI pairs of grid positions). Where
torch's brgemm reduced over whole 32-position blocks of the grid (junk columns of the padded
grid included) in one call per (chunk, tap, 64 columns), our register-blocked vdpbf16ps tile
reduces over the valid line runs only (`wgrad_segments`), across a chunk's runs and taps
without leaving registers, with B blocks as wide as the group (16-channel groups: 16 columns,
not 64), and dw is written in its own layout (no permuting copy afterwards).
"""
from __future__ import annotations

import math

import torch

from ..problems.conv import ConvProblem
from .cpu_gemm import cpu_flags
from .cpu_tap import tap_grid

BF16 = torch.bfloat16
# positions per pass over the output: one pass's B and x^T rows stay in L2, and every pass loads
# and stores the f32 output once. In-process on the 2-core EPYC (2026-12-03, 1 and 2 threads,
# kernel only): rn50_r2 / c3d_small / grouped_g8 (output 74-221 KB) best at 1024, rn50_r4 (2.4 MB)
# 9.45 ms at 2048 against 10.06 at 1024 and 11.29 at 512 (1 thread)
CHUNK, CHUNK_BIG_OUT, BIG_OUT_BYTES = 1024, 2048, 512 << 10


def own_kernel(p: ConvProblem) -> bool:
    """bf16 backward weights on a CPU with avx512_bf16 and without AMX (on AMX the tile
    kernels of torch's brgemm stay)."""
    flags = cpu_flags()
    return (p.direction == "bwd_weights" and p.dtype == BF16 and "avx512_bf16" in flags
            and "amx_bf16" not in flags)


def cm_rows(rows: int) -> int:
    """Columns of the channel-major staged x: a multiple of 32, not of 1024 (the kernel reads
    MB channel rows at once: rows a multiple of 2 KiB apart would share L1 sets)."""
    rows = -(-rows // 32) * 32
    return rows + 32 if rows % 1024 == 0 else rows


def _pad3(t: tuple[int, ...], fill: int) -> list[int]:
    return [fill] * (3 - len(t)) + list(t)


def chunk_positions(p: ConvProblem) -> int:
    """Positions per pass (CHUNK): more where the f32 output (taps x C x K/G) is large."""
    out = math.prod(p.filter) * p.C * (-(-(p.K // p.groups) // 16) * 16) * 4
    return CHUNK_BIG_OUT if out > BIG_OUT_BYTES else CHUNK


def wgrad_segments(p: ConvProblem, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks (nch, 4): start, span, first segment, end segment; segs (nseg, 2): start, length)
    on the grid of cpu_tap.tap_grid. Segments are the valid output lines, widened to even ends
    (vdpbf16ps takes positions in pairs; a widened position is a junk one, dy = 0 there, or a
    neighbour line's, merged so that none counts twice), cut at `chunk` positions; a chunk is a
    run of consecutive segments spanning at most `chunk` positions (default: chunk_positions)."""
    chunk = chunk or chunk_positions(p)
    U, _, _ = tap_grid(p)
    U3, O3 = _pad3(U, 1), _pad3(p.out_size, 1)
    runs: list[list[int]] = []
    for n in range(p.N):
        for u0 in range(O3[0]):
            for u1 in range(O3[1]):
                a = ((n * U3[0] + u0) * U3[1] + u1) * U3[2]
                a, b = a // 2 * 2, -(-(a + O3[2]) // 2) * 2
                if runs and a <= runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], b)
                else:
                    runs.append([a, b])
    segs = [(s, min(chunk, b - s)) for a, b in runs for s in range(a, b, chunk)]
    chunks: list[list[int]] = []
    for i, (s, n) in enumerate(segs):
        if chunks and s + n - chunks[-1][0] <= chunk:
            chunks[-1][1], chunks[-1][3] = s + n - chunks[-1][0], i + 1
        else:
            chunks.append([s, n, i, i + 1])
    return (torch.tensor(chunks, dtype=torch.int64).view(-1, 4), torch.tensor(segs, dtype=torch.int64).view(-1, 2))


def dw_strides(dw: torch.Tensor, ndim: int) -> tuple[int, int, int]:
    """(k, c, flattened filter index) strides of dw (K, Cg, filt..) in either layout: its filter
    dims must flatten (each stride the next's times its size)."""
    st, sh = dw.stride(), dw.shape
    for i in range(2, 1 + ndim):
        if st[i] != st[i + 1] * sh[i + 1]:
            raise ValueError("dw's filter dims do not flatten")
    return st[0], st[1], st[1 + ndim]


def wgrad_own(ops, xt: torch.Tensor, dy5: torch.Tensor, grid: list[int], taps: torch.Tensor, chunks: torch.Tensor,
              segs: torch.Tensor, dw: torch.Tensor, p: ConvProblem) -> torch.Tensor:
    """dw (p's weight shape and layout, f32 or bf16) from x staged channel-major (xt) and dy as
    it is (logical 5-D, on the 3-D `grid` of cpu_tap.tap_grid)."""
    sk, sc, sf = dw_strides(dw, p.ndim)
    ops.conv_wgrad_vnni(xt, dy5, grid, taps, chunks, segs, dw, sk, sc, sf, p.groups, p.C // p.groups,
                        p.K // p.groups)
    return dw


__all__ = ["chunk_positions", "cm_rows", "own_kernel", "wgrad_segments", "wgrad_own", "dw_strides"]
