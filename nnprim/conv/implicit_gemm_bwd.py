"""Implicit-GEMM backward weights in Triton (solver 22, family `implicit_gemm`).

Per group g, a GEMM whose reduction runs over every output pixel of every image:
  dw[g*Kg + k, c, t, r, s] = sum_{n, o} dy[n, g*Kg + k, o] * x[n, g*Cg + c, o*st - pad + tap*dil]
  rows k (M = K/groups), columns j = (t, r, s, c) with c fastest (N = T*R*S*C/groups),
  reduction p = (n, od, oh, ow) (N*OD*OH*OW, long).
The reduction is split over SPLIT programs per output tile (the seed's minibatch-thread
reduction): each writes its f32 partial tile to a workspace [SPLIT, G, Kg, T*R*S*Cg],
and a second kernel sums the partials in a fixed order (deterministic) and casts to
dw's dtype in the problem's layout. With SPLIT = 1 the first kernel stores dw itself.
Workspace: SPLIT * K * T*R*S*C/groups * 4 bytes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..args import ConvArgs
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import register
from . import configs
from .implicit_gemm import _IGemmBase, fit, geom, strides5
from .triton_epilogue import interpreting, tl_dot_precision

NUM_SMS = 132


@triton.jit
def _conv_bwd_w_kernel(
        dy_ptr, x_ptr, out_ptr,
        PT, CHUNK, Cg, Kg, D, H, W, OD, OH, OW, T, R, S,
        sdn, sdk, sdd, sdh, sdw, sxn, sxc, sxd, sxh, sxw,
        swk, swc, swt, swr, sws,
        std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
        DIRECT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    NCOL = Cg * T * R * S
    num_n = tl.cdiv(NCOL, BN)
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
        n = tmp // OD
        a = tl.load(dy_rows[:, None] + (n * sdn + od * sdd + oh * sdh + ow * sdw)[None, :],
                    mask=mask_k[:, None] & mp[None, :], other=0.0)
        idd = (od * std - pdd)[:, None] + (tt * dld)[None, :]
        ihh = (oh * sth - pdh)[:, None] + (rr * dlh)[None, :]
        iww = (ow * stw - pdw)[:, None] + (ss * dlw)[None, :]
        ok = (mp[:, None] & mask_j[None, :] & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H)
              & (iww >= 0) & (iww < W))
        b = tl.load(x_cols[None, :] + (n * sxn)[:, None] + idd * sxd + ihh * sxh + iww * sxw,
                    mask=ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if DIRECT:
        off = ((g * Kg + rk) * swk)[:, None] + (c * swc + tt * swt + rr * swr + ss * sws)[None, :]
        tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_j[None, :])
    else:
        base = (sp * tl.num_programs(1) + g) * Kg
        off = ((base + rk) * NCOL)[:, None] + rj[None, :]
        tl.store(out_ptr + off, acc, mask=mask_k[:, None] & mask_j[None, :])


@triton.jit
def _split_reduce_kernel(ws_ptr, dw_ptr, E, NCOL, Cg, R, S, SPLIT,
                         swk, swc, swt, swr, sws, BLOCK: tl.constexpr):
    """dw[e] = sum_s ws[s, e] in order s = 0..SPLIT-1; e = (g*Kg + k)*NCOL + j."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(ws_ptr + s * E + e, mask=m, other=0.0)
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


def plan_split(p: ConvProblem, tile: configs.GemmTile) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, split, chunk) for backward weights: enough programs to fill the GPU
    (about 2 waves) without reduction chunks shorter than 8 steps."""
    gm = geom(p)
    BM = fit(tile.BM, gm.Kg)
    BN = fit(tile.BN, gm.Cg * gm.taps)
    BK = tile.BK
    PT = gm.N * gm.P
    tiles = triton.cdiv(gm.Kg, BM) * triton.cdiv(gm.Cg * gm.taps, BN) * gm.G
    split = max(1, min(triton.cdiv(2 * NUM_SMS, tiles), PT // (BK * 8)))
    chunk = triton.cdiv(triton.cdiv(PT, split), BK) * BK
    split = triton.cdiv(PT, chunk)
    return BM, BN, BK, split, chunk


def conv_bwd_weights(p: ConvProblem, args: ConvArgs, tile: configs.GemmTile | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    gm = geom(p)
    tile = tile or configs.pick(p)
    dy, x = args.dy, args.x
    dw = out if out is not None else empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype, device=dy.device)
    BM, BN, BK, split, chunk = plan_split(p, tile)
    ncol = gm.Cg * gm.taps
    sw = strides5(dw)
    direct = split == 1
    target = dw if direct else torch.empty((split, gm.K, ncol), dtype=torch.float32, device=dy.device)
    grid = (triton.cdiv(gm.Kg, BM) * triton.cdiv(ncol, BN), gm.G, split)
    _conv_bwd_w_kernel[grid](
        dy, x, target, gm.N * gm.P, chunk, gm.Cg, gm.Kg, *gm.inp, *gm.out, *gm.filt,
        *strides5(dy), *strides5(x), *sw, *gm.stride, *gm.pad, *gm.dil,
        DIRECT=direct, UPCAST=interpreting() and dy.dtype == torch.bfloat16,
        PREC=tl_dot_precision(dy.dtype), BM=BM, BN=BN, BK=BK,
        num_warps=tile.warps, num_stages=tile.stages)
    if not direct:
        E = gm.K * ncol
        BLOCK = 1024
        _split_reduce_kernel[(triton.cdiv(E, BLOCK),)](
            target, dw, E, ncol, gm.Cg, gm.filt[1], gm.filt[2], split, *sw, BLOCK=BLOCK)
    return dw


@register
class ImplicitGemmBwdWeights(_IGemmBase):
    id = 22
    name = "implicit_gemm_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, problem) -> int:
        gm = geom(problem)
        _, _, _, split, _ = plan_split(problem, configs.pick(problem))
        return 0 if split == 1 else split * gm.K * gm.Cg * gm.taps * 4

    def prepare(self, problem):
        tile = configs.pick(problem)
        return lambda args: conv_bwd_weights(problem, args, tile)
