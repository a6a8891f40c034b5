"""CPU GEMM convolution (family `gemm`, ids 10-12): im2col + f32 GEMM + fused
post-processing, col2im for backward data, per-thread partials reduced at the end
for backward weights. After oneDNN's gemm_bf16_convolution (seeds/).

Math (groups G, Kg = K/G, Cg = C/G, F = prod(filter), M = output positions):
  fwd          y[n, g*Kg+k, o]  = sum_{c,f} w[g*Kg+k, c, f] * x[n, g*Cg+c, o*s + f*d - pad]
               then + bias, then the post-op chain (Sum, Eltwise, Binary) on the f32
               accumulator block, then the cast to the output dtype.
               GEMM per group: (Kg x Cg*F) @ col (Cg*F x M)  [nchw]
                               col (M x F*Cg) @ w^T (F*Cg x Kg) [nhwc: rows are positions]
  bwd_data     col = w^T @ dy, then col2im: dx[.., o*s + f*d - pad] += col[.., f, o]
  bwd_weights  dw[g] += dy[g] (Kg x M) @ col^T (M x Cg*F), summed over images; the
               images are split across threads (balance211), each thread keeps an f32
               partial, the partials are added in thread order at the end.

Supported: 1D/2D/3D, nchw (contiguous) and nhwc (channels-last) natively, groups
(depthwise included), stride, dilation, asymmetric padding; f32/f16/bf16 inputs with
f32 accumulation; bf16/f16 tiles are converted to f32 on the way into the column
buffer and the GEMM is torch's f32 matmul (MKL) -- on CPUs without native bf16 that
is far faster than a bf16 GEMM. On CPUs with avx512_bf16/amx_bf16, bf16 problems whose
GEMM output is the final result use torch's bf16 matmul instead (CpuGemmConfig.bf16_gemm).
1x1 stride-1 unpadded convolutions use the input as the GEMM operand (no im2col when no
conversion is needed) and need no col2im.

Blocking: output positions are cut into blocks whose column buffer stays under
`CpuGemmConfig.block_bytes` (at most COL_CAP_BYTES = 32 MiB per thread);
`workspace_size` is exactly the bytes the invoker allocates (column buffers,
staging for padded regions, accumulators, f32 weights, partials).
Threads: "pool" runs torch.get_num_threads() workers on a thread pool, each on its
balance211 share of the blocks (torch ops release the GIL); "torch" runs one worker
and relies on torch's parallel GEMM and copies."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..args import ConvArgs
from ..post_ops import Binary, Eltwise, Sum, eltwise
from ..problems.conv import ConvProblem, empty_in_layout, to_layout
from ..search.solver import Solver, register
from .cpu_im2col import (
    COL_CAP_BYTES,
    F32,
    Block,
    balance211,
    col_view,
    logical,
    physical,
    plan_blocks,
    scatter_taps,
    source_region,
    stage_numel,
    touches_padding,
)

ORDER = {"nchw": "gcfno", "nhwc": "gnofc"}   # column tile axes per layout


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """avx512_bf16 / amx_bf16 present: torch's bf16 matmul (oneDNN) runs natively."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class CpuGemmConfig:
    block_bytes: int = 4 << 20      # column-buffer bytes per block; 1 .. COL_CAP_BYTES
    threads: str = "pool"           # "pool" | "torch"
    nthr: int | None = None         # worker count for "pool"; None = torch.get_num_threads()
    bf16_gemm: str = "auto"         # "auto" | "f32" | "native" (see gemm_dtype)

    def workers(self) -> int:
        if self.threads == "torch":
            return 1
        return max(1, self.nthr if self.nthr is not None else torch.get_num_threads())

    def cap(self) -> int:
        return max(1, min(self.block_bytes, COL_CAP_BYTES))

    def gemm_dtype(self, p: ConvProblem) -> torch.dtype:
        """The GEMM's operand dtype. f32 (bf16/f16 tiles converted), except bf16 on a CPU
        with native bf16: "auto" then uses the bf16 GEMM (f32 accumulation inside, one
        rounding of its output) where that output is the final result -- forward without
        bias or post-ops to a bf16 output, backward data of a 1x1 stride-1 unpadded
        convolution -- and "native" everywhere except forward with bias or post-ops (GEMM
        outputs are then rounded to bf16 before the f32 col2im / minibatch reduction)."""
        if p.dtype != torch.bfloat16 or self.bf16_gemm == "f32" or not cpu_has_native_bf16():
            return F32
        plain_fwd = p.direction == "fwd" and not p.has_bias and not p.post_ops and p.out_dtype == p.dtype
        if self.bf16_gemm == "native":
            return p.dtype if plain_fwd or p.direction != "fwd" else F32
        exact = plain_fwd or (p.direction == "bwd_data" and _is_direct(p))
        return p.dtype if exact else F32


@dataclass
class Plan:
    """Everything an invoker needs, computed once in prepare()."""

    p: ConvProblem
    nthr: int
    work: list[list[Block]]                  # blocks of each worker
    per_thread: dict[str, tuple[int, torch.dtype]]   # elements and dtype of each per-worker buffer
    shared: dict[str, tuple[int, torch.dtype]] = field(default_factory=dict)
    direct: bool = False                     # 1x1, stride 1, no padding: no im2col / col2im
    gemm_dtype: torch.dtype = F32

    @staticmethod
    def _bytes(n: int, dt: torch.dtype) -> int:
        return -(-n * dt.itemsize // _ALIGN) * _ALIGN

    def workspace_bytes(self) -> int:
        per = sum(self._bytes(n, dt) for n, dt in self.per_thread.values())
        return self.nthr * per + sum(self._bytes(n, dt) for n, dt in self.shared.values())

    def has(self, name: str) -> bool:
        return self.per_thread.get(name, (0, F32))[0] > 0

    def carve(self) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """Allocate the workspace (one byte buffer) and cut it into named typed pieces."""
        ws = alloc_workspace(self.workspace_bytes())
        off = 0

        def take(n: int, dt: torch.dtype) -> torch.Tensor:
            nonlocal off
            b = self._bytes(n, dt)
            t = ws[off:off + n * dt.itemsize].view(dt)
            off += b
            return t

        shared = {k: take(n, dt) for k, (n, dt) in self.shared.items()}
        threads = [{k: take(n, dt) for k, (n, dt) in self.per_thread.items()} for _ in range(self.nthr)]
        return threads, shared


_ALIGN = 64


def alloc_workspace(nbytes: int) -> torch.Tensor:
    """The invoker's workspace, bytes aligned to 64 (tests poison it through this hook)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _is_direct(p: ConvProblem) -> bool:
    return (all(f == 1 for f in p.filter) and all(s == 1 for s in p.stride)
            and not any(p.pad_before) and not any(p.pad_after))


def _max_stage(p: ConvProblem, blocks: list[Block]) -> int:
    return max((stage_numel(p, b) for b in blocks if touches_padding(p, b)), default=0)


def make_plan(p: ConvProblem, cfg: CpuGemmConfig = CpuGemmConfig()) -> Plan:
    nthr = cfg.workers()
    F = math.prod(p.filter)
    Cg = p.C // p.groups
    bpp = p.C * F * 4
    direct = _is_direct(p)
    wnumel = p.K * Cg * F
    if p.direction == "bwd_weights":
        work = []
        for t in range(nthr):
            a, b = balance211(p.N, nthr, t)
            work.append(plan_blocks(a, b, p.out_size, bpp, cfg.cap()) if b > a else [])
    else:
        blocks = plan_blocks(0, p.N, p.out_size, bpp, cfg.cap(), min_blocks=nthr)
        if p.direction == "fwd":
            work = [blocks[slice(*balance211(len(blocks), nthr, t))] for t in range(nthr)]
        else:   # bwd_data: whole image groups per worker (the col2im accumulator)
            groups: list[list[Block]] = []
            for b in blocks:
                if groups and (groups[-1][0].n0, groups[-1][0].n1) == (b.n0, b.n1):
                    groups[-1].append(b)
                else:
                    groups.append([b])
            work = [[b for g in groups[slice(*balance211(len(groups), nthr, t))] for b in g]
                    for t in range(nthr)]
    allb = [b for w in work for b in w]
    max_pos = max((b.positions for b in allb), default=0)
    gd = cfg.gemm_dtype(p)
    same = p.dtype == gd            # inputs are already GEMM operands (no conversion)
    per: dict[str, tuple[int, torch.dtype]] = {}
    nhwc_view = direct and same and p.layout == "nhwc"
    if p.direction == "fwd":
        per["col"] = (0 if nhwc_view else max_pos * p.C * F, gd)
        per["stage"] = (_max_stage(p, allb), p.dtype)
        per["acc"] = (max_pos * p.K, gd)
    elif p.direction == "bwd_data":
        per["col"] = (max_pos * p.C * F, gd)
        per["dy"] = (0 if (same and p.layout == "nhwc") else max_pos * p.K, gd)
        if not direct:
            padded = math.prod(i + a + b for i, a, b in zip(p.in_size, p.pad_before, p.pad_after))
            per["acc"] = (max((b.nb for b in allb), default=0) * p.C * padded, F32)
    else:
        per["col"] = (0 if nhwc_view else max_pos * p.C * F, gd)
        per["stage"] = (_max_stage(p, allb), p.dtype)
        per["dy"] = (0 if (same and p.layout == "nhwc") else max_pos * p.K, gd)
        per["partial"] = (wnumel, F32)
        if gd != F32:
            per["gemm_out"] = (wnumel, gd)
    shared = {} if p.direction == "bwd_weights" else {"w": (wnumel, gd)}
    return Plan(p=p, nthr=nthr, work=work, per_thread=per, shared=shared, direct=direct, gemm_dtype=gd)


# ---- helpers ----------------------------------------------------------------------
@lru_cache(maxsize=8)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="nnprim-cpu-gemm")


def _run(plan: Plan, fn) -> None:
    """fn(ithr) on every worker; exceptions propagate."""
    if plan.nthr == 1:
        fn(0)
        return
    for _ in _pool(plan.nthr).map(fn, range(plan.nthr)):
        pass


def _weights_gemm(p: ConvProblem, w: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """w in the GEMM dtype as (G, Kg, Cg*F) [nchw] or (G, Kg, F*Cg) [nhwc], in the workspace."""
    G, Kg, Cg, F = p.groups, p.K // p.groups, p.C // p.groups, math.prod(p.filter)
    if p.layout == "nchw":
        out = buf.view(p.K, Cg, *p.filter)
        out.copy_(w)
    else:
        out = buf.view(p.K, *p.filter, Cg)
        out.copy_(physical(w, "nhwc"))
    return out.view(G, Kg, Cg * F)


def _block_index(blk: Block, t: torch.Tensor) -> tuple:
    """Index of block `blk` into a logical tensor broadcastable to y (size-1 dims kept)."""
    idx = [slice(blk.n0, blk.n1) if t.shape[0] > 1 else slice(None), slice(None)]
    idx += [slice(lo, hi) if t.shape[2 + i] > 1 else slice(None)
            for i, (lo, hi) in enumerate(zip(blk.lo, blk.hi))]
    return tuple(idx)


def _split_k(t: torch.Tensor, G: int) -> torch.Tensor:
    """(n, K|1, sp..) -> (n, G|1, Kg|1, sp..)."""
    if t.shape[1] == 1:
        return t.unsqueeze(1)
    return t.unflatten(1, (G, t.shape[1] // G))


_INPLACE = {
    "tanh": torch.Tensor.tanh_, "sigmoid": torch.Tensor.sigmoid_, "exp": torch.Tensor.exp_,
    "log": torch.Tensor.log_, "sqrt": torch.Tensor.sqrt_, "abs": torch.Tensor.abs_,
}


def _eltwise_(a: torch.Tensor, op: Eltwise) -> None:
    k, al, be = op.kind, op.alpha, op.beta
    if k == "relu" and al == 0.0:
        a.clamp_(min=0.0)
    elif k in _INPLACE:
        _INPLACE[k](a)
    elif k == "clip":
        a.clamp_(al, be)
    elif k == "linear":
        a.mul_(al).add_(be)
    elif k == "square":
        a.mul_(a)
    else:
        a.copy_(eltwise(k, a, al, be))


def apply_post_ops_block(a: torch.Tensor, blk: Block, G: int, bias: torch.Tensor | None,
                         post_ops) -> None:
    """Bias then the chain, in place on the f32 accumulator block a (nb, G, Kg, out..)."""
    nd = a.dim() - 3
    if bias is not None:
        a.add_(bias.view(1, G, -1, *([1] * nd)))
    for op in post_ops:
        if isinstance(op, Eltwise):
            _eltwise_(a, op)
            continue
        t = _split_k(op.tensor[_block_index(blk, op.tensor)], G)
        if isinstance(op, Sum):
            a.add_(t, alpha=op.scale)
        elif isinstance(op, Binary):
            o = op.op
            if o == "add":
                a.add_(t)
            elif o == "sub":
                a.sub_(t)
            elif o == "mul":
                a.mul_(t)
            elif o == "div":
                a.div_(t)
            elif o == "max":
                torch.maximum(a, t, out=a)
            else:
                torch.minimum(a, t, out=a)


def _y_block(p: ConvProblem, t: torch.Tensor, blk: Block) -> torch.Tensor:
    """Logical block view (nb, G, Kg, out..) of a logical y-shaped tensor."""
    idx = (slice(blk.n0, blk.n1), slice(None), *(slice(lo, hi) for lo, hi in zip(blk.lo, blk.hi)))
    return t[idx].unflatten(1, (p.groups, p.K // p.groups))


def _acc_logical(p: ConvProblem, acc: torch.Tensor, blk: Block) -> torch.Tensor:
    """The GEMM output (nchw: G, Kg, nb*M; nhwc: G, nb*M, Kg) as (nb, G, Kg, out..)."""
    nd = p.ndim
    G, Kg = p.groups, p.K // p.groups
    if p.layout == "nchw":
        return acc.view(G, Kg, blk.nb, *blk.out).permute(2, 0, 1, *range(3, 3 + nd))
    return acc.view(G, blk.nb, *blk.out, Kg).permute(1, 0, 2 + nd, *range(2, 2 + nd))


def _y_gemm_view(p: ConvProblem, y: torch.Tensor, blk: Block) -> torch.Tensor | None:
    """y's block as the contiguous GEMM output (nchw: G, Kg, nb*M; nhwc: G, nb*M, Kg),
    or None when it is not one (then the GEMM goes through the accumulator)."""
    G, Kg, M = p.groups, p.K // p.groups, blk.positions
    sl = tuple(slice(lo, hi) for lo, hi in zip(blk.lo, blk.hi))
    if p.layout == "nchw":
        if blk.nb != 1:
            return None
        v = y[(blk.n0, slice(None), *sl)]
        shape = (G, Kg, M)
    else:
        if G != 1:
            return None
        v = physical(y, "nhwc")[(slice(blk.n0, blk.n1), *sl)]
        shape = (1, M, Kg)
    if not v.is_contiguous():
        return None
    return v.view(shape)


def _im2col(p: ConvProblem, x: torch.Tensor, blk: Block, ws: dict, direct_view: bool) -> torch.Tensor:
    """Column tile of block `blk` as a 3D f32 GEMM operand: nchw (G, Cg*F, nb*M),
    nhwc (G, nb*M, F*Cg)."""
    order = ORDER[p.layout]
    src = source_region(p, x, blk, ws.get("stage"))
    cv = col_view(p, src, blk, order)
    G, CF, M = p.groups, (p.C // p.groups) * math.prod(p.filter), blk.positions
    shape3 = (G, CF, M) if p.layout == "nchw" else (G, M, CF)
    if direct_view:
        return cv.reshape(shape3)
    col = ws["col"][:cv.numel()].view(cv.shape)
    col.copy_(cv)
    return col.view(shape3)


# ---- forward ------------------------------------------------------------------------
def conv_fwd(plan: Plan, args: ConvArgs) -> torch.Tensor:
    p = plan.p
    x = to_layout(args.x, p.layout)
    threads, shared = plan.carve()
    wg = _weights_gemm(p, args.w, shared["w"])
    bias = args.bias.to(F32) if args.bias is not None else None
    y = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    direct_view = not plan.has("col")
    G = p.groups
    plain = bias is None and not args.post_ops and p.out_dtype == plan.gemm_dtype
    into_y = p.out_dtype == plan.gemm_dtype == F32     # GEMM (and post-ops) straight into y

    def worker(t: int) -> None:
        ws = threads[t]
        for blk in plan.work[t]:
            col = _im2col(p, x, blk, ws, direct_view)
            M = blk.positions
            dst = _y_gemm_view(p, y, blk) if plain or into_y else None
            if p.layout == "nchw":
                acc = dst if dst is not None else ws["acc"][:p.K * M].view(G, p.K // G, M)
                torch.matmul(wg, col, out=acc)
            else:
                acc = dst if dst is not None else ws["acc"][:p.K * M].view(G, M, p.K // G)
                torch.matmul(col, wg.transpose(1, 2), out=acc)
            if plain and dst is not None:
                continue
            a = _acc_logical(p, acc, blk)
            apply_post_ops_block(a, blk, G, bias, args.post_ops)
            if dst is None:
                _y_block(p, y, blk).copy_(a)

    _run(plan, worker)
    return y


# ---- backward data ------------------------------------------------------------------
def _dy_operand(p: ConvProblem, dy: torch.Tensor, blk: Block, buf: torch.Tensor | None) -> torch.Tensor:
    """dy block as a 3D f32 GEMM operand: nchw (G, Kg, nb*M), nhwc (G, nb*M, Kg)."""
    G, Kg, M = p.groups, p.K // p.groups, blk.positions
    v = _y_block(p, dy, blk)                         # (nb, G, Kg, out..)
    if p.layout == "nchw":
        perm = v.permute(1, 2, 0, *range(3, v.dim()))
        if buf is None:
            return perm.reshape(G, Kg, M)
        out = buf[:p.K * M].view(perm.shape)
        out.copy_(perm)
        return out.view(G, Kg, M)
    if buf is None:   # f32 nhwc: the dy rows are the operand
        return physical(dy, "nhwc")[blk.n0:blk.n1][
            (slice(None), *(slice(lo, hi) for lo, hi in zip(blk.lo, blk.hi)))
        ].reshape(M, G, Kg).transpose(0, 1)
    out = buf[:p.K * M].view(M, G, Kg)
    out.view(blk.nb, *blk.out, p.K).copy_(physical(dy, "nhwc")[blk.n0:blk.n1][
        (slice(None), *(slice(lo, hi) for lo, hi in zip(blk.lo, blk.hi)))])
    return out.transpose(0, 1)


def conv_bwd_data(plan: Plan, args: ConvArgs) -> torch.Tensor:
    p = plan.p
    dy = to_layout(args.dy, p.layout)
    threads, shared = plan.carve()
    wg = _weights_gemm(p, args.w, shared["w"])        # (G, Kg, CF)
    dx = empty_in_layout(p.x_shape, p.layout, dtype=p.out_dtype)
    order = ORDER[p.layout]
    G = p.groups
    pads = tuple(zip(p.pad_before, p.in_size))
    padded = tuple(i + a + b for i, a, b in zip(p.in_size, p.pad_before, p.pad_after))

    def flush(acc: torch.Tensor, n0: int, n1: int) -> None:
        inner = (slice(None), slice(None), *(slice(b, b + n) for b, n in pads))
        dx[n0:n1].copy_(logical(acc, p.layout)[inner])

    def worker(t: int) -> None:
        ws = threads[t]
        dybuf = ws["dy"] if plan.has("dy") else None
        cur = None
        acc = None
        for blk in plan.work[t]:
            dyo = _dy_operand(p, dy, blk, dybuf)
            M = blk.positions
            CF = (p.C // G) * math.prod(p.filter)
            if p.layout == "nchw":
                col = ws["col"][:G * CF * M].view(G, CF, M)
                torch.matmul(wg.transpose(1, 2), dyo, out=col)
            else:
                col = ws["col"][:G * CF * M].view(G, M, CF)
                torch.matmul(dyo, wg, out=col)
            if plan.direct:    # col is dx itself
                _x_block(p, dx, blk).copy_(_col_logical(p, col, blk))
                continue
            if cur != (blk.n0, blk.n1):
                if cur is not None:
                    flush(acc, *cur)
                cur = (blk.n0, blk.n1)
                shape = (blk.nb, p.C, *padded) if p.layout == "nchw" else (blk.nb, *padded, p.C)
                acc = ws["acc"][:math.prod(shape)].view(shape)
                acc.zero_()
            scatter_taps(p, col, order, acc, blk, blk.n0)
        if cur is not None:
            flush(acc, *cur)

    _run(plan, worker)
    return dx


def _x_block(p: ConvProblem, t: torch.Tensor, blk: Block) -> torch.Tensor:
    """Logical (nb, C, out..) block of an x-shaped tensor (direct problems: in == out)."""
    return t[(slice(blk.n0, blk.n1), slice(None), *(slice(lo, hi) for lo, hi in zip(blk.lo, blk.hi)))]


def _col_logical(p: ConvProblem, col: torch.Tensor, blk: Block) -> torch.Tensor:
    """A direct problem's column tile (F = 1) as logical (nb, C, out..)."""
    nd = p.ndim
    if p.layout == "nchw":   # (G, Cg, nb*M)
        return col.reshape(p.C, blk.nb, *blk.out).transpose(0, 1)
    v = col.view(p.groups, blk.nb, *blk.out, p.C // p.groups)      # (G, nb, out.., Cg)
    v = v.permute(1, *range(2, 2 + nd), 0, 2 + nd)                  # (nb, out.., G, Cg)
    return logical(v.reshape(blk.nb, *blk.out, p.C), "nhwc")


# ---- backward weights ---------------------------------------------------------------
def conv_bwd_weights(plan: Plan, args: ConvArgs) -> torch.Tensor:
    p = plan.p
    x = to_layout(args.x, p.layout)
    dy = to_layout(args.dy, p.layout)
    threads, _ = plan.carve()
    direct_view = not plan.has("col")
    G, Kg = p.groups, p.K // p.groups
    native = plan.gemm_dtype != F32

    def worker(t: int) -> None:
        ws = threads[t]
        dybuf = ws["dy"] if plan.has("dy") else None
        part = ws["partial"].view(G, Kg, -1)
        part.zero_()
        for blk in plan.work[t]:
            col = _im2col(p, x, blk, ws, direct_view)
            dyo = _dy_operand(p, dy, blk, dybuf)
            a, b = (dyo, col.transpose(1, 2)) if p.layout == "nchw" else (dyo.transpose(1, 2), col)
            if native:    # bf16 GEMM output, reduced in f32
                tmp = ws["gemm_out"].view(G, Kg, -1)
                torch.matmul(a, b, out=tmp)
                part.add_(tmp)
            else:         # (G,Kg,M) @ (G,M,CF)
                part.baddbmm_(a, b)

    _run(plan, worker)
    total = threads[0]["partial"]
    for t in range(1, plan.nthr):
        total.add_(threads[t]["partial"])
    dw = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
    if p.layout == "nchw":
        dw.copy_(total.view(p.w_shape))
    else:
        physical(dw, "nhwc").copy_(total.view(p.K, *p.filter, p.C // G))
    return dw


def conv_bias_grad(dy: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """db[k] = sum of dy over images and positions, accumulated in f32 (the seed's
    bias gradient); nhwc reduces over contiguous rows."""
    if physical(dy, "nhwc").is_contiguous() and not dy.is_contiguous():
        db = physical(dy, "nhwc").reshape(-1, dy.shape[1]).sum(0, dtype=F32)
    else:
        db = dy.sum(dim=[0, *range(2, dy.dim())], dtype=F32)
    return db.to(out_dtype or dy.dtype)


# ---- solvers ------------------------------------------------------------------------
_RUN = {"fwd": conv_fwd, "bwd_data": conv_bwd_data, "bwd_weights": conv_bwd_weights}
_GFLOPS_PER_CORE = 60.0     # MKL f32 GEMM per core on this class of CPU (measured ~120 on 2)
_GBS_PER_CORE = 8.0         # strided copies (im2col, col2im, casts) per core


def prepare_with(p: ConvProblem, cfg: CpuGemmConfig = CpuGemmConfig()):
    """Invoker of problem p under config cfg (tests and benchmarks use other configs)."""
    plan = make_plan(p, cfg)
    fn = _RUN[p.direction]

    def invoke(args: ConvArgs) -> torch.Tensor:
        return fn(plan, args)
    invoke.plan = plan
    return invoke


class _CpuGemmBase(Solver):
    family = "gemm"
    primitive = "conv"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    config = CpuGemmConfig()

    def workspace_size(self, p: ConvProblem) -> int:
        return make_plan(p, self.config).workspace_bytes()

    def estimate(self, p: ConvProblem) -> float:
        cores = max(1, torch.get_num_threads())
        F = math.prod(p.filter)
        col = 0.0 if _is_direct(p) else 8.0 * p.N * math.prod(p.out_size) * p.C * F
        t = p.flops() / (_GFLOPS_PER_CORE * 1e9 * cores) + (col + p.bytes()) / (_GBS_PER_CORE * 1e9 * cores)
        return t * 1e3

    def prepare(self, p: ConvProblem):
        return prepare_with(p, self.config)


@register
class CpuGemmFwd(_CpuGemmBase):
    id = 10
    name = "CpuGemmFwd"
    directions = frozenset({"fwd"})


@register
class CpuGemmBwdData(_CpuGemmBase):
    id = 11
    name = "CpuGemmBwdData"
    directions = frozenset({"bwd_data"})


@register
class CpuGemmBwdWeights(_CpuGemmBase):
    id = 12
    name = "CpuGemmBwdWeights"
    directions = frozenset({"bwd_weights"})


__all__ = ["CpuGemmConfig", "Plan", "make_plan", "prepare_with", "conv_bias_grad",
           "CpuGemmFwd", "CpuGemmBwdData", "CpuGemmBwdWeights"]
