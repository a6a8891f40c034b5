"""im2col + GEMM convolution (family `gemm`, solvers 30/31/32): a Triton im2col, the
GEMM on cuBLAS through torch (f32 accumulation into an f32 buffer), and a Triton
epilogue (bias + post-ops + cast + layout), as the seed's gemm convolution.

Per group g, over a block of GEMM rows at a time:
  fwd:         rows m = (n, o) over y's pixels, columns j = (t, r, s, c), c fastest
               col[g, m, j]  = x[n, g*Cg + c, o*st - pad + tap*dil]          (0 outside)
               y[m, g*Kg + k] = epilogue(sum_j col[g, m, j] * w[g*Kg + k, c, tap])
  bwd_data:    rows m = (n, i) over x's pixels, columns j = (t, r, s, k), k fastest
               colT[g, m, j] = dy[n, g*Kg + k, o]  where o*st = i + pad - tap*dil exactly
                               and 0 <= o < out (else 0): the transposed convolution
               dx[m, g*Cg + c] = sum_j colT[g, m, j] * w[g*Kg + k, c, tap]
  bwd_weights: dw[g*Kg + k, c, tap] = sum over row blocks of dy[m, g*Kg + k] * col[g, m, j]
A row block is a few whole images, or a slice of one image's rows when one image's
columns exceed WORKSPACE_CAP, so the column buffer (the workspace) stays bounded for
any image size: a 768-channel 1D conv with an 8192-tap filter runs in blocks of about
twenty rows instead of asking for the 96 GiB column matrix of one image.

Workspace (`Plan.workspace`, what `workspace_size` reports): the column buffer of the
largest block (none where x or dy itself is the column matrix: 1x1 stride-1 unpadded
NHWC), the f32 GEMM result of the largest block (fwd, bwd_data) or the f32 dw
accumulator (bwd_weights), and packed copies of w or of a block of dy where their
strides do not give the GEMM's operand as a view. Buffers are allocated once per call
and reused by every block; blocks are sized so that the total stays within WORKSPACE_CAP
(the block buffers get at least a quarter of it when w's own buffers are larger).

Indexing: block buffers stay far below 2**31 elements; x, dy, y, dx are read and
written with int64 image bases (`conv_index_reasons`). bwd_data at stride s > 1 spends
s**nd times the MACs (zero columns); implicit_gemm_bwd_data has no such waste.

Supported: 1D/2D/3D, both layouts, any stride/padding/dilation/groups, f32/f16/bf16.
Not supported: one GEMM row whose columns exceed WORKSPACE_CAP; more than 4 fused post-ops."""
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
from ..search.solver import Solver, register
from .implicit_gemm import Geom, check_strided, conv_index_reasons, geom, layout_strides, roofline_ms, strides5_of
from .triton_epilogue import NO_EPILOGUE, epilogue_copy_kernel, plan_epilogue, post_op_bytes, post_op_reasons

WORKSPACE_CAP = 256 * 2 ** 20   # bytes of workspace per call (beyond it when w's own buffers are larger)


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _tile_of(MC, NCOL, BM: tl.constexpr, BJ: tl.constexpr):
    """(group, row tile, column tile) of this program; all three are folded into grid
    axis 0, group-major."""
    num_j = tl.cdiv(NCOL, BJ)
    tiles = tl.cdiv(MC, BM) * num_j
    pid = tl.program_id(0)
    g = pid // tiles
    pid = pid - g * tiles
    pid_m = pid // num_j
    return g, pid_m, pid - pid_m * num_j


@triton.jit(do_not_specialize=["m0"])
def _im2col_kernel(x_ptr, col_ptr, m0, MC, Cg, D, H, W, OD, OH, OW, T, R, S,
                   sxn, sxc, sxd, sxh, sxw, std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
                   BM: tl.constexpr, BJ: tl.constexpr):
    """col[g, m - m0, j] for y rows m in [m0, m0 + MC); col is (G, MC, T*R*S*Cg) contiguous."""
    NCOL = Cg * T * R * S
    g, pid_m, pid_j = _tile_of(MC, NCOL, BM, BJ)
    rm = pid_m * BM + tl.arange(0, BM)
    rj = pid_j * BJ + tl.arange(0, BJ)
    mm = rm < MC
    mj = rj < NCOL
    gm = m0 + rm
    ow = gm % OW
    tmp = gm // OW
    oh = tmp % OH
    tmp = tmp // OH
    od = tmp % OD
    n64 = (tmp // OD).to(tl.int64)
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
    v = tl.load(x_ptr + (n64 * sxn)[:, None] + ((g * Cg + c) * sxc)[None, :] + idd * sxd + ihh * sxh
                + iww * sxw, mask=ok, other=0.0)
    tl.store(col_ptr + (g * MC + rm)[:, None] * NCOL + rj[None, :], v, mask=mm[:, None] & mj[None, :])


@triton.jit(do_not_specialize=["m0"])
def _im2col_t_kernel(dy_ptr, col_ptr, m0, MC, Kg, D, H, W, OD, OH, OW, T, R, S,
                     sdn, sdk, sdd, sdh, sdw, std, sth, stw, pdd, pdh, pdw, dld, dlh, dlw,
                     BM: tl.constexpr, BJ: tl.constexpr):
    """colT[g, m - m0, j] for x rows m = (n, i) in [m0, m0 + MC), j = (t, r, s, k):
    dy[n, g*Kg + k, o] with o*st = i + pad - tap*dil exactly and o in range, else 0;
    colT is (G, MC, T*R*S*Kg) contiguous."""
    NCOL = Kg * T * R * S
    g, pid_m, pid_j = _tile_of(MC, NCOL, BM, BJ)
    rm = pid_m * BM + tl.arange(0, BM)
    rj = pid_j * BJ + tl.arange(0, BJ)
    mm = rm < MC
    mj = rj < NCOL
    gm = m0 + rm
    iw = gm % W
    tmp = gm // W
    ih = tmp % H
    tmp = tmp // H
    i_d = tmp % D
    n64 = (tmp // D).to(tl.int64)
    k = rj % Kg
    tap = rj // Kg
    ss = tap % S
    tap = tap // S
    rr = tap % R
    tt = tap // R
    nd = (i_d + pdd)[:, None] - (tt * dld)[None, :]          # = o * st when o exists
    nh = (ih + pdh)[:, None] - (rr * dlh)[None, :]
    nw = (iw + pdw)[:, None] - (ss * dlw)[None, :]
    od = nd // std
    oh = nh // sth
    ow = nw // stw
    ok = (mm[:, None] & mj[None, :] & (nd >= 0) & (nh >= 0) & (nw >= 0) & (od * std == nd)
          & (oh * sth == nh) & (ow * stw == nw) & (od < OD) & (oh < OH) & (ow < OW))
    v = tl.load(dy_ptr + (n64 * sdn)[:, None] + ((g * Kg + k) * sdk)[None, :] + od * sdd + oh * sdh
                + ow * sdw, mask=ok, other=0.0)
    tl.store(col_ptr + (g * MC + rm)[:, None] * NCOL + rj[None, :], v, mask=mm[:, None] & mj[None, :])


# ---- planning --------------------------------------------------------------------------------
def is_pointwise(p: ConvProblem) -> bool:
    """1x1, stride 1, no padding, NHWC: x (dy) itself is the column matrix."""
    return (all(f == 1 for f in p.filter) and all(s == 1 for s in p.stride)
            and not any(p.pad_before) and not any(p.pad_after) and p.layout == "nhwc")


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _per_row(p: ConvProblem, gm: Geom) -> int:
    """Workspace bytes per GEMM row of a block: the column row, the f32 result row
    (fwd, bwd_data), a packed row of dy (bwd_weights, counted always: it sizes blocks)."""
    e = _esize(p.dtype)
    col = 0 if is_pointwise(p) else gm.G * (gm.Kg if p.direction == "bwd_data" else gm.Cg) * gm.taps * e
    extra = {"fwd": gm.K * 4, "bwd_data": gm.C * 4, "bwd_weights": gm.K * e}[p.direction]
    return col + extra


def cap_reasons(p: ConvProblem) -> list[str]:
    """Why no block of rows fits WORKSPACE_CAP (empty when one row does)."""
    per_row = _per_row(p, geom(p))
    if per_row <= WORKSPACE_CAP:
        return []
    return [f"one GEMM row needs {per_row} B of columns and f32 results (C*taps or K*taps per row); "
            f"the gemm workspace cap is {WORKSPACE_CAP} B"]


def fixed_bytes(p: ConvProblem, packed: bool | None = None) -> int:
    """Workspace bytes that do not depend on the blocks: a packed copy of w (`packed`; None:
    as for w in p's layout), the f32 dw accumulator (bwd_weights)."""
    gm = geom(p)
    if packed is None:
        packed = w_packed(p, _meta(p.w_shape, layout_strides(p.w_shape, p.layout), p.dtype))
    nw = gm.K * gm.Cg * gm.taps
    return (nw * _esize(p.dtype) if packed else 0) + (nw * 4 if p.direction == "bwd_weights" else 0)


def row_blocks(p: ConvProblem, fixed: int | None = None) -> list[tuple[int, int]]:
    """(first row, rows) of each block: whole images while one image's block buffers fit
    what WORKSPACE_CAP leaves beside the `fixed` buffers (at least a quarter of it), else
    slices of one image's rows; rows are y's pixels (x's for bwd_data)."""
    gm = geom(p)
    if fixed is None:
        fixed = fixed_bytes(p)
    budget = max(WORKSPACE_CAP - fixed, WORKSPACE_CAP // 4)
    P = math.prod(gm.inp) if p.direction == "bwd_data" else gm.P
    per_row = _per_row(p, gm)
    if P * per_row <= budget:
        nb = max(1, min(gm.N, budget // (P * per_row)))
        return [(n0 * P, min(nb, gm.N - n0) * P) for n0 in range(0, gm.N, nb)]
    pc = max(1, budget // per_row)
    return [(n * P + p0, min(pc, P - p0)) for n in range(gm.N) for p0 in range(0, P, pc)]


def rows_view(t: torch.Tensor, G: int, P: int, m0: int, mc: int) -> torch.Tensor | None:
    """Rows [m0, m0 + mc) (flattened n, pixel; P pixels per image) of an (N, ch, *sp)
    tensor as a (G, ch / G, mc) view, or None when its strides do not give one (then the
    caller packs a copy)."""
    ch = t.shape[1]
    try:
        rows = t.movedim(1, -1).view(-1, ch)                     # channels-last: (N*P, ch)
        return rows[m0:m0 + mc].view(mc, G, ch // G).permute(1, 2, 0)
    except RuntimeError:
        pass
    n0, p0 = divmod(m0, P)
    if p0 + mc <= P:                                              # inside one image
        try:
            return t[n0].view(ch, P)[:, p0:p0 + mc].view(G, ch // G, mc)
        except RuntimeError:
            pass
    return None


def _meta(shape, strides, dtype) -> torch.Tensor:
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def w_fwd_view(w: torch.Tensor, gm: Geom) -> torch.Tensor | None:
    """w as the forward GEMM's B operand (G, taps*Cg, Kg), (t, r, s, c) rows, or None."""
    try:
        return w.movedim(1, -1).view(gm.G, gm.Kg, gm.taps * gm.Cg).transpose(1, 2)
    except RuntimeError:
        return None


def w_bwd_view(w: torch.Tensor, gm: Geom) -> torch.Tensor | None:
    """w as backward data's B operand (G, taps*Kg, Cg), (t, r, s, k) rows, or None."""
    nd = w.dim() - 2
    try:
        wg = w.view(gm.G, gm.Kg, gm.Cg, *w.shape[2:]).permute(0, *range(3, 3 + nd), 1, 2)
        return wg.view(gm.G, gm.taps * gm.Kg, gm.Cg)
    except RuntimeError:
        return None


def w_packed(p: ConvProblem, w: torch.Tensor) -> bool:
    """Whether the GEMM operand of w (real or meta) needs a packed copy (bwd_weights: no w)."""
    view = {"fwd": w_fwd_view, "bwd_data": w_bwd_view}.get(p.direction)
    return view is not None and view(w, geom(p)) is None


def _pack_w(w: torch.Tensor, gm: Geom, direction: str) -> torch.Tensor:
    """Copy of w in the GEMM operand's order (a workspace buffer)."""
    nd = w.dim() - 2
    filt = tuple(w.shape[2:])
    if direction == "fwd":
        buf = workspace.empty((gm.G, gm.Kg, gm.taps * gm.Cg), w.dtype, w.device)
        buf.view(gm.K, *filt, gm.Cg).copy_(w.movedim(1, -1))
        return buf.transpose(1, 2)
    buf = workspace.empty((gm.G, gm.taps * gm.Kg, gm.Cg), w.dtype, w.device)
    buf.view(gm.G, *filt, gm.Kg, gm.Cg).copy_(
        w.reshape(gm.G, gm.Kg, gm.Cg, *filt).permute(0, *range(3, 3 + nd), 1, 2))
    return buf


def _pack_rows(t: torch.Tensor, buf: torch.Tensor, G: int, P: int, m0: int, mc: int) -> torch.Tensor:
    """Rows [m0, m0 + mc) of t copied into buf as (G, ch / G, mc) (blocks are whole images
    or lie inside one image)."""
    ch = t.shape[1]
    out = buf[:mc * ch].view(G, ch // G, mc)
    n0, p0 = divmod(m0, P)
    if p0 == 0 and mc % P == 0:
        nb = mc // P
        out.view(G, ch // G, nb, P).copy_(t[n0:n0 + nb].reshape(nb, G, ch // G, P).permute(1, 2, 0, 3))
    else:
        out.copy_(t[n0].reshape(G, ch // G, P)[:, :, p0:p0 + mc])
    return out


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (f32) = a @ b, or out += a @ b; f32 accumulation for any input dtype."""
    if a.is_cuda:
        if a.shape[0] == 1 and not accumulate:
            # one group: mm, not a batch of one (cuBLAS's batched GEMM does not split K: the
            # 1x1 backward weights' 400k-long reduction ran 1.5-2.5x slower as bmm, H200)
            torch.mm(a[0], b[0], out_dtype=torch.float32, out=out[0])
        elif accumulate:
            torch.baddbmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.bmm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:   # CPU (interpreter tests): no out_dtype kernels
        out.baddbmm_(a.float(), b.float())
    else:
        torch.bmm(a.float(), b.float(), out=out)


@dataclass(frozen=True)
class Buffers:
    """Element counts of the workspace buffers of one call (0 = not allocated)."""
    col: int            # column block, problem dtype
    acc: int            # f32 GEMM result of a block (fwd, bwd_data) or the dw accumulator
    w_pack: int         # packed w (problem dtype)
    dy_pack: int        # packed dy block (bwd_weights)

    def nbytes(self, e: int) -> int:
        return (self.col + self.w_pack + self.dy_pack) * e + self.acc * 4


class Plan:
    """An invoker: blocks, buffers and launches planned for the problem and the strides
    of its tensors (the layout's own by default; a call with other strides gets a plan
    for those, made on first use and kept in `variants`)."""

    def __init__(self, p: ConvProblem, strides: tuple | None = None):
        self.p = p
        gm = self.gm = geom(p)
        d = p.direction
        self.shapes = {"fwd": (p.x_shape, p.w_shape, p.y_shape), "bwd_data": (p.y_shape, p.w_shape, p.x_shape),
                       "bwd_weights": (p.y_shape, p.x_shape, p.w_shape)}[d]
        std = tuple(layout_strides(s, p.layout) for s in self.shapes)
        self.strides = strides or std
        if strides is not None and strides != std:
            check_strided(p, self.shapes, strides)
        self.variants: dict = {}
        meta = [_meta(s, st, p.dtype) for s, st in zip(self.shapes, self.strides)]
        pack_w = w_packed(p, meta[1])
        self.blocks = row_blocks(p, fixed_bytes(p, pack_w))
        self.P = math.prod(gm.inp) if d == "bwd_data" else gm.P
        mc_max = max(mc for _, mc in self.blocks)
        self.direct_rows = is_pointwise(p)          # x (dy) rows are the column matrix
        self.ncol = gm.taps * (gm.Kg if d == "bwd_data" else gm.Cg)
        e = _esize(p.dtype)
        src = meta[1] if d == "bwd_weights" else meta[0]          # x (fwd, bwd_w) or dy (bwd_data)
        if self.direct_rows and any(rows_view(src, gm.G, self.P, m0, mc) is None for m0, mc in self.blocks):
            self.direct_rows = False
        self.pack_dy = d == "bwd_weights" and any(rows_view(meta[0], gm.G, self.P, m0, mc) is None
                                                  for m0, mc in self.blocks)
        self.bufs = Buffers(
            col=0 if self.direct_rows else gm.G * mc_max * self.ncol,
            acc={"fwd": gm.K * mc_max, "bwd_data": gm.C * mc_max, "bwd_weights": gm.K * gm.Cg * gm.taps}[d],
            w_pack=gm.K * gm.Cg * gm.taps if pack_w else 0,
            dy_pack=gm.K * mc_max if self.pack_dy else 0)
        self.workspace = self.bufs.nbytes(e)
        self._plan_launches()

    def _plan_launches(self) -> None:
        p, gm, d = self.p, self.gm, self.p.direction
        src_st = strides5_of(self.strides[1] if d == "bwd_weights" else self.strides[0])
        conv = (*gm.stride, *gm.pad, *gm.dil)
        geo = (*gm.inp, *gm.out, *gm.filt)
        BM, BJ = 64, min(64, triton.next_power_of_2(self.ncol))
        kernel = _im2col_t_kernel if d == "bwd_data" else _im2col_kernel
        sizes = sorted({mc for _, mc in self.blocks})
        # one launch per block size: the first row m0 is a per-call, unspecialised argument
        self.im2col = {} if self.direct_rows else {
            mc: Launch(kernel, (triton.cdiv(mc, BM) * triton.cdiv(self.ncol, BJ) * gm.G,),
                       (mc, gm.Kg if d == "bwd_data" else gm.Cg, *geo, *src_st, *conv, BM, BJ))
            for mc in sizes}
        self.epilogues = {}
        if d == "bwd_weights":
            return
        self.epi = plan_epilogue(p) if d == "fwd" else NO_EPILOGUE
        nch = gm.Kg if d == "fwd" else gm.Cg
        so = strides5_of(self.strides[2])
        BN = min(64, max(16, triton.next_power_of_2(nch)))
        for mc in sizes:
            self.epilogues[mc] = Launch(
                epilogue_copy_kernel, (triton.cdiv(mc, 64) * triton.cdiv(nch, BN) * gm.G,),
                (mc, nch, self.P, mc * nch, nch, 1, so[0], so[4], so[1],
                 *self.epi.scalars(), *self.epi.constexprs(), 64, BN))

    # ---- run ---------------------------------------------------------------------------------
    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        ins = {"fwd": (args.x, args.w), "bwd_data": (args.dy, args.w), "bwd_weights": (args.dy, args.x)}[p.direction]
        dst = out if out is not None else torch.empty_strided(self.shapes[2], self.strides[2], dtype=p.out_dtype,
                                                              device=ins[0].device)
        key = (ins[0].stride(), ins[1].stride(), dst.stride())
        if key != self.strides:
            v = self.variants.get(key)
            if v is None:
                v = self.variants[key] = Plan(p, key)
            return v(args, dst)
        return {"fwd": self._fwd, "bwd_data": self._bwd_data, "bwd_weights": self._bwd_weights}[p.direction](
            args, dst)

    def _alloc(self, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        b = self.bufs
        col = workspace.empty((b.col,), self.p.dtype, device) if b.col else None
        return col, workspace.empty((b.acc,), torch.float32, device)

    def _col(self, src: torch.Tensor, col_buf: torch.Tensor | None, m0: int, mc: int) -> torch.Tensor:
        """The column matrix (G, mc, ncol) of block [m0, m0 + mc)."""
        gm = self.gm
        if col_buf is None:
            return rows_view(src, gm.G, self.P, m0, mc).transpose(1, 2)
        col = col_buf[:gm.G * mc * self.ncol].view(gm.G, mc, self.ncol)
        self.im2col[mc](src, col, m0)
        return col

    def _fwd(self, args: ConvArgs, y: torch.Tensor) -> torch.Tensor:
        gm, x = self.gm, args.x
        col_buf, acc_buf = self._alloc(x.device)
        wt = w_fwd_view(args.w, gm)
        if wt is None:
            wt = _pack_w(args.w, gm, "fwd")
        ptrs = self.epi.pointers(args.bias, args.post_ops, y)
        for m0, mc in self.blocks:
            acc = acc_buf[:gm.G * mc * gm.Kg].view(gm.G, mc, gm.Kg)
            _gemm(self._col(x, col_buf, m0, mc), wt, acc, False)
            self.epilogues[mc](acc, y, *ptrs, m0)
        return y

    def _bwd_data(self, args: ConvArgs, dx: torch.Tensor) -> torch.Tensor:
        gm, dy = self.gm, args.dy
        col_buf, acc_buf = self._alloc(dy.device)
        wb = w_bwd_view(args.w, gm)
        if wb is None:
            wb = _pack_w(args.w, gm, "bwd_data")
        for m0, mc in self.blocks:
            acc = acc_buf[:gm.G * mc * gm.Cg].view(gm.G, mc, gm.Cg)
            _gemm(self._col(dy, col_buf, m0, mc), wb, acc, False)
            self.epilogues[mc](acc, dx, dx, dx, dx, dx, dx, m0)
        return dx

    def _bwd_weights(self, args: ConvArgs, dw: torch.Tensor) -> torch.Tensor:
        p, gm, dy, x = self.p, self.gm, args.dy, args.x
        col_buf, acc_buf = self._alloc(x.device)
        acc = acc_buf.view(gm.G, gm.Kg, self.ncol)
        dy_buf = workspace.empty((self.bufs.dy_pack,), dy.dtype, dy.device) if self.pack_dy else None
        for i, (m0, mc) in enumerate(self.blocks):
            dyt = rows_view(dy, gm.G, self.P, m0, mc)
            if dyt is None:
                dyt = _pack_rows(dy, dy_buf, gm.G, self.P, m0, mc)
            _gemm(dyt, self._col(x, col_buf, m0, mc), acc, i > 0)
        nd = len(p.filter)
        dw.copy_(acc.view(gm.K, *p.filter, gm.Cg).permute(0, nd + 1, *range(1, nd + 1)))
        return dw


def workspace_bytes(p: ConvProblem) -> int:
    """Bytes the invoker allocates beyond its output, for tensors in p's layout."""
    return Plan(p).workspace


def conv(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot run of p's direction (plans, then runs); `out` (optional) receives the result."""
    return Plan(p)(args, out)


conv_fwd = conv_bwd_data = conv_bwd_weights = conv


# ---- solvers ---------------------------------------------------------------------------------
class _GemmBase(Solver):
    family = "gemm"
    primitive = "conv"
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + conv_index_reasons(problem) + cap_reasons(problem) + post_op_reasons(problem)

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def estimate(self, problem) -> float | None:
        gm = geom(problem)
        e = _esize(problem.dtype)
        if problem.direction == "bwd_data":
            rows, ncol, nres = gm.N * math.prod(gm.inp), gm.Kg * gm.taps, gm.C
        else:
            rows, ncol, nres = gm.N * gm.P, gm.Cg * gm.taps, gm.K
        col = 0 if is_pointwise(problem) else 2 * rows * gm.G * ncol * e       # write + read
        if problem.layout == "nhwc" and problem.device == "cuda":
            # the column copy moves one run of a pixel's channels per tap: runs under 32 bytes
            # copy element-wise (RGB stem, Cg = 3 bf16: 6-byte runs; rn50_conv1 backward
            # weights measured 2.0 ms on the H200 against 0.45 estimated at full bandwidth)
            col /= max(0.15, min(1.0, gm.Cg * e / 32))
        res = 0 if problem.direction == "bwd_weights" else 2 * rows * nres * 4
        # bwd_data multiplies the zero columns of a strided transposed convolution too
        waste = math.prod(gm.stride) if problem.direction == "bwd_data" else 1
        blocks = len(row_blocks(problem))
        device = roofline_ms(problem.flops() * waste, problem.bytes() + post_op_bytes(problem) + col + res,
                             problem.dtype, 0.75) + 0.01 + 0.02 * blocks
        # find counts max(device, host) per call; the host enqueues allocations, the im2col and
        # epilogue launches and a cuBLAS call per block: 0.15-0.2 ms on the H200's host
        # (serial latency minus device time, 4 held-out layers, 2026-11-30)
        host = 0.075 + 0.02 * (blocks - 1) if problem.device == "cuda" else 0.0
        return max(device, host)

    def prepare(self, problem):
        return Plan(problem)


@register
class GemmFwd(_GemmBase):
    id = 30
    name = "gemm_fwd"
    directions = frozenset({"fwd"})


@register
class GemmBwdData(_GemmBase):
    id = 31
    name = "gemm_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class GemmBwdWeights(_GemmBase):
    id = 32
    name = "gemm_bwd_weights"
    directions = frozenset({"bwd_weights"})
