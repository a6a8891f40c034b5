"""Depthwise convolution (groups == C == K) on NHWC in Triton: solvers 43/44/45, family
`direct`.

Depthwise layers do ~9 MACs per byte: they are memory bound and the only goal is to
read x and write y about once at full bandwidth. The general direct kernels
(direct.py) walk the taps with runtime filter sizes and narrow channel blocks; here
the filter is a compile-time constant (every tap unrolled), a program owns a 2-D
rectangle of output pixels by BC channels (channels contiguous: 16-byte vector loads
along C), and each tap's shifted input tile is re-read from L1/L2, so DRAM sees each
input pixel about once.

Forward (bias and the post-op chain fused) and backward data share one kernel:
  fwd:      y[n, c, o]  = sum_tap x[n, c, o*st - pad + tap*dil] * w[c, 0, tap]
  bwd_data: dx[n, c, i] = sum_tap dy[n, c, o] * w[c, 0, tap],  o = (i + pad - tap*dil) / st
            when exact and in range.
Backward weights: dw[c, 0, tap] = sum_{n, o} dy[n, c, o] * x[n, c, o*st - pad + tap*dil];
a program owns BC channels and a run of pixel tiles, reduces each tap's products over
the pixels into a [taps, BC] f32 partial; the partials of the pixel slices are summed
in a fixed order afterwards (deterministic; workspace SPLIT * taps * C * 4 bytes).

Supported: 1-D/2-D, channel multiplier 1, channels-last (unit channel stride) x / y /
dy / dx, any stride, padding, dilation, filter up to MAX_TAPS (9) taps; f32/f16/bf16."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import workspace
from ..args import ConvArgs
from ..launch import Launch
from ..limits import grid_reasons
from ..problems.conv import ConvProblem
from ..search.solver import Solver, register
from .implicit_gemm import conv_index_reasons, geom, layout_strides, roofline_ms, strides5_of
from .implicit_gemm_bwd import NUM_SMS
from .triton_epilogue import NO_EPILOGUE, epilogue, plan_epilogue, post_op_bytes, post_op_reasons

# Every tap is unrolled: 7x7 filters measured 0.03-0.2x cuDNN (spills), so larger
# filters stay with the general direct solvers.
MAX_TAPS = 9
# (BH, BW, BC, warps), measured on the H200 (benchmarks/results/depthwise_2026-11-30.log):
# 128-pixel rectangles 32 wide (4 x 32 on 56x56 images, 8 x 8 on 7x7), 64 channels
TILE = dict(fwd=(4, 32, 64, 4), bwd_data=(4, 32, 64, 4), bwd_weights=(4, 32, 64, 4))


# Fraction of ~4.2 TB/s that each kernel family serving depthwise layers reached on the bytes of
# x + w + y (bf16, H200, 2026-12-02; benchmarks/depthwise.py, results/depthwise_2026-12-02_s13_*.json
# and 2026-11-30's log for stride 2): (forward and backward data, backward weights) per
# (family, stride 1). walk: depthwise_walk.py; tile: this module; direct: direct.py;
# gluon_wgrad: gluon_conv_wgrad.py (backward weights only).
DW_EFFICIENCY = {
    ("walk", True): (0.5, 0.35),      # mbv2 3x3 56x56: 2.38 / 1.69 TB/s; 7x7 C 960: 1.45 / 0.74
    ("walk", False): (0.65, 0.49),    # mbv2 stride 2, 112x112 C 96 (2026-12-02): 2.75 / 2.05 TB/s
    ("tile", True): (0.28, 0.13),     # mbv2: 1.16 / 0.54 TB/s
    ("tile", False): (0.45, 0.22),    # mbv2 stride 2: 1.89 / 0.95 TB/s
    ("direct", True): (0.2, 0.06),    # mbv2: 0.85 / 0.25 TB/s
    ("direct", False): (0.2, 0.17),
    ("gluon_wgrad", True): (None, 0.15),   # solver 29 on mbv2: 0.65 TB/s
    ("gluon_wgrad", False): (None, 0.15),
}


WALK_FULL_WIDTH = 28   # the walk's efficiency holds from walks this many columns long (see dw_estimate)


def dw_estimate(p: ConvProblem, family: str) -> float:
    """A depthwise layer's time (ms) by the measured efficiency of `family`'s kernels. The
    walk pays a prologue per program (the window's first columns) that a short row does not
    repay: on 14-wide images it measured 1.0-1.2x the tile kernels' time (H200 system db and
    the s17 held-out run: 0.079 against 0.069 ms), where it is 2x faster at 56 wide."""
    fwd, wgrad = DW_EFFICIENCY[(family, all(s == 1 for s in p.stride))]
    eff = wgrad if p.direction == "bwd_weights" else fwd
    if family == "walk":
        width = p.in_size[-1] if p.direction == "bwd_data" else p.out_size[-1]
        eff *= min(1.0, width / WALK_FULL_WIDTH)
    return roofline_ms(0, p.bytes() + post_op_bytes(p), p.dtype) / eff


# ---- Triton kernels ------------------------------------------------------------------------------
@triton.jit
def _dw_kernel(src_ptr, w_ptr, dst_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
               C, SH, SW, DH, DW, ssn, ssh, ssw, sdn, sdh, sdw,
               sth, stw, pdh, pdw, dlh, dlw,
               p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
               HAS_BIAS: tl.constexpr,
               P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
               P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
               P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
               P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
               TRANSPOSED: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
               BH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """dst tile [BH*BW pixels of one image, BC channels]; src/dst channel stride 1."""
    BP: tl.constexpr = BH * BW
    pid = tl.program_id(0)
    n_tw = tl.cdiv(DW, BW)
    n_th = tl.cdiv(DH, BH)
    tw = pid % n_tw
    tmp = pid // n_tw
    th = tmp % n_th
    n64 = (tmp // n_th).to(tl.int64)
    ri = tl.arange(0, BP)
    qh = th * BH + ri // BW
    qw = tw * BW + ri % BW
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = rc < C
    mp = (qh < DH) & (qw < DW)
    src = src_ptr + n64 * ssn
    acc = tl.zeros((BP, BC), dtype=tl.float32)
    for r in tl.static_range(R):
        if TRANSPOSED:
            nh = qh + pdh - r * dlh
            ih = nh // sth
            ok_h = (nh >= 0) & (ih * sth == nh) & (ih < SH)
        else:
            ih = qh * sth - pdh + r * dlh
            ok_h = (ih >= 0) & (ih < SH)
        for s in tl.static_range(S):
            if TRANSPOSED:
                nw = qw + pdw - s * dlw
                iw = nw // stw
                ok = mp & ok_h & (nw >= 0) & (iw * stw == nw) & (iw < SW)
            else:
                iw = qw * stw - pdw + s * dlw
                ok = mp & ok_h & (iw >= 0) & (iw < SW)
            xv = tl.load(src + (ih * ssh + iw * ssw)[:, None] + rc[None, :], mask=ok[:, None] & mc[None, :],
                         other=0.0)
            wv = tl.load(w_ptr + rc * (R * S) + (r * S + s), mask=mc, other=0.0)   # w (C, 1, R, S) dense
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    mask = mp[:, None] & mc[None, :]
    y_off = (n64 * sdn + qh * sdh + qw * sdw)[:, None] + rc[None, :]
    acc = epilogue(acc, y_off, rc, mc, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(dst_ptr + y_off, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dw_bwd_w_kernel(dy_ptr, x_ptr, ws_ptr, C, H, W, OH, OW, n_tiles, tiles_per_prog,
                     sxn, sxh, sxw, syn, syh, syw, sth, stw, pdh, pdw, dlh, dlw,
                     R: tl.constexpr, S: tl.constexpr, TP: tl.constexpr,
                     BH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """Partial dw of pixel tiles [pid1 * tiles_per_prog, +tiles_per_prog) for BC channels
    into ws[pid1, tap, c] (TP >= R*S, a power of two, rows past R*S unused)."""
    BP: tl.constexpr = BH * BW
    rc = tl.program_id(0) * BC + tl.arange(0, BC)
    mc = rc < C
    sl = tl.program_id(1)
    taps = tl.arange(0, TP)
    acc = tl.zeros((TP, BC), dtype=tl.float32)
    ri = tl.arange(0, BP)
    n_tw = tl.cdiv(OW, BW)
    n_th = tl.cdiv(OH, BH)
    t0 = sl * tiles_per_prog
    for t in range(t0, tl.minimum(t0 + tiles_per_prog, n_tiles)):
        tw = t % n_tw
        tmp = t // n_tw
        th = tmp % n_th
        n64 = (tmp // n_th).to(tl.int64)
        oh = th * BH + ri // BW
        ow = tw * BW + ri % BW
        mp = (oh < OH) & (ow < OW)
        dyv = tl.load(dy_ptr + n64 * syn + (oh * syh + ow * syw)[:, None] + rc[None, :],
                      mask=mp[:, None] & mc[None, :], other=0.0).to(tl.float32)
        xb = x_ptr + n64 * sxn
        for r in tl.static_range(R):
            ih = oh * sth - pdh + r * dlh
            ok_h = mp & (ih >= 0) & (ih < H)
            for s in tl.static_range(S):
                iw = ow * stw - pdw + s * dlw
                ok = ok_h & (iw >= 0) & (iw < W)
                xv = tl.load(xb + (ih * sxh + iw * sxw)[:, None] + rc[None, :], mask=ok[:, None] & mc[None, :],
                             other=0.0).to(tl.float32)
                part = tl.sum(dyv * xv, axis=0)
                acc += tl.where((taps == r * S + s)[:, None], part[None, :], 0.0)
    tl.store(ws_ptr + (sl * TP + taps)[:, None].to(tl.int64) * C + rc[None, :], acc,
             mask=(taps < R * S)[:, None] & mc[None, :])


# ---- launchers -----------------------------------------------------------------------------------
def _tile(p: ConvProblem, dst_h: int, dst_w: int) -> tuple[int, int, int, int]:
    """(BH, BW, BC, warps): the direction's tile, narrowed to small images and channel counts."""
    BH, BW, BC, warps = TILE[p.direction]
    pixels = BH * BW
    BW = min(BW, triton.next_power_of_2(dst_w))
    BH = min(max(pixels // BW, 1), triton.next_power_of_2(dst_h))
    BC = max(16, min(BC, triton.next_power_of_2(p.C)))
    return BH, BW, BC, warps


def _strides2(t_strides: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(n, c, h, w) strides of a logical (N, C, [H,] W) tensor."""
    s = strides5_of(t_strides)
    return s[0], s[1], s[3], s[4]


class DwPlan:
    """Forward (epilogue fused) or backward data: one launch of `_dw_kernel`."""

    def __init__(self, p: ConvProblem, tile: tuple[int, int, int, int] | None = None):
        self.p = p
        transposed = p.direction == "bwd_data"
        gm = geom(p)
        src_sp, dst_sp = (gm.out, gm.inp) if transposed else (gm.inp, gm.out)
        self.out_shape = p.x_shape if transposed else p.y_shape
        src_shape = p.y_shape if transposed else p.x_shape
        self.strides = (layout_strides(src_shape, "nhwc"), layout_strides(self.out_shape, "nhwc"))
        self.epi = NO_EPILOGUE if transposed else plan_epilogue(p)
        BH, BW, BC, warps = tile or _tile(p, dst_sp[1], dst_sp[2])
        ss, sd = _strides2(self.strides[0]), _strides2(self.strides[1])
        self.tiles = gm.N * triton.cdiv(dst_sp[1], BH) * triton.cdiv(dst_sp[2], BW)
        self.launch = Launch(
            _dw_kernel, (self.tiles, triton.cdiv(p.C, BC)),
            (p.C, src_sp[1], src_sp[2], dst_sp[1], dst_sp[2], ss[0], ss[2], ss[3], sd[0], sd[2], sd[3],
             *gm.stride[1:], *gm.pad[1:], *gm.dil[1:], *self.epi.scalars(), *self.epi.constexprs(),
             transposed, gm.filt[1], gm.filt[2], BH, BW, BC),
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


def _bwd_w_split(p: ConvProblem, BH: int, BW: int, BC: int) -> tuple[int, int, int]:
    """(pixel tiles, tiles per slice, slices) of backward weights: ~4 programs per SM."""
    gm = geom(p)
    nt = gm.N * triton.cdiv(gm.out[1], BH) * triton.cdiv(gm.out[2], BW)
    split = max(1, min(nt, triton.cdiv(4 * NUM_SMS, triton.cdiv(p.C, BC))))
    tpp = triton.cdiv(nt, split)
    return nt, tpp, triton.cdiv(nt, tpp)


def bwd_w_workspace(p: ConvProblem) -> int:
    """Bytes of the f32 per-slice partials [SPLIT, taps (power of two), C]."""
    gm = geom(p)
    BH, BW, BC, _ = _tile(p, gm.out[1], gm.out[2])
    return _bwd_w_split(p, BH, BW, BC)[2] * triton.next_power_of_2(gm.filt[1] * gm.filt[2]) * p.C * 4


class DwBwdWeightsPlan:
    """Backward weights: per-slice partials [SPLIT, taps, C] (f32), summed in order."""

    def __init__(self, p: ConvProblem, tile: tuple[int, int, int, int] | None = None):
        self.p = p
        gm = geom(p)
        BH, BW, BC, warps = tile or _tile(p, gm.out[1], gm.out[2])
        self.strides = (layout_strides(p.y_shape, "nhwc"), layout_strides(p.x_shape, "nhwc"))
        sy, sx = _strides2(self.strides[0]), _strides2(self.strides[1])
        self.taps = gm.filt[1] * gm.filt[2]
        TP = triton.next_power_of_2(self.taps)
        nt, tpp, self.split = _bwd_w_split(p, BH, BW, BC)
        nkb = triton.cdiv(p.C, BC)
        self.ws_shape = (self.split, TP, p.C)
        self.launch = Launch(
            _dw_bwd_w_kernel, (nkb, self.split),
            (p.C, gm.inp[1], gm.inp[2], gm.out[1], gm.out[2], nt, tpp, sx[0], sx[2], sx[3], sy[0], sy[2], sy[3],
             *gm.stride[1:], *gm.pad[1:], *gm.dil[1:], gm.filt[1], gm.filt[2], TP, BH, BW, BC),
            num_warps=warps)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        dy, x = _in_layout(args.dy, self.strides[0]), _in_layout(args.x, self.strides[1])
        ws = workspace.empty(self.ws_shape, torch.float32, x.device)
        self.launch(dy, x, ws)
        dw = out if out is not None else torch.empty(p.w_shape, dtype=p.out_dtype, device=x.device)
        # fixed-order sum over the slices, then [taps, C] -> dw[C, 1, *filter]
        total = ws.sum(0)[: self.taps]
        dw.copy_(total.t().reshape(p.w_shape))
        return dw


def _in_layout(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """t itself when it has the planned (channels-last) strides, else a copy that has them."""
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _dense_w(w: torch.Tensor) -> torch.Tensor:
    """w (C, 1, [R,] S) with strides (R*S, *, S, 1): contiguous and channels-last weights
    both are (the middle dim has size 1), anything else is copied (it is tiny)."""
    rs = math.prod(w.shape[2:])
    if w.stride(0) == rs and w.stride(-1) == 1 and (w.dim() == 3 or w.stride(-2) == w.shape[-1]):
        return w
    return w.contiguous()


# ---- solvers ---------------------------------------------------------------------------------------
class _DepthwiseBase(Solver):
    family = "direct"
    primitive = "conv"
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        p = problem
        if not (p.groups == p.C == p.K):
            reasons.append(f"depthwise only (groups == C == K), got groups={p.groups}, C={p.C}, K={p.K}")
        if p.layout != "nhwc":
            reasons.append("channels-last (nhwc) layout only")
        if p.ndim == 3:
            reasons.append("1-D and 2-D only")
        if math.prod(p.filter) > MAX_TAPS:
            reasons.append(f"filter {p.filter} has more than {MAX_TAPS} taps")
        gm = geom(p)
        dst = gm.inp if p.direction == "bwd_data" else gm.out
        BH, BW, BC, _ = _tile(p, dst[1], dst[2])
        if p.direction != "bwd_weights":
            reasons += grid_reasons(((1, f"blocks of {BC} channels", triton.cdiv(p.C, BC)),))
        return reasons + conv_index_reasons(p) + post_op_reasons(p)

    def estimate(self, problem) -> float | None:
        return dw_estimate(problem, "tile")


@register
class DepthwiseFwd(_DepthwiseBase):
    id = 43
    name = "depthwise_fwd"
    directions = frozenset({"fwd"})

    def prepare(self, problem):
        return DwPlan(problem)


@register
class DepthwiseBwdData(_DepthwiseBase):
    id = 44
    name = "depthwise_bwd_data"
    directions = frozenset({"bwd_data"})

    def prepare(self, problem):
        return DwPlan(problem)


@register
class DepthwiseBwdWeights(_DepthwiseBase):
    id = 45
    name = "depthwise_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, problem) -> int:
        return bwd_w_workspace(problem)

    def prepare(self, problem):
        return DwBwdWeightsPlan(problem)
