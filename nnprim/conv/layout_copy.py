"""The NCHW <-> NHWC copies of the layout-changing solvers (layout_change.py) as one Triton
transpose per tensor.

torch's `contiguous(memory_format=channels_last)` ran these copies at ~1.2 TB/s on the
H200 (2026-12-01), which made an NCHW layer through the NHWC kernels cost 2x cuDNN's NCHW
time on rn50_r3_3x3 even though the NHWC kernel alone ran at 1.1x. A copy is the transpose
of each image's [C, P] matrix (P = the pixels): a program loads a [BC, BP] tile along P
(coalesced in NCHW) and stores it along C (coalesced in NHWC); Triton moves the tile
between the two thread layouts through shared memory.

`Transpose(shape, to)`: the planned copy of one shape (what the solvers hold);
`to_nhwc(t)`: a logical (N, C, *sp) tensor -> the same values in channels-last memory;
`to_nchw(t)`: the reverse. Other strides and CPU tensors (outside the interpreter) take
torch's copy."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..launch import Launch, interpreting
from ..limits import GRID_AXIS_MAX, fits_int32
from ..problems.conv import to_layout

BA = 64   # tile rows: channels (to NHWC) or pixels (to NCHW)
BB = 64


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, A, B, TA, TB, BA: tl.constexpr, BB: tl.constexpr):
    """dst[n, b, a] = src[n, a, b] for each image n; src, dst contiguous. One grid axis of
    n * TA * TB programs (TA, TB: tiles along a, b), tiles of one image consecutive: axes 1
    and 2 allow 65535 programs, fewer than a 4096 x 4096 image's 64-pixel tiles."""
    pid = tl.program_id(0)
    tiles = TA * TB
    img = pid // tiles
    t = pid - img * tiles
    ra = (t % TA) * BA + tl.arange(0, BA)
    rb = (t // TA) * BB + tl.arange(0, BB)
    base = img.to(tl.int64) * A * B
    m = (ra < A)[:, None] & (rb < B)[None, :]
    v = tl.load(src_ptr + base + ra[:, None] * B + rb[None, :], mask=m)
    tl.store(dst_ptr + base + rb[None, :] * A + ra[:, None], v, mask=m)


class Transpose:
    """The copy of tensors of one logical shape (N, C, *sp) into layout `to` ("nhwc" or
    "nchw"), planned once: a call costs one planned launch (~5 us of host time where
    Triton's JIT launch took 20-40, which left the GPU idle between the copies and the
    convolution of a 0.1 ms NCHW layer)."""

    def __init__(self, shape: tuple[int, ...], to: str):
        self.shape, self.to = tuple(shape), to
        nd = len(shape)
        # the kernel indexes within an image in int32, and its programs on grid axis 0
        self.runs = nd >= 3 and fits_int32(math.prod(shape[1:]))
        if not self.runs:
            return
        n, c, *sp = shape
        p = math.prod(sp)
        a, b = (c, p) if to == "nhwc" else (p, c)      # each image's [a, b] matrix -> [b, a]
        ta, tb = triton.cdiv(a, BA), triton.cdiv(b, BB)
        self.runs = n * ta * tb <= GRID_AXIS_MAX[0]
        if not self.runs:
            return
        self.launch = Launch(_transpose_kernel, (n * ta * tb,), (a, b, ta, tb, BA, BB), num_warps=4)
        self.phys_shape = (n, *sp, c)                  # NHWC memory order
        self.to_logical = (0, nd - 1, *range(1, nd - 1))
        self.nchw_strides = tuple(math.prod(shape[i + 1:]) for i in range(nd))
        self.nhwc_strides = (p * c, 1, *(c * math.prod(sp[i + 1:]) for i in range(len(sp))))
        # C == 1 or one pixel: both layouts are the same memory (nothing to copy)
        self.runs = self.nchw_strides != self.nhwc_strides

    def __call__(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """t in layout `to`: t itself when it already is (copied into `out` when given, a
        contiguous tensor of t's shape for "nchw"), else one transposing copy. The planned
        strides are checked first: the common case costs two stride comparisons."""
        fast = self.runs and (t.is_cuda or interpreting())
        if self.to == "nhwc":
            if fast and t.stride() == self.nchw_strides:
                phys = torch.empty(self.phys_shape, dtype=t.dtype, device=t.device)
                self.launch(t, phys)
                return phys.permute(*self.to_logical)
            return to_layout(t, "nhwc")
        if out is None and t.is_contiguous():
            return t
        if fast and t.stride() == self.nhwc_strides and (out is None or out.stride() == self.nchw_strides):
            dst = torch.empty(self.shape, dtype=t.dtype, device=t.device) if out is None else out
            self.launch(t, dst)
            return dst
        return to_layout(t, "nchw") if out is None else out.copy_(t)


def to_nhwc(t: torch.Tensor) -> torch.Tensor:
    """t (logical N, C, *sp) in channels-last memory: t itself when it is, else one copy."""
    return Transpose(tuple(t.shape), "nhwc")(t)


def to_nchw(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """t (logical N, C, *sp, channels-last memory) as a contiguous NCHW tensor (into `out`
    when given: a contiguous tensor of t's shape and dtype)."""
    return Transpose(tuple(t.shape), "nchw")(t, out)
