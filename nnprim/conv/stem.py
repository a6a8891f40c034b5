"""Small-channel ("stem") convolution in Triton (family `implicit_gemm`, solvers 70/71/72):
the RGB stem of image networks (ResNet-50 conv1: C=3, 7x7, stride 2, K=64) and other
convolutions whose filter rows are short, S*C <= MAX_RUN.

Forward, as a GEMM with the reduction ordered (r, s, c):
  y[m, k] = sum_r sum_j A_r[m, j] * Wf[r, j, k],  m = (n, oh, ow), j = s*CE + c,
  A_r[m, j] = x[n, oh*sh - ph + r, ow*sw - pw + j // CE, j % CE]  (0 outside the image),
  Wf[r, j, k] = w[k, j % CE, r, j // CE]  (0 for j >= S*CE or j % CE >= C).
With NHWC x and dilation 1, the S taps of one filter row read S consecutive pixels, so
A_r's row m is one contiguous run of S*CE elements: one K step per filter row, a
[BM, SCP] tile (SCP = S*CE rounded up to a power of two) loaded as plain rows instead of
the per-element div/mod gather of the flat implicit GEMM. CE is C, or C padded to a power
of two in a copy of x (`StemTile.cpad`: aligned 4/8-element vector loads). Wf is packed
per call (weights change every step) into a workspace [R, SCP, KP] by a tiny kernel;
bias and the post-op chain are fused (triton_epilogue).

Backward weights: dw[k, c, r, s] = sum_m dy[m, k] * A_r[m, s*CE + c]: a program owns BN
output channels and RB filter rows (an [BN, RB*SCP] f32 accumulator, the whole filter
for the stem) and a slice of the pixels; it reads each dy tile once. The slices' f32
partials [SPLIT, K, R*S*C] are summed in a fixed order by implicit_gemm_bwd's reduction
kernel (deterministic).

Backward data, phase-folded: dx pixels are taken in blocks of sh x sw (one per stride
phase) and the GEMM's N side is (phase a, phase b, channel c), NP = next_pow2(sh*sw*C)
(12 -> 16 for the stem, instead of C = 3 -> 16 per phase). For the block (qh, qw) every
tap of every phase reads dy at oh = qh + UH + dh, ow = qw + UW + dw over a small window
(WH x WW, 4x4 for the stem), so
  dx[n, qh*sh + a, qw*sw + b, c] = sum_{dh, dw, k} dy[n, qh+UH+dh, qw+UW+dw, k] * Wd[dh, dw, k, (a, b, c)],
  Wd[dh, dw, k, (a, b, c)] = w[k, c, a + ph - (UH+dh)*sh, b + pw - (UW+dw)*sw]  (0 off the filter),
a GEMM with shifted [BM, BK] dy tiles (channel rows, vector loads) and a packed Wd.

Supported: 1D and 2D, groups 1, dilation 1, any stride and (asymmetric) padding, both
layouts (strided indexing; NHWC is the fast one), f32/f16/bf16, any K (tiled), S*C <=
MAX_RUN; backward data also sh*sw*C <= MAX_FOLD. Indexing as implicit_gemm.py (int64
image bases, int32 within). Not supported: 3D, groups, dilation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import workspace
from ..args import ConvArgs
from ..launch import Launch
from ..problems.conv import ConvProblem
from ..search.solver import register
from .implicit_gemm import (
    HOST_FLOOR_MS,
    HOST_PER_LAUNCH_MS,
    _IGemmBase,
    _Plan,
    fit,
    geom,
    layout_strides,
    roofline_ms,
    same_memory,
    strides5_of,
)
from .implicit_gemm_bwd import NUM_SMS, _split_reduce_kernel, max_split
from .triton_epilogue import epilogue, interpreting, plan_epilogue, post_op_bytes, tl_dot_precision

MAX_RUN = 128    # S*C: one filter row's run of elements (the forward's K step)
MAX_FOLD = 64    # sh*sw*C: backward data's N side
MAX_ACC = 256    # backward weights: accumulator columns RB*SCP per program (default)
MIN_STEPS = 8    # backward weights: pixel steps per slice at least (shorter slices: partials dominate)


@dataclass(frozen=True)
class StemTile:
    BM: int          # 16..256, power of two: output pixels (fwd), dx blocks (bwd_data), pixels per step (bwd_weights)
    BN: int          # 16..256, power of two: output channels (fwd, bwd_weights); bwd_data: K per step
    warps: int       # 2, 4 or 8
    stages: int      # 1..6
    cpad: bool = False   # fwd / bwd_weights: read x from a copy with C padded to a power of two
    waves: int = 4       # bwd_weights: pixel slices to give about waves x NUM_SMS programs
    acc_cols: int = MAX_ACC   # bwd_weights: accumulator columns RB*SCP at most (power of two >= SCP)


# defaults per direction, first guesses from the sm_90 compile (compile_check's report): the
# 8-warp forward holds 128 registers a thread where 4 warps need 226; backward weights
# spills at BM 64 (the [64, 256] accumulator next to the gathered tile's pointers), not at
# BM 32. benchmarks/stem_probe.py times the alternatives on the H200.
# H200, rn50_conv1 (N=128), 2026-12-01 (benchmarks/results/stem_probe_2026-12-01.json): forward
# 0.472 ms for BM 64 / 4 warps against 0.52 for 128 / 8; backward weights 1.36 ms with the
# channels padded to 4 (aligned 8-byte pixel loads) against 2.38 without
DEFAULT_TILES = {
    "fwd": StemTile(64, 64, 4, 3),
    "bwd_data": StemTile(128, 64, 4, 3),
    "bwd_weights": StemTile(32, 64, 8, 2, cpad=True),
}

# of this estimate's padded MACs, measured (rn50_conv1 on the H200, 2026-12-01: 0.47 / 0.57 /
# 1.36 ms against 0.18 / 0.21 / 0.21 ms at 0.35)
EFFICIENCY = {"fwd": 0.13, "bwd_data": 0.13, "bwd_weights": 0.055}

# what benchmarks/stem_probe.py times on the H200 (compile_check compiles each for sm_90)
VARIANTS: dict[str, tuple[StemTile, ...]] = {
    "fwd": (DEFAULT_TILES["fwd"], StemTile(128, 64, 4, 3), StemTile(128, 64, 8, 3), StemTile(256, 64, 8, 3),
            StemTile(128, 64, 8, 2), StemTile(128, 64, 8, 4), StemTile(128, 64, 8, 3, cpad=True),
            StemTile(256, 64, 8, 3, cpad=True)),
    "bwd_data": (DEFAULT_TILES["bwd_data"], StemTile(64, 64, 4, 3), StemTile(256, 64, 8, 3),
                 StemTile(256, 64, 4, 3), StemTile(128, 64, 4, 4), StemTile(128, 32, 4, 4)),
    "bwd_weights": (DEFAULT_TILES["bwd_weights"], StemTile(64, 64, 8, 2), StemTile(16, 64, 8, 2),
                    StemTile(32, 64, 8, 1), StemTile(32, 64, 8, 3), StemTile(32, 64, 8, 2, waves=2),
                    StemTile(32, 64, 8, 2, waves=8), StemTile(32, 64, 8, 2),
                    StemTile(32, 64, 4, 2, acc_cols=128), StemTile(64, 64, 8, 2, acc_cols=128)),
}


def default_tile(p: ConvProblem) -> StemTile:
    return DEFAULT_TILES[p.direction]


# ---- kernels -----------------------------------------------------------------------------
@triton.jit
def _pad_channels_kernel(x_ptr, xp_ptr, NPIX, C, CE: tl.constexpr, BP: tl.constexpr):
    """xp[pix, c] = x[pix, c] for c < C, 0 up to CE (x NHWC-contiguous, xp [pixels, CE])."""
    pix = (tl.program_id(0) * BP + tl.arange(0, BP)).to(tl.int64)
    c = tl.arange(0, CE)
    m = pix < NPIX
    v = tl.load(x_ptr + pix[:, None] * C + c[None, :], mask=m[:, None] & (c < C)[None, :], other=0.0)
    tl.store(xp_ptr + pix[:, None] * CE + c[None, :], v, mask=m[:, None])


@triton.jit
def _pack_fwd_kernel(w_ptr, wp_ptr, K, C, S, KP, swk, swc, swr, sws,
                     CE: tl.constexpr, SCP: tl.constexpr, BN: tl.constexpr):
    """wp[r, j, k] = w[k, j % CE, r, j // CE] (0 off the filter and for k >= K): [R, SCP, KP]."""
    r = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, SCP)
    s = j // CE
    c = j % CE
    ok = ((s < S) & (c < C))[:, None] & (rn < K)[None, :]
    v = tl.load(w_ptr + r * swr + (s * sws + c * swc)[:, None] + (rn * swk)[None, :], mask=ok, other=0.0)
    tl.store(wp_ptr + ((r * SCP + j) * KP)[:, None] + rn[None, :], v)


@triton.jit
def _run_cols(sxc, sxw, CE: tl.constexpr, SCP: tl.constexpr, CONTIG: tl.constexpr):
    """(j, pixel of j, offset of j) along one filter row's run: element j is channel
    j % CE of pixel j // CE; with CONTIG (channel stride 1, pixel stride CE) the offset is j
    itself, which lets the compiler see contiguous (aligned, for a padded CE) rows."""
    j = tl.arange(0, SCP)
    px = j // CE
    if CONTIG:
        col = j
    else:
        col = px * sxw + (j % CE) * sxc
    return j, px, col


@triton.jit
def _row_base(n64, ih, iw0, sxn, sxh, sxw, CE: tl.constexpr, CONTIG: tl.constexpr, ALIGN: tl.constexpr):
    """Offset of pixel (n, ih, iw0) channel 0; a multiple of ALIGN (x padded to CE channels)."""
    if CONTIG:
        base = n64 * sxn + ih * sxh + iw0 * CE
    else:
        base = n64 * sxn + ih * sxh + iw0 * sxw
    if ALIGN > 1:
        base = tl.multiple_of(base, ALIGN)
    return base


@triton.jit(do_not_specialize=["M", "H", "W", "OH", "OW"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _stem_fwd_kernel(
        x_ptr, wp_ptr, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
        M, K, H, W, OH, OW, R, SC, KP,
        sxn, sxc, sxh, sxw, syn, syp, syk, sth, stw, pdh, pdw,
        p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
        HAS_BIAS: tl.constexpr,
        P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
        P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
        P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
        P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
        CE: tl.constexpr, SCP: tl.constexpr, CONTIG: tl.constexpr, ALIGN: tl.constexpr,
        UPCAST: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """y tile [BM pixels, BN channels]: R steps of A_r [BM, SCP] (runs of x) x Wf[r] [SCP, BN]."""
    num_n = tl.cdiv(K, BN)
    pid = tl.program_id(0)
    pid_m = pid // num_n           # channel blocks of one pixel block run together (A from L2)
    pid_n = pid - pid_m * num_n
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < K
    ow = rm % OW
    tmp = rm // OW
    oh = tmp % OH
    n = tmp // OH
    n64 = n.to(tl.int64)
    ih0 = oh * sth - pdh
    iw0 = ow * stw - pdw
    j, px, col = _run_cols(sxc, sxw, CE, SCP, CONTIG)
    iw = iw0[:, None] + px[None, :]
    col_ok = mask_m[:, None] & (j < SC)[None, :] & (iw >= 0) & (iw < W)
    b_ptr = wp_ptr + (j * KP)[:, None] + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r in range(0, R):
        ih = ih0 + r
        ok = col_ok & ((ih >= 0) & (ih < H))[:, None]
        base = _row_base(n64, ih, iw0, sxn, sxh, sxw, CE, CONTIG, ALIGN)
        a = tl.load(x_ptr + base[:, None] + col[None, :], mask=ok, other=0.0)
        b = tl.load(b_ptr + r * SCP * KP)          # packed: zero rows/columns, no mask
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    pix = rm - n * (OH * OW)
    y_off = (n64 * syn + pix * syp)[:, None] + (rn * syk)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    acc = epilogue(acc, y_off, rn, mask_n, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "CHUNK", "H", "W", "OH", "OW"])  # sizes: no recompile per shape
def _stem_bwd_w_kernel(
        dy_ptr, x_ptr, ws_ptr,
        M, CHUNK, K, C, H, W, OH, OW, R, SC, NCOL,
        sdn, sdk, sdh, sdw, sxn, sxc, sxh, sxw, sth, stw, pdh, pdw,
        CE: tl.constexpr, SCP: tl.constexpr, RB: tl.constexpr, CONTIG: tl.constexpr, ALIGN: tl.constexpr,
        UPCAST: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Program (channel block, block of RB filter rows; pixel slice): acc[BN, RB*SCP] +=
    dy^T [BN, BM] @ [A_r for its rows] [BM, RB*SCP]; the partial goes to ws[slice, k,
    r*S*C + s*C + c] (NCOL = R*S*C columns)."""
    NRB = tl.cdiv(R, RB)
    pid = tl.program_id(0)
    kb = pid // NRB
    rb = pid - kb * NRB
    sp = tl.program_id(1)
    rk = kb * BN + tl.arange(0, BN)
    mask_k = rk < K
    jj = tl.arange(0, RB * SCP)
    rr = rb * RB + jj // SCP
    j = jj % SCP
    px = j // CE
    cc = j % CE
    if CONTIG:
        col = rr * sxh + j
    else:
        col = rr * sxh + px * sxw + cc * sxc
    col_ok = (rr < R) & (j < SC)
    acc = tl.zeros((BN, RB * SCP), dtype=tl.float32)
    p_begin = sp * CHUNK
    p_end = tl.minimum(p_begin + CHUNK, M)
    for p0 in range(p_begin, p_end, BM):
        rm = p0 + tl.arange(0, BM)
        mp = rm < p_end
        ow = rm % OW
        tmp = rm // OW
        oh = tmp % OH
        n64 = (tmp // OH).to(tl.int64)
        d = tl.load(dy_ptr + (n64 * sdn + oh * sdh + ow * sdw)[:, None] + (rk * sdk)[None, :],
                    mask=mp[:, None] & mask_k[None, :], other=0.0)
        ih0 = oh * sth - pdh
        iw0 = ow * stw - pdw
        ih = ih0[:, None] + rr[None, :]
        iw = iw0[:, None] + px[None, :]
        ok = mp[:, None] & col_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        base = _row_base(n64, ih0, iw0, sxn, sxh, sxw, CE, CONTIG, ALIGN)
        a = tl.load(x_ptr + base[:, None] + col[None, :], mask=ok, other=0.0)
        if UPCAST:
            d = d.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(tl.trans(d), a, acc, input_precision=PREC)
    wcol = rr * (SC // CE * C) + px * C + cc
    valid = col_ok & (cc < C)
    tl.store(ws_ptr + ((sp * K + rk) * NCOL)[:, None] + wcol[None, :], acc,
             mask=mask_k[:, None] & valid[None, :])


@triton.jit
def _pack_bwd_data_kernel(w_ptr, wp_ptr, K, C, R, S, WW, UH, UW, STH, STW, pdh, pdw, KP,
                          swk, swc, swr, sws, NP: tl.constexpr, BK: tl.constexpr):
    """wp[dh, dw, k, (a, b, c)] = w[k, c, a + ph - (UH+dh)*sh, b + pw - (UW+dw)*sw], 0 off
    the filter, for k >= K and for columns past sh*sw*C: [WH*WW, KP, NP]."""
    win = tl.program_id(0)
    dh = win // WW
    dw = win - dh * WW
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    nc = tl.arange(0, NP)
    pa = nc // (STW * C)
    rest = nc - pa * (STW * C)
    pb = rest // C
    c = rest - pb * C
    r = pa + pdh - (UH + dh) * STH
    s = pb + pdw - (UW + dw) * STW
    ok = (nc < STH * STW * C) & (r >= 0) & (r < R) & (s >= 0) & (s < S)
    v = tl.load(w_ptr + (kk * swk)[:, None] + (c * swc + r * swr + s * sws)[None, :],
                mask=(kk < K)[:, None] & ok[None, :], other=0.0)
    tl.store(wp_ptr + ((win * KP + kk) * NP)[:, None] + nc[None, :], v)


@triton.jit(do_not_specialize=["M", "H", "W", "OH", "OW", "QH", "QW"])  # sizes: no recompile per shape
def _stem_bwd_data_kernel(
        dy_ptr, wp_ptr, dx_ptr,
        M, K, C, H, W, OH, OW, QH, QW, WH, WW, UH, UW, STH, STW, KP,
        sdn, sdk, sdh, sdw, sxn, sxc, sxh, sxw,
        NP: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """dx blocks (n, qh, qw) of sh x sw pixels: acc[BM, NP] = sum over the dy window and k
    of dy tiles [BM, BK] (block rows shifted by (dh, dw)) x Wd[dh, dw] [BK, NP]."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = rm < M
    qw = rm % QW
    tmp = rm // QW
    qh = tmp % QH
    n64 = (tmp // QH).to(tl.int64)
    rk = tl.arange(0, BK)
    nc = tl.arange(0, NP)
    acc = tl.zeros((BM, NP), dtype=tl.float32)
    nk = KP // BK
    for it in range(0, WH * WW * nk):
        win = it // nk
        k0 = (it - win * nk) * BK
        dh = win // WW
        dw = win - dh * WW
        oh = qh + UH + dh
        ow = qw + UW + dw
        ok = mask_m & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
        kk = k0 + rk
        a = tl.load(dy_ptr + (n64 * sdn + oh * sdh + ow * sdw)[:, None] + (kk * sdk)[None, :],
                    mask=ok[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(wp_ptr + ((win * KP + kk) * NP)[:, None] + nc[None, :])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    pa = nc // (STW * C)
    rest = nc - pa * (STW * C)
    pb = rest // C
    c = rest - pb * C
    ih = qh[:, None] * STH + pa[None, :]
    iw = qw[:, None] * STW + pb[None, :]
    ok = mask_m[:, None] & (nc < STH * STW * C)[None, :] & (ih < H) & (iw < W)
    tl.store(dx_ptr + n64[:, None] * sxn + ih * sxh + iw * sxw + (c * sxc)[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=ok)


# ---- host side -------------------------------------------------------------------------
def run_pitch(p: ConvProblem, cpad: bool) -> int:
    """CE: elements per pixel in a run (C, or C padded to a power of two in a copy)."""
    return triton.next_power_of_2(p.C) if cpad else p.C


def run_cols(p: ConvProblem, ce: int) -> int:
    """SCP: a filter row's run S*CE rounded up to a power of two (>= 16 for tl.dot)."""
    return max(16, triton.next_power_of_2(p.filter[-1] * ce))


def dy_window(filt: int, st: int, pad: int) -> tuple[int, int]:
    """(U, WN): the dx block q (pixels q*st + a, a < st) reads dy at q + U + d, d < WN:
    the offsets u = (a + pad - r) / st of every tap r that divides exactly."""
    us = [(a + pad - r) // st for a in range(st) for r in range(filt) if (a + pad - r) % st == 0]
    return min(us), max(us) - min(us) + 1


def _x_nhwc(p: ConvProblem, sx: tuple) -> bool:
    return same_memory((p.x_shape,), (sx,), (layout_strides(p.x_shape, "nhwc"),))


def _contig(sx5: tuple, gm, ce: int) -> bool:
    """A run is contiguous in x: channel stride 1, pixel stride CE (or one pixel per row)."""
    return sx5[1] == 1 and (sx5[4] == ce or gm.inp[2] == 1)


class XRuns:
    """How the forward and backward-weights kernels read x's runs: straight from x, or from
    a copy with C padded to a power of two (`cpad`: aligned vector loads); the run pitch CE,
    x's 5-D strides as read, contiguity and alignment (a launch constant each)."""

    def __init__(self, p: ConvProblem, tile: StemTile, x_strides: tuple):
        gm = geom(p)
        sx = strides5_of(x_strides)
        self.cpad = tile.cpad and p.C & (p.C - 1) != 0 and _x_nhwc(p, x_strides)
        self.ce = ce = run_pitch(p, self.cpad)
        H, W = gm.inp[1:]
        self.xp_elems = 0
        if self.cpad:
            sx = (H * W * ce, 1, 0, W * ce, ce)
            self.xp_elems = gm.N * H * W * ce
            self.pad = Launch(_pad_channels_kernel, (triton.cdiv(gm.N * H * W, 256),), (gm.N * H * W, p.C, ce, 256))
        self.sx = sx
        self.contig = _contig(sx, gm, ce)
        # aligned rows: every pixel starts at a multiple of CE (a power of two) elements
        self.align = ce if self.contig and ce & (ce - 1) == 0 and sx[0] % ce == 0 and sx[3] % ce == 0 else 1

    def workspace_bytes(self, dtype: torch.dtype) -> int:
        return self.xp_elems * dtype.itemsize

    def source(self, x: torch.Tensor) -> torch.Tensor:
        """x itself, or its channel-padded copy (made now, in the workspace)."""
        if not self.cpad:
            return x
        xp = workspace.empty((self.xp_elems,), x.dtype, x.device)
        self.pad(x, xp)
        return xp


class StemFwdPlan(_Plan):
    """Forward: pack Wf (and pad x when `cpad`), then one launch of `_stem_fwd_kernel`."""

    def __init__(self, p: ConvProblem, tile: StemTile | None = None, strides: tuple | None = None):
        super().__init__(p, tile or default_tile(p), strides)
        gm, tile = geom(p), self.tile
        _, sw, sy = (strides5_of(s) for s in self.strides)
        self.xr = xr = XRuns(p, tile, self.strides[0])
        sx, ce, contig, align = xr.sx, xr.ce, xr.contig, xr.align
        H, W = gm.inp[1:]
        R, S = gm.filt[1:]
        scp = run_cols(p, ce)
        M = gm.N * gm.P
        BM, BN = fit(tile.BM, M), fit(tile.BN, p.K)
        KP = triton.cdiv(p.K, BN) * BN
        self.wp_shape = (R * scp * KP,)
        self.pack = Launch(_pack_fwd_kernel, (R, KP // BN), (p.K, p.C, S, KP, sw[0], sw[1], sw[3], sw[4], ce, scp, BN))
        self.epi = plan_epilogue(p)
        self.launch = Launch(
            _stem_fwd_kernel, (triton.cdiv(M, BM) * (KP // BN),),
            (M, p.K, H, W, *gm.out[1:], R, S * ce, KP, sx[0], sx[1], sx[3], sx[4], sy[0], sy[4], sy[1],
             *gm.stride[1:], *gm.pad[1:], *self.epi.scalars(), *self.epi.constexprs(),
             ce, scp, contig, align, interpreting() and p.dtype == torch.bfloat16, tl_dot_precision(p.dtype),
             BM, BN),
            num_warps=tile.warps, num_stages=tile.stages)

    def workspace_bytes(self) -> int:
        return self.wp_shape[0] * self.p.dtype.itemsize + self.xr.workspace_bytes(self.p.dtype)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        x, w = args.x, args.w
        if out is not None and out.stride() != self.strides[2]:
            return out.copy_(self(args))      # the epilogue's operands are indexed like y
        y = out if out is not None else self.alloc(self.p.out_dtype, x.device)
        if (x.stride(), w.stride()) != self.strides[:2]:
            return self.variant((x.stride(), w.stride(), self.strides[2]))(args, y)
        wp = workspace.empty(self.wp_shape, w.dtype, w.device)
        self.pack(w, wp)
        self.launch(self.xr.source(x), wp, y, *self.epi.pointers(args.bias, args.post_ops, y))
        return y


def bwd_w_split(p: ConvProblem, tile: StemTile, progs: int) -> tuple[int, int]:
    """(split, chunk): pixel slices for about tile.waves x NUM_SMS programs, each at least
    MIN_STEPS steps of BM pixels, the partials within int32 indexing."""
    M = p.N * math.prod(p.out_size)
    BM = fit(tile.BM, M)
    split = max(1, min(triton.cdiv(tile.waves * NUM_SMS, progs), M // (BM * MIN_STEPS), max_split(p)))
    chunk = triton.cdiv(triton.cdiv(M, split), BM) * BM
    return triton.cdiv(M, chunk), chunk


class StemBwdWeightsPlan(_Plan):
    """Backward weights: (pad x when `cpad`) the sliced run GEMM into f32 partials, then
    their ordered sum into dw (workspace: partials [SPLIT, K, R*S*C] f32, padded x)."""

    def __init__(self, p: ConvProblem, tile: StemTile | None = None, strides: tuple | None = None):
        super().__init__(p, tile or default_tile(p), strides)
        gm, tile = geom(p), self.tile
        sd, _, sw = (strides5_of(s) for s in self.strides)
        self.xr = xr = XRuns(p, tile, self.strides[1])
        sx, ce, contig, align = xr.sx, xr.ce, xr.contig, xr.align
        H, W = gm.inp[1:]
        R, S = gm.filt[1:]
        scp = run_cols(p, ce)
        rb = max(1, min(triton.next_power_of_2(R), tile.acc_cols // scp))
        M = gm.N * gm.P
        BM, BN = fit(tile.BM, M), fit(tile.BN, p.K)
        progs = triton.cdiv(p.K, BN) * triton.cdiv(R, rb)
        split, chunk = bwd_w_split(p, tile, progs)
        ncol = R * S * p.C
        self.ws_shape = (split, p.K, ncol)
        self.launch = Launch(
            _stem_bwd_w_kernel, (progs, split),
            (M, chunk, p.K, p.C, H, W, *gm.out[1:], R, S * ce, ncol, sd[0], sd[1], sd[3], sd[4],
             sx[0], sx[1], sx[3], sx[4], *gm.stride[1:], *gm.pad[1:],
             ce, scp, rb, contig, align, interpreting() and p.dtype == torch.bfloat16, tl_dot_precision(p.dtype),
             BM, BN),
            num_warps=tile.warps, num_stages=tile.stages)
        E = p.K * ncol
        self.reduce = Launch(_split_reduce_kernel, (triton.cdiv(E, 1024),),
                             (E, ncol, p.C, R, S, split, *sw, 1024))

    def workspace_bytes(self) -> int:
        return math.prod(self.ws_shape) * 4 + self.xr.workspace_bytes(self.p.dtype)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        dy, x = args.dy, args.x
        dw = out if out is not None else self.alloc(self.p.out_dtype, dy.device)
        if (dy.stride(), x.stride(), dw.stride()) != self.strides:
            return self.variant((dy.stride(), x.stride(), dw.stride()))(args, dw)
        ws = workspace.empty(self.ws_shape, torch.float32, dy.device)
        self.launch(dy, self.xr.source(x), ws)
        self.reduce(ws, dw)
        return dw


class StemBwdDataPlan(_Plan):
    """Backward data: pack Wd, then one launch of the phase-folded `_stem_bwd_data_kernel`."""

    def __init__(self, p: ConvProblem, tile: StemTile | None = None, strides: tuple | None = None):
        super().__init__(p, tile or default_tile(p), strides)
        gm, tile = geom(p), self.tile
        sd, sw, sx = (strides5_of(s) for s in self.strides)
        H, W = gm.inp[1:]
        R, S = gm.filt[1:]
        sth, stw = gm.stride[1:]
        pdh, pdw = gm.pad[1:]
        uh, wh = dy_window(R, sth, pdh)
        uw, ww = dy_window(S, stw, pdw)
        QH, QW = triton.cdiv(H, sth), triton.cdiv(W, stw)
        M = gm.N * QH * QW
        np_ = max(16, triton.next_power_of_2(sth * stw * p.C))
        BM, BK = fit(tile.BM, M), fit(tile.BN, p.K)
        KP = triton.cdiv(p.K, BK) * BK
        self.wp_shape = (wh * ww * KP * np_,)
        self.pack = Launch(_pack_bwd_data_kernel, (wh * ww, KP // BK),
                           (p.K, p.C, R, S, ww, uh, uw, sth, stw, pdh, pdw, KP, sw[0], sw[1], sw[3], sw[4], np_, BK))
        self.launch = Launch(
            _stem_bwd_data_kernel, (triton.cdiv(M, BM),),
            (M, p.K, p.C, H, W, *gm.out[1:], QH, QW, wh, ww, uh, uw, sth, stw, KP,
             sd[0], sd[1], sd[3], sd[4], sx[0], sx[1], sx[3], sx[4],
             np_, interpreting() and p.dtype == torch.bfloat16, tl_dot_precision(p.dtype), BM, BK),
            num_warps=tile.warps, num_stages=tile.stages)

    def workspace_bytes(self) -> int:
        return self.wp_shape[0] * self.p.dtype.itemsize

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        dy, w = args.dy, args.w
        dx = out if out is not None else self.alloc(self.p.out_dtype, dy.device)
        if (dy.stride(), w.stride(), dx.stride()) != self.strides:
            return self.variant((dy.stride(), w.stride(), dx.stride()))(args, dx)
        wp = workspace.empty(self.wp_shape, w.dtype, w.device)
        self.pack(w, wp)
        self.launch(dy, wp, dx)
        return dx


PLANS = {"fwd": StemFwdPlan, "bwd_data": StemBwdDataPlan, "bwd_weights": StemBwdWeightsPlan}


def plan(p: ConvProblem, tile: StemTile | None = None) -> _Plan:
    return PLANS[p.direction](p, tile)


def conv_fwd(p: ConvProblem, args: ConvArgs, tile: StemTile | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    return StemFwdPlan(p, tile)(args, out)


def conv_bwd_data(p: ConvProblem, args: ConvArgs, tile: StemTile | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    return StemBwdDataPlan(p, tile)(args, out)


def conv_bwd_weights(p: ConvProblem, args: ConvArgs, tile: StemTile | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    return StemBwdWeightsPlan(p, tile)(args, out)


# ---- solvers ---------------------------------------------------------------------------------
def stem_reasons(p: ConvProblem) -> list[str]:
    """Why the stem kernels cannot serve p (beyond the implicit-GEMM base reasons)."""
    reasons = []
    if p.ndim == 3:
        reasons.append("3D is not supported (1D and 2D only)")
    if p.groups != 1:
        reasons.append(f"groups={p.groups}: only groups=1")
    if any(d != 1 for d in p.dilation):
        reasons.append(f"dilation={p.dilation}: only dilation 1")
    if p.filter[-1] * p.C > MAX_RUN:
        reasons.append(f"S*C = {p.filter[-1]}*{p.C} > {MAX_RUN}: a filter row's run must be short (small C)")
    if p.direction == "bwd_data" and math.prod(p.stride) * p.C > MAX_FOLD:
        reasons.append(f"stride {p.stride} x C={p.C} = {math.prod(p.stride) * p.C} phase-folded columns > {MAX_FOLD}")
    return reasons


class _StemBase(_IGemmBase):
    plan_type: type  # the direction's plan (its invoker)

    def workspace_size(self, problem) -> int:
        return self.plan_type(problem).workspace_bytes()

    def prepare(self, problem):
        return self.plan_type(problem)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + stem_reasons(problem)

    def estimate(self, problem) -> float | None:
        """Roofline of the MACs the kernels really issue (runs padded to SCP, the backward
        data's zero taps and padded columns) and the minimum bytes at the efficiency measured
        on the H200 (EFFICIENCY: gathered pointer-row tiles, small N for backward data). NCHW
        runs are strided gathers (x0.3, as the implicit GEMM)."""
        p, gm = problem, geom(problem)
        R, S = gm.filt[1:]
        M = gm.N * gm.P
        scp = run_cols(p, p.C)
        kp = triton.next_power_of_2(p.K)
        if p.direction == "fwd":
            flops = 2.0 * M * kp * R * scp
        elif p.direction == "bwd_weights":
            rows = triton.next_power_of_2(R) if triton.next_power_of_2(R) * scp <= MAX_ACC else R
            flops = 2.0 * M * kp * rows * scp
        else:
            (_, wh), (_, ww) = dy_window(R, gm.stride[1], gm.pad[1]), dy_window(S, gm.stride[2], gm.pad[2])
            blocks = gm.N * math.prod(triton.cdiv(i, s) for i, s in zip(gm.inp[1:], gm.stride[1:]))
            flops = 2.0 * blocks * wh * ww * kp * max(16, triton.next_power_of_2(math.prod(gm.stride) * p.C))
        eff = EFFICIENCY[p.direction] * (0.3 if p.layout == "nchw" else 1.0)
        t = roofline_ms(flops, p.bytes() + post_op_bytes(p), p.dtype, eff)
        # host: w's pack + the kernel (fwd, bwd_data); the slices, their ordered reduction and
        # x's channel padding (bwd_weights: 0.066-0.071 ms on small held-out 1x1 layers, H200)
        launches = 3 if p.direction == "bwd_weights" else 2
        return max(t, HOST_FLOOR_MS + HOST_PER_LAUNCH_MS * (launches - 1)) if p.device == "cuda" else t


@register
class StemFwd(_StemBase):
    id = 70
    name = "stem_fwd"
    directions = frozenset({"fwd"})
    plan_type = StemFwdPlan


@register
class StemBwdData(_StemBase):
    id = 71
    name = "stem_bwd_data"
    directions = frozenset({"bwd_data"})
    plan_type = StemBwdDataPlan


@register
class StemBwdWeights(_StemBase):
    id = 72
    name = "stem_bwd_weights"
    directions = frozenset({"bwd_weights"})
    plan_type = StemBwdWeightsPlan
