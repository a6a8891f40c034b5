"""im2col + GEMM convolution (family `gemm`, solvers 30/31/32): a Triton im2col, the
GEMM on cuBLAS through torch (f32 accumulation and f32 output for half inputs), and a
Triton epilogue (bias + post-ops + cast + layout), as the seed's gemm convolution.

Column matrix per group g: col[g, m, j] = x[n, g*Cg + c, o*st - pad + tap*dil]
(0 outside), m = (n, o) output rows, j = (t, r, s, c) channels fastest.
  fwd:         y[m, g*Kg + k]  = epilogue(col[g] @ Wg^T)          Wg = w[g] as (Kg, T*R*S*Cg)
  bwd_data:    dcol[g]         = dy[:, g] @ Wg  (f32), then col2im (a gather over taps)
  bwd_weights: dw[g]           = sum over row blocks of dy[:, g]^T @ col[g]   (f32)
Rows are processed in blocks of whole images so the column buffer (the workspace) stays
under WORKSPACE_CAP; 1x1 stride-1 unpadded NHWC convolutions use x itself as col.
NCHW dy is converted to NHWC first (part of the measured time).

Supported: 1D/2D/3D, both layouts, any stride/padding/dilation/groups, f32/f16/bf16.
Not supported: tensors of 2**31 elements or more; more than 4 fused post-ops."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..args import ConvArgs
from ..launch import Launch
from ..problems.conv import ConvProblem, to_layout
from ..search.solver import Solver, register
from .implicit_gemm import Geom, gemm_shape_reasons, geom, layout_strides, roofline_ms, strides5_of
from .triton_epilogue import epilogue_copy_kernel, plan_epilogue, post_op_bytes, post_op_reasons

WORKSPACE_CAP = 256 * 2 ** 20


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _im2col_kernel(x_ptr, col_ptr, m0, MC, Cg, D, H, W, OD, OH, OW, T, R, S,
                   sxn, sxc, sxd, sxh, sxw, std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
                   BM: tl.constexpr, BJ: tl.constexpr):
    """col[g, m - m0, j] for rows m in [m0, m0 + MC); col is (G, MC, T*R*S*Cg) contiguous."""
    g = tl.program_id(2)
    NCOL = Cg * T * R * S
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rj = tl.program_id(1) * BJ + tl.arange(0, BJ)
    mm = rm < MC
    mj = rj < NCOL
    gm = m0 + rm
    ow = gm % OW
    tmp = gm // OW
    oh = tmp % OH
    tmp = tmp // OH
    od = tmp % OD
    n = tmp // OD
    c = rj % Cg
    tap = rj // Cg
    ss = tap % S
    tap = tap // S
    rr = tap % R
    tt = tap // R
    idd = (od * std - pdd)[:, None] + (tt * dld)[None, :]
    ihh = (oh * sth - pdh)[:, None] + (rr * dlh)[None, :]
    iww = (ow * stw - pdw)[:, None] + (ss * dlw)[None, :]
    ok = (mm[:, None] & mj[None, :] & (idd >= 0) & (idd < D) & (ihh >= 0) & (ihh < H)
          & (iww >= 0) & (iww < W))
    v = tl.load(x_ptr + (n * sxn)[:, None] + ((g * Cg + c) * sxc)[None, :] + idd * sxd + ihh * sxh
                + iww * sxw, mask=ok, other=0.0)
    tl.store(col_ptr + (g * MC + rm)[:, None] * NCOL + rj[None, :], v, mask=mm[:, None] & mj[None, :])


@triton.jit
def _col2im_kernel(dcol_ptr, dx_ptr, n0, MI, MC, Cg, D, H, W, OD, OH, OW, T, R, S,
                   sxn, sxc, sxd, sxh, sxw, std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
                   BM: tl.constexpr, BC: tl.constexpr):
    """dx[n, g*Cg + c, i] = sum_taps dcol[g, (n - n0)*P + o, tap*Cg + c] where
    o*st = i + pad - tap*dil exactly; rows i over images n0.. (MI input rows);
    dcol is (G, MC, T*R*S*Cg) contiguous f32."""
    g = tl.program_id(2)
    NCOL = Cg * T * R * S
    ri = tl.program_id(0) * BM + tl.arange(0, BM)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mi = ri < MI
    mc = rc < Cg
    iw = ri % W
    tmp = ri // W
    ih = tmp % H
    tmp = tmp // H
    idd = tmp % D
    nl = tmp // D
    acc = tl.zeros((BM, BC), dtype=tl.float32)
    for tap in range(0, T * R * S):
        s = tap % S
        r = (tap // S) % R
        t = tap // (S * R)
        nd_ = idd + pdd - t * dld
        nh_ = ih + pdh - r * dlh
        nw_ = iw + pdw - s * dlw
        od = nd_ // std
        oh = nh_ // sth
        ow = nw_ // stw
        ok = (mi & (nd_ >= 0) & (nh_ >= 0) & (nw_ >= 0) & (od * std == nd_) & (oh * sth == nh_)
              & (ow * stw == nw_) & (od < OD) & (oh < OH) & (ow < OW))
        row = (nl * OD + od) * OH * OW + oh * OW + ow
        v = tl.load(dcol_ptr + (g * MC + row)[:, None] * NCOL + (tap * Cg + rc)[None, :],
                    mask=ok[:, None] & mc[None, :], other=0.0)
        acc += v
    off = ((n0 + nl) * sxn + idd * sxd + ih * sxh + iw * sxw)[:, None] + ((g * Cg + rc) * sxc)[None, :]
    tl.store(dx_ptr + off, acc.to(dx_ptr.dtype.element_ty), mask=mi[:, None] & mc[None, :])


# ---- host helpers ----------------------------------------------------------------------------
def _geo_args(gm: Geom) -> tuple:
    return (*gm.inp, *gm.out, *gm.filt)


def _conv_args(gm: Geom) -> tuple:
    return (*gm.stride, *gm.pad, *gm.dil)


def is_pointwise(p: ConvProblem) -> bool:
    """1x1, stride 1, no padding, NHWC: x itself is the column matrix."""
    return (all(f == 1 for f in p.filter) and all(s == 1 for s in p.stride)
            and not any(p.pad_before) and not any(p.pad_after) and p.layout == "nhwc")


def _per_row_bytes(p: ConvProblem, gm: Geom) -> int:
    e = torch.tensor([], dtype=p.dtype).element_size()
    ncol = gm.C * gm.taps                     # all groups
    col = 0 if is_pointwise(p) else ncol * e
    if p.direction == "fwd":
        return col + gm.K * 4
    if p.direction == "bwd_data":
        return ncol * 4
    return col


def images_per_block(p: ConvProblem) -> int:
    gm = geom(p)
    per_image = max(1, _per_row_bytes(p, gm) * gm.P)
    return max(1, min(gm.N, WORKSPACE_CAP // per_image))


def workspace_bytes(p: ConvProblem) -> int:
    gm = geom(p)
    ws = images_per_block(p) * gm.P * _per_row_bytes(p, gm)
    if p.direction != "fwd" and p.layout == "nchw":
        ws += math.prod(p.y_shape) * torch.tensor([], dtype=p.dtype).element_size()
    if p.direction == "bwd_weights":
        ws += gm.K * gm.Cg * gm.taps * 4
    return ws


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched product with f32 output (f32 accumulation) for any input dtype."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _w_groups(w: torch.Tensor, gm: Geom) -> torch.Tensor:
    """w as (G, Kg, T*R*S*Cg), channels fastest (a view for channels-last weights)."""
    perm = (0, *range(2, w.dim()), 1)
    return w.permute(*perm).reshape(gm.G, gm.Kg, gm.taps * gm.Cg)


def _rows_nhwc(t: torch.Tensor, gm: Geom, ch: int) -> torch.Tensor:
    """A channels-last (N, ch, *sp) tensor as a (rows, ch) matrix view."""
    perm = (0, *range(2, t.dim()), 1)
    return t.permute(*perm).reshape(-1, ch)


class _Blocks:
    """Row blocks of whole images (bounded column buffer) and the im2col launch of each."""

    def __init__(self, p: ConvProblem, sx: tuple[int, ...] | None):
        gm = self.gm = geom(p)
        self.pointwise = is_pointwise(p)
        nb = images_per_block(p)
        self.blocks = [(n0 * gm.P, min(nb, gm.N - n0) * gm.P, n0, min(nb, gm.N - n0)) for n0 in range(0, gm.N, nb)]
        self.ncol = gm.Cg * gm.taps
        self.im2col = []
        if self.pointwise or sx is None:
            return
        BM, BJ = 64, min(64, triton.next_power_of_2(self.ncol))
        for m0, mc, _, _ in self.blocks:
            self.im2col.append(Launch(_im2col_kernel, (triton.cdiv(mc, BM), triton.cdiv(self.ncol, BJ), gm.G),
                                      (m0, mc, gm.Cg, *_geo_args(gm), *strides5_of(sx), *_conv_args(gm), BM, BJ)))

    def col(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The column matrix (G, mc, T*R*S*Cg) of block i (x itself for pointwise problems)."""
        m0, mc, _, _ = self.blocks[i]
        gm = self.gm
        if self.pointwise:
            return _rows_nhwc(x, gm, gm.C)[m0:m0 + mc].view(mc, gm.G, gm.Cg).transpose(0, 1)
        col = torch.empty((gm.G, mc, self.ncol), dtype=x.dtype, device=x.device)
        self.im2col[i](x, col)
        return col


def _std(p: ConvProblem, shapes, strides):
    return strides or tuple(layout_strides(s, p.layout) for s in shapes)


def _variant(plan, key: tuple):
    """The plan of `plan`'s problem for other strides (made once, then kept)."""
    v = plan.variants.get(key)
    if v is None:
        v = plan.variants[key] = type(plan)(plan.p, key)
    return v


class FwdPlan:
    """y = epilogue(col @ W^T) per row block."""

    def __init__(self, p: ConvProblem, strides: tuple | None = None):
        self.p = p
        self.variants: dict = {}
        self.strides = _std(p, (p.x_shape, p.w_shape, p.y_shape), strides)
        self.rows = _Blocks(p, self.strides[0])
        gm = self.rows.gm
        self.epi = plan_epilogue(p)
        sy = strides5_of(self.strides[2])
        BM, BN = 64, min(64, max(16, triton.next_power_of_2(gm.Kg)))
        self.epilogues = [
            Launch(epilogue_copy_kernel, (triton.cdiv(mc, BM), triton.cdiv(gm.Kg, BN), gm.G),
                   (m0, mc, gm.Kg, gm.P, mc * gm.Kg, gm.Kg, 1, sy[0], sy[4], sy[1],
                    *self.epi.scalars(), *self.epi.constexprs(), BM, BN))
            for m0, mc, _, _ in self.rows.blocks]

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p, x = self.p, args.x
        if out is not None and out.stride() != self.strides[2]:
            return out.copy_(self(args))
        y = out if out is not None else torch.empty_strided(p.y_shape, self.strides[2], dtype=p.out_dtype,
                                                            device=x.device)
        if x.stride() != self.strides[0]:
            return _variant(self, (x.stride(), args.w.stride(), self.strides[2]))(args, y)
        gm = self.rows.gm
        wt = _w_groups(args.w, gm).to(x.dtype).transpose(1, 2)      # (G, CRSg, Kg)
        ptrs = self.epi.pointers(args.bias, args.post_ops, y)
        for i, launch in enumerate(self.epilogues):
            acc = _bmm_f32(self.rows.col(x, i), wt)                    # (G, mc, Kg) f32
            launch(acc.contiguous(), y, *ptrs)
        return y


class BwdDataPlan:
    """dcol = dy @ W per row block (f32), then col2im."""

    def __init__(self, p: ConvProblem, strides: tuple | None = None):
        self.p = p
        self.variants: dict = {}
        self.strides = _std(p, (p.y_shape, p.w_shape, p.x_shape), strides)
        gm = self.gm = geom(p)
        self.rows = _Blocks(p, None)
        sx = strides5_of(self.strides[2])
        HWD = math.prod(gm.inp)
        BM, BC = 64, min(64, max(16, triton.next_power_of_2(gm.Cg)))
        self.col2im = [
            Launch(_col2im_kernel, (triton.cdiv(nimg * HWD, BM), triton.cdiv(gm.Cg, BC), gm.G),
                   (n0, nimg * HWD, mc, gm.Cg, *_geo_args(gm), *sx, *_conv_args(gm), BM, BC))
            for m0, mc, n0, nimg in self.rows.blocks]

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p, gm = self.p, self.gm
        dy = to_layout(args.dy, "nhwc")
        dx = out if out is not None else torch.empty_strided(p.x_shape, self.strides[2], dtype=p.out_dtype,
                                                             device=dy.device)
        if dx.stride() != self.strides[2]:
            return _variant(self, (self.strides[0], self.strides[1], dx.stride()))(args, dx)
        wg = _w_groups(args.w, gm).to(dy.dtype)                      # (G, Kg, CRSg)
        dy2 = _rows_nhwc(dy, gm, gm.K)
        for (m0, mc, _, _), launch in zip(self.rows.blocks, self.col2im):
            dyg = dy2[m0:m0 + mc].view(mc, gm.G, gm.Kg).transpose(0, 1)
            launch(_bmm_f32(dyg, wg).contiguous(), dx)               # (G, mc, CRSg) f32
        return dx


class BwdWeightsPlan:
    """dw = sum over row blocks of dy^T @ col (f32), then cast into dw's layout."""

    def __init__(self, p: ConvProblem, strides: tuple | None = None):
        self.p = p
        self.variants: dict = {}
        self.strides = _std(p, (p.y_shape, p.x_shape, p.w_shape), strides)
        self.rows = _Blocks(p, self.strides[1])

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p, x = self.p, args.x
        if x.stride() != self.strides[1]:
            return _variant(self, (self.strides[0], x.stride(), self.strides[2]))(args, out)
        gm = self.rows.gm
        dy = to_layout(args.dy, "nhwc")
        dw = out if out is not None else torch.empty_strided(p.w_shape, self.strides[2], dtype=p.out_dtype,
                                                             device=x.device)
        dy2 = _rows_nhwc(dy, gm, gm.K)
        acc = None
        for i, (m0, mc, _, _) in enumerate(self.rows.blocks):
            dyg = dy2[m0:m0 + mc].view(mc, gm.G, gm.Kg).permute(1, 2, 0)   # (G, Kg, mc)
            part = _bmm_f32(dyg, self.rows.col(x, i))                      # (G, Kg, CRSg)
            acc = part if acc is None else acc.add_(part)
        nd = len(p.filter)
        dw.copy_(acc.reshape(gm.K, *p.filter, gm.Cg).permute(0, nd + 1, *range(1, nd + 1)))
        return dw


def conv_fwd(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
    return FwdPlan(p)(args, out)


def conv_bwd_data(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
    return BwdDataPlan(p)(args, out)


def conv_bwd_weights(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
    return BwdWeightsPlan(p)(args, out)


# ---- solvers ---------------------------------------------------------------------------------
class _GemmBase(Solver):
    family = "gemm"
    primitive = "conv"
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + gemm_shape_reasons(problem) + post_op_reasons(problem)

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def estimate(self, problem) -> float | None:
        gm = geom(problem)
        e = torch.tensor([], dtype=problem.dtype).element_size()
        rows = gm.N * gm.P
        col = 0 if is_pointwise(problem) else 2 * rows * gm.C * gm.taps * e   # write + read
        extra = {"fwd": 2 * rows * gm.K * 4,
                 "bwd_data": 2 * rows * gm.C * gm.taps * 4,
                 "bwd_weights": 0}[problem.direction]
        return roofline_ms(problem.flops(), problem.bytes() + post_op_bytes(problem) + col + extra,
                           problem.dtype, 0.75) + 0.01


@register
class GemmFwd(_GemmBase):
    id = 30
    name = "gemm_fwd"
    directions = frozenset({"fwd"})

    def prepare(self, problem):
        return FwdPlan(problem)


@register
class GemmBwdData(_GemmBase):
    id = 31
    name = "gemm_bwd_data"
    directions = frozenset({"bwd_data"})

    def prepare(self, problem):
        return BwdDataPlan(problem)


@register
class GemmBwdWeights(_GemmBase):
    id = 32
    name = "gemm_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def prepare(self, problem):
        return BwdWeightsPlan(problem)
