"""Winograd convolution (family `winograd`, solvers 50-57) for 3x3 (1D: 3-tap) filters,
stride 1, dilation 1, on the GPU in Triton: F(2x2,3x3) and F(4x4,3x3) in 2D, F(2,3) and
F(4,3) in 1D; forward, backward data and backward weights.

Math (Lavin & Gray). Per tile of m x m outputs (alpha = m + 2 inputs a side), with the
transform matrices B^T (alpha x alpha), G (alpha x 3) and A^T (m x alpha) of F(m, 3):
    U[k,c]   = G w[k,c] G^T                       filter transform   (alpha x alpha)
    V[c,t]   = B^T d[c,t] B                       input transform of tile t's patch d
    M[k,t]   = sum_c U[k,c] (.) V[c,t]            alpha^2 GEMMs (K x C) @ (C x tiles)
    y[k,t]   = A^T M[k,t] A                       output transform   (m x m)
In 1D the H direction is the identity transform (alpha_h = m_h = 1). The GEMMs do
alpha^2/m^2 multiplies per output and input channel against the direct convolution's 9
(3 in 1D): 2.25x fewer for F(2x2), 4x for F(4x4), 1.5x for F(2,3), 2x for F(4,3).
Backward data of a stride-1 convolution is the forward convolution of dy with the
flipped, transposed filter w'[c,k,r,s] = w[k,c,2-r,2-s] and padding 2 - pad on each side
(pad <= 2); the filter transform reads w that way, so both directions share the kernels.
Backward weights is the adjoint of the tile formula (y_t = A^T [U (.) V_t] A is linear in
U, and U = G w G^T in w):
    dW[k,c]  = G^T [ sum_t (A dy[k,t] A^T) (.) V[c,t] ] G
the input transform of x, the same kind of transform (A, alpha x m) of each m x m tile of
dy, alpha^2 GEMMs (K x tiles) @ (tiles x C) reduced over the tiles in splits (partial
sums, to which later chunks of images add, summed in a fixed order by the last kernel:
deterministic), then G^T dU G.

Kernels: `_filter_kernel` (U, per call: weights change in training), `_input_kernel`
(V of a chunk of images, written to the workspace as V[e, tile, channel] in the GEMM
operand dtype), then either the fused `_gemm_kernel` (solvers 50-53: per block of tiles
and output channels, the alpha^2 products one after the other -- one accumulator live --
each folded at once into the m x m output tiles by the output transform, then bias +
post-op chain (triton_epilogue), cast and store: M never touches memory) or the
non-fused pair `_bgemm_kernel` + `_output_kernel` (solvers 54/55, F(4): big GEMM tiles,
M[e, tile, k] in f32 through the workspace, then the output transform and epilogue).
The fused kernel holds m*m output tiles in registers, so its GEMM tiles are small
(32 x 32 in 2D); for an f32 (FMA) tl.dot that costs efficiency, which the non-fused
solvers avoid at the price of M's traffic: find picks. Backward weights (56/57): the
input kernel on x (B^T) and on dy (A), `_wgemm_kernel` (dYt[e]^T V[e] over a split of the
tiles, into f32 partial sums), `_wgrad_out_kernel` (sum of the splits, G^T dU G, cast,
dw's layout). Transform matrices are constexpr
tuples: zero coefficients are pruned at compile time, the transforms are explicit
separable sums. The tiles compile for sm_90 with no (or a few bytes of) register spills
(ptxas -v).

Numerics (transforms always in f32). Measured relative norm error vs float64 (random
data, C = 64..512, roundings emulated in torch; the half rows include the output
rounding, which alone is 1.6e-3):
                   f32 in, ieee GEMM   half in, bf16 operands   half in, f32 operands + TF32
    F(2x2,3x3)     7.5e-8              4.1e-3                   1.7e-3
    F(4x4,3x3)     4.8e-7              2.5e-2  (breaks 1e-2)    3.4e-3
    F(2,3)         -                   3.4e-3                   1.7e-3
    F(4,3)         -                   8.3e-3  (too close)      1.9e-3
so f32 inputs use f32 operands and an exact (ieee) GEMM, and half inputs f32 operands with
a TF32 GEMM for every variant (bf16 operands would break the tolerance for F(4) and leave
little margin for F(2)). With torch.set_float32_matmul_precision("high"|"medium") f32
inputs use a 3xTF32 GEMM (tensor cores; expected error ~1e-6, inside the f32 contract:
benchmarks/conv_families.py measures it), as
torch's own matmul relaxes its precision under that setting; the default ("highest")
keeps the exact GEMM.

Workspace: U (alpha^2 * K * C/groups), V of one chunk of images (chunks keep the
workspace under WORKSPACE_CAP), and for 54/55 M of that chunk; backward weights (56/57):
V and dYt of a chunk, f32 partial sums (splits x alpha^2 x K x C/groups). Supported:
1D/2D, both layouts, groups with C/groups and K/groups >= 16 (the GEMM's tiles; depthwise and narrow
groups belong to `direct`), any padding (forward; backward data needs pad <= 2 a side),
bias + up to 4 post-ops, f32/f16/bf16 (backward weights: f32 operands for every dtype,
exact or TF32 GEMM as above). Not applicable: filters other than 3 (3x3 / 3-tap),
stride or dilation != 1, 3D.
CPU: solver 14 (cpu_winograd.py: torch ops, explicit add/sub transforms, one bmm). The
transform matrices live in winograd_math.py, shared with it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..args import ConvArgs
from ..launch import Launch
from ..problems.conv import ConvProblem
from ..search.solver import Solver, register
from .implicit_gemm import INT32_LIMIT, layout_strides, strides5_of
from .implicit_gemm_bwd import NUM_SMS
from .triton_epilogue import NO_EPILOGUE, epilogue, interpreting, plan_epilogue, post_op_bytes, post_op_reasons
from .winograd_math import F23, F43, IDENTITY, VARIANTS, Transform  # noqa: F401 -- re-exported

WORKSPACE_CAP = 512 << 20
MIN_CH_PER_GROUP = 16
SPLIT_TILES = 128                  # backward weights: fewest tiles a split of the reduction gets


# ---- Triton kernels --------------------------------------------------------------------------
@triton.jit
def _axpy(s, c: tl.constexpr, d):
    """s + c*d with c a compile-time coefficient (0 pruned, +-1 without a multiply)."""
    if c == 1.0:
        s = s + d
    elif c == -1.0:
        s = s - d
    elif c != 0.0:
        s = s + c * d
    return s


@triton.jit
def _filter_kernel(w_ptr, u_ptr, G, CI, CO, s_g, s_ci, s_co, s_r, s_s,
                   GH: tl.constexpr, GW: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                   FLIP: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr):
    """u[e, g, ci, co] = sum_{r,s} GH[xi][r] GW[nu][s] w(g, ci, co, r, s), e = xi*AW + nu, with
    w(g, ci, co, r, s) = w_ptr[g*s_g + ci*s_ci + co*s_co + r'*s_r + s'*s_s] and (r', s') =
    (r, s), or (R-1-r, S-1-s) when FLIP (backward data: the flipped, transposed filter)."""
    AH: tl.constexpr = len(GH)
    AW: tl.constexpr = len(GW)
    g = tl.program_id(2)
    ri = tl.program_id(0) * BI + tl.arange(0, BI)
    ro = tl.program_id(1) * BO + tl.arange(0, BO)
    mask = (ri < CI)[:, None] & (ro < CO)[None, :]
    base = w_ptr + g * s_g + (ri * s_ci)[:, None] + (ro * s_co)[None, :]
    for xi in tl.static_range(AH):
        for nu in tl.static_range(AW):
            acc = tl.zeros((BI, BO), dtype=tl.float32)
            for r in tl.static_range(R):
                for s in tl.static_range(S):
                    if GH[xi][r] * GW[nu][s] != 0.0:
                        if FLIP:
                            off = (R - 1 - r) * s_r + (S - 1 - s) * s_s
                        else:
                            off = r * s_r + s * s_s
                        wv = tl.load(base + off, mask=mask, other=0.0).to(tl.float32)
                        acc = _axpy(acc, GH[xi][r] * GW[nu][s], wv)
            e = xi * AW + nu
            tl.store(u_ptr + ((e * G + g) * CI + ri)[:, None] * CO + ro[None, :],
                     acc.to(u_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _input_kernel(x_ptr, v_ptr, t0, NT, C, TH, TW, H, W, ph, pw, sxn, sxc, sxh, sxw,
                  MH: tl.constexpr, MW: tl.constexpr, BTH: tl.constexpr, BTW: tl.constexpr,
                  BP: tl.constexpr, BC: tl.constexpr):
    """v[e, t - t0, c] = sum_{i,j} BTH[xi][i] BTW[nu][j] x[n, c, th*MH - ph + i, tw*MW - pw + j]
    (0 outside the image) for tiles t = (n, th, tw) in [t0, t0 + NT), e = xi*AW + nu:
    rows first (T_i = row i times BTW^T), then columns (V += BTH[:, i] T_i). BTH is
    AH x PH: AH transformed rows from a patch of PH rows (B^T: PH = AH = alpha; A, the
    backward-weights transform of an m x m tile of dy: PH = m)."""
    AH: tl.constexpr = len(BTH)
    AW: tl.constexpr = len(BTW)
    PH: tl.constexpr = len(BTH[0])
    PW: tl.constexpr = len(BTW[0])
    rt = tl.program_id(0) * BP + tl.arange(0, BP)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mt = rt < NT
    mc = rc < C
    t = t0 + rt
    tw = t % TW
    t2 = t // TW
    th = t2 % TH
    n = t2 // TH
    ih0 = th * MH - ph
    iw0 = tw * MW - pw
    row = n.to(tl.int64) * sxn
    col = (rc.to(tl.int64) * sxc)[None, :]
    V = ()
    for _e in tl.static_range(AH * AW):
        V = V + (tl.zeros((BP, BC), dtype=tl.float32),)
    for i in tl.static_range(PH):
        ih = ih0 + i
        okh = mt & (ih >= 0) & (ih < H)
        D = ()
        for j in tl.static_range(PW):
            iw = iw0 + j
            ok = okh & (iw >= 0) & (iw < W)
            d = tl.load(x_ptr + (row + ih.to(tl.int64) * sxh + iw.to(tl.int64) * sxw)[:, None] + col,
                        mask=ok[:, None] & mc[None, :], other=0.0)
            D = D + (d.to(tl.float32),)
        for nu in tl.static_range(AW):
            s = tl.zeros((BP, BC), dtype=tl.float32)
            for j in tl.static_range(PW):
                s = _axpy(s, BTW[nu][j], D[j])
            for xi in tl.static_range(AH):
                if BTH[xi][i] != 0.0:
                    V = V[:xi * AW + nu] + (_axpy(V[xi * AW + nu], BTH[xi][i], s),) + V[xi * AW + nu + 1:]
    m2 = mt[:, None] & mc[None, :]
    off = rt[:, None] * C + rc[None, :]
    for e in tl.static_range(AH * AW):
        tl.store(v_ptr + e * NT * C + off, V[e].to(v_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _gemm_kernel(v_ptr, u_ptr, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                 t0, NT, G, Cg, Kg, NKB, TH, TW, OH, OW, s_yn, s_yc, s_yh, s_yw,
                 p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                 HAS_BIAS: tl.constexpr,
                 P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
                 P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
                 P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
                 P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
                 ATH: tl.constexpr, ATW: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                 BP: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """Fused GEMM + output transform, for BP tiles x BK output channels of group g: each
    M[e] = sum_c V[e, t, g*Cg + c] U[e, g, c, k] in turn (e outer, so one accumulator is live),
    folded at once into the m x m output tiles Y[a][b] += ATH[a][xi] ATW[b][nu] M[xi*AW + nu];
    then y[n, g*Kg + k, th*MH + a, tw*MW + b] = epilogue(Y[a][b]) inside the image."""
    MH: tl.constexpr = len(ATH)
    MW: tl.constexpr = len(ATW)
    AH: tl.constexpr = len(ATH[0])
    AW: tl.constexpr = len(ATW[0])
    pid_k = tl.program_id(1)
    g = pid_k // NKB
    rt = tl.program_id(0) * BP + tl.arange(0, BP)
    rk = (pid_k - g * NKB) * BK + tl.arange(0, BK)
    mt = rt < NT
    mk = rk < Kg
    C = G * Cg
    Y = ()
    for _i in tl.static_range(MH * MW):
        Y = Y + (tl.zeros((BP, BK), dtype=tl.float32),)
    # int32 offsets shared by every e (pointer tensors per e would all stay live)
    rcb = tl.arange(0, BC)
    a_off = rt[:, None] * C + rcb[None, :]
    b_off = rcb[:, None] * Kg + rk[None, :]
    for xi in tl.static_range(AH):
        for nu in tl.static_range(AW):
            acc = tl.zeros((BP, BK), dtype=tl.float32)
            a_e = v_ptr + (xi * AW + nu) * NT * C + g * Cg
            b_e = u_ptr + ((xi * AW + nu) * G + g) * Cg * Kg
            for c0 in range(0, Cg, BC):
                mc = (c0 + rcb) < Cg
                a = tl.load(a_e + c0 + a_off, mask=mt[:, None] & mc[None, :], other=0.0)
                b = tl.load(b_e + c0 * Kg + b_off, mask=mc[:, None] & mk[None, :], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PREC)
            for i in tl.static_range(MH * MW):
                if ATH[i // MW][xi] * ATW[i % MW][nu] != 0.0:
                    Y = Y[:i] + (_axpy(Y[i], ATH[i // MW][xi] * ATW[i % MW][nu], acc),) + Y[i + 1:]
    _store_tiles(Y, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, t0 + rt, mt, g * Kg + rk, mk,
                 TH, TW, OH, OW, s_yn, s_yc, s_yh, s_yw,
                 p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                 HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                 P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC, MH, MW)


@triton.jit
def _store_tiles(Y, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, t, mt, rn, mk,
                 TH, TW, OH, OW, s_yn, s_yc, s_yh, s_yw,
                 p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                 HAS_BIAS: tl.constexpr,
                 P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
                 P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
                 P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
                 P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
                 MH: tl.constexpr, MW: tl.constexpr):
    """y[n, rn, th*MH + a, tw*MW + b] = epilogue(Y[a*MW + b]) for tiles t = (n, th, tw),
    outputs inside the image only (int64 offsets; any layout through the strides)."""
    tw = t % TW
    t2 = t // TW
    th = t2 % TH
    n = t2 // TH
    col = (rn.to(tl.int64) * s_yc)[None, :]
    for i in tl.static_range(MH * MW):
        oh = th * MH + i // MW
        ow = tw * MW + i % MW
        mask = (mt & (oh < OH) & (ow < OW))[:, None] & mk[None, :]
        y_off = (n.to(tl.int64) * s_yn + oh.to(tl.int64) * s_yh + ow.to(tl.int64) * s_yw)[:, None] + col
        yv = epilogue(Y[i], y_off, rn, mk, mask, bias_ptr,
                      p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                      HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                      P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
        tl.store(y_ptr + y_off, yv.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bgemm_kernel(v_ptr, u_ptr, m_ptr, NT, G, Cg, Kg, NKB,
                  PREC: tl.constexpr, UPCAST: tl.constexpr,
                  BP: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """Non-fused GEMM: m[e, t, g*Kg + k] = sum_c V[e, t, g*Cg + c] U[e, g, c, k] (f32), one
    (e, tile block, channel block) per program: big accumulators, no transform in registers."""
    e = tl.program_id(2)
    pid_k = tl.program_id(1)
    g = pid_k // NKB
    rt = tl.program_id(0) * BP + tl.arange(0, BP)
    rk = (pid_k - g * NKB) * BK + tl.arange(0, BK)
    mt = rt < NT
    mk = rk < Kg
    C = G * Cg
    a_base = v_ptr + e * NT * C + rt[:, None] * C + g * Cg
    b_base = u_ptr + (e * G + g) * Cg * Kg + rk[None, :]
    acc = tl.zeros((BP, BK), dtype=tl.float32)
    for c0 in range(0, Cg, BC):
        rc = c0 + tl.arange(0, BC)
        mc = rc < Cg
        a = tl.load(a_base + rc[None, :], mask=mt[:, None] & mc[None, :], other=0.0)
        b = tl.load(b_base + rc[:, None] * Kg, mask=mc[:, None] & mk[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(m_ptr + e * NT * G * Kg + rt[:, None] * (G * Kg) + (g * Kg + rk)[None, :], acc,
             mask=mt[:, None] & mk[None, :])


@triton.jit
def _output_kernel(m_ptr, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                   t0, NT, K, TH, TW, OH, OW, s_yn, s_yc, s_yh, s_yw,
                   p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                   HAS_BIAS: tl.constexpr,
                   P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
                   P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
                   P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
                   P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
                   ATH: tl.constexpr, ATW: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr):
    """Output transform of the non-fused path: Y[a][b] = sum_e ATH[a][xi] ATW[b][nu] m[e, t, k],
    then the epilogue and the store (as the fused kernel's)."""
    MH: tl.constexpr = len(ATH)
    MW: tl.constexpr = len(ATW)
    AH: tl.constexpr = len(ATH[0])
    AW: tl.constexpr = len(ATW[0])
    rt = tl.program_id(0) * BP + tl.arange(0, BP)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mt = rt < NT
    mk = rk < K
    Y = ()
    for _i in tl.static_range(MH * MW):
        Y = Y + (tl.zeros((BP, BK), dtype=tl.float32),)
    base = m_ptr + rt[:, None] * K + rk[None, :]
    for xi in tl.static_range(AH):
        for nu in tl.static_range(AW):
            mv = tl.load(base + (xi * AW + nu) * NT * K, mask=mt[:, None] & mk[None, :], other=0.0)
            for i in tl.static_range(MH * MW):
                if ATH[i // MW][xi] * ATW[i % MW][nu] != 0.0:
                    Y = Y[:i] + (_axpy(Y[i], ATH[i // MW][xi] * ATW[i % MW][nu], mv),) + Y[i + 1:]
    _store_tiles(Y, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, t0 + rt, mt, rk, mk,
                 TH, TW, OH, OW, s_yn, s_yc, s_yh, s_yw,
                 p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                 HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                 P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC, MH, MW)


@triton.jit
def _wgemm_kernel(dyt_ptr, v_ptr, part_ptr, NT, TPS, G, Cg, Kg, NKB, NCB,
                  ACCUM: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """Backward weights, transformed domain: part[s, e, g, k, c] (+)= sum over tiles t of
    split s ([s*TPS, (s+1)*TPS)) of dYt[e, t, g*Kg + k] V[e, t, g*Cg + c]; program_id =
    (g, k block, c block), split s, e. The first chunk of images stores, later ones add
    (ACCUM); `_wgrad_out_kernel` sums the splits in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.program_id(2)
    cb = pid % NCB
    t2 = pid // NCB
    kb = t2 % NKB
    g = t2 // NKB
    rk = kb * BK + tl.arange(0, BK)
    rc = cb * BC + tl.arange(0, BC)
    mk = rk < Kg
    mc = rc < Cg
    K = G * Kg
    C = G * Cg
    t_end = tl.minimum((s + 1) * TPS, NT)
    a_base = dyt_ptr + e * NT * K + g * Kg + rk[None, :]
    b_base = v_ptr + e * NT * C + g * Cg + rc[None, :]
    acc = tl.zeros((BK, BC), dtype=tl.float32)
    for t0 in range(s * TPS, t_end, BT):
        rt = t0 + tl.arange(0, BT)
        mt = rt < t_end
        a = tl.load(a_base + rt[:, None] * K, mask=mt[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_base + rt[:, None] * C, mask=mt[:, None] & mc[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)
    E = tl.num_programs(2)
    ptrs = part_ptr + ((s * E + e) * G + g) * Kg * Cg + rk[:, None] * Cg + rc[None, :]
    mask = mk[:, None] & mc[None, :]
    if ACCUM:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, acc, mask=mask)


@triton.jit
def _wgrad_out_kernel(part_ptr, dw_ptr, NSLOT, G, Kg, Cg, NKB, s_k, s_c, s_r, s_s,
                      GH: tl.constexpr, GW: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """dw[g*Kg + k, c, r, s] = sum_{xi,nu} GH[xi][r] GW[nu][s] sum_slot part[slot, xi*AW + nu, g, k, c]
    (G^T dU G), cast to dw's dtype and stored through its strides."""
    AH: tl.constexpr = len(GH)
    AW: tl.constexpr = len(GW)
    R: tl.constexpr = len(GH[0])
    S: tl.constexpr = len(GW[0])
    pid = tl.program_id(0)
    g = pid // NKB
    rk = (pid - g * NKB) * BK + tl.arange(0, BK)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rk < Kg)[:, None] & (rc < Cg)[None, :]
    E = AH * AW
    Y = ()
    for _i in tl.static_range(R * S):
        Y = Y + (tl.zeros((BK, BC), dtype=tl.float32),)
    off = rk[:, None] * Cg + rc[None, :]          # int32, shared by every e and slot
    for xi in tl.static_range(AH):
        for nu in tl.static_range(AW):
            du = tl.zeros((BK, BC), dtype=tl.float32)
            for slot in range(0, NSLOT):
                du += tl.load(part_ptr + (((slot * E + xi * AW + nu) * G + g) * Kg * Cg) + off, mask=mask, other=0.0)
            for i in tl.static_range(R * S):
                if GH[xi][i // S] * GW[nu][i % S] != 0.0:
                    Y = Y[:i] + (_axpy(Y[i], GH[xi][i // S] * GW[nu][i % S], du),) + Y[i + 1:]
    dst = dw_ptr + ((g * Kg + rk) * s_k)[:, None] + (rc * s_c)[None, :]
    for i in tl.static_range(R * S):
        tl.store(dst + (i // S) * s_r + (i % S) * s_s, Y[i].to(dw_ptr.dtype.element_ty), mask=mask)


# ---- geometry, tiles, plan ---------------------------------------------------------------------
@dataclass(frozen=True)
class WinoGeom:
    """The forward convolution the kernels run: dy * w' for backward data. Sizes are 2-D
    (H = 1 for 1D): N images, G groups of CI input and CO output channels, input H x W,
    output OH x OW, top/left padding ph/pw; TH x TW tiles of MH x MW outputs."""
    N: int
    G: int
    CI: int
    CO: int
    H: int
    W: int
    OH: int
    OW: int
    ph: int
    pw: int
    th: Transform
    tw: Transform

    @property
    def tiles_per_image(self) -> int:
        return self.TH * self.TW

    @property
    def TH(self) -> int:
        return -(-self.OH // self.th.m)

    @property
    def TW(self) -> int:
        return -(-self.OW // self.tw.m)

    @property
    def E(self) -> int:
        return self.th.alpha * self.tw.alpha


def wino_geom(p: ConvProblem, m: int) -> WinoGeom:
    tr = VARIANTS[m]
    sp = lambda t: (1,) * (2 - len(t)) + tuple(t)  # noqa: E731
    th = tr if p.ndim == 2 else IDENTITY
    G = p.groups
    if p.direction != "bwd_data":            # fwd, and bwd_weights' tiles of the forward output
        (H, W), (OH, OW) = sp(p.in_size), sp(p.out_size)
        ph, pw = sp(p.pad_before) if p.ndim == 2 else (0, p.pad_before[0])
        return WinoGeom(p.N, G, p.C // G, p.K // G, H, W, OH, OW, ph, pw, th, tr)
    (H, W), (OH, OW) = sp(p.out_size), sp(p.in_size)
    pb = tuple(2 - b for b in p.pad_before)
    ph, pw = pb if p.ndim == 2 else (0, pb[0])
    return WinoGeom(p.N, G, p.K // G, p.C // G, H, W, OH, OW, ph, pw, th, tr)


@dataclass(frozen=True)
class WinoTile:
    """GEMM tile: BP tiles x BK output channels, BC channels per step (powers of two,
    >= 16), warps, pipeline stages."""
    BP: int
    BK: int
    BC: int
    warps: int
    stages: int


def pick_tile(m: int, ndim: int, fused: bool, kg: int) -> WinoTile:
    """Tiles that compile for sm_90 without register spills (ptxas -v, Triton 3.6): the
    fused kernel keeps m x m output tiles Y plus one accumulator live, and an f32 (FMA)
    tl.dot holds each thread's operand slices for all BC channels of a step: BC = 16 and
    small tiles there. Non-fused GEMM: 128 x 64 (or 128 x 128 for K/groups >= 128)."""
    if not fused:
        return WinoTile(128, 128, 16, 8, 2) if kg >= 128 else WinoTile(128, 64, 16, 8, 3)
    if ndim == 1:
        return WinoTile(128, 64, 16, 8, 2) if m == 2 else WinoTile(64, 64, 16, 8, 2)
    return WinoTile(32, 32, 16, 4, 2) if m == 2 else WinoTile(32, 32, 16, 8, 2)


def operand_dtype(m: int, dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(GEMM operand dtype, tl.dot precision): see the module's numerics table."""
    if dtype == torch.float32:
        return torch.float32, ("ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32x3")
    return torch.float32, "tf32"


class WinogradPlan:
    """Everything but the tensors, fixed in prepare: geometry, chunks of images, operand
    dtype, kernel launches. `m` = 2 or 4 (F(2x2,3x3) / F(4x4,3x3), or F(2,3) / F(4,3));
    `fused`: output transform in the GEMM kernel, else through M in the workspace."""

    def __init__(self, p: ConvProblem, m: int, fused: bool = True, tile: WinoTile | None = None,
                 precision: str | None = None):
        self.p, self.m, self.fused = p, m, fused
        self.gm = gm = wino_geom(p, m)
        self.tile = tile = tile or pick_tile(m, p.ndim, fused, gm.CO)
        self.op_dtype, prec = operand_dtype(m, p.dtype)
        self.prec = precision or prec
        self.out_shape = p.y_shape if p.direction == "fwd" else p.x_shape
        self.epi = plan_epilogue(p) if p.direction == "fwd" else NO_EPILOGUE
        e = self.op_dtype.itemsize
        K = gm.G * gm.CO
        self.u_numel = gm.E * gm.G * gm.CI * gm.CO
        per_image = gm.E * gm.tiles_per_image * gm.G * gm.CI * e + (0 if fused else gm.E * gm.tiles_per_image * K * 4)
        self.images = max(1, min(gm.N, (WORKSPACE_CAP - self.u_numel * e) // max(1, per_image)))
        self.chunks = [(n0, min(gm.N, n0 + self.images)) for n0 in range(0, gm.N, self.images)]
        self.v_numel = gm.E * gm.tiles_per_image * gm.G * gm.CI * self.images
        self.m_numel = 0 if fused else gm.E * gm.tiles_per_image * K * self.images
        self._plan_launches()

    def _plan_launches(self) -> None:
        p, gm, tile = self.p, self.gm, self.tile
        src_shape = p.x_shape if p.direction == "fwd" else p.y_shape
        s5 = strides5_of(layout_strides(src_shape, p.layout))
        sx = (s5[0], s5[1], s5[3], s5[4])
        w5 = strides5_of(layout_strides(p.w_shape, p.layout))   # (k, c, -, r, s)
        Kg = p.K // p.groups
        if p.direction == "fwd":
            fs = (Kg * w5[0], w5[1], w5[0], w5[3], w5[4])         # s_g, s_ci (input c), s_co (output k)
        else:
            fs = (Kg * w5[0], w5[0], w5[1], w5[3], w5[4])         # transposed: ci = k, co = c
        R = 3 if p.ndim == 2 else 1
        bi, bo = 16, 32
        self.filter = Launch(_filter_kernel, (triton.cdiv(gm.CI, bi), triton.cdiv(gm.CO, bo), gm.G),
                             (gm.G, gm.CI, gm.CO, *fs, gm.th.G, gm.tw.G, R, 3, p.direction != "fwd", bi, bo))
        y5 = strides5_of(layout_strides(self.out_shape, p.layout))
        s_y = (y5[0], y5[1], y5[3], y5[4])
        nkb = triton.cdiv(gm.CO, tile.BK)
        upcast = interpreting() and self.op_dtype != torch.float32
        epi = (*self.epi.scalars(), *self.epi.constexprs())
        self.steps = []
        # input transform tile: E tiles of V live at once; ~72 registers of them a thread
        BPI, BCI = (16, 16) if gm.E > 16 else (32, 32)
        for n0, n1 in self.chunks:
            nt = (n1 - n0) * gm.tiles_per_image
            t0 = n0 * gm.tiles_per_image
            inp = Launch(_input_kernel, (triton.cdiv(nt, BPI), triton.cdiv(gm.G * gm.CI, BCI)),
                         (t0, nt, gm.G * gm.CI, gm.TH, gm.TW, gm.H, gm.W, gm.ph, gm.pw, *sx,
                          gm.th.m, gm.tw.m, gm.th.BT, gm.tw.BT, BPI, BCI))
            opts = dict(num_warps=tile.warps, num_stages=tile.stages)
            if self.fused:
                gemm = Launch(_gemm_kernel, (triton.cdiv(nt, tile.BP), gm.G * nkb),
                              (t0, nt, gm.G, gm.CI, gm.CO, nkb, gm.TH, gm.TW, gm.OH, gm.OW, *s_y, *epi,
                               gm.th.AT, gm.tw.AT, self.prec, upcast, tile.BP, tile.BK, tile.BC), **opts)
                self.steps.append((inp, gemm, None))
                continue
            gemm = Launch(_bgemm_kernel, (triton.cdiv(nt, tile.BP), gm.G * nkb, gm.E),
                          (nt, gm.G, gm.CI, gm.CO, nkb, self.prec, upcast, tile.BP, tile.BK, tile.BC), **opts)
            BPO, BKO = (16, 32) if gm.E > 16 else (32, 32)      # m*m output tiles live
            out = Launch(_output_kernel, (triton.cdiv(nt, BPO), triton.cdiv(gm.G * gm.CO, BKO)),
                         (t0, nt, gm.G * gm.CO, gm.TH, gm.TW, gm.OH, gm.OW, *s_y, *epi,
                          gm.th.AT, gm.tw.AT, BPO, BKO))
            self.steps.append((inp, gemm, out))

    @property
    def workspace_bytes(self) -> int:
        return (self.u_numel + self.v_numel) * self.op_dtype.itemsize + self.m_numel * 4

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        fwd = p.direction == "fwd"
        src = _standard(args.x if fwd else args.dy, p.layout)
        w = _standard(args.w, p.layout)
        dst = out if out is not None else _empty(self.out_shape, p.layout, p.out_dtype, src.device)
        if not _same_strides(dst, p.layout):
            return dst.copy_(self(args))
        u = new_buffer(self.u_numel, self.op_dtype, src.device)
        v = new_buffer(self.v_numel, self.op_dtype, src.device)
        mbuf = new_buffer(self.m_numel, torch.float32, src.device) if self.m_numel else None
        self.filter(w, u)
        ptrs = self.epi.pointers(args.bias, args.post_ops, dst)
        for inp, gemm, outp in self.steps:
            inp(src, v)
            if outp is None:
                gemm(v, u, dst, *ptrs)
            else:
                gemm(v, u, mbuf)
                outp(mbuf, dst, *ptrs)
        return dst


def _a_matrix(t: Transform) -> tuple:
    """A (alpha x m) = AT transposed: the transform of an m x m tile of dy in backward weights."""
    return tuple(tuple(t.AT[a][xi] for a in range(t.m)) for xi in range(t.alpha))


class WinogradBwdWeightsPlan:
    """dW[k,c] = G^T [sum_t (A dY_t A^T) (.) V_t] G (the adjoint of the forward tile formula
    y_t = A^T [(G w G^T) (.) V_t] A): V of x (the forward input transform), dYt of dy (A on
    each m x m tile of the output), the transformed-domain GEMM dU[e] = dYt[e]^T V[e] reduced
    over the tiles in splits (partial sums, summed in a fixed order: deterministic), and the
    filter-side transform G^T dU G. Chunks of images add their own splits."""

    def __init__(self, p: ConvProblem, m: int, precision: str | None = None):
        self.p, self.m = p, m
        self.gm = gm = wino_geom(p, m)
        _, prec = operand_dtype(m, p.dtype)
        self.prec = precision or prec
        K, C = gm.G * gm.CO, gm.G * gm.CI
        per_image = gm.E * gm.tiles_per_image * (C + K)
        self.images = max(1, min(gm.N, WORKSPACE_CAP // 2 // max(1, per_image * 4)))
        self.chunks = [(n0, min(gm.N, n0 + self.images)) for n0 in range(0, gm.N, self.images)]
        self.v_numel = gm.E * gm.tiles_per_image * C * self.images
        self.dyt_numel = gm.E * gm.tiles_per_image * K * self.images
        BT, self.BK, self.BC = 32, 64, 64
        nkb, ncb = triton.cdiv(gm.CO, self.BK), triton.cdiv(gm.CI, self.BC)
        programs = gm.G * nkb * ncb * gm.E
        sx = strides5_of(layout_strides(p.x_shape, p.layout))
        sy = strides5_of(layout_strides(p.y_shape, p.layout))
        A_h, A_w = _a_matrix(gm.th), _a_matrix(gm.tw)
        BPI, BCI = (16, 16) if gm.E > 16 else (32, 32)
        upcast = interpreting()
        self.steps = []
        nt0 = self.images * gm.tiles_per_image               # the first chunk is the largest
        self.slots = max(1, min(triton.cdiv(2 * NUM_SMS, programs), triton.cdiv(nt0, SPLIT_TILES)))
        for n0, n1 in self.chunks:
            nt = (n1 - n0) * gm.tiles_per_image
            t0 = n0 * gm.tiles_per_image
            tps = triton.cdiv(triton.cdiv(nt, self.slots), BT) * BT
            splits = triton.cdiv(nt, tps)                    # <= slots; the first chunk fills them all
            vx = Launch(_input_kernel, (triton.cdiv(nt, BPI), triton.cdiv(C, BCI)),
                        (t0, nt, C, gm.TH, gm.TW, gm.H, gm.W, gm.ph, gm.pw, sx[0], sx[1], sx[3], sx[4],
                         gm.th.m, gm.tw.m, gm.th.BT, gm.tw.BT, BPI, BCI))
            vdy = Launch(_input_kernel, (triton.cdiv(nt, BPI), triton.cdiv(K, BCI)),
                         (t0, nt, K, gm.TH, gm.TW, gm.OH, gm.OW, 0, 0, sy[0], sy[1], sy[3], sy[4],
                          gm.th.m, gm.tw.m, A_h, A_w, BPI, BCI))
            gemm = Launch(_wgemm_kernel, (gm.G * nkb * ncb, splits, gm.E),
                          (nt, tps, gm.G, gm.CI, gm.CO, nkb, ncb, n0 > 0, self.prec, upcast, BT, self.BK, self.BC),
                          num_warps=8, num_stages=3)
            self.steps.append((vx, vdy, gemm))
        slot = self.slots
        self.part_numel = slot * gm.E * K * gm.CI
        w5 = strides5_of(layout_strides(p.w_shape, p.layout))
        bko, bco = (16, 32) if gm.E > 16 else (32, 32)
        self.final = Launch(_wgrad_out_kernel, (gm.G * triton.cdiv(gm.CO, bko), triton.cdiv(gm.CI, bco)),
                            (slot, gm.G, gm.CO, gm.CI, triton.cdiv(gm.CO, bko), w5[0], w5[1], w5[3], w5[4],
                             gm.th.G, gm.tw.G, bko, bco), num_stages=1)

    @property
    def workspace_bytes(self) -> int:
        return (self.v_numel + self.dyt_numel + self.part_numel) * 4

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        x, dy = _standard(args.x, p.layout), _standard(args.dy, p.layout)
        dst = out if out is not None else _empty(p.w_shape, p.layout, p.out_dtype, x.device)
        if not _same_strides(dst, p.layout):
            return dst.copy_(self(args))
        v = new_buffer(self.v_numel, torch.float32, x.device)
        dyt = new_buffer(self.dyt_numel, torch.float32, x.device)
        part = new_buffer(self.part_numel, torch.float32, x.device)
        for vx, vdy, gemm in self.steps:
            vx(x, v)
            vdy(dy, dyt)
            gemm(dyt, v, part)
        self.final(part, dst)
        return dst


def new_buffer(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A workspace buffer (tests replace this to hand out NaN-poisoned ones and count them)."""
    return torch.empty(numel, dtype=dtype, device=device)


def _empty(shape, layout: str, dtype: torch.dtype, device) -> torch.Tensor:
    from ..problems.conv import empty_in_layout
    return empty_in_layout(shape, layout, dtype=dtype, device=device)


def _same_strides(t: torch.Tensor, layout: str) -> bool:
    want = layout_strides(tuple(t.shape), layout)
    return all(a == b or n == 1 for a, b, n in zip(t.stride(), want, t.shape))


def _standard(t: torch.Tensor, layout: str) -> torch.Tensor:
    if _same_strides(t, layout):
        return t
    if layout == "nchw":
        return t.contiguous()
    perm = (0, *range(2, t.dim()), 1)
    inv = (0, t.dim() - 1, *range(1, t.dim() - 1))
    return t.permute(*perm).contiguous().permute(*inv)


def winograd_reasons(p: ConvProblem) -> list[str]:
    reasons = []
    if p.ndim not in (1, 2):
        reasons.append(f"Winograd serves 1D and 2D convolutions, not {p.ndim}D")
        return reasons
    if any(f != 3 for f in p.filter):
        reasons.append(f"Winograd F(m,3) serves 3-tap / 3x3 filters, got {p.filter}")
    if any(s != 1 for s in p.stride):
        reasons.append(f"Winograd serves stride 1 only, got stride {p.stride}")
    if any(d != 1 for d in p.dilation):
        reasons.append(f"Winograd serves dilation 1 only, got dilation {p.dilation}")
    cg, kg = p.C // p.groups, p.K // p.groups
    if min(cg, kg) < MIN_CH_PER_GROUP:
        reasons.append(f"C/groups={cg} and K/groups={kg} must be >= {MIN_CH_PER_GROUP} (the transformed-domain "
                       f"GEMM's tiles; depthwise and narrow groups: direct)")
    if p.direction == "bwd_data" and max(p.pad_before + p.pad_after) > 2:
        reasons.append(f"backward data as a forward convolution needs padding <= 2, got {p.padding}")
    if reasons:
        return reasons
    gm = wino_geom(p, 4)                  # F(4) transforms the most elements per tile
    per_image = gm.E * gm.tiles_per_image * max(gm.G * gm.CI, gm.G * gm.CO)
    if per_image >= INT32_LIMIT or gm.E * gm.G * gm.CI * gm.CO >= INT32_LIMIT:
        reasons.append(f"one image's transformed input/output has {per_image} elements; the workspace "
                       f"indexing (int32) needs < 2**31")
    return reasons


# ---- solvers -------------------------------------------------------------------------------------
def host_floor_ms(problem, launches: int) -> float:
    """Host work per call on the H200 machine (find's clock): the plan, the allocations and
    `launches` kernel launches (filter transform and main kernel fused; input transform,
    GEMM and output transform unfused). The system db's fastest calls: 0.065 ms (fused),
    0.072 (unfused); without it the small layers' estimates fell to 0.03 ms."""
    return 0.03 + 0.0133 * launches if problem.device == "cuda" else 0.0


class _WinogradBase(Solver):
    family = "winograd"
    primitive = "conv"
    uses_triton = True
    m: int
    fused: bool = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + winograd_reasons(problem) + post_op_reasons(problem)

    def workspace_size(self, problem) -> int:
        return WinogradPlan(problem, self.m, self.fused).workspace_bytes

    def estimate(self, problem) -> float | None:
        gm = wino_geom(problem, self.m)
        op_dtype, prec = operand_dtype(self.m, problem.dtype)
        nt = gm.N * gm.tiles_per_image
        gemm_flops = 2.0 * gm.E * nt * gm.G * gm.CI * gm.CO
        v_bytes = gm.E * nt * gm.G * gm.CI * op_dtype.itemsize
        m_bytes = 0 if self.fused else gm.E * nt * gm.G * gm.CO * 4
        # f32 FMA tl.dot (ieee) ~half the 67 TFLOP/s; tensor cores: 3xTF32, TF32, bf16
        rate = {"ieee": 30e12, "tf32x3": 120e12, "tf32": 300e12}[prec] if op_dtype == torch.float32 else 400e12
        if self.fused and prec == "ieee":
            rate *= 0.7               # fewer accumulators per thread: more shared-memory traffic per FMA
        if prec == "tf32":
            # measured on the H200 (system db, bf16 ResNet layers): the transforms, not the
            # GEMM, bound these kernels: ~17 (fused F2), ~7 (fused F4), ~35 (unfused) TFLOP/s of GEMM
            rate = min(rate, 35e12 if not self.fused else 17e12 if self.m == 2 else 7e12)
        nbytes = problem.bytes() + post_op_bytes(problem) + 2 * v_bytes + 2 * m_bytes
        t = (gemm_flops / rate + nbytes / 4.2e12) / 0.8 * 1e3 + 0.01
        return max(t, host_floor_ms(problem, 2 if self.fused else 3))

    def prepare(self, problem):
        return WinogradPlan(problem, self.m, self.fused)


@register
class WinogradF2Fwd(_WinogradBase):
    id = 50
    name = "winograd_f2_fwd"
    directions = frozenset({"fwd"})
    m = 2


@register
class WinogradF4Fwd(_WinogradBase):
    id = 51
    name = "winograd_f4_fwd"
    directions = frozenset({"fwd"})
    m = 4


@register
class WinogradF2BwdData(_WinogradBase):
    id = 52
    name = "winograd_f2_bwd_data"
    directions = frozenset({"bwd_data"})
    m = 2


@register
class WinogradF4BwdData(_WinogradBase):
    id = 53
    name = "winograd_f4_bwd_data"
    directions = frozenset({"bwd_data"})
    m = 4


@register
class WinogradF4NonfusedFwd(_WinogradBase):
    id = 54
    name = "winograd_f4_nonfused_fwd"
    directions = frozenset({"fwd"})
    m = 4
    fused = False


@register
class WinogradF4NonfusedBwdData(_WinogradBase):
    id = 55
    name = "winograd_f4_nonfused_bwd_data"
    directions = frozenset({"bwd_data"})
    m = 4
    fused = False


class _WinogradBwdWeights(_WinogradBase):
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, problem) -> int:
        return WinogradBwdWeightsPlan(problem, self.m).workspace_bytes

    def estimate(self, problem) -> float | None:
        gm = wino_geom(problem, self.m)
        _, prec = operand_dtype(self.m, problem.dtype)
        nt = gm.N * gm.tiles_per_image
        gemm_flops = 2.0 * gm.E * nt * gm.G * gm.CI * gm.CO
        rate = {"ieee": 30e12, "tf32x3": 120e12, "tf32": 15e12}[prec]  # tf32: measured on the H200 (system db)
        nbytes = problem.bytes() + 2 * gm.E * nt * gm.G * (gm.CI + gm.CO) * 4
        return max((gemm_flops / rate + nbytes / 4.2e12) / 0.8 * 1e3 + 0.015, host_floor_ms(problem, 3))

    def prepare(self, problem):
        return WinogradBwdWeightsPlan(problem, self.m)


@register
class WinogradF2BwdWeights(_WinogradBwdWeights):
    id = 56
    name = "winograd_f2_bwd_weights"
    m = 2


@register
class WinogradF4BwdWeights(_WinogradBwdWeights):
    id = 57
    name = "winograd_f4_bwd_weights"
    m = 4

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        if problem.dtype != torch.float32:
            # the TF32 GEMM over the F(4x4) transformed tiles: on the H200 2.3e-2 relative error in
            # f16 (8x64x56x56 3x3, tests/gpu/test_api_gpu.py; torch 3.6e-4), and find recorded it
            # "wrong" (> 2e-2) in bf16 (benchmarks/diag/wgrad_f16_check.py, 2026-12-02)
            reasons.append(f"dtype {problem.dtype}: F(4x4) backward weights on half inputs is ~2e-2 off "
                           "(TF32 GEMM of the transformed tiles); f32 only")
        return reasons


def conv_bwd_weights(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None, m: int = 2) -> torch.Tensor:
    """One-shot backward weights (plans, then runs); tests and benchmarks."""
    return WinogradBwdWeightsPlan(p, m)(args, out)


def conv(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None, m: int = 2, fused: bool = True,
         tile: WinoTile | None = None) -> torch.Tensor:
    """One-shot run (plans, then runs); tests and benchmarks."""
    return WinogradPlan(p, m, fused, tile)(args, out)
