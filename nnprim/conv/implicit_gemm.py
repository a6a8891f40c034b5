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

Supported: 1D/2D/3D, nchw/nhwc, any stride/padding/dilation/groups, f32 (exact, no
TF32), f16, bf16 (f32 or bf16 output for forward). Not supported: tensors of 2**31
elements or more (int32 indexing), more than 4 fused post-ops."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..args import ConvArgs
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import Solver, register
from . import configs
from .triton_epilogue import epilogue, epilogue_args, interpreting, post_op_bytes, post_op_reasons, tl_dot_precision, y_strides

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


def strides5(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of t as a logical (N, C, D, H, W) tensor (0 for the missing dims)."""
    s = t.stride()
    return (s[0], s[1]) + (0,) * (5 - t.dim()) + tuple(s[2:])


def gemm_shape_reasons(p: ConvProblem) -> list[str]:
    reasons = []
    for name, shape in (("x", p.x_shape), ("w", p.w_shape), ("y", p.y_shape)):
        if math.prod(shape) >= INT32_LIMIT:
            reasons.append(f"{name} has {math.prod(shape)} elements; int32 indexing needs < 2**31")
    return reasons


def roofline_ms(flops: float, nbytes: float, dtype: torch.dtype, efficiency: float = 0.7) -> float:
    t_c = flops / (PEAK_TFLOPS.get(dtype, 50.0) * 1e12)
    t_m = nbytes / (PEAK_TBS * 1e12)
    return max(t_c, t_m) / efficiency * 1e3 + 0.005


def fit(block: int, n: int, lo: int = 16) -> int:
    """Shrink a power-of-two block to the problem size (at least lo)."""
    return max(lo, min(block, triton.next_power_of_2(max(n, 1))))


# ---- forward kernel ----------------------------------------------------------------------
@triton.jit
def _conv_fwd_kernel(
        x_ptr, w_ptr, y_ptr, bias_ptr,
        p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
        M, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sxn, sxc, sxd, sxh, sxw, swk, swc, swt, swr, sws, syn, syp, syk,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        HAS_BIAS: tl.constexpr,
        P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
        P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
        P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
        P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
        FLAT_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(Kg, BN)
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
    id0 = od * std - pdd
    ih0 = oh * sth - pdh
    iw0 = ow * stw - pdw
    x_row = x_ptr + n * sxn + g * Cg * sxc          # [BM] pointers
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
    y_off = (n * syn + pix * syp)[:, None] + (rk_glob * syk)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    acc = epilogue(acc, y_off, rk_glob, mask_n, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


def conv_fwd(p: ConvProblem, args: ConvArgs, tile: configs.GemmTile | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the forward kernel; `out` (optional, y-shaped in p.layout) receives y."""
    gm = geom(p)
    tile = tile or configs.pick(p)
    x, w = args.x, args.w
    y = out if out is not None else empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype, device=x.device)
    M = gm.N * gm.P
    flat = gm.Cg < 32 and gm.taps > 1
    BM = fit(tile.BM, M)
    BN = fit(tile.BN, gm.Kg)
    BK = fit(tile.BK, gm.Cg * gm.taps if flat else gm.Cg)
    sy = y_strides(p, (gm.N, gm.K, gm.P))
    epi = epilogue_args(p, args.bias, args.post_ops, y)
    grid = (triton.cdiv(M, BM) * triton.cdiv(gm.Kg, BN), gm.G)
    _conv_fwd_kernel[grid](
        x, w, y, M=M, Cg=gm.Cg, Kg=gm.Kg, D=gm.inp[0], H=gm.inp[1], W=gm.inp[2],
        OD=gm.out[0], OH=gm.out[1], OW=gm.out[2], T=gm.filt[0], R=gm.filt[1], S=gm.filt[2],
        **_sx(x), **_sw(w), syn=sy[0], syp=sy[1], syk=sy[2], **_spd(gm), **epi,
        FLAT_K=flat, UPCAST=interpreting() and x.dtype == torch.bfloat16,
        PREC=tl_dot_precision(x.dtype), BM=BM, BN=BN, BK=BK, GROUP_M=tile.group_m,
        num_warps=tile.warps, num_stages=tile.stages)
    return y


def _sx(x: torch.Tensor) -> dict:
    s = strides5(x)
    return dict(sxn=s[0], sxc=s[1], sxd=s[2], sxh=s[3], sxw=s[4])


def _sw(w: torch.Tensor) -> dict:
    s = strides5(w)
    return dict(swk=s[0], swc=s[1], swt=s[2], swr=s[3], sws=s[4])


def _spd(gm: Geom) -> dict:
    return dict(std=gm.stride[0], sth=gm.stride[1], stw=gm.stride[2], pdd=gm.pad[0], pdh=gm.pad[1],
                pdw=gm.pad[2], dld=gm.dil[0], dlh=gm.dil[1], dlw=gm.dil[2])


# ---- backward data kernel --------------------------------------------------------------------
@triton.jit
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
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(Cg, BN)
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
    n = tmp // QD
    dy_row = dy_ptr + n * sdn + g * Kg * sdk
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
    x_off = (n * sxn + i_d * sxd + i_h * sxh + i_w * sxw)[:, None] + ((g * Cg + rn) * sxc)[None, :]
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


def conv_bwd_data(p: ConvProblem, args: ConvArgs, tile: configs.GemmTile | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    gm = geom(p)
    tile = tile or configs.pick(p)
    dy, w = args.dy, args.w
    dx = out if out is not None else empty_in_layout(p.x_shape, p.layout, dtype=p.out_dtype, device=dy.device)
    BN = fit(tile.BN, gm.Cg)
    BK = fit(tile.BK, gm.Kg)
    sd, sw, sx = strides5(dy), strides5(w), strides5(dx)
    per_dim = [dim_phases(gm.inp[i], gm.filt[i], gm.stride[i], gm.pad[i], gm.dil[i]) for i in range(3)]
    for pd_ in per_dim[0]:
        for ph_ in per_dim[1]:
            for pw_ in per_dim[2]:
                M = gm.N * pd_.Q * ph_.Q * pw_.Q
                BM = fit(tile.BM, M)
                grid = (triton.cdiv(M, BM) * triton.cdiv(gm.Cg, BN), gm.G)
                ph3 = (pd_, ph_, pw_)
                _conv_bwd_data_kernel[grid](
                    dy, w, dx, M, gm.Cg, gm.Kg, *gm.inp, *gm.out, *(q.Q for q in ph3),
                    *sd, *sw, *sx, *(q.ph for q in ph3), *gm.stride,
                    *(q.r0 for q in ph3), *(q.rs for q in ph3), *(q.nr for q in ph3),
                    *(q.bs for q in ph3), *(q.dc for q in ph3),
                    UPCAST=interpreting() and dy.dtype == torch.bfloat16, PREC=tl_dot_precision(dy.dtype),
                    BM=BM, BN=BN, BK=BK, GROUP_M=tile.group_m,
                    num_warps=tile.warps, num_stages=tile.stages)
    return dx


# ---- solvers ---------------------------------------------------------------------------------
class _IGemmBase(Solver):
    family = "implicit_gemm"
    primitive = "conv"
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + gemm_shape_reasons(problem) + post_op_reasons(problem)

    def estimate(self, problem) -> float | None:
        gm = geom(problem)
        # tensor-core efficiency falls when a GEMM side is narrower than the tile
        n_side = {"fwd": gm.Kg, "bwd_data": gm.Cg, "bwd_weights": gm.Cg * gm.taps}[problem.direction]
        k_side = {"fwd": gm.Cg * gm.taps, "bwd_data": gm.Kg * gm.taps,
                  "bwd_weights": gm.N * gm.P}[problem.direction]
        eff = 0.7 * min(1.0, n_side / 64) * min(1.0, k_side / 64)
        return roofline_ms(problem.flops(), problem.bytes() + post_op_bytes(problem), problem.dtype,
                           max(eff, 0.02))


@register
class ImplicitGemmFwd(_IGemmBase):
    id = 20
    name = "implicit_gemm_fwd"
    directions = frozenset({"fwd"})

    def prepare(self, problem):
        tile = configs.pick(problem)
        return lambda args: conv_fwd(problem, args, tile)


@register
class ImplicitGemmBwdData(_IGemmBase):
    id = 21
    name = "implicit_gemm_bwd_data"
    directions = frozenset({"bwd_data"})

    def prepare(self, problem):
        tile = configs.pick(problem)
        return lambda args: conv_bwd_data(problem, args, tile)


# bwd_weights (id 22) lives in implicit_gemm_bwd.py; imported here so that loading this
# module registers the whole family.
from . import implicit_gemm_bwd  # noqa: E402,F401
