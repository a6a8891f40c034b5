"""CPU per-tap convolution backward weights (family `gemm`, id 13 `CpuTapBwdWeights`):
one GEMM per filter tap over ALL output positions, no im2col, for stride-1 problems
with bf16 inputs and output on CPUs with native bf16 (avx512_bf16 / amx_bf16).

Math (groups G, Kg = K/G, Cg = C/G; padded grid P = in + pad_before + pad_after per
spatial dim, flattened with strides ps; stride 1, so out = P - d*(f-1)):
  x_pad   (C, N*prod(P) + slack)  channel-major, zero halo and zero slack
  dy_wide (K, N*prod(P))          dy on the padded grid, zero where o_i >= out_i
  tap f:  off_f = sum_i f_i * d_i * ps_i
          dw[g*Kg + k, c, f] = sum_q dy_wide[g*Kg + k, q] * x_pad[g*Cg + c, q + off_f]
A valid position q (o_i < out_i) reads o_i + f_i*d_i <= P_i - 1: its own row and image.
Junk positions read whatever follows (finite: staged x or the zero slack) times dy = 0.

Each dw element is ONE GEMM's output: the bf16 GEMM (oneDNN, f32 accumulation inside
over all N*prod(P) positions) rounds once, to the result's dtype -- the contract's f32
accumulation, unlike a per-block bf16 GEMM whose partials are rounded before they are
summed. Both operands are plain row-major views (row stride of x_pad is its row length),
so the GEMM reads them in place. Cost over the im2col GEMM (solver 12): no column buffer
(F x the input) and the native bf16 GEMM instead of the f32 one; the extra work is the
junk positions ((prod(P) - prod(out)) / prod(out), 7 % on a padded 56x56 3x3).
f32 is not served: the f32 GEMM with a reduction of N*prod(P) and a 64x64 output runs at
half the speed of the im2col GEMM's (benchmarks/CPU_SPEED.md), and f16 has no native GEMM."""
from __future__ import annotations

import itertools
import math

import torch

from ..args import ConvArgs
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import Solver, register
from .cpu_gemm import cpu_has_native_bf16, workspace
from .cpu_im2col import physical

_ALIGN = 64


def _grid(p: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(padded sizes P, their row-major strides ps, elements per image prod(P))."""
    P = tuple(i + a + b for i, a, b in zip(p.in_size, p.pad_before, p.pad_after))
    ps = [1] * len(P)
    for i in range(len(P) - 2, -1, -1):
        ps[i] = ps[i + 1] * P[i + 1]
    return P, tuple(ps), math.prod(P)


def tap_offsets(p: ConvProblem) -> list[int]:
    """Flat offset of each filter tap on the padded grid, taps in row-major filter order."""
    _, ps, _ = _grid(p)
    return [sum(f * d * s for f, d, s in zip(fi, p.dilation, ps))
            for fi in itertools.product(*(range(f) for f in p.filter))]


def _sizes(p: ConvProblem) -> tuple[int, int, int]:
    """(elements of x_pad, of dy_wide, row length of x_pad)."""
    _, _, pt = _grid(p)
    mt = p.N * pt
    row = mt + max(tap_offsets(p))
    return p.C * row, p.K * mt, row


def _bytes(n: int, dt: torch.dtype) -> int:
    return -(-n * dt.itemsize // _ALIGN) * _ALIGN


def workspace_bytes(p: ConvProblem) -> int:
    nx, ndy, _ = _sizes(p)
    return _bytes(nx, p.dtype) + _bytes(ndy, p.dtype)


def _stage(p: ConvProblem, x: torch.Tensor, dy: torch.Tensor, ws: torch.Tensor, pm: bool
           ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x_pad and dy_wide in the workspace: position-major ((row, C), (N*prod(P), K): nhwc
    inputs copy row by row) or channel-major ((C, row), (K, N*prod(P)): nchw inputs copy
    plane by plane). Both buffers are zeroed whole (halo, junk and slack; one memset),
    then the interiors are copied."""
    P, _, pt = _grid(p)
    nx, ndy, row = _sizes(p)
    mt = p.N * pt
    xbuf = ws[:nx * p.dtype.itemsize].view(p.dtype)
    off = _bytes(nx, p.dtype)
    dbuf = ws[off:off + ndy * p.dtype.itemsize].view(p.dtype)
    xbuf.zero_()
    dbuf.zero_()
    inner = tuple(slice(b, b + n) for b, n in zip(p.pad_before, p.in_size))
    valid = tuple(slice(0, o) for o in p.out_size)
    if pm:
        xp, dyw = xbuf.view(row, p.C), dbuf.view(mt, p.K)
        xp[:mt].view(p.N, *P, p.C)[(slice(None), *inner)].copy_(physical(x, "nhwc"))
        dyw.view(p.N, *P, p.K)[(slice(None), *valid)].copy_(physical(dy, "nhwc"))
    else:
        xp, dyw = xbuf.view(p.C, row), dbuf.view(p.K, mt)
        xp[:, :mt].view(p.C, p.N, *P)[(slice(None), slice(None), *inner)].copy_(x.transpose(0, 1))
        dyw.view(p.K, p.N, *P)[(slice(None), slice(None), *valid)].copy_(dy.transpose(0, 1))
    return xp, dyw, mt


def tap_bwd_weights(p: ConvProblem, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    pm = p.layout == "nhwc"
    xp, dyw, mt = _stage(p, args.x, args.dy, ws, pm)
    offs = tap_offsets(p)
    F = len(offs)
    # torch.mm (oneDNN's bf16 matmul) takes the transposed, row-strided views in place.
    out = torch.empty(F, G, Kg, Cg, dtype=p.out_dtype)      # tap-major dw pieces
    outt = out.view(F, G, Cg, Kg)                            # position-major: dw^T pieces
    for t, o in enumerate(offs):
        for g in range(G):
            ck, kk = slice(g * Cg, (g + 1) * Cg), slice(g * Kg, (g + 1) * Kg)
            if pm:    # (Cg, mt) . (mt, Kg)
                torch.mm(xp[o:o + mt, ck].t(), dyw[:, kk], out=outt[t, g])
            else:     # (Kg, mt) . (mt, Cg)
                torch.mm(dyw[kk], xp[ck, o:o + mt].t(), out=out[t, g])
    src = (outt.transpose(2, 3) if pm else out).reshape(*p.filter, p.K, Cg)
    dw = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
    nd = p.ndim
    if p.layout == "nchw":
        dw.copy_(src.permute(nd, nd + 1, *range(nd)))
    else:   # physical (K, filter.., Cg)
        physical(dw, "nhwc").copy_(src.permute(nd, *range(nd), nd + 1))
    return dw


@register
class CpuTapBwdWeights(Solver):
    id = 13
    name = "CpuTapBwdWeights"
    family = "gemm"
    primitive = "conv"
    directions = frozenset({"bwd_weights"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.bfloat16})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        if any(s != 1 for s in p.stride):
            reasons.append(f"stride={p.stride}: per-tap GEMMs need stride 1")
        if p.out_dtype != p.dtype:
            reasons.append(f"out_dtype={p.out_dtype}: the bf16 GEMM output is the result (bf16 only)")
        if not cpu_has_native_bf16():
            reasons.append("CPU without avx512_bf16/amx_bf16: no native bf16 GEMM")
        if p.C // p.groups < 8 or p.K // p.groups < 8:
            reasons.append(f"groups={p.groups}: per-group GEMMs under 8x8 (the im2col GEMM is faster)")
        return reasons

    def workspace_size(self, p: ConvProblem) -> int:
        return workspace_bytes(p)

    def estimate(self, p: ConvProblem) -> float:
        # native bf16 GEMM at ~150 GFLOP/s per core on these reduction-heavy shapes (measured
        # 130-210, plus the junk positions), staging (zero + copy) at ~8 GB/s per core.
        cores = max(1, torch.get_num_threads())
        _, _, pt = _grid(p)
        junk = pt / max(1, math.prod(p.out_size))
        t = p.flops() * junk / (150e9 * cores) + 2.0 * workspace_bytes(p) / (8e9 * cores)
        return t * 1e3

    def prepare(self, p: ConvProblem):
        nbytes = workspace_bytes(p)

        def invoke(args: ConvArgs) -> torch.Tensor:
            with workspace(nbytes) as ws:
                return tap_bwd_weights(p, args, ws)
        return invoke


__all__ = ["CpuTapBwdWeights", "tap_bwd_weights", "tap_offsets", "workspace_bytes"]
