"""Implicit-GEMM backward weights in Triton (solver 22, family `implicit_gemm`).

Per group g, a GEMM whose reduction runs over every output pixel of every image:
  dw[g*Kg + k, c, t, r, s] = sum_{n, o} dy[n, g*Kg + k, o] * x[n, g*Cg + c, o*st - pad + tap*dil]
  rows k (M = K/groups), columns j = (t, r, s, c) with c fastest (N = T*R*S*C/groups),
  reduction p = (n, od, oh, ow) (N*OD*OH*OW, long).
The reduction is split over SPLIT programs per output tile (the seed's minibatch-thread
reduction): each writes its f32 partial tile to a workspace [SPLIT, G, Kg, T*R*S*Cg],
and a second kernel sums the partials in a fixed order (deterministic) and casts to
dw's dtype in the problem's layout. With SPLIT = 1 the first kernel stores dw itself.
Workspace: SPLIT * K * T*R*S*C/groups * 4 bytes (SPLIT kept so that it stays below
2**31 elements). Indexing as implicit_gemm.py: int64 image bases, int32 within."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import workspace
from ..args import ConvArgs
from ..launch import Launch, descriptor
from ..limits import INT32_MAX, TILE_HEADROOM
from ..problems.conv import ConvProblem
from ..search.solver import register
from . import configs
from .implicit_gemm import _group_pid, _IGemmBase, _Plan, conv_tile, fit, geom, is_plain_gemm, is_tma_conv, strides5_of
from .triton_epilogue import interpreting, tl_dot_precision

NUM_SMS = 132


@triton.jit(do_not_specialize=["PT", "H", "W", "OH", "OW"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _conv_bwd_w_kernel(
        dy_ptr, x_ptr, out_ptr,
        PT, CHUNK, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sdn, sdk, sdd, sdh, sdw, sxn, sxc, sxd, sxh, sxw,
        swk, swc, swt, swr, sws,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        DIRECT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    sp = tl.program_id(1)
    NCOL = Cg * T * R * S
    num_n = tl.cdiv(NCOL, BN)
    tiles = tl.cdiv(Kg, BM) * num_n
    pid, g = _group_pid(tiles)
    pid_m = pid // num_n
    pid_n = pid % num_n
    rk = pid_m * BM + tl.arange(0, BM)
    rj = pid_n * BN + tl.arange(0, BN)
    mask_k = rk < Kg
    mask_j = rj < NCOL
    c = rj % Cg
    tap = rj // Cg
    ss = tap % S
    tap = tap // S
    rr = tap % R
    tt = tap // R
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    dy_rows = dy_ptr + (g * Kg + rk) * sdk                    # [BM]
    x_cols = x_ptr + (g * Cg + c) * sxc                       # [BN]
    p_begin = sp * CHUNK
    p_end = tl.minimum(p_begin + CHUNK, PT)
    for p0 in range(p_begin, p_end, BK):
        rp = p0 + tl.arange(0, BK)
        mp = rp < p_end
        ow = rp % OW
        tmp = rp // OW
        oh = tmp % OH
        tmp = tmp // OH
        od = tmp % OD
        n64 = (tmp // OD).to(tl.int64)
        a = tl.load(dy_rows[:, None] + (n64 * sdn + od * sdd + oh * sdh + ow * sdw)[None, :],
                    mask=mask_k[:, None] & mp[None, :], other=0.0)
        idd = (od * std - pdd)[:, None] + (tt * dld)[None, :]
        ihh = (oh * sth - pdh)[:, None] + (rr * dlh)[None, :]
        iww = (ow * stw - pdw)[:, None] + (ss * dlw)[None, :]
        ok = (mp[:, None] & mask_j[None, :] & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H)
              & (iww >= 0) & (iww < W))
        b = tl.load(x_cols[None, :] + (n64 * sxn)[:, None] + idd * sxd + ihh * sxh + iww * sxw,
                    mask=ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if DIRECT:
        off = ((g * Kg + rk) * swk)[:, None] + (c * swc + tt * swt + rr * swr + ss * sws)[None, :]
        tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_j[None, :])
    else:
        base = (sp * (tl.num_programs(0) // tiles) + g) * Kg   # G = programs / tiles per group
        off = ((base + rk) * NCOL)[:, None] + rj[None, :]
        tl.store(out_ptr + off, acc, mask=mask_k[:, None] & mask_j[None, :])


@triton.jit(do_not_specialize=["NT", "OH", "OW"])  # sizes: no recompile per shape (see ARCHITECTURE)
def _conv_bwd_w_tma_kernel(
        dy_desc, x_desc, out_ptr,
        NT, TPS, K, C, OD, OH, OW, T, R, S, pdd, pdh, pdw, dld, dlh, dlw,
        swk, swc, swt, swr, sws,
        DIRECT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BH: tl.constexpr, BW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Stride-1 NHWC backward weights with TMA reads: program (k block, tap x c block,
    split) sums dy[o, k] * x[o - pad + tap*dil, c] over the output tiles
    [sp*TPS, (sp+1)*TPS) (BH x BW rectangles of one (n, od) slice). Out-of-bounds dy
    rows read as zeros, so tile tails and the padding need no masks."""
    BP: tl.constexpr = BH * BW
    ncb = tl.cdiv(C, BN)
    nj = T * R * S * ncb
    pid_k = tl.program_id(0) // nj          # (k block, tap x c block) folded into axis 0
    pid_j = tl.program_id(0) - pid_k * nj
    sp = tl.program_id(1)
    tap = pid_j // ncb
    c0 = (pid_j - tap * ncb) * BN
    ss = tap % S
    rr = (tap // S) % R
    tt = tap // (S * R)
    n_tw = tl.cdiv(OW, BW)
    n_th = tl.cdiv(OH, BH)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for t in range(sp * TPS, tl.minimum(sp * TPS + TPS, NT)):
        tw = t % n_tw
        tmp = t // n_tw
        th = tmp % n_th
        nd = tmp // n_th
        od = nd % OD
        n = nd // OD
        a = dy_desc.load([n, od, th * BH, tw * BW, pid_k * BM])
        b = x_desc.load([n, od - pdd + tt * dld, th * BH - pdh + rr * dlh, tw * BW - pdw + ss * dlw, c0])
        a = tl.trans(tl.reshape(a, (BP, BM)))
        b = tl.reshape(b, (BP, BN))
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    rk = pid_k * BM + tl.arange(0, BM)
    rc = c0 + tl.arange(0, BN)
    mask = (rk < K)[:, None] & (rc < C)[None, :]
    if DIRECT:
        off = (rk * swk)[:, None] + (rc * swc + tt * swt + rr * swr + ss * sws)[None, :]
        tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        off = ((sp * K + rk) * (T * R * S * C))[:, None] + (tap * C + rc)[None, :]
        tl.store(out_ptr + off, acc, mask=mask)


REDUCE_SLICES = tl.constexpr(8)   # slices loaded per step: one load per step is latency-bound


@triton.jit
def _split_reduce_kernel(ws_ptr, dw_ptr, E, NCOL, Cg, R, S, SPLIT,
                         swk, swc, swt, swr, sws, BLOCK: tl.constexpr):
    """dw[e] = sum_s ws[s, e] in a fixed order (REDUCE_SLICES slices at a time, summed as a
    tree, then added in slice order): deterministic; e = (g*Kg + k)*NCOL + j."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    rs = tl.arange(0, REDUCE_SLICES)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s0 in range(0, SPLIT, REDUCE_SLICES):
        sl = s0 + rs
        v = tl.load(ws_ptr + (sl * E)[:, None] + e[None, :], mask=(sl < SPLIT)[:, None] & m[None, :], other=0.0)
        acc += tl.sum(v, axis=0)
    row = e // NCOL
    j = e - row * NCOL
    c = j % Cg
    tap = j // Cg
    ss = tap % S
    tap = tap // S
    rr = tap % R
    tt = tap // R
    tl.store(dw_ptr + row * swk + c * swc + tt * swt + rr * swr + ss * sws,
             acc.to(dw_ptr.dtype.element_ty), mask=m)


def max_split(p: ConvProblem) -> int:
    """Most reduction slices whose f32 partials [SPLIT, K, taps*C/groups] (the workspace)
    stay int32-indexable; at least 1 (w itself is, by conv_index_reasons)."""
    per_slice = p.K * (p.C // p.groups) * math.prod(p.filter)
    return max(1, (INT32_MAX - TILE_HEADROOM) // per_slice)


def plan_split(p: ConvProblem, tile: configs.GemmTile) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, split, chunk) for backward weights: enough programs to fill the GPU
    (about 2 waves) without reduction chunks shorter than 8 steps."""
    gm = geom(p)
    BM = fit(tile.BM, gm.Kg)
    BN = fit(tile.BN, gm.Cg * gm.taps)
    BK = tile.BK
    PT = gm.N * gm.P
    tiles = triton.cdiv(gm.Kg, BM) * triton.cdiv(gm.Cg * gm.taps, BN) * gm.G
    split = max(1, min(triton.cdiv(2 * NUM_SMS, tiles), PT // (BK * 8), max_split(p)))
    chunk = triton.cdiv(triton.cdiv(PT, split), BK) * BK
    split = triton.cdiv(PT, chunk)
    return BM, BN, BK, split, chunk


class BwdWeightsPlan(_Plan):
    """Backward weights: the split-reduction GEMM (pointer gathers, or TMA reads for
    stride-1 NHWC when `configs.use_tma_conv`), then (SPLIT > 1) the ordered sum of the
    partials into dw."""

    def __init__(self, p: ConvProblem, tile: configs.GemmTile | None = None, strides: tuple | None = None,
                 tma_conv: bool | None = None):
        super().__init__(p, tile, strides)
        gm, tile = geom(p), self.tile
        ncol = gm.Cg * gm.taps
        sd, sx, sw = (strides5_of(s) for s in self.strides)
        if tma_conv is None:
            tma_conv = configs.use_tma_conv(p)
        BH, BW = conv_tile(tile.BK, gm.out[1], gm.out[2])
        # the TMA kernel reduces BH*BW output pixels per step (tl.dot needs >= 16): tiny
        # images (1x1, 2x2) take the gather kernel
        self.tma = tma_conv and self.std and (is_tma_conv(p) or is_plain_gemm(p)) and BH * BW >= 16
        if self.tma:
            split = self._tma_setup(p, tile, sw)
        else:
            split = self._gather_setup(p, tile, sd, sx, sw)
        E = gm.K * ncol
        self.reduce = Launch(_split_reduce_kernel, (triton.cdiv(E, 1024),),
                             (E, ncol, gm.Cg, gm.filt[1], gm.filt[2], split, *sw, 1024))

    def _tma_setup(self, p: ConvProblem, tile: configs.GemmTile, sw: tuple) -> int:
        gm = geom(p)
        BH, BW = conv_tile(tile.BK, gm.out[1], gm.out[2])
        BM, BN = fit(tile.BM, gm.K), fit(tile.BN, gm.C)
        nt = gm.N * gm.out[0] * triton.cdiv(gm.out[1], BH) * triton.cdiv(gm.out[2], BW)
        progs = triton.cdiv(gm.K, BM) * gm.taps * triton.cdiv(gm.C, BN)
        split = max(1, min(max(nt // 4, 1), triton.cdiv(2 * NUM_SMS, progs), max_split(p)))
        tps = triton.cdiv(nt, split)
        split = triton.cdiv(nt, tps)
        self.direct = split == 1
        self.ws_shape = (split, gm.K, gm.taps * gm.C)
        self.da = ([gm.N, *gm.out, gm.K], [gm.P * gm.K, gm.out[1] * gm.out[2] * gm.K, gm.out[2] * gm.K, gm.K, 1],
                   [1, 1, BH, BW, BM])
        P_in = gm.inp[0] * gm.inp[1] * gm.inp[2]
        self.db = ([gm.N, *gm.inp, gm.C], [P_in * gm.C, gm.inp[1] * gm.inp[2] * gm.C, gm.inp[2] * gm.C, gm.C, 1],
                   [1, 1, BH, BW, BN])
        self.launch = Launch(
            _conv_bwd_w_tma_kernel, (triton.cdiv(gm.K, BM) * gm.taps * triton.cdiv(gm.C, BN), split),
            (nt, tps, gm.K, gm.C, *gm.out, *gm.filt, *gm.pad, *gm.dil, *sw, self.direct,
             interpreting() and p.dtype == torch.bfloat16, tl_dot_precision(p.dtype), BH, BW, BM, BN),
            num_warps=tile.warps, num_stages=tile.stages)
        return split

    def _gather_setup(self, p: ConvProblem, tile: configs.GemmTile, sd: tuple, sx: tuple, sw: tuple) -> int:
        gm = geom(p)
        BM, BN, BK, split, chunk = plan_split(p, tile)
        ncol = gm.Cg * gm.taps
        self.direct = split == 1
        self.ws_shape = (split, gm.K, ncol)
        self.launch = Launch(
            _conv_bwd_w_kernel, (triton.cdiv(gm.Kg, BM) * triton.cdiv(ncol, BN) * gm.G, split),
            (gm.N * gm.P, chunk, gm.Cg, gm.Kg, *gm.inp, *gm.out, *gm.filt, *sd, *sx, *sw,
             *gm.stride, *gm.pad, *gm.dil, self.direct, interpreting() and p.dtype == torch.bfloat16,
             tl_dot_precision(p.dtype), BM, BN, BK),
            num_warps=tile.warps, num_stages=tile.stages)
        return split

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        dy, x = args.dy, args.x
        dw = out if out is not None else self.alloc(self.p.out_dtype, dy.device)
        if out is not None and dw.stride() != self.strides[2]:
            return self.variant((dy.stride(), x.stride(), dw.stride()))(args, dw)
        plan = self.by_inputs.get((dy.stride(), x.stride())) or self.for_inputs((dy.stride(), x.stride()))
        if plan is not self:
            return plan(args, dw)
        dp, xp = dy.data_ptr(), x.data_ptr()
        if self.tma and (dp | xp) & 15:
            return self.variant_no_tma()(args, dw)
        dst = dw if self.direct else workspace.empty(self.ws_shape, torch.float32, dw.device)
        launch, op = self.launch, dst.data_ptr()
        if launch.ready() and not (dp | xp | op) & 15:      # addresses, not tensors (Launch.run_addresses)
            if self.tma:
                launch.run_keyed_addresses((dp, xp), lambda: (descriptor(dy, *self.da), descriptor(x, *self.db)), op)
            else:
                launch.run_addresses(dp, xp, op)
        elif self.tma:
            launch(descriptor(dy, *self.da), descriptor(x, *self.db), dst)
        else:
            launch(dy, x, dst)
        if not self.direct:
            red, wp = self.reduce, dw.data_ptr()
            if red.ready() and not (op | wp) & 15:
                red.run_addresses(op, wp)
            else:
                red(dst, dw)
        return dw

    def variant_no_tma(self) -> BwdWeightsPlan:
        v = self.variants.get("no_tma")
        if v is None:
            v = self.variants["no_tma"] = BwdWeightsPlan(self.p, self.tile, self.strides, tma_conv=False)
        return v


def conv_bwd_weights(p: ConvProblem, args: ConvArgs, tile: configs.GemmTile | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot backward weights (plans, then runs); `out` (optional, w-shaped) receives dw."""
    return BwdWeightsPlan(p, tile)(args, out)


@register
class ImplicitGemmBwdWeights(_IGemmBase):
    id = 22
    name = "implicit_gemm_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, problem) -> int:
        plan = BwdWeightsPlan(problem)
        return 0 if plan.direct else math.prod(plan.ws_shape) * 4

    def prepare(self, problem):
        return BwdWeightsPlan(problem)
