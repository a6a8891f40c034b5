"""Implicit-GEMM convolution in Triton (family `implicit_gemm`): forward with the fused
epilogue (bias + post-op chain), backward data; backward weights is in
implicit_gemm_bwd.py.

Forward as a GEMM per group g:  y[m, k] = sum_j A[m, j] * B[j, k]
  m = (n, od, oh, ow)  (M = N*OD*OH*OW),  k in [0, K/groups),
  j = (t, r, s, c)     (K_gemm = T*R*S*C/groups, channels fastest),
  A[m, j] = x[n, g*Cg + c, od*sd - pd + t*dd, oh*sh - ph + r*dh, ow*sw - pw + s*dw]
            (0 outside the input: the padding, asymmetric allowed, is index masks),
  B[j, k] = w[g*Kg + k, c, t, r, s].
Both layouts are indexed natively through strides (NHWC: c contiguous, loads along the
GEMM's reduction; NCHW: w contiguous, loads along M). 1D and 2D are 3D with unit dims.
Two reduction walks: channel-blocked (one tap at a time, BK channels; C/groups >= 32)
and flat (BK consecutive j, gathered; small C/groups such as the RGB stem).

Backward data as a GEMM per group and per stride phase (the "transposed conv"):
  dx[n, g*Cg + c, i] = sum_{k, taps} dy[n, g*Kg + k, o] * w[g*Kg + k, c, tap]
with o = (i + pad - tap*dil) / stride when exact and in range. Output pixels are split
into stride phases i = ph + stride*q; within a phase the contributing taps form an
arithmetic progression known on the host, so no tap is masked out for divisibility
(no wasted MACs at stride 2). f32 accumulation; output cast to the problem's dtype.

TMA paths (Hopper tensor descriptors; f16/bf16 NHWC, groups 1, 16-byte channel rows):
1x1 stride-1 unpadded forward / backward data run as a plain GEMM (`_gemm_tma_kernel`);
stride-1 convolutions with a filter run `_conv_tma_kernel` (the output tile is a
rectangle of one image, each tap's source tile a shifted box of a 5-D descriptor whose
zero fill is the padding); backward weights has its own (implicit_gemm_bwd.py). Which
directions use them: configs.TMA_CONV_DIRECTIONS (measured).

Invokers are plans (`FwdPlan`, `BwdDataPlan`): every launch argument is computed in
`prepare`; a call allocates the output and launches (nnprim/launch.py).

Supported: 1D/2D/3D, nchw/nhwc, any stride/padding/dilation/groups, f32 (exact, no
TF32), f16, bf16 (f32 or bf16 output for forward). Indexing: the base of each image
(n * stride_n) is int64, offsets within an image, the pixel rows (N * spatial) and the
weights are int32, so problems whose rows, one image of x or y, or w reach 2**31
elements are refused (`conv_index_reasons`); groups are folded into grid axis 0 (no
65535 limit). Not supported: more than 4 fused post-ops."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..args import ConvArgs
from ..errors import NotSupportedError
from ..launch import Launch, descriptor
from ..limits import int32_reasons, span
from ..problems.conv import ConvProblem
from ..search.solver import Solver, register
from . import configs
from .triton_epilogue import NO_EPILOGUE, epilogue, interpreting, plan_epilogue, post_op_bytes, post_op_reasons, tl_dot_precision

PEAK_TFLOPS = {torch.bfloat16: 750.0, torch.float16: 750.0, torch.float32: 50.0}
PEAK_TBS = 4.2
INT32_LIMIT = 2 ** 31


# ---- geometry --------------------------------------------------------------------------
@dataclass(frozen=True)
class Geom:
    """A problem's sizes padded to 3 spatial dims (leading unit dims for 1D/2D)."""
    N: int
    C: int
    K: int
    G: int
    inp: tuple[int, int, int]
    filt: tuple[int, int, int]
    out: tuple[int, int, int]
    stride: tuple[int, int, int]
    pad: tuple[int, int, int]
    dil: tuple[int, int, int]

    @property
    def Cg(self) -> int:
        return self.C // self.G

    @property
    def Kg(self) -> int:
        return self.K // self.G

    @property
    def taps(self) -> int:
        return math.prod(self.filt)

    @property
    def P(self) -> int:
        return math.prod(self.out)


def geom(p: ConvProblem) -> Geom:
    k = 3 - p.ndim
    return Geom(p.N, p.C, p.K, p.groups, (1,) * k + p.in_size, (1,) * k + p.filter,
                (1,) * k + p.out_size, (1,) * k + p.stride, (0,) * k + p.pad_before,
                (1,) * k + p.dilation)


def gemm_shape_reasons(p: ConvProblem) -> list[str]:
    """Whole tensors below 2**31 elements (for kernels indexing every tensor in int32)."""
    reasons = []
    for name, shape in (("x", p.x_shape), ("w", p.w_shape), ("y", p.y_shape)):
        if math.prod(shape) >= INT32_LIMIT:
            reasons.append(f"{name} has {math.prod(shape)} elements; int32 indexing needs < 2**31")
    return reasons


def conv_index_reasons(p: ConvProblem) -> list[str]:
    """Why the conv Triton kernels (implicit GEMM, im2col, direct) cannot index p: they
    add each image's base n * stride_n in int64 and index within an image, the pixel rows
    and the weights in int32."""
    gm = geom(p)
    p_in = math.prod(gm.inp)
    return int32_reasons((
        ("rows of y (N*OD*OH*OW)", gm.N * gm.P), ("rows of x (N*D*H*W)", gm.N * p_in),
        ("one image of y (K*OD*OH*OW)", gm.K * gm.P), ("one image of x (C*D*H*W)", gm.C * p_in),
        ("w (K*C/groups*taps)", gm.K * gm.Cg * gm.taps)))


def flipped_padding_reasons(p: ConvProblem) -> list[str]:
    """Why stride-1 backward data cannot run as the forward of dy with the flipped filter:
    that forward's padding, dilation*(filter-1) - pad per side, would be negative."""
    reach = tuple(d * (r - 1) for d, r in zip(p.dilation, p.filter))
    if any(a > m or b > m for a, b, m in zip(p.pad_before, p.pad_after, reach)):
        return [f"padding {p.padding} exceeds dilation*(filter-1) = {reach}: the flipped "
                "convolution would need negative padding"]
    return []


TENSOR_NAMES = {"fwd": ("x", "w", "y"), "bwd_data": ("dy", "w", "dx"), "bwd_weights": ("dy", "x", "dw")}


def check_strided(p: ConvProblem, shapes, strides) -> None:
    """Raise NotSupportedError when the direction's three tensors, given with `strides`
    (views, not the layout's own), reach farther than int32 indexing within one image
    (or within the weights, which have no int64 batch base)."""
    for name, shape, st in zip(TENSOR_NAMES[p.direction], shapes, strides):
        whole = name in ("w", "dw")
        ext = span(shape, st) if whole else span(shape[1:], st[1:])
        if int32_reasons(((name, ext),)):
            raise NotSupportedError(f"{name} strides {tuple(st)} reach {ext} elements within one "
                                    f"{'tensor' if whole else 'image'}: int32 indexing needs fewer")


# the host work of one call (plan lookup, output allocation, a Triton launch): the system db's
# fastest implicit GEMM calls on the H200 took 0.022-0.03 ms in every direction (find's clock)
HOST_FLOOR_MS = 0.025
HOST_PER_LAUNCH_MS = 0.013   # each further launch of a call (as Winograd's; stride-2 bwd_data runs one per phase)
GPU_SMS = 132                # an H200's SMs (the estimates price H200 runs)
# The native NCHW kernels' efficiency against the NHWC estimate, per direction, and the least
# time of their backward: the H200 system db (2026-12-02) has the Triton implicit GEMM on NCHW
# at 3.6x (backward data), 4.8x (backward weights), 2.0x (forward) its estimate at a flat 0.3,
# against 1.9x / 1.7x / 1.65x on NHWC; its NCHW backward never under 0.086 ms, small layers included
NCHW_EFF = {"fwd": 0.25, "bwd_data": 0.16, "bwd_weights": 0.1}
NCHW_BWD_FLOOR_MS = 0.085


def roofline_ms(flops: float, nbytes: float, dtype: torch.dtype, efficiency: float = 0.7) -> float:
    t_c = flops / (PEAK_TFLOPS.get(dtype, 50.0) * 1e12)
    t_m = nbytes / (PEAK_TBS * 1e12)
    return max(t_c, t_m) / efficiency * 1e3 + 0.005


def bwd_data_launches(p: ConvProblem) -> int:
    """Launches of solver 21's call: one per stride phase of dx (BwdDataPlan's loop), one
    when a TMA kernel serves it (stride 1)."""
    if all(s == 1 for s in p.stride):
        return 1
    return math.prod(len(dim_phases(n, f, s, pb, dl)) for n, f, s, pb, dl in
                     zip(p.in_size, p.filter, p.stride, p.pad_before, p.dilation))


def fit(block: int, n: int, lo: int = 16) -> int:
    """Shrink a power-of-two block to the problem size (at least lo)."""
    return max(lo, min(block, triton.next_power_of_2(max(n, 1))))


# ---- forward kernel ----------------------------------------------------------------------
@triton.jit
def _group_pid(tiles_per_group):
    """(tile, group) of this program: groups are folded into grid axis 0 (axes 1 and 2
    allow only 65535 programs), group-major so a group's tiles run together."""
    pid = tl.program_id(0)
    g = pid // tiles_per_group
    return pid - g * tiles_per_group, g


@triton.jit(do_not_specialize=["M", "H", "W", "OH", "OW"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _conv_fwd_kernel(
        x_ptr, w_ptr, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
        M, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sxn, sxc, sxd, sxh, sxw, swk, swc, swt, swr, sws, syn, syp, syk,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
        HAS_BIAS: tl.constexpr,
        P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
        P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
        P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
        P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
        FLAT_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(Kg, BN)
    pid, g = _group_pid(num_m * num_n)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < Kg
    ow = rm % OW
    tmp = rm // OW
    oh = tmp % OH
    tmp = tmp // OH
    od = tmp % OD
    n = tmp // OD
    n64 = n.to(tl.int64)
    id0 = od * std - pdd
    ih0 = oh * sth - pdh
    iw0 = ow * stw - pdw
    x_row = x_ptr + n64 * sxn + g * Cg * sxc        # [BM] pointers (int64 image bases)
    w_col = w_ptr + (g * Kg + rn) * swk             # [BN] pointers
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if FLAT_K:
        KT = Cg * T * R * S
        for k0 in range(0, KT, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < KT
            c = rk % Cg
            tap = rk // Cg
            ss = tap % S
            tap = tap // S
            rr = tap % R
            tt = tap // R
            idd = id0[:, None] + (tt * dld)[None, :]
            ihh = ih0[:, None] + (rr * dlh)[None, :]
            iww = iw0[:, None] + (ss * dlw)[None, :]
            ok = (mask_m[:, None] & mk[None, :] & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H)
                  & (iww >= 0) & (iww < W))
            a = tl.load(x_row[:, None] + (c * sxc)[None, :] + idd * sxd + ihh * sxh + iww * sxw,
                        mask=ok, other=0.0)
            b = tl.load(w_col[None, :] + (c * swc + tt * swt + rr * swr + ss * sws)[:, None],
                        mask=mk[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
    else:
        nc = tl.cdiv(Cg, BK)
        for it in range(0, T * R * S * nc):
            tap = it // nc
            c0 = (it - tap * nc) * BK
            ss = tap % S
            tap = tap // S
            rr = tap % R
            tt = tap // R
            idd = id0 + tt * dld
            ihh = ih0 + rr * dlh
            iww = iw0 + ss * dlw
            ok = mask_m & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H) & (iww >= 0) & (iww < W)
            rc = c0 + tl.arange(0, BK)
            mc = rc < Cg
            a = tl.load((x_row + idd * sxd + ihh * sxh + iww * sxw)[:, None] + (rc * sxc)[None, :],
                        mask=ok[:, None] & mc[None, :], other=0.0)
            b = tl.load(w_col[None, :] + (rc * swc)[:, None] + (tt * swt + rr * swr + ss * sws),
                        mask=mc[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)

    P = OD * OH * OW
    pix = rm - n * P
    rk_glob = g * Kg + rn
    y_off = (n64 * syn + pix * syp)[:, None] + (rk_glob * syk)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    acc = epilogue(acc, y_off, rk_glob, mask_n, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- 1x1 stride-1 NHWC: a plain GEMM through TMA ------------------------------------------
@triton.jit(do_not_specialize=["M"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _gemm_tma_kernel(
        a_desc, b_desc, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
        M, N, KR,
        p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
        HAS_BIAS: tl.constexpr,
        P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
        P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
        P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
        P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
        TRANS_B: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """y[m, n] = epilogue(sum_k A[m, k] * B[k, n]) with A [M, KR] and B either [N, KR]
    (TRANS_B: forward, B = w as [K, C]) or [KR, N] (backward data, B = w as [K, C],
    N = C), both read by TMA (out-of-bounds rows/columns come back as zeros); y is
    [M, N] row-major (NHWC), stored with vector stores along n."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(KR, BK)):
        a = a_desc.load([off_m, k * BK])
        if TRANS_B:
            b = tl.trans(b_desc.load([off_n, k * BK]))
        else:
            b = b_desc.load([k * BK, off_n])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    mask_n = rn < N
    mask = (rm < M)[:, None] & mask_n[None, :]
    y_off = rm.to(tl.int64)[:, None] * N + rn[None, :]
    acc = epilogue(acc, y_off, rn, mask_n, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["NSL", "OH", "OW"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _conv_tma_kernel(
        a_desc, b_desc, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
        NSL, NCH, CRED, OD, OH, OW, T, R, S, syn, syd, syh, syw, pdd, pdh, pdw, dld, dlh, dlw,
        p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
        HAS_BIAS: tl.constexpr,
        P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
        P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
        P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
        P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
        TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BH: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Stride-1 NHWC convolution (groups 1) with every operand read by TMA: an output
    tile is a BH x BW rectangle of one (n, od) slice; for each tap the source tile is
    the same rectangle shifted by tap*dil - pad (forward) or pad - tap*dil (backward
    data), read through a 5-D descriptor over the source [N, D, H, W, CRED] whose
    out-of-bounds zero fill is the padding. The weights are w as [K, T*R*S*C]:
    forward reads [BN, BK] boxes at (k, tap*C + c) and transposes; backward data reads
    [BK, BN] boxes at (k, tap*C + c). Columns past C spill into the next tap's
    weights: they only produce output columns that are masked at the store."""
    BM: tl.constexpr = BH * BW
    pid = tl.program_id(0)
    n_tw = tl.cdiv(OW, BW)
    n_th = tl.cdiv(OH, BH)
    num_m = NSL * n_th * n_tw
    num_n = tl.cdiv(NCH, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    tw = pid_m % n_tw
    tmp = pid_m // n_tw
    th = tmp % n_th
    nd = tmp // n_th
    od = nd % OD
    n = nd // OD
    oh0 = th * BH
    ow0 = tw * BW
    off_n = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    nk = tl.cdiv(CRED, BK)
    for it in range(0, T * R * S * nk):
        tap = it // nk
        c0 = (it - tap * nk) * BK
        ss = tap % S
        rr = (tap // S) % R
        tt = tap // (S * R)
        if TRANSPOSED:
            a = a_desc.load([n, od + pdd - tt * dld, oh0 + pdh - rr * dlh, ow0 + pdw - ss * dlw, c0])
            b = b_desc.load([c0, tap * NCH + off_n])
        else:
            a = a_desc.load([n, od - pdd + tt * dld, oh0 - pdh + rr * dlh, ow0 - pdw + ss * dlw, c0])
            b = tl.trans(b_desc.load([off_n, tap * CRED + c0]))
        a = tl.reshape(a, (BM, BK))
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    ri = tl.arange(0, BM)
    oh = oh0 + ri // BW
    ow = ow0 + ri % BW
    rn = off_n + tl.arange(0, BN)
    mask_n = rn < NCH
    mask = ((oh < OH) & (ow < OW))[:, None] & mask_n[None, :]
    y_off = (n.to(tl.int64) * syn + od * syd + oh * syh + ow * syw)[:, None] + rn[None, :]
    acc = epilogue(acc, y_off, rn, mask_n, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


def layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Strides of a contiguous logical (N, C, *spatial) tensor stored in `layout`."""
    phys = tuple(shape) if layout == "nchw" else (shape[0], *shape[2:], shape[1])
    st, acc = [0] * len(phys), 1
    for i in range(len(phys) - 1, -1, -1):
        st[i] = acc
        acc *= phys[i]
    if layout == "nchw":
        return tuple(st)
    return (st[0], st[-1], *st[1:-1])


def is_plain_gemm(p: ConvProblem) -> bool:
    """1x1, stride 1, unpadded, ungrouped NHWC, f16/bf16 with 16-byte rows: x (or dy)
    is a row-major [pixels, channels] matrix and w a [K, C] one; TMA can read both."""
    return configs.plain_gemm_eligible(p)


def same_memory(shapes, strides_a, strides_b) -> bool:
    """Whether tensors of `shapes` with strides_a and strides_b address the same
    elements (strides of size-1 dims do not matter)."""
    return all(all(n == 1 or x == y for n, x, y in zip(sh, a, b))
               for sh, a, b in zip(shapes, strides_a, strides_b))


class _Plan:
    """An invoker planned in prepare: output allocation and launches with every
    scalar precomputed for the problem's standard strides (its layout, contiguous).
    A call with other strides (views, size-1 dims strided differently, an `out`
    buffer in another order) gets a plan for those strides, made on first use and
    kept in `variants`."""

    def __init__(self, p: ConvProblem, tile: configs.GemmTile | None, strides: tuple | None):
        self.p = p
        self.tile = tile or configs.pick(p)
        ins = {"fwd": (p.x_shape, p.w_shape, p.y_shape), "bwd_data": (p.y_shape, p.w_shape, p.x_shape),
               "bwd_weights": (p.y_shape, p.x_shape, p.w_shape)}[p.direction]
        std = tuple(layout_strides(s, p.layout) for s in ins)
        self.strides = strides or std
        self.shapes = ins
        self.out_shape = ins[2]
        self.std = same_memory(ins, self.strides, std)
        if not self.std:
            check_strided(p, ins, self.strides)
        self.variants: dict = {}
        self.by_inputs: dict = {self.strides[:2]: self}

    def variant(self, strides: tuple) -> _Plan:
        v = self.variants.get(strides)
        if v is None:
            v = self.variants[strides] = type(self)(self.p, self.tile, strides)
        return v

    def for_inputs(self, key: tuple) -> _Plan:
        """The plan of inputs with strides `key` (two tuples) and the planned output: this
        one where they address the planned memory (a 1x1 filter's contiguous w has other
        strides on its size-1 dims than channels-last's: the common case, kept cheap)."""
        v = self.by_inputs.get(key)
        if v is None:
            full = (*key, self.strides[2])
            v = self if same_memory(self.shapes, full, self.strides) else self.variant(full)
            if len(self.by_inputs) < 64:
                self.by_inputs[key] = v
        return v

    def alloc(self, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty_strided(self.out_shape, self.strides[2], dtype=dtype, device=device)


def is_tma_conv(p: ConvProblem) -> bool:
    """Stride-1 ungrouped NHWC f16/bf16 with 16-byte channel rows, filter larger than
    1x1: the TMA convolution kernel can read x (dy) and w."""
    return configs.tma_conv_eligible(p)


def conv_tile(BM: int, OH: int, OW: int) -> tuple[int, int]:
    """(BH, BW) of a TMA convolution's output rectangle: whole (power-of-two) rows of
    up to BM pixels, as many rows as fit (fewer for small images)."""
    BW = min(triton.next_power_of_2(OW), BM)
    return min(triton.next_power_of_2(OH), max(BM // BW, 1)), BW


def _tma_conv_setup(plan: _Plan, p: ConvProblem, tile: configs.GemmTile, epi) -> None:
    """Plan `_conv_tma_kernel` (forward or stride-1 backward data) on `plan`."""
    gm = geom(p)
    transposed = p.direction == "bwd_data"
    src_sp, dst_sp = (gm.out, gm.inp) if transposed else (gm.inp, gm.out)
    nch, cred = (gm.C, gm.K) if transposed else (gm.K, gm.C)
    pad = gm.pad
    BH, BW = conv_tile(tile.BM, dst_sp[1], dst_sp[2])
    BN, BK = fit(tile.BN, nch), fit(tile.BK, cred)
    sd = strides5_of(plan.strides[2])
    n_m = gm.N * dst_sp[0] * triton.cdiv(dst_sp[1], BH) * triton.cdiv(dst_sp[2], BW)
    plan.da = ([gm.N, *src_sp, cred], [math.prod(src_sp) * cred, src_sp[1] * src_sp[2] * cred, src_sp[2] * cred,
                                       cred, 1], [1, 1, BH, BW, BK])
    plan.db = ([gm.K, gm.taps * gm.C], [gm.taps * gm.C, 1], [BK, BN] if transposed else [BN, BK])
    plan.launch = Launch(
        _conv_tma_kernel, (n_m * triton.cdiv(nch, BN),),
        (gm.N * dst_sp[0], nch, cred, *dst_sp, *gm.filt, sd[0], sd[2], sd[3], sd[4], *pad, *gm.dil,
         *epi.scalars(), *epi.constexprs(), transposed, interpreting() and p.dtype == torch.bfloat16,
         tl_dot_precision(p.dtype), BH, BW, BN, BK, tile.group_m),
        num_warps=tile.warps, num_stages=tile.stages)


class FwdPlan(_Plan):
    """Forward: y = epilogue(conv(x, w)), one launch: the implicit GEMM, the TMA GEMM
    for plain-GEMM problems, or the TMA convolution (stride 1, `configs.use_tma_conv`)."""

    def __init__(self, p: ConvProblem, tile: configs.GemmTile | None = None, strides: tuple | None = None,
                 tma: bool = True, tma_conv: bool | None = None):
        super().__init__(p, tile, strides)
        gm, tile = geom(p), self.tile
        self.epi = plan_epilogue(p)
        sx, sw, sy = (strides5_of(s) for s in self.strides)
        upcast = interpreting() and p.dtype == torch.bfloat16
        M = gm.N * gm.P
        BM, BN = fit(tile.BM, M), fit(tile.BN, gm.Kg)
        if tma_conv is None:
            tma_conv = configs.use_tma_conv(p)
        self.tma = tma and self.std and (is_plain_gemm(p) or (tma_conv and is_tma_conv(p)))
        self.fallback = None
        if self.tma and not is_plain_gemm(p):
            _tma_conv_setup(self, p, tile, self.epi)
            return
        if self.tma:
            BK = fit(tile.BK, gm.C)
            self.da = ([M, p.C], [p.C, 1], [BM, BK])
            self.db = ([p.K, p.C], [p.C, 1], [BN, BK])
            self.launch = Launch(
                _gemm_tma_kernel, (triton.cdiv(M, BM) * triton.cdiv(gm.K, BN),),
                (M, gm.K, gm.C, *self.epi.scalars(), *self.epi.constexprs(), True, upcast,
                 tl_dot_precision(p.dtype), BM, BN, BK, tile.group_m),
                num_warps=tile.warps, num_stages=tile.stages)
            return
        flat = gm.Cg < 32 and gm.taps > 1
        BK = fit(tile.BK, gm.Cg * gm.taps if flat else gm.Cg)
        sy3 = (sy[0], sy[4], sy[1])   # (n, pixel, channel): pixels are w-fastest in both layouts
        self.launch = Launch(
            _conv_fwd_kernel, (triton.cdiv(M, BM) * triton.cdiv(gm.Kg, BN) * gm.G,),
            (M, gm.Cg, gm.Kg, *gm.inp, *gm.out, *gm.filt, *sx, *sw, *sy3, *gm.stride, *gm.pad, *gm.dil,
             *self.epi.scalars(), *self.epi.constexprs(), flat, upcast, tl_dot_precision(p.dtype),
             BM, BN, BK, tile.group_m),
            num_warps=tile.warps, num_stages=tile.stages)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        x, w = args.x, args.w
        if out is not None and out.stride() != self.strides[2]:
            return out.copy_(self(args))
        y = out if out is not None else self.alloc(self.p.out_dtype, x.device)
        plan = self.by_inputs.get((x.stride(), w.stride())) or self.for_inputs((x.stride(), w.stride()))
        if plan is not self:
            return plan(args, y)
        ptrs = self.epi.pointers(args.bias, args.post_ops, y)
        xp, wp, yp = x.data_ptr(), w.data_ptr(), y.data_ptr()
        if self.tma and (xp | wp) & 15:
            self.fallback = self.fallback or FwdPlan(self.p, self.tile, self.strides, tma=False)
            return self.fallback(args, y)
        launch = self.launch
        # the planned fast path: addresses, not tensors (Launch.run_addresses)
        addr = self.epi.addresses(ptrs, yp) if launch.ready() and not (xp | wp | yp) & 15 else None
        if self.tma:
            if addr is not None:
                launch.run_keyed_addresses((xp, wp), lambda: (descriptor(x, *self.da), descriptor(w, *self.db)),
                                           yp, *addr)
            else:
                launch(descriptor(x, *self.da), descriptor(w, *self.db), y, *ptrs)
        elif addr is not None:
            launch.run_addresses(xp, wp, yp, *addr)
        else:
            launch(x, w, y, *ptrs)
        return y


def strides5_of(s: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a logical (N, C, *spatial) tensor as (N, C, D, H, W) (0 for missing dims)."""
    return (s[0], s[1]) + (0,) * (5 - len(s)) + tuple(s[2:])


def strides5(t: torch.Tensor) -> tuple[int, ...]:
    return strides5_of(t.stride())


def conv_fwd(p: ConvProblem, args: ConvArgs, tile: configs.GemmTile | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot forward (plans, then runs); `out` (optional, y-shaped) receives y."""
    return FwdPlan(p, tile)(args, out)


# ---- backward data kernel --------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "H", "W", "OH", "OW", "QH", "QW"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _conv_bwd_data_kernel(
        dy_ptr, w_ptr, dx_ptr,
        M, Cg, Kg, D, H, W, OD, OH, OW, QD, QH, QW,
        sdn, sdk, sdd, sdh, sdw, swk, swc, swt, swr, sws, sxn, sxc, sxd, sxh, sxw,
        phd, phh, phw, std, sth, stw,
        r0d, r0h, r0w, rsd, rsh, rsw, nrd, nrh, nrw, bsd, bsh, bsw, dcd, dch, dcw,
        UPCAST: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """One stride phase: dx pixels i = ph + st*q (q < Q); taps r = r0 + j*rs (j < nr)
    reach dy at o = q + bs - j*dc."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(Cg, BN)
    pid, g = _group_pid(num_m * num_n)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < Cg
    qw = rm % QW
    tmp = rm // QW
    qh = tmp % QH
    tmp = tmp // QH
    qd = tmp % QD
    n64 = (tmp // QD).to(tl.int64)
    dy_row = dy_ptr + n64 * sdn + g * Kg * sdk
    w_col = w_ptr + (g * Kg * swk + rn * swc)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    nk = tl.cdiv(Kg, BK)
    for it in range(0, nrd * nrh * nrw * nk):
        tap = it // nk
        k0 = (it - tap * nk) * BK
        js = tap % nrw
        tap = tap // nrw
        jr = tap % nrh
        jt = tap // nrh
        o_d = qd + bsd - jt * dcd
        o_h = qh + bsh - jr * dch
        o_w = qw + bsw - js * dcw
        ok = mask_m & (o_d >= 0) & (o_d < OD) & (o_h >= 0) & (o_h < OH) & (o_w >= 0) & (o_w < OW)
        rk = k0 + tl.arange(0, BK)
        mk = rk < Kg
        a = tl.load((dy_row + o_d * sdd + o_h * sdh + o_w * sdw)[:, None] + (rk * sdk)[None, :],
                    mask=ok[:, None] & mk[None, :], other=0.0)
        t = r0d + jt * rsd
        r = r0h + jr * rsh
        s = r0w + js * rsw
        b = tl.load(w_col[None, :] + (rk * swk)[:, None] + (t * swt + r * swr + s * sws),
                    mask=mk[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)

    i_d = phd + qd * std
    i_h = phh + qh * sth
    i_w = phw + qw * stw
    x_off = (n64 * sxn + i_d * sxd + i_h * sxh + i_w * sxw)[:, None] + ((g * Cg + rn) * sxc)[None, :]
    tl.store(dx_ptr + x_off, acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Phase:
    """Per-dim stride phase of backward data: dx index i = ph + st*q, q < Q; taps
    r = r0 + j*rs, j < nr, reach dy index o = q + bs - j*dc."""
    ph: int
    Q: int
    r0: int
    rs: int
    nr: int
    bs: int
    dc: int


def dim_phases(size: int, filt: int, st: int, pad: int, dil: int) -> list[Phase]:
    out = []
    for ph in range(st):
        Q = (size - ph + st - 1) // st
        if Q <= 0:
            continue
        taps = [r for r in range(filt) if (ph + pad - r * dil) % st == 0]
        if taps:
            r0, rs = taps[0], st // math.gcd(st, dil)
            out.append(Phase(ph, Q, r0, rs, len(taps), (ph + pad - r0 * dil) // st, rs * dil // st))
        else:
            out.append(Phase(ph, Q, 0, 1, 0, 0, 0))
    return out


class BwdDataPlan(_Plan):
    """Backward data: one implicit-GEMM launch per stride phase, or one TMA GEMM for
    plain-GEMM problems, or one TMA convolution (stride 1, `configs.use_tma_conv`)."""

    def __init__(self, p: ConvProblem, tile: configs.GemmTile | None = None, strides: tuple | None = None,
                 tma: bool = True, tma_conv: bool | None = None):
        super().__init__(p, tile, strides)
        gm, tile = geom(p), self.tile
        upcast = interpreting() and p.dtype == torch.bfloat16
        prec = tl_dot_precision(p.dtype)
        BN = fit(tile.BN, gm.Cg)
        BK = fit(tile.BK, gm.Kg)
        if tma_conv is None:
            tma_conv = configs.use_tma_conv(p)
        self.tma = tma and self.std and (is_plain_gemm(p) or (tma_conv and is_tma_conv(p)))
        self.fallback = None
        self.launches = []
        if self.tma and not is_plain_gemm(p):
            _tma_conv_setup(self, p, tile, NO_EPILOGUE)
            self.launches.append(self.launch)
            return
        if self.tma:
            M = gm.N * gm.P
            BM = fit(tile.BM, M)
            self.da = ([M, p.K], [p.K, 1], [BM, BK])
            self.db = ([p.K, p.C], [p.C, 1], [BK, BN])
            self.launches.append(Launch(
                _gemm_tma_kernel, (triton.cdiv(M, BM) * triton.cdiv(gm.C, BN),),
                (M, gm.C, gm.K, *NO_EPILOGUE.scalars(), *NO_EPILOGUE.constexprs(), False, upcast, prec,
                 BM, BN, BK, tile.group_m),
                num_warps=tile.warps, num_stages=tile.stages))
            return
        sd, sw, sx = (strides5_of(s) for s in self.strides)
        per_dim = [dim_phases(gm.inp[i], gm.filt[i], gm.stride[i], gm.pad[i], gm.dil[i]) for i in range(3)]
        for pd_ in per_dim[0]:
            for ph_ in per_dim[1]:
                for pw_ in per_dim[2]:
                    M = gm.N * pd_.Q * ph_.Q * pw_.Q
                    BM = fit(tile.BM, M)
                    ph3 = (pd_, ph_, pw_)
                    self.launches.append(Launch(
                        _conv_bwd_data_kernel, (triton.cdiv(M, BM) * triton.cdiv(gm.Cg, BN) * gm.G,),
                        (M, gm.Cg, gm.Kg, *gm.inp, *gm.out, *(q.Q for q in ph3),
                         *sd, *sw, *sx, *(q.ph for q in ph3), *gm.stride,
                         *(q.r0 for q in ph3), *(q.rs for q in ph3), *(q.nr for q in ph3),
                         *(q.bs for q in ph3), *(q.dc for q in ph3), upcast, prec, BM, BN, BK, tile.group_m),
                        num_warps=tile.warps, num_stages=tile.stages))

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        dy, w = args.dy, args.w
        dx = out if out is not None else self.alloc(self.p.out_dtype, dy.device)
        if out is not None and dx.stride() != self.strides[2]:
            return self.variant((dy.stride(), w.stride(), dx.stride()))(args, dx)
        plan = self.by_inputs.get((dy.stride(), w.stride())) or self.for_inputs((dy.stride(), w.stride()))
        if plan is not self:
            return plan(args, dx)
        dp, wp, xp = dy.data_ptr(), w.data_ptr(), dx.data_ptr()
        if self.tma:
            if (dp | wp) & 15:
                self.fallback = self.fallback or BwdDataPlan(self.p, self.tile, self.strides, tma=False)
                return self.fallback(args, dx)
            launch = self.launches[0]
            if launch.ready() and not xp & 15:   # addresses, not tensors (Launch.run_addresses)
                launch.run_keyed_addresses((dp, wp), lambda: (descriptor(dy, *self.da), descriptor(w, *self.db)),
                                           *(xp,) * 6)
            else:
                launch(descriptor(dy, *self.da), descriptor(w, *self.db), *(dx,) * 6)
            return dx
        fast = not (dp | wp | xp) & 15
        for launch in self.launches:
            if fast and launch.ready():
                launch.run_addresses(dp, wp, xp)
            else:
                launch(dy, w, dx)
        return dx


def conv_bwd_data(p: ConvProblem, args: ConvArgs, tile: configs.GemmTile | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot backward data (plans, then runs); `out` (optional, x-shaped) receives dx."""
    return BwdDataPlan(p, tile)(args, out)


# ---- solvers ---------------------------------------------------------------------------------
class _IGemmBase(Solver):
    family = "implicit_gemm"
    primitive = "conv"
    uses_triton = True
    launch_per_phase = True   # stride-2 backward data: one launch per dx phase (the Gluon solver: one)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + conv_index_reasons(problem) + post_op_reasons(problem)

    def estimate(self, problem) -> float | None:
        gm = geom(problem)
        d = problem.direction
        # tensor-core efficiency falls when a GEMM side is narrower than the tile (per group:
        # depthwise backward weights is a 1-row GEMM per channel)
        m_side = {"fwd": gm.N * gm.P, "bwd_data": gm.N * math.prod(gm.inp), "bwd_weights": gm.Kg}[d]
        n_side = {"fwd": gm.Kg, "bwd_data": gm.Cg, "bwd_weights": gm.Cg * gm.taps}[d]
        k_side = {"fwd": gm.Cg * gm.taps, "bwd_data": gm.Kg * gm.taps, "bwd_weights": gm.N * gm.P}[d]
        eff = 0.7 * min(1.0, m_side / 64) * min(1.0, n_side / 64) * min(1.0, k_side / 64)
        if d != "bwd_weights" and problem.device == "cuda":
            # fewer 128 x 128 output tiles than SMs leave SMs idle (backward weights splits its
            # long reduction instead)
            tiles = math.ceil(m_side / 128) * math.ceil(n_side / 128) * problem.groups
            eff *= min(1.0, tiles / GPU_SMS)
        # flat walk (RGB stems, patchify): gathered K, 14-33 TFLOP/s on the H200; a cap on the
        # tensor-core rate only (the convnext 4x4 / 4 stem, 0.46 GFLOP in 14 MB: 0.047 ms where
        # the capped roofline of its bytes said 0.14, 2026-12-02 held-out run)
        flat = d == "fwd" and gm.Cg < 32 and gm.taps > 1
        eff_mma = min(eff, 0.025) if flat else eff
        if d == "bwd_weights" and gm.Cg < 32 and gm.taps > 1 and not is_tma_conv(problem):
            eff = eff_mma = min(eff, 0.033)  # the same gathered (tap, c) columns: rn50_conv1 25 TFLOP/s (issue 13)
        nchw = problem.layout == "nchw" and gm.taps > 1
        if nchw:   # NCHW indexed natively: channel-strided gathers per tap (NCHW_EFF; 1x1 is a plain GEMM)
            eff *= NCHW_EFF[d]
            eff_mma *= NCHW_EFF[d]
        launches = bwd_data_launches(problem) if d == "bwd_data" and self.launch_per_phase else 1
        nbytes = problem.bytes() + post_op_bytes(problem)
        t = max(roofline_ms(problem.flops(), 0.0, problem.dtype, max(eff_mma, 0.02)),
                roofline_ms(0.0, nbytes, problem.dtype, max(eff, 0.02)))
        if problem.device != "cuda":
            return t
        floor = HOST_FLOOR_MS + HOST_PER_LAUNCH_MS * (launches - 1)
        return max(t, floor, NCHW_BWD_FLOOR_MS if nchw and d != "fwd" else 0.0)


@register
class ImplicitGemmFwd(_IGemmBase):
    id = 20
    name = "implicit_gemm_fwd"
    directions = frozenset({"fwd"})

    def prepare(self, problem):
        return FwdPlan(problem)


@register
class ImplicitGemmBwdData(_IGemmBase):
    id = 21
    name = "implicit_gemm_bwd_data"
    directions = frozenset({"bwd_data"})

    def prepare(self, problem):
        return BwdDataPlan(problem)
