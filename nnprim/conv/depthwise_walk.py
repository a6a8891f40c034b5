"""Depthwise convolution that walks along the image rows with a sliding window in
registers: solvers 46/47/48 `depthwise_walk_{fwd,bwd_data,bwd_weights}`, family `direct`
(issue 13).

Solvers 43-45 (depthwise.py) compute a 2-D pixel tile per program and load every tap's
shifted tile again: 9 loads, 9 bf16 -> f32 conversions and the masks of 9 tiles per
output of a 3x3 filter, ~40 SASS instructions per output (sm_90, `benchmarks/diag/
dw_sass.py`), 1.1-1.2 TB/s on the H200: instruction bound. Here a program owns BH output
rows x BC channels of one image and walks a run of WALK output columns left to right:
per column it loads the new input column once per filter row (R loads of [BH, BC]) and
keeps the last S columns in registers, so an input value is loaded and converted R times
instead of R*S (3 instead of 9), the row masks and pointers are computed once per
program, and each output costs its R*S FMAs plus ~5 instructions (21.7 SASS instructions per
output, 110 registers). The walk is latency-bound (a column's loads cannot pass the previous
column's store): LOOK columns are in flight as raw loads, programs are one warp, and channel
blocks are the fastest grid index so that a pixel's channels are read from DRAM together.
H200, 2026-12-02 (BENCHMARKS.md): mbv2 3x3 forward 1.09x, backward data 1.92x, backward
weights 0.97x cuDNN (2.38 TB/s effective forward, 57% of the roof).

  forward:        y[n, c, h, w]  = sum_{r,u} x[n, c, h - ph + r*dh, w - pw + u] * wt[c, r, u]
  backward data:  the forward of dy with the flipped filter, padding dh*(R-1) - ph, (S-1) - pw
  backward weights: dw[c, r, u] = sum_{n,h,w} dy[n, c, h, w] * x[n, c, h - ph + r*dh, w - pw + u]
    accumulated per tap in [BH, BC] f32 registers along the walk (FMAs, no reduction per
    column), summed over the rows once per program into ws[split, tap, c]; the splits are
    summed in a fixed order afterwards (deterministic).

Stride 2 (forward and backward weights; `_walk_s2`, `_wgrad_s2`): output column w reads input
columns 2w - pw + u, so a 3-wide filter's last column is the next step's first and a step
loads 2 new columns (6 loads per output of a 3x3 instead of the tile kernel's 9); rows take
any stride. Backward data at stride 2 is a transposed convolution: it stays with 44.

Covers 1-D and 2-D, channels-last (unit channel stride), column stride 1 or 2 (backward
data: stride 1), filters up to 3 x 3 with unit column dilation (any row dilation), any
padding (backward data: at most the filter reach), f32/f16/bf16; the bias and post-op chain
fused into the forward. Other problems stay with solvers 43-45."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import workspace
from ..args import ConvArgs
from ..launch import Launch
from ..limits import grid_reasons
from ..problems.conv import ConvProblem
from ..search.solver import Solver, register
from .depthwise import _dense_w, _in_layout, _strides2, dw_estimate
from .implicit_gemm import conv_index_reasons, flipped_padding_reasons, geom, layout_strides
from .implicit_gemm_bwd import NUM_SMS
from .triton_epilogue import NO_EPILOGUE, epilogue, plan_epilogue, post_op_reasons

MAX_R = 3
MAX_S = 3
# (BH, BC, WALK, warps, LOOK: columns in flight; forward and backward data), measured on the
# H200 (benchmarks/depthwise.py, results/depthwise_2026-12-02*.json)
TILE = dict(fwd=(8, 16, 28, 1, 3), bwd_data=(8, 16, 28, 1, 3), bwd_weights=(16, 32, 28, 2, 1))
# images of at most SMALL_IMAGE pixels (7x7): more rows and warps per program
SMALL_IMAGE = 64
# column stride 2 forward: 8 x 32 (mbv2 112x112 C 96: 0.140 ms against 0.169 for 8 x 16 and
# cuDNN's 0.145, results/depthwise_s2_2026-12-02_s14.json)
TILE_S2_FWD = (8, 32, 28, 1, 3)
TILE_SMALL = dict(fwd=(16, 64, 28, 4, 3), bwd_data=(16, 64, 28, 4, 3), bwd_weights=(8, 64, 28, 2, 1))


# ---- Triton kernels ------------------------------------------------------------------------------
@triton.jit
def _raw_column(p0, p1, p2, m0, m1, m2, ok, R: tl.constexpr):
    """The input column at p* for filter rows 0..R-1 in the input dtype (a load in flight:
    converted when it enters the window); rows past R repeat row 0 (never used)."""
    c0 = tl.load(p0, mask=m0 & ok, other=0.0)
    c1 = c0
    c2 = c0
    if R > 1:
        c1 = tl.load(p1, mask=m1 & ok, other=0.0)
    if R > 2:
        c2 = tl.load(p2, mask=m2 & ok, other=0.0)
    return c0, c1, c2


@triton.jit
def _column(p0, p1, p2, m0, m1, m2, ok, R: tl.constexpr):
    """`_raw_column` as f32 (0 outside the image)."""
    c0, c1, c2 = _raw_column(p0, p1, p2, m0, m1, m2, ok, R)
    return c0.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32)


@triton.jit
def _tap_w(w_ptr, rc, mc, r: tl.constexpr, u: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
           FLIP: tl.constexpr):
    """Weights of tap (r, u) for channels rc, f32 [BC] (0 for taps past the filter)."""
    if (r < R) and (u < S):
        if FLIP:
            tap = (R - 1 - r) * S + (S - 1 - u)
        else:
            tap = r * S + u
        return tl.load(w_ptr + rc * (R * S) + tap, mask=mc, other=0.0).to(tl.float32)
    else:
        return tl.zeros_like(rc).to(tl.float32)


@triton.jit
def _fma_col(acc, c0, c1, c2, w0, w1, w2, R: tl.constexpr):
    """acc + the column's rows times their weights (one filter column)."""
    acc += c0 * w0[None, :]
    if R > 1:
        acc += c1 * w1[None, :]
    if R > 2:
        acc += c2 * w2[None, :]
    return acc


@triton.jit
def _walk_kernel(src_ptr, w_ptr, dst_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                 C, SH, SW, DH, DW, ssn, ssh, ssw, sdn, sdh, sdw, pdh, pdw, dlh, sth,
                 p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                 HAS_BIAS: tl.constexpr,
                 P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
                 P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
                 P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
                 P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
                 FLIP: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                 BH: tl.constexpr, BC: tl.constexpr, WALK: tl.constexpr, LOOK: tl.constexpr,
                 CST: tl.constexpr):
    """dst rows [th*BH, +BH) x columns [tw*WALK, +WALK) x channels [cb*BC, +BC) of one image:
    dst[h, w] = sum_{r,u} src[h*sth - pdh + r*dlh, w*CST - pdw + u] * wt[r, u] (FLIP: wt flipped).
    Channel blocks are the fastest grid index: the programs that share pixels run together,
    so DRAM reads whole pixels (all C channels) at a time, not one block's slice of each."""
    n_cb = tl.cdiv(C, BC)
    cb = tl.program_id(0) % n_cb
    pid = tl.program_id(0) // n_cb
    n_tw = tl.cdiv(DW, WALK)
    n_th = tl.cdiv(DH, BH)
    tw = pid % n_tw
    tmp = pid // n_tw
    th = tmp % n_th
    n64 = (tmp // n_th).to(tl.int64)
    oh = th * BH + tl.arange(0, BH)
    rc = cb * BC + tl.arange(0, BC)
    mc = rc < C
    mrow = oh < DH
    # per filter row: the input row's pointers at column 0 and its mask (fixed along the walk)
    src = src_ptr + n64 * ssn
    ih0 = oh * sth - pdh
    ih1 = ih0 + dlh
    ih2 = ih1 + dlh
    p0 = src + (ih0 * ssh)[:, None] + rc[None, :]
    p1 = src + (ih1 * ssh)[:, None] + rc[None, :]
    p2 = src + (ih2 * ssh)[:, None] + rc[None, :]
    m0 = (mrow & (ih0 >= 0) & (ih0 < SH))[:, None] & mc[None, :]
    m1 = (mrow & (ih1 >= 0) & (ih1 < SH))[:, None] & mc[None, :]
    m2 = (mrow & (ih2 >= 0) & (ih2 < SH))[:, None] & mc[None, :]
    w00 = _tap_w(w_ptr, rc, mc, 0, 0, R, S, FLIP)
    w10 = _tap_w(w_ptr, rc, mc, 1, 0, R, S, FLIP)
    w20 = _tap_w(w_ptr, rc, mc, 2, 0, R, S, FLIP)
    w01 = _tap_w(w_ptr, rc, mc, 0, 1, R, S, FLIP)
    w11 = _tap_w(w_ptr, rc, mc, 1, 1, R, S, FLIP)
    w21 = _tap_w(w_ptr, rc, mc, 2, 1, R, S, FLIP)
    w02 = _tap_w(w_ptr, rc, mc, 0, 2, R, S, FLIP)
    w12 = _tap_w(w_ptr, rc, mc, 1, 2, R, S, FLIP)
    w22 = _tap_w(w_ptr, rc, mc, 2, 2, R, S, FLIP)
    z = tl.zeros((BH, BC), dtype=tl.float32)
    ow0 = tw * WALK
    mask_st = mrow[:, None] & mc[None, :]
    y_row = n64 * sdn + (oh * sdh)[:, None] + rc[None, :]
    if CST == 1:
        # the window: input columns iw, iw+1 (a0*, a1*) before the first output column
        iw = ow0 - pdw
        a00, a01, a02 = _column(p0 + iw * ssw, p1 + iw * ssw, p2 + iw * ssw, m0, m1, m2,
                                (iw >= 0) & (iw < SW), R)
        a10, a11, a12 = z, z, z
        if S > 2:
            a10, a11, a12 = _column(p0 + (iw + 1) * ssw, p1 + (iw + 1) * ssw, p2 + (iw + 1) * ssw, m0, m1, m2,
                                    (iw + 1 >= 0) & (iw + 1 < SW), R)
        jn = ow0 - pdw + S - 1           # the column that enters the window at the first output column
        b0, b1, b2 = _column(p0 + jn * ssw, p1 + jn * ssw, p2 + jn * ssw, m0, m1, m2, (jn >= 0) & (jn < SW), R)
        # LOOK - 1 more columns in flight (raw, 2 bytes a value): q* the next, r* the one after
        q0, q1, q2 = b0, b1, b2
        r0, r1, r2 = b0, b1, b2
        if LOOK > 1:
            q0, q1, q2 = _raw_column(p0 + (jn + 1) * ssw, p1 + (jn + 1) * ssw, p2 + (jn + 1) * ssw, m0, m1, m2,
                                     (jn >= -1) & (jn + 1 < SW), R)
        if LOOK > 2:
            r0, r1, r2 = _raw_column(p0 + (jn + 2) * ssw, p1 + (jn + 2) * ssw, p2 + (jn + 2) * ssw, m0, m1, m2,
                                     (jn >= -2) & (jn + 2 < SW), R)
        for j in tl.range(0, WALK, loop_unroll_factor=S):
            ow = ow0 + j
            # the column LOOK ahead goes out before this column's store, which the compiler cannot
            # move loads across (y may alias x as far as it knows): the walk is latency-bound
            jn = ow - pdw + S - 1 + LOOK
            e0, e1, e2 = _raw_column(p0 + jn * ssw, p1 + jn * ssw, p2 + jn * ssw, m0, m1, m2, (jn >= 0) & (jn < SW), R)
            if S == 1:
                acc = _fma_col(z, b0, b1, b2, w00, w10, w20, R)
            elif S == 2:
                acc = _fma_col(z, a00, a01, a02, w00, w10, w20, R)
                acc = _fma_col(acc, b0, b1, b2, w01, w11, w21, R)
                a00, a01, a02 = b0, b1, b2
            else:
                acc = _fma_col(z, a00, a01, a02, w00, w10, w20, R)
                acc = _fma_col(acc, a10, a11, a12, w01, w11, w21, R)
                acc = _fma_col(acc, b0, b1, b2, w02, w12, w22, R)
                a00, a01, a02 = a10, a11, a12
                a10, a11, a12 = b0, b1, b2
            if LOOK == 1:
                b0, b1, b2 = e0.to(tl.float32), e1.to(tl.float32), e2.to(tl.float32)
            else:
                b0, b1, b2 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32)
                if LOOK == 2:
                    q0, q1, q2 = e0, e1, e2
                else:
                    q0, q1, q2 = r0, r1, r2
                    r0, r1, r2 = e0, e1, e2
            mask = mask_st & (ow < DW)
            y_off = y_row + ow * sdw
            acc = epilogue(acc, y_off, rc, mc, mask, bias_ptr,
                           p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                           HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                           P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
            tl.store(dst_ptr + y_off, acc.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        _walk_s2(p0, p1, p2, m0, m1, m2, w00, w10, w20, w01, w11, w21, w02, w12, w22, z, ow0, pdw, SW, ssw, DW,
                 sdw, mask_st, y_row, rc, mc, dst_ptr, bias_ptr,
                 p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                 HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                 P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC, R, S, WALK)


@triton.jit
def _walk_s2(p0, p1, p2, m0, m1, m2, w00, w10, w20, w01, w11, w21, w02, w12, w22, z, ow0, pdw, SW, ssw, DW,
             sdw, mask_st, y_row, rc, mc, dst_ptr, bias_ptr,
             p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
             HAS_BIAS: tl.constexpr,
             P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
             P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
             P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
             P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
             R: tl.constexpr, S: tl.constexpr, WALK: tl.constexpr):
    """The walk at column stride 2: output column ow reads input columns 2*ow - pdw + u. A
    3-wide filter's last column is the next step's first (kept, `a`), so a step loads 2 new
    columns (S == 3: u = 1, 2; S <= 2: u < S); the next step's are in flight (raw) before
    this step's store."""
    FIRST: tl.constexpr = 1 if S == 3 else 0
    c = 2 * ow0 - pdw + FIRST                        # this step's first new column
    a0, a1, a2 = z, z, z
    if S == 3:
        a0, a1, a2 = _column(p0 + (c - 1) * ssw, p1 + (c - 1) * ssw, p2 + (c - 1) * ssw, m0, m1, m2,
                             (c >= 1) & (c - 1 < SW), R)
    q0, q1, q2 = _raw_column(p0 + c * ssw, p1 + c * ssw, p2 + c * ssw, m0, m1, m2, (c >= 0) & (c < SW), R)
    r0, r1, r2 = q0, q1, q2
    if S - FIRST > 1:
        r0, r1, r2 = _raw_column(p0 + (c + 1) * ssw, p1 + (c + 1) * ssw, p2 + (c + 1) * ssw, m0, m1, m2,
                                 (c >= -1) & (c + 1 < SW), R)
    for j in range(0, WALK):
        ow = ow0 + j
        b0, b1, b2 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32)
        e0, e1, e2 = r0.to(tl.float32), r1.to(tl.float32), r2.to(tl.float32)
        cn = c + 2 * (j + 1)                         # the next step's first new column
        q0, q1, q2 = _raw_column(p0 + cn * ssw, p1 + cn * ssw, p2 + cn * ssw, m0, m1, m2,
                                 (cn >= 0) & (cn < SW), R)
        if S - FIRST > 1:
            r0, r1, r2 = _raw_column(p0 + (cn + 1) * ssw, p1 + (cn + 1) * ssw, p2 + (cn + 1) * ssw, m0, m1, m2,
                                     (cn >= -1) & (cn + 1 < SW), R)
        if S == 3:
            acc = _fma_col(z, a0, a1, a2, w00, w10, w20, R)
            acc = _fma_col(acc, b0, b1, b2, w01, w11, w21, R)
            acc = _fma_col(acc, e0, e1, e2, w02, w12, w22, R)
            a0, a1, a2 = e0, e1, e2
        elif S == 2:
            acc = _fma_col(z, b0, b1, b2, w00, w10, w20, R)
            acc = _fma_col(acc, e0, e1, e2, w01, w11, w21, R)
        else:
            acc = _fma_col(z, b0, b1, b2, w00, w10, w20, R)
        mask = mask_st & (ow < DW)
        y_off = y_row + ow * sdw
        acc = epilogue(acc, y_off, rc, mc, mask, bias_ptr,
                       p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                       HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                       P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
        tl.store(dst_ptr + y_off, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_sum(ws_ptr, row, acc, rc, mc, C, r: tl.constexpr, u: tl.constexpr, R: tl.constexpr,
             S: tl.constexpr):
    """ws[row + tap(r, u), rc] = acc summed over its rows (taps past the filter: nothing)."""
    if (r < R) and (u < S):
        tl.store(ws_ptr + (row + r * S + u).to(tl.int64) * C + rc, tl.sum(acc, axis=0), mask=mc)


@triton.jit
def _acc_taps(g00, g10, g20, g01, g11, g21, g02, g12, g22, d, x00, x01, x02, x10, x11, x12, x20, x21, x22,
              R: tl.constexpr, S: tl.constexpr):
    """g[r][u] += d * x[u][r] for the taps of the filter (r < R, u < S): the window's column
    u holds x[u][0..2] (one value per filter row)."""
    g00 += d * x00
    if S > 1:
        g01 += d * x10
    if S > 2:
        g02 += d * x20
    if R > 1:
        g10 += d * x01
        if S > 1:
            g11 += d * x11
        if S > 2:
            g12 += d * x21
    if R > 2:
        g20 += d * x02
        if S > 1:
            g21 += d * x12
        if S > 2:
            g22 += d * x22
    return g00, g10, g20, g01, g11, g21, g02, g12, g22


@triton.jit
def _wgrad_s2(p0, p1, p2, m0, m1, m2, pdy, mdy, syw, sxw, ow0, pdw, W, OW, z,
              g00, g10, g20, g01, g11, g21, g02, g12, g22, R: tl.constexpr, S: tl.constexpr, WALK: tl.constexpr):
    """One tile's walk of backward weights at column stride 2 (see `_walk_s2`: a 3-wide
    filter's last column is the next step's first); the next step's dy and x columns are
    loaded a step ahead."""
    FIRST: tl.constexpr = 1 if S == 3 else 0
    c = 2 * ow0 - pdw + FIRST
    a0, a1, a2 = z, z, z
    if S == 3:
        a0, a1, a2 = _column(p0 + (c - 1) * sxw, p1 + (c - 1) * sxw, p2 + (c - 1) * sxw, m0, m1, m2,
                             (c >= 1) & (c - 1 < W), R)
    q0, q1, q2 = _raw_column(p0 + c * sxw, p1 + c * sxw, p2 + c * sxw, m0, m1, m2, (c >= 0) & (c < W), R)
    r0, r1, r2 = q0, q1, q2
    if S - FIRST > 1:
        r0, r1, r2 = _raw_column(p0 + (c + 1) * sxw, p1 + (c + 1) * sxw, p2 + (c + 1) * sxw, m0, m1, m2,
                                 (c >= -1) & (c + 1 < W), R)
    dr = tl.load(pdy + ow0 * syw, mask=mdy & (ow0 < OW), other=0.0)
    for j in range(0, WALK):
        ow = ow0 + j
        d = dr.to(tl.float32)
        b0, b1, b2 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32)
        e0, e1, e2 = r0.to(tl.float32), r1.to(tl.float32), r2.to(tl.float32)
        dr = tl.load(pdy + (ow + 1) * syw, mask=mdy & (ow + 1 < OW) & (j + 1 < WALK), other=0.0)
        cn = c + 2 * (j + 1)
        q0, q1, q2 = _raw_column(p0 + cn * sxw, p1 + cn * sxw, p2 + cn * sxw, m0, m1, m2, (cn >= 0) & (cn < W), R)
        if S - FIRST > 1:
            r0, r1, r2 = _raw_column(p0 + (cn + 1) * sxw, p1 + (cn + 1) * sxw, p2 + (cn + 1) * sxw, m0, m1, m2,
                                     (cn >= -1) & (cn + 1 < W), R)
        if S == 3:    # the window's columns: the carried one, this step's two
            g00, g10, g20, g01, g11, g21, g02, g12, g22 = _acc_taps(
                g00, g10, g20, g01, g11, g21, g02, g12, g22, d, a0, a1, a2, b0, b1, b2, e0, e1, e2, R, S)
            a0, a1, a2 = e0, e1, e2
        else:
            g00, g10, g20, g01, g11, g21, g02, g12, g22 = _acc_taps(
                g00, g10, g20, g01, g11, g21, g02, g12, g22, d, b0, b1, b2, e0, e1, e2, e0, e1, e2, R, S)
    return g00, g10, g20, g01, g11, g21, g02, g12, g22


@triton.jit
def _walk_wgrad_kernel(dy_ptr, x_ptr, ws_ptr, C, H, W, OH, OW, n_tiles, tiles_per_prog,
                       sxn, sxh, sxw, syn, syh, syw, pdh, pdw, dlh, sth,
                       R: tl.constexpr, S: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr,
                       WALK: tl.constexpr, CST: tl.constexpr):
    """Partial dw of the (image, row block, column run) tiles [sl * tiles_per_prog, +tiles_per_prog)
    for channels [cb*BC, +BC) into ws[sl, tap, c] (sl = program_id(1), cb = program_id(0));
    output (h, w) reads x[h*sth - pdh + r*dlh, w*CST - pdw + u]."""
    rc = tl.program_id(0) * BC + tl.arange(0, BC)
    mc = rc < C
    sl = tl.program_id(1)
    n_tw = tl.cdiv(OW, WALK)
    n_th = tl.cdiv(OH, BH)
    z = tl.zeros((BH, BC), dtype=tl.float32)
    g00, g10, g20, g01, g11, g21, g02, g12, g22 = z, z, z, z, z, z, z, z, z
    t0 = sl * tiles_per_prog
    for t in range(t0, tl.minimum(t0 + tiles_per_prog, n_tiles)):
        tw = t % n_tw
        tmp = t // n_tw
        th = tmp % n_th
        n64 = (tmp // n_th).to(tl.int64)
        oh = th * BH + tl.arange(0, BH)
        mrow = oh < OH
        xb = x_ptr + n64 * sxn
        ih0 = oh * sth - pdh
        ih1 = ih0 + dlh
        ih2 = ih1 + dlh
        p0 = xb + (ih0 * sxh)[:, None] + rc[None, :]
        p1 = xb + (ih1 * sxh)[:, None] + rc[None, :]
        p2 = xb + (ih2 * sxh)[:, None] + rc[None, :]
        m0 = (mrow & (ih0 >= 0) & (ih0 < H))[:, None] & mc[None, :]
        m1 = (mrow & (ih1 >= 0) & (ih1 < H))[:, None] & mc[None, :]
        m2 = (mrow & (ih2 >= 0) & (ih2 < H))[:, None] & mc[None, :]
        pdy = dy_ptr + n64 * syn + (oh * syh)[:, None] + rc[None, :]
        mdy = mrow[:, None] & mc[None, :]
        ow0 = tw * WALK
        if CST == 1:
            iw = ow0 - pdw
            a00, a01, a02 = _column(p0 + iw * sxw, p1 + iw * sxw, p2 + iw * sxw, m0, m1, m2,
                                    (iw >= 0) & (iw < W), R)
            a10, a11, a12 = z, z, z
            if S > 2:
                a10, a11, a12 = _column(p0 + (iw + 1) * sxw, p1 + (iw + 1) * sxw, p2 + (iw + 1) * sxw, m0, m1, m2,
                                        (iw + 1 >= 0) & (iw + 1 < W), R)
            d = tl.load(pdy + ow0 * syw, mask=mdy & (ow0 < OW), other=0.0).to(tl.float32)
            jn = ow0 - pdw + S - 1
            b0, b1, b2 = _column(p0 + jn * sxw, p1 + jn * sxw, p2 + jn * sxw, m0, m1, m2, (jn >= 0) & (jn < W), R)
            for j in tl.range(0, WALK, loop_unroll_factor=S):
                ow = ow0 + j
                # the next column's dy and x, loaded one step ahead (the walk is latency-bound)
                dn = tl.load(pdy + (ow + 1) * syw, mask=mdy & (ow + 1 < OW) & (j + 1 < WALK), other=0.0).to(tl.float32)
                jn = ow - pdw + S
                n0, n1, n2 = _column(p0 + jn * sxw, p1 + jn * sxw, p2 + jn * sxw, m0, m1, m2, (jn >= 0) & (jn < W),
                                     R)
                # the window's columns, oldest first: a0*, a1* (the last S - 1), b
                if S == 1:
                    g00, g10, g20, g01, g11, g21, g02, g12, g22 = _acc_taps(
                        g00, g10, g20, g01, g11, g21, g02, g12, g22, d, b0, b1, b2, b0, b1, b2, b0, b1, b2, R, S)
                elif S == 2:
                    g00, g10, g20, g01, g11, g21, g02, g12, g22 = _acc_taps(
                        g00, g10, g20, g01, g11, g21, g02, g12, g22, d, a00, a01, a02, b0, b1, b2, b0, b1, b2, R, S)
                    a00, a01, a02 = b0, b1, b2
                else:
                    g00, g10, g20, g01, g11, g21, g02, g12, g22 = _acc_taps(
                        g00, g10, g20, g01, g11, g21, g02, g12, g22, d, a00, a01, a02, a10, a11, a12, b0, b1, b2, R, S)
                    a00, a01, a02 = a10, a11, a12
                    a10, a11, a12 = b0, b1, b2
                b0, b1, b2 = n0, n1, n2
                d = dn
        else:
            g00, g10, g20, g01, g11, g21, g02, g12, g22 = _wgrad_s2(
                p0, p1, p2, m0, m1, m2, pdy, mdy, syw, sxw, ow0, pdw, W, OW, z,
                g00, g10, g20, g01, g11, g21, g02, g12, g22, R, S, WALK)
    row = sl * (R * S)
    _row_sum(ws_ptr, row, g00, rc, mc, C, 0, 0, R, S)
    _row_sum(ws_ptr, row, g01, rc, mc, C, 0, 1, R, S)
    _row_sum(ws_ptr, row, g02, rc, mc, C, 0, 2, R, S)
    _row_sum(ws_ptr, row, g10, rc, mc, C, 1, 0, R, S)
    _row_sum(ws_ptr, row, g11, rc, mc, C, 1, 1, R, S)
    _row_sum(ws_ptr, row, g12, rc, mc, C, 1, 2, R, S)
    _row_sum(ws_ptr, row, g20, rc, mc, C, 2, 0, R, S)
    _row_sum(ws_ptr, row, g21, rc, mc, C, 2, 1, R, S)
    _row_sum(ws_ptr, row, g22, rc, mc, C, 2, 2, R, S)


# ---- launchers -----------------------------------------------------------------------------------
def _tile(p: ConvProblem, dst_h: int, dst_w: int, tile: tuple | None = None) -> tuple[int, int, int, int, int]:
    """(BH, BC, WALK, warps, LOOK): `tile` or the direction's, narrowed to small images and
    channel counts; the walk covers the row in equal runs (no run of a few columns)."""
    if tile is None and p.direction == "fwd" and geom(p).stride[2] == 2 and dst_h * dst_w > SMALL_IMAGE:
        tile = TILE_S2_FWD
    BH, BC, WALK, warps, *look = tile or (TILE_SMALL if dst_h * dst_w <= SMALL_IMAGE else TILE)[p.direction]
    BH = min(BH, triton.next_power_of_2(dst_h))
    BC = max(8, min(BC, triton.next_power_of_2(p.C)))
    WALK = triton.cdiv(dst_w, triton.cdiv(dst_w, WALK))
    return BH, BC, WALK, warps, (look[0] if look else 2)


def _padding(p: ConvProblem) -> tuple[int, int, int]:
    """(pad rows, pad columns, row dilation) of the forward convolution the kernel runs."""
    gm = geom(p)
    R, S = gm.filt[1], gm.filt[2]
    if p.direction == "bwd_data":
        return gm.dil[1] * (R - 1) - gm.pad[1], (S - 1) - gm.pad[2], gm.dil[1]
    return gm.pad[1], gm.pad[2], gm.dil[1]


class WalkPlan:
    """Forward (epilogue fused) or stride-1 backward data: one launch of `_walk_kernel`."""

    def __init__(self, p: ConvProblem, tile: tuple[int, int, int, int] | None = None):
        self.p = p
        transposed = p.direction == "bwd_data"
        gm = geom(p)
        src_sp, dst_sp = (gm.out, gm.inp) if transposed else (gm.inp, gm.out)
        self.out_shape = p.x_shape if transposed else p.y_shape
        src_shape = p.y_shape if transposed else p.x_shape
        self.strides = (layout_strides(src_shape, "nhwc"), layout_strides(self.out_shape, "nhwc"))
        self.epi = NO_EPILOGUE if transposed else plan_epilogue(p)
        BH, BC, WALK, warps, LOOK = _tile(p, dst_sp[1], dst_sp[2], tile)
        ss, sd = _strides2(self.strides[0]), _strides2(self.strides[1])
        self.tiles = gm.N * triton.cdiv(dst_sp[1], BH) * triton.cdiv(dst_sp[2], WALK)
        self.launch = Launch(
            _walk_kernel, (self.tiles * triton.cdiv(p.C, BC),),
            (p.C, src_sp[1], src_sp[2], dst_sp[1], dst_sp[2], ss[0], ss[2], ss[3], sd[0], sd[2], sd[3],
             *_padding(p), 1 if transposed else gm.stride[1], *self.epi.scalars(), *self.epi.constexprs(),
             transposed, gm.filt[1], gm.filt[2], BH, BC, WALK, LOOK, 1 if transposed else gm.stride[2]),
            num_warps=warps)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        src = _in_layout(args.dy if p.direction == "bwd_data" else args.x, self.strides[0])
        dst = out if out is not None and out.stride() == self.strides[1] else \
            torch.empty_strided(self.out_shape, self.strides[1], dtype=p.out_dtype, device=src.device)
        self.launch(src, _dense_w(args.w), dst, *self.epi.pointers(args.bias, args.post_ops, dst))
        if out is not None and dst is not out:
            return out.copy_(dst)
        return dst


def _wgrad_split(p: ConvProblem, BH: int, BC: int, WALK: int) -> tuple[int, int, int]:
    """(tiles, tiles per slice, slices) of backward weights: ~4 programs per SM."""
    gm = geom(p)
    nt = gm.N * triton.cdiv(gm.out[1], BH) * triton.cdiv(gm.out[2], WALK)
    split = max(1, min(nt, triton.cdiv(4 * NUM_SMS, triton.cdiv(p.C, BC))))
    tpp = triton.cdiv(nt, split)
    return nt, tpp, triton.cdiv(nt, tpp)


class WalkWgradPlan:
    """Backward weights: per-slice partials [SPLIT, taps, C] (f32), summed in order."""

    def __init__(self, p: ConvProblem, tile: tuple[int, int, int, int] | None = None):
        self.p = p
        gm = geom(p)
        BH, BC, WALK, warps, _ = _tile(p, gm.out[1], gm.out[2], tile)
        self.strides = (layout_strides(p.y_shape, "nhwc"), layout_strides(p.x_shape, "nhwc"))
        sy, sx = _strides2(self.strides[0]), _strides2(self.strides[1])
        self.taps = gm.filt[1] * gm.filt[2]
        nt, tpp, self.split = _wgrad_split(p, BH, BC, WALK)
        self.ws_shape = (self.split, self.taps, p.C)
        self.launch = Launch(
            _walk_wgrad_kernel, (triton.cdiv(p.C, BC), self.split),
            (p.C, gm.inp[1], gm.inp[2], gm.out[1], gm.out[2], nt, tpp, sx[0], sx[2], sx[3], sy[0], sy[2], sy[3],
             gm.pad[1], gm.pad[2], gm.dil[1], gm.stride[1], gm.filt[1], gm.filt[2], BH, BC, WALK, gm.stride[2]),
            num_warps=warps)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        dy, x = _in_layout(args.dy, self.strides[0]), _in_layout(args.x, self.strides[1])
        ws = workspace.empty(self.ws_shape, torch.float32, x.device)
        self.launch(dy, x, ws)
        dw = out if out is not None else torch.empty(p.w_shape, dtype=p.out_dtype, device=x.device)
        dw.copy_(ws.sum(0).t().reshape(p.w_shape))     # fixed-order sum over the slices
        return dw


def workspace_bytes(p: ConvProblem) -> int:
    """Bytes of backward weights' f32 per-slice partials [SPLIT, taps, C]."""
    gm = geom(p)
    BH, BC, WALK, _, _ = _tile(p, gm.out[1], gm.out[2])
    return _wgrad_split(p, BH, BC, WALK)[2] * gm.filt[1] * gm.filt[2] * p.C * 4


# ---- solvers ---------------------------------------------------------------------------------------
def shape_reasons(p: ConvProblem) -> list[str]:
    """Options the walking kernels do not cover (each names the option and its value)."""
    reasons = []
    if not (p.groups == p.C == p.K):
        reasons.append(f"groups={p.groups}, C={p.C}, K={p.K}: depthwise only (groups == C == K)")
    if p.layout != "nhwc":
        reasons.append(f"layout={p.layout}: needs channels-last (nhwc)")
    if p.ndim == 3:
        reasons.append("ndim=3: 1-D and 2-D only")
    gm = geom(p)
    if p.direction == "bwd_data":
        if any(s != 1 for s in p.stride):
            reasons.append(f"stride={tuple(p.stride)}: backward data needs stride 1 (a transposed convolution)")
    elif gm.stride[2] > 2:
        reasons.append(f"stride={tuple(p.stride)}: the columns need stride 1 or 2 (the sliding window)")
    if gm.filt[1] > MAX_R or gm.filt[2] > MAX_S:
        reasons.append(f"filter {p.filter}: at most {MAX_R} x {MAX_S}")
    if gm.dil[2] != 1:
        reasons.append(f"dilation {p.dilation}: the columns need dilation 1 (the sliding window)")
    if p.direction == "bwd_data":
        reasons += flipped_padding_reasons(p)
    return reasons


class _WalkBase(Solver):
    family = "direct"
    primitive = "conv"
    uses_triton = True
    deterministic = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        p = problem
        reasons += shape_reasons(p)
        if not reasons and p.direction != "bwd_weights":
            gm = geom(p)
            dst = gm.inp if p.direction == "bwd_data" else gm.out
            BH, BC, WALK, _, _ = _tile(p, dst[1], dst[2])
            programs = gm.N * triton.cdiv(dst[1], BH) * triton.cdiv(dst[2], WALK) * triton.cdiv(p.C, BC)
            reasons += grid_reasons(((0, "row runs x channel blocks", programs),))
        return reasons + conv_index_reasons(p) + post_op_reasons(p)

    def estimate(self, problem) -> float | None:
        return dw_estimate(problem, "walk")


@register
class DepthwiseWalkFwd(_WalkBase):
    """Depthwise forward walking the rows; bias and post-ops fused."""
    id = 46
    name = "depthwise_walk_fwd"
    directions = frozenset({"fwd"})

    def prepare(self, problem):
        return WalkPlan(problem)


@register
class DepthwiseWalkBwdData(_WalkBase):
    """Depthwise backward data: the walking forward on dy with the flipped filter."""
    id = 47
    name = "depthwise_walk_bwd_data"
    directions = frozenset({"bwd_data"})

    def prepare(self, problem):
        return WalkPlan(problem)


@register
class DepthwiseWalkBwdWeights(_WalkBase):
    """Depthwise backward weights: per-tap register partials along the walk."""
    id = 48
    name = "depthwise_walk_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def prepare(self, problem):
        return WalkWgradPlan(problem)

