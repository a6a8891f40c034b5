"""NCHW <-> NHWC copies as one tiled Triton transpose per image (the layout changes of the
NCHW-via-NHWC solvers 23/24/25).

torch's `contiguous(memory_format=...)` of a bf16 activation moves ~0.7 TB/s on the H200
(rn50_r3_3x3 NCHW, 2026-12-01: 0.15 ms of the 0.20 ms call went to the two copies around a
0.053 ms kernel): one side of its elementwise copy is strided. Here a [BR, BC] tile is read
coalesced along one side, transposed in registers / shared memory by `tl.trans`, and
written coalesced along the other.

A logical (N, C, *spatial) tensor in one layout is an [N, R, Q] matrix per image in memory
(NCHW: R = C, Q = prod(spatial); NHWC: R = prod(spatial), Q = C); the copy to the other
layout writes its [N, Q, R] transpose."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..launch import interpreting
from ..problems.conv import empty_in_layout, layout_of, to_layout

BR = 64
BC = 64
MAX_GRID_Y = 65535


@triton.jit
def _transpose_kernel(src, dst, R, Q, BR: tl.constexpr, BC: tl.constexpr):
    """dst[n, q, r] = src[n, r, q] for one [BR, BC] tile of image n = program_id(1)."""
    n_q = tl.cdiv(Q, BC)
    pr = tl.program_id(0) // n_q
    pq = tl.program_id(0) - pr * n_q
    base = tl.program_id(1).to(tl.int64) * R * Q
    rr = pr * BR + tl.arange(0, BR)
    qq = pq * BC + tl.arange(0, BC)
    mask = (rr < R)[:, None] & (qq < Q)[None, :]
    t = tl.load(src + base + rr[:, None] * Q + qq[None, :], mask=mask)
    tl.store(dst + base + qq[:, None] * R + rr[None, :], tl.trans(t), mask=tl.trans(mask))


def _fast(t: torch.Tensor) -> bool:
    return (t.is_cuda or interpreting()) and t.dim() >= 3 and t.shape[0] <= MAX_GRID_Y \
        and math.prod(t.shape[1:]) < 2 ** 31


def change_layout(t: torch.Tensor, layout: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """t stored in `layout` ("nchw" | "nhwc"), as `to_layout`, written into `out` when
    given (a logical-shaped tensor in `layout`). A standard NCHW <-> NHWC change runs the
    transpose kernel; anything else (other strides, CPU without the interpreter) to_layout."""
    src = layout_of(t)
    std = t.is_contiguous() if src == "nchw" else t.permute(0, *range(2, t.dim()), 1).is_contiguous()
    if src == layout or not std or not _fast(t):
        res = to_layout(t, layout)
        return res if out is None else out.copy_(res)
    if out is None or layout_of(out) != layout:
        dst = empty_in_layout(t.shape, layout, dtype=t.dtype, device=t.device)
    else:
        dst = out
    N, C, spatial = t.shape[0], t.shape[1], math.prod(t.shape[2:])
    R, Q = (C, spatial) if src == "nchw" else (spatial, C)
    _transpose_kernel[(triton.cdiv(R, BR) * triton.cdiv(Q, BC), N)](t, dst, R, Q, BR, BC, num_warps=4)
    if out is not None and dst is not out:
        return out.copy_(dst)
    return dst
