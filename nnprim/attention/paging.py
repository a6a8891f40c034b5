"""Paged K/V addressing shared by the Triton kernels, and the append scatter kernel.

Key j of sequence b lives in page block_table[b, j // PAGE], row j % PAGE of a pool
(num_pages, Hkv, PAGE, D); a kernel adds `pg * s_page + pi * s_row` to the base of its
KV head (`K + hk * s_h`) where the contiguous cache adds `j * s_row` to
`K + b * s_b + hk * s_h`. `page_rows` gives (pg, pi) of a block of keys: when PAGE is a
multiple of BLOCK_N and the block starts at a multiple of BLOCK_N (every kernel's key loop
does) the block never straddles pages, so one page id is loaded per block and rows stay
contiguous; otherwise each row looks its page up (page sizes below the key block, or
not a power of two). PAGE == 0 means not paged: (0, j)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import interpreting


@triton.jit
def page_rows(BT, offs_n, n_ok, n0, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(page id, row in its page) as int64 for keys offs_n = n0 + arange(BLOCK_N) of the
    sequence whose block-table row starts at BT; (0, offs_n) when PAGE == 0. Rows with
    n_ok False read no table entry (page 0)."""
    if PAGE == 0:
        return tl.zeros([BLOCK_N], dtype=tl.int64), offs_n.to(tl.int64)
    elif PAGE % BLOCK_N == 0:
        pg = tl.load(BT + n0 // PAGE).to(tl.int64)
        return pg + tl.zeros([BLOCK_N], dtype=tl.int64), (offs_n % PAGE).to(tl.int64)
    else:
        pg = tl.load(BT + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        return pg, (offs_n % PAGE).to(tl.int64)


def pipeline_stages(num_stages: int, page: int) -> int:
    """The num_stages to compile a paged key loop with so that K/V get the prefetch depth the
    contiguous loop gets from `num_stages`. Triton's pipeliner (3.6, AssignLatencies) gives each
    load (num_stages - 1) // (indirection levels + 1) iterations of latency; a K/V tile whose
    address needs its block-table entry is one level deep, so num_stages 3 left K/V a single
    buffer (offline sm_90 compile: 73 KB of shared memory against 139 KB contiguous, bf16
    128-key tiles; benchmarks/diag/paged_ir.py). 2 * num_stages - 1 restores (num_stages - 1)."""
    return 2 * num_stages - 1 if page and num_stages > 1 else num_stages


@triton.jit
def _scatter_rows_kernel(DST0, SRC0, DST1, SRC1, BT, LENS,
                         s_db0, s_dh0, s_dn0, s_dx0, s_sb0, s_sh0, s_sn0, s_sx0,
                         s_db1, s_dh1, s_dn1, s_dx1, s_sb1, s_sh1, s_sn1, s_sx1,
                         s_bt, H, S, n_table,
                         X0: tl.constexpr, X1: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_X0: tl.constexpr, BLOCK_X1: tl.constexpr,
                         TWO: tl.constexpr):
    """Program (b * H + h, block of new tokens): rows s of SRC (B, H, S, X) go to
    DST[page, h, row] (num_pages, H, PAGE, X) at position kv_lens[b] + s; rows past the
    block table are skipped (the host checks for them outside graph capture)."""
    pid = tl.program_id(0)
    b = pid // H
    h = (pid % H).to(tl.int64)
    b64 = b.to(tl.int64)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos = tl.load(LENS + b).to(tl.int64) + offs_s
    ok = (offs_s < S) & (pos >= 0) & (pos < n_table * PAGE)
    pg = tl.load(BT + b64 * s_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
    row = pos % PAGE
    offs_x0 = tl.arange(0, BLOCK_X0)
    m0 = ok[:, None] & (offs_x0[None, :] < X0)
    x0 = tl.load(SRC0 + b64 * s_sb0 + h * s_sh0 + offs_s[:, None].to(tl.int64) * s_sn0 + offs_x0[None, :] * s_sx0,
                 mask=m0)
    tl.store(DST0 + pg[:, None] * s_db0 + h * s_dh0 + row[:, None] * s_dn0 + offs_x0[None, :] * s_dx0,
             x0.to(DST0.dtype.element_ty), mask=m0)
    if TWO:
        offs_x1 = tl.arange(0, BLOCK_X1)
        m1 = ok[:, None] & (offs_x1[None, :] < X1)
        x1 = tl.load(SRC1 + b64 * s_sb1 + h * s_sh1 + offs_s[:, None].to(tl.int64) * s_sn1
                     + offs_x1[None, :] * s_sx1, mask=m1)
        tl.store(DST1 + pg[:, None] * s_db1 + h * s_dh1 + row[:, None] * s_dn1 + offs_x1[None, :] * s_dx1,
                 x1.to(DST1.dtype.element_ty), mask=m1)


def scatter_rows(dst: list[torch.Tensor], src: list[torch.Tensor], block_table: torch.Tensor,
                 kv_lens: torch.Tensor, page: int) -> None:
    """dst[i][block_table[b, p // page], h, p % page] = src[i][b, h, s] for p = kv_lens[b] + s,
    two (dst, src) pairs per launch (K and V parts of the same kind)."""
    B, H, S = src[0].shape[:3]
    n_table = block_table.shape[1]
    interp = interpreting()
    for i in range(0, len(dst), 2):
        pairs = list(zip(dst[i:i + 2], src[i:i + 2]))
        (d0, s0), (d1, s1) = pairs[0], pairs[-1]
        x0, x1 = s0.shape[3], s1.shape[3]
        bx0 = triton.next_power_of_2(x0)
        bx1 = triton.next_power_of_2(x1)
        block_s = max(1, min(64, triton.next_power_of_2(S), 8192 // max(bx0, bx1)))
        if interp:
            block_s = min(block_s, 16)
        grid = (B * H, triton.cdiv(S, block_s))
        _scatter_rows_kernel[grid](d0, s0, d1, s1, block_table, kv_lens,
                                   *d0.stride(), *s0.stride(), *d1.stride(), *s1.stride(),
                                   block_table.stride(0), H, S, n_table,
                                   X0=x0, X1=x1, PAGE=page, BLOCK_S=block_s, BLOCK_X0=bx0, BLOCK_X1=bx1,
                                   TWO=len(pairs) == 2, num_warps=4)


__all__ = ["page_rows", "pipeline_stages", "scatter_rows"]
