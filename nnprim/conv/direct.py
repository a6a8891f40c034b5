"""Direct convolution in Triton for grouped and depthwise convolutions with few channels
per group (family `direct`, solvers 40/41/42). These are memory bound: a program owns a
tile of [BP pixels, BC channels] of the output (channels contiguous in NHWC; the pixels
a 2-D BP/BW x BW rectangle of one image) and walks the taps, re-reading its shifted
input tiles from L1/L2, so DRAM sees each input and output about once.

Forward / backward data (one kernel, `TRANSPOSED` selects the direction):
  fwd:      y[n, k, o]  = sum_{c < Cg, tap} x[n, grp(k)*Cg + c, o*st - pad + tap*dil] * w[k, c, tap]
  bwd_data: dx[n, c, i] = sum_{k < Kg, tap} dy[n, grp(c)*Kg + k, o] * w[grp(c)*Kg + k, c % Cg, tap]
            with o = (i + pad - tap*dil) / st when exact and in range.
Two inner products: FMA over the group's channels (any C/groups, K/groups; depthwise),
or, when C/groups == K/groups >= 2 divides the channel block, a tensor-core product of
the [BP, BC] source tile with the block-diagonal [BC, BC] slice of the weights (a few
times the MACs, but tensor cores have ~15x the FMA rate: resnext-style groups).
Forward fuses bias and the post-op chain.

Backward weights: dw[k, c, tap] = sum_{n, o} dy[n, k, o] * x[n, grp(k)*Cg + c, o*st - pad + tap*dil];
a program owns BC output channels and a slice of the pixels, holds a [BJ = taps*Cg, BC]
accumulator, reads each dy tile once and the shifted x tiles through the cache; slices
are summed in a fixed order by a second kernel (deterministic; workspace
SPLIT * K * taps*Cg * 4 bytes). Depthwise-like problems (C/groups == 1) use the 2-D-tile
variant instead (`_direct_bwd_w_tiles_kernel`: columns outer, a few spatial tiles per
program, elementwise accumulation; measured faster there, slower for resnext groups).

Indexing: each image's base (n * stride_n) is int64, offsets within an image and the
pixel rows int32 (`conv_index_reasons`); the backward-weights partials are kept within
WORKSPACE_CAP by limiting the number of slices.

Supported: groups > 1 with C/groups <= 16 and K/groups <= 16; 1D/2D/3D; both layouts;
any stride/padding/dilation; f32/f16/bf16."""
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
from . import configs
from .depthwise import dw_estimate
from .implicit_gemm import check_strided, conv_index_reasons, geom, layout_strides, roofline_ms, strides5_of
from .implicit_gemm_bwd import NUM_SMS, _split_reduce_kernel
from .triton_epilogue import NO_EPILOGUE, epilogue, interpreting, plan_epilogue, post_op_bytes, post_op_reasons, tl_dot_precision

MAX_CH_PER_GROUP = 16
WORKSPACE_CAP = 256 * 2 ** 20   # bytes of backward-weights partials (fewer slices beyond it)


@triton.jit
def _direct_kernel(
        src_ptr, w_ptr, dst_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
        NDST, SRC_G, DST_G, SD, SH, SW, DD, DH, DW, T, R, S,
        ssn, ssc, ssd, ssh, ssw, sw_dst, sw_src, swt, swr, sws, sdn, sdp, sdc,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
        HAS_BIAS: tl.constexpr,
        P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
        P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
        P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
        P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
        TRANSPOSED: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BP: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """dst tile [BP pixels, BC channels]: the pixels are a 2-D (BP/BW) x BW rectangle
    of one (n, d) slice, so the shifted source tiles of the taps overlap in L1;
    SRC_G/DST_G source/destination channels per group."""
    BH: tl.constexpr = BP // BW
    pid = tl.program_id(0)
    n_tw = tl.cdiv(DW, BW)
    n_th = tl.cdiv(DH, BH)
    tw = pid % n_tw
    tmp = pid // n_tw
    th = tmp % n_th
    nd = tmp // n_th
    qd = nd % DD
    n64 = (nd // DD).to(tl.int64)
    ri = tl.arange(0, BP)
    qh = th * BH + ri // BW
    qw = tw * BW + ri % BW
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mp = (qh < DH) & (qw < DW)
    mc = rc < NDST
    grp = rc // DST_G
    dst_local = rc - grp * DST_G
    if TRANSPOSED:
        w_dst = dst_local * sw_dst
    else:
        w_dst = rc * sw_dst
    src_row = src_ptr + n64 * ssn
    acc = tl.zeros((BP, BC), dtype=tl.float32)
    if DOT:
        # src channels of this block: the same BC channels (SRC_G == DST_G, BC % DST_G == 0)
        rs = tl.program_id(1) * BC + tl.arange(0, BC)
        ms = rs < NDST
        grp_s = rs // SRC_G
        src_local = rs - grp_s * SRC_G
        if TRANSPOSED:
            w_src = rs * sw_src
        else:
            w_src = src_local * sw_src
        wmask = (grp_s[:, None] == grp[None, :]) & ms[:, None] & mc[None, :]
    for tap in range(0, T * R * S):
        s = tap % S
        r = (tap // S) % R
        t = tap // (S * R)
        if TRANSPOSED:
            nd_ = qd + pdd - t * dld
            nh_ = qh + pdh - r * dlh
            nw_ = qw + pdw - s * dlw
            id_ = nd_ // std
            ih_ = nh_ // sth
            iw_ = nw_ // stw
            ok = (mp & (nd_ >= 0) & (nh_ >= 0) & (nw_ >= 0) & (id_ * std == nd_) & (ih_ * sth == nh_)
                  & (iw_ * stw == nw_) & (id_ < SD) & (ih_ < SH) & (iw_ < SW))
        else:
            id_ = qd * std - pdd + t * dld
            ih_ = qh * sth - pdh + r * dlh
            iw_ = qw * stw - pdw + s * dlw
            ok = mp & (id_ >= 0) & (id_ < SD) & (ih_ >= 0) & (ih_ < SH) & (iw_ >= 0) & (iw_ < SW)
        pix = src_row + id_ * ssd + ih_ * ssh + iw_ * ssw
        w_tap = t * swt + r * swr + s * sws
        if DOT:
            a = tl.load(pix[:, None] + (rs * ssc)[None, :], mask=ok[:, None] & ms[None, :], other=0.0)
            b = tl.load(w_ptr + w_tap + w_src[:, None] + w_dst[None, :], mask=wmask, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            for j in range(0, SRC_G):
                cs = grp * SRC_G + j
                a = tl.load(pix[:, None] + (cs * ssc)[None, :], mask=ok[:, None] & mc[None, :], other=0.0)
                if TRANSPOSED:
                    wv = tl.load(w_ptr + w_tap + w_dst + cs * sw_src, mask=mc, other=0.0)
                else:
                    wv = tl.load(w_ptr + w_tap + w_dst + j * sw_src, mask=mc, other=0.0)
                acc += a.to(tl.float32) * wv.to(tl.float32)[None, :]
    pixd = (qd * DH + qh) * DW + qw
    off = (n64 * sdn + pixd * sdp)[:, None] + (rc * sdc)[None, :]
    mask = mp[:, None] & mc[None, :]
    acc = epilogue(acc, off, rc, mc, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(dst_ptr + off, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _direct_bwd_w_kernel(
        dy_ptr, x_ptr, ws_ptr, PT, CHUNK, K, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sdn, sdk, sdd, sdh, sdw, sxn, sxc, sxd, sxh, sxw,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        BP: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr):
    """ws[split, k, j] = sum over this split's pixels of dy[p, k] * x[p shifted by tap(j), c(j)]."""
    rk = tl.program_id(0) * BC + tl.arange(0, BC)
    sp = tl.program_id(1)
    mk = rk < K
    grp = rk // Kg
    NJ = Cg * T * R * S
    rj = tl.arange(0, BJ)
    mj = rj < NJ
    c = rj % Cg
    tap = rj // Cg
    ss = tap % S
    rr = (tap // S) % R
    tt = tap // (S * R)
    xc = (grp * Cg)[None, :] + c[:, None]                  # [BJ, BC] input channel
    acc = tl.zeros((BJ, BC), dtype=tl.float32)
    p_begin = sp * CHUNK
    p_end = tl.minimum(p_begin + CHUNK, PT)
    for p0 in range(p_begin, p_end, BP):
        rp = p0 + tl.arange(0, BP)
        mp = rp < p_end
        ow = rp % OW
        tmp = rp // OW
        oh = tmp % OH
        tmp = tmp // OH
        od = tmp % OD
        n64 = (tmp // OD).to(tl.int64)
        dyv = tl.load(dy_ptr + (n64 * sdn + od * sdd + oh * sdh + ow * sdw)[:, None] + (rk * sdk)[None, :],
                      mask=mp[:, None] & mk[None, :], other=0.0).to(tl.float32)
        idd = (od * std - pdd)[:, None] + (tt * dld)[None, :]      # [BP, BJ]
        ihh = (oh * sth - pdh)[:, None] + (rr * dlh)[None, :]
        iww = (ow * stw - pdw)[:, None] + (ss * dlw)[None, :]
        ok = (mp[:, None] & mj[None, :] & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H)
              & (iww >= 0) & (iww < W))
        pix = (n64 * sxn)[:, None] + idd * sxd + ihh * sxh + iww * sxw  # [BP, BJ]
        xv = tl.load(x_ptr + pix[:, :, None] + (xc * sxc)[None, :, :],
                     mask=ok[:, :, None] & mk[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xv * dyv[:, None, :], axis=0)
    off = ((sp * K + rk) * NJ)[None, :] + rj[:, None]
    tl.store(ws_ptr + off, acc, mask=mj[:, None] & mk[None, :])


@triton.jit
def _direct_bwd_w_tap_kernel(
        dy_ptr, x_ptr, ws_ptr, PT, CHUNK, K, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sdn, sdk, sdd, sdh, sdw, sxn, sxc, sxd, sxh, sxw,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        BP: tl.constexpr, BC: tl.constexpr):
    """One (tap, c) column j per program (axis 0, so programs sharing a pixel slice run
    together and re-read it from L2): elementwise [BP, BC] accumulator, one reduction."""
    j = tl.program_id(0)
    rk = tl.program_id(1) * BC + tl.arange(0, BC)
    sp = tl.program_id(2)
    mk = rk < K
    NJ = Cg * T * R * S
    c = j % Cg
    tap = j // Cg
    ss = tap % S
    rr = (tap // S) % R
    tt = tap // (S * R)
    xc = ((rk // Kg) * Cg + c) * sxc
    acc = tl.zeros((BP, BC), dtype=tl.float32)
    p_begin = sp * CHUNK
    p_end = tl.minimum(p_begin + CHUNK, PT)
    for p0 in range(p_begin, p_end, BP):
        rp = p0 + tl.arange(0, BP)
        mp = rp < p_end
        ow = rp % OW
        tmp = rp // OW
        oh = tmp % OH
        tmp = tmp // OH
        od = tmp % OD
        n64 = (tmp // OD).to(tl.int64)
        dyv = tl.load(dy_ptr + (n64 * sdn + od * sdd + oh * sdh + ow * sdw)[:, None] + (rk * sdk)[None, :],
                      mask=mp[:, None] & mk[None, :], other=0.0)
        idd = od * std - pdd + tt * dld
        ihh = oh * sth - pdh + rr * dlh
        iww = ow * stw - pdw + ss * dlw
        ok = mp & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H) & (iww >= 0) & (iww < W)
        xv = tl.load(x_ptr + (n64 * sxn + idd * sxd + ihh * sxh + iww * sxw)[:, None] + xc[None, :],
                     mask=ok[:, None] & mk[None, :], other=0.0)
        acc += dyv.to(tl.float32) * xv.to(tl.float32)
    tl.store(ws_ptr + (sp * K + rk) * NJ + j, tl.sum(acc, axis=0), mask=mk)


@triton.jit
def _direct_bwd_w_tiles_kernel(
        dy_ptr, x_ptr, ws_ptr, NT, TPS, K, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sdn, sdk, sdd, sdh, sdw, sxn, sxc, sxd, sxh, sxw,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        BP: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """ws[sp, k, j] = sum over the output pixels of spatial tiles [sp*TPS, (sp+1)*TPS) of
    dy[p, k] * x[p shifted by tap(j), grp(k)*Cg + c(j)]. A tile is a 2-D (BP/BW) x BW
    rectangle of one (n, od) slice of the output; the columns j = (tap, c) are the outer
    loop, so each runs an elementwise [BP, BC] accumulation over the program's few
    tiles (their dy and x halo stay in L1 across the columns) and one reduction."""
    BH: tl.constexpr = BP // BW
    rk = tl.program_id(0) * BC + tl.arange(0, BC)
    sp = tl.program_id(1)
    mk = rk < K
    grp = rk // Kg
    NJ = Cg * T * R * S
    n_tw = tl.cdiv(OW, BW)
    n_th = tl.cdiv(OH, BH)
    t_begin = sp * TPS
    t_end = tl.minimum(t_begin + TPS, NT)
    ri = tl.arange(0, BP)
    dy_col = (rk * sdk)[None, :]
    for j in range(0, NJ):
        c = j % Cg
        tap = j // Cg
        ss = tap % S
        rr = (tap // S) % R
        tt = tap // (S * R)
        x_col = ((grp * Cg + c) * sxc)[None, :]
        acc = tl.zeros((BP, BC), dtype=tl.float32)
        for t in range(t_begin, t_end):
            tw = t % n_tw
            tmp = t // n_tw
            th = tmp % n_th
            nd = tmp // n_th
            od = nd % OD
            n64 = (nd // OD).to(tl.int64)
            oh = th * BH + ri // BW
            ow = tw * BW + ri % BW
            mp = (oh < OH) & (ow < OW)
            dyv = tl.load(dy_ptr + (n64 * sdn + od * sdd + oh * sdh + ow * sdw)[:, None] + dy_col,
                          mask=mp[:, None] & mk[None, :], other=0.0)
            idd = od * std - pdd + tt * dld
            ihh = oh * sth - pdh + rr * dlh
            iww = ow * stw - pdw + ss * dlw
            ok = mp & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H) & (iww >= 0) & (iww < W)
            xv = tl.load(x_ptr + (n64 * sxn + idd * sxd + ihh * sxh + iww * sxw)[:, None] + x_col,
                         mask=ok[:, None] & mk[None, :], other=0.0)
            acc += dyv.to(tl.float32) * xv.to(tl.float32)
        tl.store(ws_ptr + (sp * K + rk) * NJ + j, tl.sum(acc, axis=0), mask=mk)


# ---- launchers -------------------------------------------------------------------------------
def _use_dot(src_g: int, dst_g: int, BC: int) -> bool:
    return src_g == dst_g and src_g >= 2 and BC % dst_g == 0


def _spatial_tile(BP: int, DH: int, DW: int, BW: int = 0) -> tuple[int, int]:
    """(BP, BW): a rectangle of BP/BW rows x BW columns, about 8 rows when the image
    has rows (2-D/3-D), one row for 1-D."""
    if BW <= 0:
        BW = min(triton.next_power_of_2(DW), BP if DH == 1 else max(BP // 8, 1))
    BW = min(BW, BP)
    return BP, BW


def _channel_block(p: ConvProblem, tile: configs.DirectTile) -> tuple[int, int]:
    """(BC, destination channels) of `_direct_kernel` for p (grid axis 1 = cdiv(ndst, BC))."""
    ndst = p.C if p.direction == "bwd_data" else p.K
    return max(16, min(tile.BC, triton.next_power_of_2(ndst))), ndst


def _max_split(p: ConvProblem) -> int:
    """Most pixel slices whose f32 partials [SPLIT, K, taps*C/groups] fit WORKSPACE_CAP (and
    so int32 indexing); at least 1."""
    per_slice = p.K * (p.C // p.groups) * math.prod(p.filter) * 4
    return max(1, WORKSPACE_CAP // per_slice)


class DirectPlan:
    """Forward (epilogue fused) or backward data through `_direct_kernel`, one launch."""

    def __init__(self, p: ConvProblem, tile: configs.DirectTile | None = None, strides: tuple | None = None):
        self.p, self.tile = p, tile or configs.pick_direct(p)
        tile = self.tile
        transposed = p.direction == "bwd_data"
        ins = (p.y_shape, p.w_shape, p.x_shape) if transposed else (p.x_shape, p.w_shape, p.y_shape)
        self.strides = strides or tuple(layout_strides(s, p.layout) for s in ins)
        if strides is not None:
            check_strided(p, ins, strides)
        self.out_shape = ins[2]
        self.variants: dict = {}
        gm = geom(p)
        if transposed:
            src_sp, dst_sp, ndst, src_g, dst_g = gm.out, gm.inp, gm.C, gm.Kg, gm.Cg
        else:
            src_sp, dst_sp, ndst, src_g, dst_g = gm.inp, gm.out, gm.K, gm.Cg, gm.Kg
        self.epi = NO_EPILOGUE if transposed else plan_epilogue(p)
        M = gm.N * math.prod(dst_sp)
        BC, _ = _channel_block(p, tile)
        BP = max(16, min(tile.BP, triton.next_power_of_2(M)))
        BP, BW = _spatial_tile(BP, dst_sp[1], dst_sp[2], tile.BW)
        dot = _use_dot(src_g, dst_g, BC)
        ss, sw, sd = (strides5_of(s) for s in self.strides)
        sw_dst, sw_src = (sw[1], sw[0]) if transposed else (sw[0], sw[1])
        tiles = gm.N * dst_sp[0] * triton.cdiv(dst_sp[1], BP // BW) * triton.cdiv(dst_sp[2], BW)
        self.launch = Launch(
            _direct_kernel, (tiles, triton.cdiv(ndst, BC)),
            (ndst, src_g, dst_g, *src_sp, *dst_sp, *gm.filt, *ss, sw_dst, sw_src, sw[2], sw[3], sw[4],
             sd[0], sd[4], sd[1], *gm.stride, *gm.pad, *gm.dil, *self.epi.scalars(), *self.epi.constexprs(),
             transposed, dot, interpreting() and p.dtype == torch.bfloat16, tl_dot_precision(p.dtype),
             BP, BW, BC),
            num_warps=tile.warps)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        src = args.dy if p.direction == "bwd_data" else args.x
        w = args.w
        if out is not None and out.stride() != self.strides[2]:
            return out.copy_(self(args))
        dst = out if out is not None else torch.empty_strided(self.out_shape, self.strides[2], dtype=p.out_dtype,
                                                              device=src.device)
        if (src.stride(), w.stride()) != self.strides[:2]:
            key = (src.stride(), w.stride(), self.strides[2])
            if key not in self.variants:
                self.variants[key] = DirectPlan(p, self.tile, key)
            return self.variants[key](args, dst)
        self.launch(src, w, dst, *self.epi.pointers(args.bias, args.post_ops, dst))
        return dst


def conv_fwd(p: ConvProblem, args: ConvArgs, tile: configs.DirectTile | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    return DirectPlan(p, tile)(args, out)


def conv_bwd_data(p: ConvProblem, args: ConvArgs, tile: configs.DirectTile | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    return DirectPlan(p, tile)(args, out)


def plan_bwd_w(p: ConvProblem, tile: configs.DirectTile) -> tuple[int, int, int, int, int]:
    gm = geom(p)
    BJ = max(2, triton.next_power_of_2(gm.Cg * gm.taps))
    BC = max(16, min(tile.BC, triton.next_power_of_2(gm.K)))
    # keep the [BP, BJ, BC] product tile near 8K elements
    BP = max(2, min(tile.BP, 8192 // (BJ * BC)))
    PT = gm.N * gm.P
    progs = triton.cdiv(gm.K, BC)
    split = max(1, min(triton.cdiv(4 * NUM_SMS, progs), PT // (BP * 16), _max_split(p)))
    chunk = triton.cdiv(triton.cdiv(PT, split), BP) * BP
    return BP, BJ, BC, triton.cdiv(PT, chunk), chunk


class BwdWeightsPlan:
    """Backward weights: partial sums per pixel slice into a workspace, then the ordered
    reduction. tap_grid=False: one program holds every (tap, c) column ([BJ, BC]
    accumulator); tap_grid=True: one program per column (see _direct_bwd_w_tap_kernel)."""

    def __init__(self, p: ConvProblem, tile: configs.DirectTile | None = None, tap_grid: bool = False,
                 strides: tuple | None = None):
        self.p, self.tile, self.tap_grid = p, tile or configs.pick_direct(p), tap_grid
        tile = self.tile
        shapes = (p.y_shape, p.x_shape, p.w_shape)
        self.strides = strides or tuple(layout_strides(s, p.layout) for s in shapes)
        if strides is not None:
            check_strided(p, shapes, strides)
        self.variants: dict = {}
        gm = geom(p)
        BP, BJ, BC, split, chunk = plan_bwd_w(p, tile)
        nj = gm.Cg * gm.taps
        sd, sx, sw = (strides5_of(s) for s in self.strides)
        PT = gm.N * gm.P
        if tap_grid:
            BP = max(16, min(tile.BP, triton.next_power_of_2(PT)))
            split = max(1, min(triton.cdiv(4 * NUM_SMS, nj * triton.cdiv(gm.K, BC)), PT // (BP * 8),
                               _max_split(p)))
            chunk = triton.cdiv(triton.cdiv(PT, split), BP) * BP
            split = triton.cdiv(PT, chunk)
        geo = (PT, chunk, gm.K, gm.Cg, gm.Kg, *gm.inp, *gm.out, *gm.filt, *sd, *sx, *gm.stride, *gm.pad, *gm.dil)
        if tap_grid:
            self.launch = Launch(_direct_bwd_w_tap_kernel, (nj, triton.cdiv(gm.K, BC), split), (*geo, BP, BC),
                                 num_warps=tile.warps)
        else:
            self.launch = Launch(_direct_bwd_w_kernel, (triton.cdiv(gm.K, BC), split), (*geo, BP, BJ, BC),
                                 num_warps=4)
        self.ws_shape = (split, gm.K, nj)
        E = gm.K * nj
        self.reduce = Launch(_split_reduce_kernel, (triton.cdiv(E, 1024),),
                             (E, nj, gm.Cg, gm.filt[1], gm.filt[2], split, *sw, 1024))

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p, dy, x = self.p, args.dy, args.x
        dw = out if out is not None else torch.empty_strided(p.w_shape, self.strides[2], dtype=p.out_dtype,
                                                             device=x.device)
        if (dy.stride(), x.stride(), dw.stride()) != self.strides:
            key = (dy.stride(), x.stride(), dw.stride())
            if key not in self.variants:
                self.variants[key] = BwdWeightsPlan(p, self.tile, self.tap_grid, key)
            return self.variants[key](args, dw)
        ws = workspace.empty(self.ws_shape, torch.float32, x.device)
        self.launch(dy, x, ws)
        self.reduce(ws, dw)
        return dw


class BwdWeightsTilePlan:
    """Backward weights over 2-D spatial tiles (`_direct_bwd_w_tiles_kernel`), then the
    ordered reduction of the per-slice partials (workspace SPLIT * K * taps*Cg * 4 bytes)."""

    def __init__(self, p: ConvProblem, tile: configs.DirectTile | None = None, strides: tuple | None = None):
        self.p, self.tile = p, tile or configs.pick_direct(p)
        tile = self.tile
        shapes = (p.y_shape, p.x_shape, p.w_shape)
        self.strides = strides or tuple(layout_strides(s, p.layout) for s in shapes)
        if strides is not None:
            check_strided(p, shapes, strides)
        self.variants: dict = {}
        gm = geom(p)
        nj = gm.Cg * gm.taps
        BC = max(16, min(tile.BC, triton.next_power_of_2(gm.K)))
        BP, BW = _spatial_tile(max(16, min(tile.BP, triton.next_power_of_2(gm.P))), gm.out[1], gm.out[2], tile.BW)
        nt = gm.N * gm.out[0] * triton.cdiv(gm.out[1], BP // BW) * triton.cdiv(gm.out[2], BW)
        nkb = triton.cdiv(gm.K, BC)
        split = max(1, min(nt, triton.cdiv(8 * NUM_SMS, nkb), _max_split(p)))
        tps = triton.cdiv(nt, split)
        split = triton.cdiv(nt, tps)
        sd, sx, sw = (strides5_of(s) for s in self.strides)
        self.launch = Launch(_direct_bwd_w_tiles_kernel, (nkb, split),
                             (nt, tps, gm.K, gm.Cg, gm.Kg, *gm.inp, *gm.out, *gm.filt, *sd, *sx,
                              *gm.stride, *gm.pad, *gm.dil, BP, BW, BC), num_warps=tile.warps)
        self.ws_shape = (split, gm.K, nj)
        E = gm.K * nj
        self.reduce = Launch(_split_reduce_kernel, (triton.cdiv(E, 1024),),
                             (E, nj, gm.Cg, gm.filt[1], gm.filt[2], split, *sw, 1024))

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p, dy, x = self.p, args.dy, args.x
        dw = out if out is not None else torch.empty_strided(p.w_shape, self.strides[2], dtype=p.out_dtype,
                                                             device=x.device)
        if (dy.stride(), x.stride(), dw.stride()) != self.strides:
            key = (dy.stride(), x.stride(), dw.stride())
            if key not in self.variants:
                self.variants[key] = BwdWeightsTilePlan(p, self.tile, key)
            return self.variants[key](args, dw)
        ws = workspace.empty(self.ws_shape, torch.float32, x.device)
        self.launch(dy, x, ws)
        self.reduce(ws, dw)
        return dw


def bwd_weights_plan(p: ConvProblem):
    """The backward-weights plan the solver uses: the 2-D-tile kernel for C/groups == 1
    (depthwise), the [taps*Cg, BC]-accumulator kernel otherwise (measured, see configs)."""
    if configs.direct_bwd_w_tiles(p):
        return BwdWeightsTilePlan(p)
    return BwdWeightsPlan(p)


def conv_bwd_weights(p: ConvProblem, args: ConvArgs, tile: configs.DirectTile | None = None,
                     out: torch.Tensor | None = None, tap_grid: bool = False) -> torch.Tensor:
    if tile is None and not tap_grid:
        return bwd_weights_plan(p)(args, out)
    return BwdWeightsPlan(p, tile, tap_grid)(args, out)


# ---- solvers ---------------------------------------------------------------------------------
class _DirectBase(Solver):
    family = "direct"
    primitive = "conv"
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        cg, kg = problem.C // problem.groups, problem.K // problem.groups
        if problem.groups == 1:
            reasons.append("direct serves grouped convolutions only (groups > 1)")
        if cg > MAX_CH_PER_GROUP or kg > MAX_CH_PER_GROUP:
            reasons.append(f"C/groups={cg} and K/groups={kg} must be <= {MAX_CH_PER_GROUP}")
        if problem.direction != "bwd_weights":
            bc, ndst = _channel_block(problem, configs.pick_direct(problem))
            reasons += grid_reasons(((1, f"blocks of {bc} channels", triton.cdiv(ndst, bc)),))
        return reasons + conv_index_reasons(problem) + post_op_reasons(problem)

    def estimate(self, problem) -> float | None:
        if problem.groups == problem.C == problem.K:     # depthwise: measured (depthwise.DW_EFFICIENCY)
            return dw_estimate(problem, "direct")
        gm = geom(problem)
        # FMA path: ~40 TFLOP/s of f32 FMA; dot path and bwd weights are cache/bandwidth bound
        dot = _use_dot(gm.Cg, gm.Kg, 64) and problem.direction != "bwd_weights"
        nbytes = problem.bytes() + post_op_bytes(problem)
        t_c = problem.flops() / (200e12 if dot else 40e12)
        # the per-tap gathers: resnext_g32 (4 channels a group) forward / backward data moved its
        # 205 MB at 0.81 / 0.67 TB/s on the H200 (0.25 / 0.31 ms; system db), not at 4.2
        t_m = nbytes / (GROUPED_TBS if problem.direction != "bwd_weights" else 4.2e12)
        return max(t_c, t_m) / 0.7 * 1e3 + 0.005 if t_c > 0 else roofline_ms(0, nbytes, problem.dtype)


GROUPED_TBS = 1.1e12    # grouped (not depthwise) forward / backward data; with the 0.7 below: 0.77 TB/s


@register
class DirectFwd(_DirectBase):
    id = 40
    name = "direct_fwd"
    directions = frozenset({"fwd"})

    def prepare(self, problem):
        return DirectPlan(problem)


@register
class DirectBwdData(_DirectBase):
    id = 41
    name = "direct_bwd_data"
    directions = frozenset({"bwd_data"})

    def prepare(self, problem):
        return DirectPlan(problem)


@register
class DirectBwdWeights(_DirectBase):
    id = 42
    name = "direct_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, problem) -> int:
        return math.prod(bwd_weights_plan(problem).ws_shape) * 4

    def prepare(self, problem):
        return bwd_weights_plan(problem)
