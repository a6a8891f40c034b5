"""CPU flash attention in vectorised torch (family `flash`, ids 115 `cpu_flash_fwd`,
116 `cpu_flash_bwd`): blocked over query rows and key blocks, online softmax in f32,
f32 GEMMs through torch's batched matmul (MKL) into preallocated score tiles, and, where
torch's oneDNN matmul exists and a chunk is one (batch, kv head) pair, the GEMMs with
fresh or accumulated outputs (P V, dQ, dK^T, dV^T) through oneDNN (`_nt`).

Math (per batch entry b, query head h, K/V head hk = h // G, G = Hq / Hkv):
    s_ij  = scale * q_i . k_j + bias_ij      bias: additive mask where visible, -inf where
                                             a bool mask / causal / kv_lens hides key j
    lse_i = log sum_j exp(s_ij)              (f32, before dropout; -inf for a dead row)
    o_i   = sum_j keep_ij / (1 - p) * exp(s_ij - lse_i) v_j
Forward, per key block c (online softmax, m = running max, l = running sum):
    m' = max(m, max_j s_ij);  P = exp(s - m');  l = l e^(m - m') + sum_j P;
    acc = acc e^(m - m') + (P * keep) V_c;      o = acc / l / (1 - p),  lse = m + log l
Backward (recompute; P from the forward's lse, D_i = rowsum(dO * O), 0 for dead rows):
    P = exp(s - lse);  Pd = P * keep / (1 - p);  dV_c += Pd^T dO;  dP = (dO V_c^T) * keep / (1 - p)
    dS = P * (dP - D);  dQ += scale dS K_c;  dK_c += scale dS^T Q
A fully masked row ("dead": lse = -inf) gives o = NaN (0 with softmax_inf_as_zero) and
zero gradients (its dq row is 0 and it adds nothing to dk/dv), as the reference documents.

Layout: GQA needs no repeated K/V. Queries of the G heads sharing a K/V head are stacked
as rows: q (B, Hq, Sq, D) is viewed as (B, Hkv, G, Sq, D) and a block of query rows
r0:r1 of a chunk of (batch, kv head) pairs becomes the f32 GEMM operand
(nb * nh, G * nr, D); keys are (nb * nh, nc, D). The tile of scores is
(nb * nh, G * nr, nc) f32, at most `_TILE_ELEMS` elements (no Sq x Sk matrix); dK and dV
of a key block come out of one GEMM already summed over the G query heads.
bf16/f16 blocks are converted to f32 on the way in (per block); outputs are written in
q's dtype, lse in f32. On CPUs with native bf16 (avx512_bf16), bf16 problems use the bf16
GEMM (oneDNN, f32 accumulation inside) where its single rounding is the result's: the
forward takes whole rows (Sk <= 2048) and computes o = (P / l) V in one GEMM; the backward
takes whole G*Sq x Sk tiles per head and computes dV = P^T dO, dQ = (scale dS) K and
dK = (scale dS)^T Q each in one GEMM (P and dS rounded to bf16, as torch's CPU flash
kernel does). S = Q K^T and dP = dO V^T stay f32 GEMMs (their outputs feed exp / dP - D).
Scores are computed in the log2 domain (q pre-scaled by
scale * log2(e), `exp2`, which is ~3x faster than torch's `exp` on CPU; lse converted back
with ln 2) into preallocated tile buffers (`bmm(out=)`). Threads: torch's intra-op
threads inside each GEMM / elementwise op (benchmarks/ATTENTION_CPU.md).

Masks: causal (both alignments, per-batch with kv_lens) and kv_lens skip key blocks that
no row of the block sees and build an element mask only for boundary blocks; bool and
additive mask buffers are sliced per block and broadcast (no materialised full mask).
Dropout: the keep flags of each (rows, keys) block come from nnprim.dropout's torch
Philox (`dropout_keep_block`), bit-identical with the reference and the Triton kernels.
Quantized K/V (forward): each key block's codes, scales and zero points are sliced and
dequantized in f32 (KVQuant.dequantize).

Supported: f32/f16/bf16, any head dims (D != Dv), any strides, every option of the
attention contract. Not supported: CUDA tensors (the Triton flash solvers serve those).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .. import fp8
from ..args import AttnArgs
from ..dropout import dropout_keep_block, dropout_scale, dropout_threshold
from ..paged import gathering
from ..problems.attention import AttentionProblem
from ..quant import KVQuant
from ..search.solver import Solver, register
from .masking import MASK_FLOOR

F32 = torch.float32
_NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Blocking (tests shrink these to exercise the multi-block paths).
_TILE_ELEMS = 1 << 20      # f32 score tile (rows x keys) per step: 4 MiB (< 8 MiB)
_KV_BLOCK = 512            # keys per block
_MIN_GEMM_ROWS = 64        # rows of one GEMM (G * nr) before chunks of heads shrink
_ONE_HEAD_WORK = 1 << 16   # G * Sq * D per thread from which chunks hold one (batch, kv head) pair


def _empty(shape, dtype, device) -> torch.Tensor:
    """Output allocation (tests swap in a NaN-filled allocator to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---- planning -------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Chunks of (batch, kv head) pairs and the row / key block sizes of one problem."""
    nb: int   # batch entries per chunk
    nh: int   # kv heads per chunk
    nr: int   # query rows per block
    nc: int   # keys per block


def plan(problem: AttentionProblem, tile_elems: int | None = None, kv_block: int | None = None) -> Plan:
    """Largest row blocks whose (nb * nh * G * nr, nc) tile stays under tile_elems; the
    chunk of (batch, head) pairs shrinks only when G * nr would drop below _MIN_GEMM_ROWS.
    With oneDNN's f32 matmul (_onednn), chunks hold one pair once a head's GEMMs are big
    enough per thread (G * Sq * D >= _ONE_HEAD_WORK * threads; smaller ones split over
    threads lose to MKL's batched GEMM, measured at 2 threads S=1024 D=64) or for the bf16
    whole-row forward: the GEMMs run 2D (oneDNN: 10-15 % faster than MKL's sgemm here)."""
    E = tile_elems or _TILE_ELEMS
    whole_row = False
    B, Hkv, G, Sq, Sk = problem.B, problem.Hkv, problem.group, problem.Sq, problem.Sk
    if (kv_block is None and problem.direction == "fwd" and problem.dtype == torch.bfloat16
            and Sk <= _WHOLE_ROW_MAX and _native_bf16()):
        kv_block = Sk                  # whole rows: the P V GEMM runs in bf16 (_pv_native)
        whole_row = True
        E = tile_elems or 2 * _TILE_ELEMS   # 8 MiB of scores: >= 128 rows per head at Sk 2048
    if (kv_block is None and tile_elems is None and problem.direction == "bwd" and _bwd_whole_ok(problem)):
        # whole (Sq x Sk) tiles per head: dV, dK, dQ each come out of one bf16 GEMM
        nh = 1 if _onednn() else max(1, min(Hkv, 2 * _TILE_ELEMS // (G * Sq * Sk)))
        return Plan(1, nh, Sq, Sk)
    nc = max(1, min(Sk, kv_block or _KV_BLOCK))
    cap = max(1, E // nc)                                  # tile rows
    nr_min = min(Sq, max(1, -(-_MIN_GEMM_ROWS // G)))
    work = G * Sq * min(problem.D, problem.Dv)
    if _onednn() and (whole_row or work >= _ONE_HEAD_WORK * torch.get_num_threads()):
        nb, nh = 1, 1
    elif B * Hkv * G * nr_min <= cap:
        nb, nh = B, Hkv
    elif Hkv * G * nr_min <= cap:
        nb, nh = max(1, cap // (Hkv * G * nr_min)), Hkv
    else:
        nb, nh = 1, max(1, min(Hkv, cap // (G * nr_min)))
    nr = max(1, min(Sq, cap // (nb * nh * G)))
    return Plan(nb, nh, nr, nc)


def _chunks(problem: AttentionProblem, pl: Plan):
    for b0 in range(0, problem.B, pl.nb):
        for h0 in range(0, problem.Hkv, pl.nh):
            yield slice(b0, min(problem.B, b0 + pl.nb)), slice(h0, min(problem.Hkv, h0 + pl.nh))


class _Ctx:
    """Per-call state shared by forward and backward: scale, kv lengths, mask view,
    dropout parameters and the causal/kv_lens block classification."""

    def __init__(self, problem: AttentionProblem, args: AttnArgs) -> None:
        self.p, self.a = problem, args
        self.scale = args.scale_value(problem.invert_scale)
        self.dev = args.q.device
        self.lens = args.kv_lens.tolist() if args.kv_lens is not None else None
        self.kv_lens = args.kv_lens.to(torch.int64) if args.kv_lens is not None else None
        m = args.attn_mask
        self.mask = None if m is None else _log2_safe(m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)))
        self.thr = dropout_threshold(problem.dropout_p) if problem.dropout_p > 0 else None

    def shift(self, L: int) -> int:
        """Key j is causally visible to row i iff j <= i + shift."""
        return 0 if self.p.causal == "top_left" else L - self.p.Sq

    def key_range(self, bs: slice, r0: int, r1: int) -> tuple[int, int | None]:
        """(hi, vis_from): rows r0:r1 of batches bs see no key at or past hi; keys
        below vis_from are visible to every row (None: all keys below hi are)."""
        Sk = self.p.Sk
        Ls = self.lens[bs] if self.lens is not None else [Sk]
        hi = max(Ls)
        lo = min(Ls)
        if self.p.causal is not None:
            hi = max(min(L, r1 + self.shift(L)) for L in Ls)
            lo = min(min(L, r0 + 1 + self.shift(L)) for L in Ls)
        hi, lo = max(0, min(Sk, hi)), max(0, min(Sk, lo))
        return hi, (None if lo >= hi else lo)

    def mask_tile(self, s5: torch.Tensor, bs: slice, hs: slice, r0: int, r1: int,
                  c0: int, c1: int, needs_vis: bool) -> None:
        """Apply causal / kv_lens visibility and the mask buffer to the score tile
        s5 (nb, nh, G, nr, nc) in place."""
        if needs_vis:
            j = torch.arange(c0, c1, device=self.dev).view(1, 1, 1, 1, -1)
            hidden = None
            if self.kv_lens is not None:
                L = self.kv_lens[bs].view(-1, 1, 1, 1, 1)
                hidden = j >= L
            else:
                L = self.p.Sk
            if self.p.causal is not None:
                i = torch.arange(r0, r1, device=self.dev).view(1, 1, 1, -1, 1)
                lim = i if self.p.causal == "top_left" else i + (L - self.p.Sq)
                h2 = j > lim
                hidden = h2 if hidden is None else hidden | h2
            s5.masked_fill_(hidden, _NEG_INF)
        m = self.mask
        if m is None:
            return
        if m.shape[0] != 1:
            m = m[bs]
        if m.shape[1] != 1:
            m = m.unflatten(1, (self.p.Hkv, self.p.group))[:, hs]
        else:
            m = m.unsqueeze(2)
        if m.shape[3] != 1:
            m = m[:, :, :, r0:r1]
        if m.shape[4] != 1:
            m = m[..., c0:c1]
        if m.dtype == torch.bool:
            s5.masked_fill_(~m, _NEG_INF)
        else:
            s5.add_(m, alpha=LOG2E)             # scores are in the log2 domain

    def keep_tile(self, bs: slice, hs: slice, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Dropout keep flags (nb, nh, G, nr, nc) of the block (global indices)."""
        p, dev = self.p, self.dev
        G = p.group
        b = torch.arange(bs.start, bs.stop, device=dev).view(-1, 1, 1, 1, 1)
        h = (torch.arange(hs.start, hs.stop, device=dev).view(1, -1, 1, 1, 1) * G
             + torch.arange(G, device=dev).view(1, 1, -1, 1, 1))
        i = torch.arange(r0, r1, device=dev).view(1, 1, 1, -1, 1)
        j = torch.arange(c0, c1, device=dev).view(1, 1, 1, 1, -1)
        return dropout_keep_block(self.a.seed, self.a.offset, b, h, i, j, p.Hq, p.Sq, p.Sk, self.thr)


def _rows_f32(t: torch.Tensor, Hkv: int, bs: slice, hs: slice, r0: int, r1: int,
              mul: float | None = None) -> torch.Tensor:
    """Rows r0:r1 of t (B, Hq, Sq, X) for the chunk as f32 (nb * nh, G * nr, X)."""
    blk = t.unflatten(1, (Hkv, -1))[bs, hs, :, r0:r1]
    out = torch.empty(blk.shape, dtype=F32, device=t.device)
    out.copy_(blk)
    if mul is not None:
        out.mul_(mul)
    return out.view(-1, blk.shape[2] * blk.shape[3], blk.shape[4])


def _keys_f32(t, bs: slice, hs: slice, c0: int, c1: int) -> torch.Tensor:
    """Keys c0:c1 of K or V (tensor or KVQuant) for the chunk as f32 (nb * nh, nc, X)."""
    if isinstance(t, KVQuant):
        def sl(x):
            if x is None or x.numel() == 1:
                return x
            return x[bs, hs] if x.dim() == 2 else x[bs, hs, c0:c1]   # per head | grouped
        t = KVQuant(t.data[bs, hs, c0:c1], sl(t.scales), sl(t.zero_points), t.dtype,
                    t.group_size, t.layout).dequantize(F32)
    else:
        t = t[bs, hs, c0:c1].to(F32)
    return t.reshape(-1, t.shape[2], t.shape[3])


def _log2_safe(m: torch.Tensor) -> torch.Tensor:
    """An additive mask whose finite values survive the log2 domain: values below -FMAX / log2(e)
    (f32 / bf16 finfo.min, a common "masked" value) overflowed to -inf there, a row of them then
    fully masked (NaN) where torch gives the softmax of equal scores; they are raised to that
    bound (a copy, only when there are any). -inf stays."""
    if m.dtype == torch.bool or m.dtype == torch.float16 or m.numel() == 0:
        return m
    least = float(m.amin())             # one reduction over the mask's own storage
    if least >= MASK_FLOOR:             # the common case: nothing to raise
        return m
    if least > _NEG_INF:
        return m.clamp(min=MASK_FLOOR)
    low = (m < MASK_FLOOR) & (m > _NEG_INF)     # -inf present: finite values past the bound too?
    return m.masked_fill(low, MASK_FLOOR) if bool(low.any()) else m


# |lse| past this: its f32 ulp (2^-9 at 2^14) shows in exp2(s - lse), whose rows no longer sum to 1
_LOOSE_LSE = 2.0 ** 14


def _normalisers(ctx: _Ctx, pl: Plan, qb: torch.Tensor, k: torch.Tensor, lse2: torch.Tensor, dead: torch.Tensor,
                 bs: slice, hs: slice, r0: int, r1: int,
                 buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lse2, 1 / row sums or None) for the backward's P = exp2(s - lse2) / sum. Where |lse| is so
    large (a huge finite additive mask: -1e9) that the f32 lse lost its log-sum term (P rows summed
    to up to Sk) or is off by more than exp2's range (-1e30), those rows take their own max and
    sum, recomputed over the keys in one online pass; None when no row is such (the common case:
    no extra pass)."""
    loose = (lse2.abs() > _LOOSE_LSE * LOG2E) & ~dead
    if not bool(loose.any()):
        return lse2, None
    N, M = qb.shape[0], qb.shape[1]
    nb, nh, G, nr = bs.stop - bs.start, hs.stop - hs.start, ctx.p.group, r1 - r0
    m = torch.full_like(lse2, _NEG_INF)
    z = torch.zeros_like(lse2)
    for c0, c1, needs_vis in _blocks(ctx, pl, bs, r0, r1):
        s = _nt(qb, _keys_f32(k, bs, hs, c0, c1), out=_tile(buf, N, M, c1 - c0))
        ctx.mask_tile(s.view(nb, nh, G, nr, c1 - c0), bs, hs, r0, r1, c0, c1, needs_vis)
        mn = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isneginf(mn), torch.zeros_like(mn), mn)
        z = z * torch.exp2(m - safe) + s.sub_(safe).exp2_().sum(-1, keepdim=True)
        m = mn
    return torch.where(loose, m, lse2), torch.where(loose, 1.0 / z, torch.ones_like(z))


def _blocks(ctx: _Ctx, pl: Plan, bs: slice, r0: int, r1: int):
    """(c0, c1, needs_vis) of the key blocks rows r0:r1 of batches bs can see."""
    hi, vis_from = ctx.key_range(bs, r0, r1)
    for c0 in range(0, hi, pl.nc):
        c1 = min(hi, c0 + pl.nc)
        yield c0, c1, vis_from is not None and c1 > vis_from


# ---- forward --------------------------------------------------------------------------

_WHOLE_ROW_MAX = 2048      # bf16 forward: keys in one block (whole rows) up to this Sk
_WHOLE_TILE_MAX = 1 << 22  # bf16 backward: whole G*Sq x Sk tiles per head up to 16 MiB of f32 scores


def _native_bf16() -> bool:
    from ..conv.cpu_gemm import cpu_has_native_bf16  # lazy: attention need not import conv
    return cpu_has_native_bf16()


def _pv_native(problem: AttentionProblem, args: AttnArgs) -> bool:
    """P V through the native bf16 GEMM (oneDNN, f32 accumulation inside): bf16 V on a CPU
    with avx512_bf16, no dropout, and whole rows (one key block). The normalised P / l
    (f32, rounded to bf16 as torch's CPU flash kernel rounds P) times V sums over every
    key in one GEMM whose bf16 output is o itself: one rounding of o, as in torch."""
    return (isinstance(args.v, torch.Tensor) and args.v.dtype == args.q.dtype == torch.bfloat16
            and problem.dropout_p == 0 and problem.Sk <= _WHOLE_ROW_MAX and _native_bf16())



def _onednn() -> bool:
    from ..conv.cpu_gemm import onednn_linear_available  # lazy: attention need not import conv
    return onednn_linear_available()


def _nt(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
        acc: torch.Tensor | None = None) -> torch.Tensor:
    """acc + a @ w^T per batch entry (a (N, M, K), w (N, n, K), f32; acc None: no add).
    Given out (a preallocated score tile): the batched MKL GEMM into it. Else with one
    entry: oneDNN's f32 matmul, 10-15 % faster than MKL's sgemm on AMD CPUs (a transposed
    w is read in place, a transposed a is copied; the binary post-op fuses the add), whose
    output is always fresh: fresh multi-MiB score tiles page-fault on every block (up to
    30 % of the time at S=1024), so the tiles stay on MKL. Else batched MKL, in place."""
    if out is None and a.shape[0] == 1 and a.dtype == F32 and w.dtype == F32 and _onednn():
        lin = torch.ops.mkldnn._linear_pointwise
        r = lin(a[0], w[0], None, "none", [], "") if acc is None else lin.binary(a[0], acc[0], w[0], None, "add")
        return r.unsqueeze(0)
    if acc is not None:
        return acc.baddbmm_(a, w.transpose(1, 2))
    return torch.bmm(a, w.transpose(1, 2), out=out)


def _tile(buf: torch.Tensor, N: int, M: int, n: int) -> torch.Tensor:
    """A (N, M, n) view at the start of a preallocated flat f32 buffer (fresh large
    allocations cost page faults on every block)."""
    return buf[:N * M * n].view(N, M, n)


def cpu_forward(problem: AttentionProblem, args: AttnArgs, pl: Plan | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o in q's dtype (B, Hq, Sq, Dv), lse f32 (B, Hq, Sq)). Scores are kept in the log2
    domain (q pre-scaled by scale * log2(e), exp2: ~3x faster than exp in torch on CPU)."""
    pl = pl or plan(problem)
    ctx = _Ctx(problem, args)
    B, Hq, Hkv, G, Sq, Dv = problem.B, problem.Hq, problem.Hkv, problem.group, problem.Sq, problem.Dv
    pv_native = _pv_native(problem, args)
    dev = args.q.device
    o = _empty((B, Hq, Sq, Dv), args.q.dtype, dev)
    lse = _empty((B, Hq, Sq), F32, dev)
    o5, lse5 = o.unflatten(1, (Hkv, G)), lse.unflatten(1, (Hkv, G))
    drop = problem.dropout_p > 0
    rows_max = pl.nb * pl.nh * G * pl.nr
    sbuf = torch.empty(rows_max * pl.nc, dtype=F32, device=dev)
    pbuf = torch.empty(rows_max * pl.nc if pv_native else 0, dtype=torch.bfloat16, device=dev)
    for bs, hs in _chunks(problem, pl):
        nb, nh = bs.stop - bs.start, hs.stop - hs.start
        for r0 in range(0, Sq, pl.nr):
            r1 = min(Sq, r0 + pl.nr)
            nr = r1 - r0
            qb = _rows_f32(args.q, Hkv, bs, hs, r0, r1, ctx.scale * LOG2E)
            N, M = qb.shape[0], qb.shape[1]
            m = l = acc = direct = None
            blocks = list(_blocks(ctx, pl, bs, r0, r1))
            whole_row = pv_native and len(blocks) == 1
            for c0, c1, needs_vis in blocks:
                kb = _keys_f32(args.k, bs, hs, c0, c1)
                s = _nt(qb, kb, out=_tile(sbuf, N, M, c1 - c0))
                ctx.mask_tile(s.view(nb, nh, G, nr, c1 - c0), bs, hs, r0, r1, c0, c1, needs_vis)
                m_blk = s.amax(dim=-1, keepdim=True)
                m_new = m_blk if m is None else torch.maximum(m, m_blk)
                m_use = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                s.sub_(m_use).exp2_()
                rs = s.sum(dim=-1, keepdim=True)
                if drop:
                    s.mul_(ctx.keep_tile(bs, hs, r0, r1, c0, c1).view(N, M, -1))
                if whole_row:   # o = (P / l) V: one bf16 GEMM over all keys, its output is o
                    vn = args.v[bs, hs, c0:c1]
                    # dead rows (no visible key, l = 0) enter the GEMM as zeros, never NaN: on
                    # AMX CPUs the bf16 GEMM leaks a NaN row of P into its neighbour row
                    dead = rs == 0
                    pn = _tile(pbuf, N, M, c1 - c0).copy_(s.mul_(rs.masked_fill(dead, 1.0).reciprocal()))
                    direct = torch.bmm(pn, vn.reshape(-1, *vn.shape[2:]))   # (mul out=bf16: 2x slower)
                    if not problem.inf_as_zero and bool(dead.any()):
                        direct.masked_fill_(dead, math.nan)      # 0/0, as torch's softmax gives
                    l, m = rs, m_new
                    continue
                vb = _keys_f32(args.v, bs, hs, c0, c1)
                if acc is None:
                    l, acc = rs, _nt(s, vb.transpose(1, 2))
                else:
                    alpha = torch.exp2(m - m_use)
                    l = l.mul_(alpha).add_(rs)
                    acc = _nt(s, vb.transpose(1, 2), acc=acc.mul_(alpha))
                m = m_new
            if direct is not None:      # whole row in bf16: already normalised and rounded
                o5[bs, hs, :, r0:r1] = direct.view(nb, nh, G, nr, Dv)
                lse5[bs, hs, :, r0:r1] = (m + torch.log2(l)).mul_(LN2).view(nb, nh, G, nr)
                continue
            if acc is None:                                  # no visible key: dead rows
                m = torch.full((N, M, 1), _NEG_INF, dtype=F32, device=dev)
                l = torch.zeros((N, M, 1), dtype=F32, device=dev)
                acc = torch.zeros((N, M, Dv), dtype=F32, device=dev)
            lse_b = (m + torch.log2(l)).mul_(LN2)
            if problem.inf_as_zero:
                l = l.masked_fill(l == 0, 1.0)
            acc.div_(l)
            if drop:
                acc.mul_(dropout_scale(problem.dropout_p))
            o5[bs, hs, :, r0:r1] = acc.view(nb, nh, G, nr, Dv)
            lse5[bs, hs, :, r0:r1] = lse_b.view(nb, nh, G, nr)
    return o, lse


# ---- backward -------------------------------------------------------------------------

def _bwd_whole_ok(problem: AttentionProblem) -> bool:
    return (problem.dtype == torch.bfloat16 and problem.dropout_p == 0 and not problem.quantized
            and problem.group * problem.Sq * problem.Sk <= _WHOLE_TILE_MAX and _native_bf16())


def _rows_all(t: torch.Tensor, Hkv: int, bs: slice, hs: slice) -> torch.Tensor:
    """All rows of t (B, Hq, Sq, X) for the chunk in t's dtype as (nb * nh, G * Sq, X)."""
    blk = t.unflatten(1, (Hkv, -1))[bs, hs]
    return blk.reshape(-1, blk.shape[2] * blk.shape[3], blk.shape[4])


def _bmm_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched bf16 GEMM; a single batch goes through the 2D GEMM, which reads transposed
    operands in place (the batched one copies them)."""
    if a.shape[0] == 1:
        return torch.mm(a[0], b[0]).unsqueeze(0)
    return torch.bmm(a, b)


def _backward_whole(problem: AttentionProblem, args: AttnArgs, pl: Plan, ctx: _Ctx,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """bf16 backward on a native-bf16 CPU with whole (Sq x Sk) tiles per head: S and dP in
    f32 GEMMs (f32 operands), then dV = P^T dO, dQ = (scale dS) K, dK = (scale dS)^T Q each
    as ONE bf16 GEMM over all rows / keys (P and dS rounded to bf16 as torch's CPU flash
    backward does, f32 accumulation inside) whose output is the gradient itself: one
    rounding, no f32 accumulators across blocks."""
    q, k, v = args.q, args.k, args.v
    Hkv, G, Sq, Sk = problem.Hkv, problem.group, problem.Sq, problem.Sk
    D, Dv = problem.D, problem.Dv
    dev = q.device
    dq5 = dq.unflatten(1, (Hkv, G))
    lse4 = args.lse.unflatten(1, (Hkv, G))
    rows_max = pl.nb * pl.nh * G * Sq
    sbuf = torch.empty(rows_max * Sk, dtype=F32, device=dev)
    dpbuf = torch.empty(rows_max * Sk, dtype=F32, device=dev)
    hbuf = torch.empty(rows_max * Sk, dtype=torch.bfloat16, device=dev)
    for bs, hs in _chunks(problem, pl):
        nb, nh = bs.stop - bs.start, hs.stop - hs.start
        blocks = list(_blocks(ctx, pl, bs, 0, Sq))
        if not blocks:                                   # no row sees any key
            dq5[bs, hs] = 0
            dk[bs, hs] = 0
            dv[bs, hs] = 0
            continue
        (c0, c1, needs_vis), = blocks                    # nc = Sk: one block from key 0
        nc = c1 - c0
        qb = _rows_f32(q, Hkv, bs, hs, 0, Sq, ctx.scale * LOG2E)
        dob = _rows_f32(args.do, Hkv, bs, hs, 0, Sq)
        ob = _rows_f32(args.o, Hkv, bs, hs, 0, Sq)
        N, M = qb.shape[0], qb.shape[1]
        lse_b = lse4[bs, hs].reshape(N, M, 1).to(F32)
        dead = lse_b == _NEG_INF
        di = (dob * ob).sum(dim=-1, keepdim=True).masked_fill_(dead, 0.0)
        lse2 = (lse_b * LOG2E).masked_fill_(dead, float("inf"))
        lse2, rz = _normalisers(ctx, pl, qb, k, lse2, dead, bs, hs, 0, Sq, sbuf)
        s = _nt(qb, _keys_f32(k, bs, hs, c0, c1), out=_tile(sbuf, N, M, nc))
        ctx.mask_tile(s.view(nb, nh, G, Sq, nc), bs, hs, 0, Sq, c0, c1, needs_vis)
        p = s.sub_(lse2).exp2_()
        if rz is not None:
            p.mul_(rz)
        dp = _nt(dob, _keys_f32(v, bs, hs, c0, c1), out=_tile(dpbuf, N, M, nc))
        h = _tile(hbuf, N, M, nc).copy_(p)                                  # P in bf16
        dv[bs, hs, c0:c1] = _bmm_bf16(h.transpose(1, 2), _rows_all(args.do, Hkv, bs, hs)).view(nb, nh, nc, Dv)
        h.copy_(dp.sub_(di).mul_(p).mul_(ctx.scale))                         # scale dS in bf16
        kn = k[bs, hs, c0:c1]
        dq5[bs, hs] = _bmm_bf16(h, kn.reshape(-1, nc, D)).view(nb, nh, G, Sq, D)
        dk[bs, hs, c0:c1] = _bmm_bf16(h.transpose(1, 2), _rows_all(q, Hkv, bs, hs)).view(nb, nh, nc, D)
        if c1 < Sk:                                      # keys no row sees
            dk[bs, hs, c1:] = 0
            dv[bs, hs, c1:] = 0


def cpu_backward(problem: AttentionProblem, args: AttnArgs, pl: Plan | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's, k's, v's dtypes, from args.do, args.o and args.lse (scores in
    the log2 domain as in the forward)."""
    pl = pl or plan(problem)
    ctx = _Ctx(problem, args)
    q, k, v = args.q, args.k, args.v
    Hkv, G, Sq, Sk = problem.Hkv, problem.group, problem.Sq, problem.Sk
    D, Dv = problem.D, problem.Dv
    dev = q.device
    dq = _empty(tuple(q.shape), q.dtype, dev)
    dk = _empty(tuple(k.shape), k.dtype, dev)
    dv = _empty(tuple(v.shape), v.dtype, dev)
    if (pl.nr == Sq and pl.nc == Sk and _bwd_whole_ok(problem)
            and all(t.dtype == torch.bfloat16 for t in (q, k, v, args.do))):
        _backward_whole(problem, args, pl, ctx, dq, dk, dv)
        return dq, dk, dv
    dq5 = dq.unflatten(1, (Hkv, G))
    lse4 = args.lse.unflatten(1, (Hkv, G))
    drop = problem.dropout_p > 0
    kscale = dropout_scale(problem.dropout_p) if drop else 1.0
    rows_max = pl.nb * pl.nh * G * pl.nr
    sbuf = torch.empty(rows_max * pl.nc, dtype=F32, device=dev)
    dpbuf = torch.empty(rows_max * pl.nc, dtype=F32, device=dev)
    pdbuf = torch.empty(rows_max * pl.nc, dtype=F32, device=dev) if drop else None
    for bs, hs in _chunks(problem, pl):
        nb, nh = bs.stop - bs.start, hs.stop - hs.start
        dk_acc = torch.zeros((nb * nh, Sk, D), dtype=F32, device=dev)
        dv_acc = torch.zeros((nb * nh, Sk, Dv), dtype=F32, device=dev)
        dkb: dict[tuple[int, int], torch.Tensor] = {}
        dvb: dict[tuple[int, int], torch.Tensor] = {}
        for r0 in range(0, Sq, pl.nr):
            r1 = min(Sq, r0 + pl.nr)
            nr = r1 - r0
            qb = _rows_f32(q, Hkv, bs, hs, r0, r1, ctx.scale * LOG2E)
            dob = _rows_f32(args.do, Hkv, bs, hs, r0, r1)
            ob = _rows_f32(args.o, Hkv, bs, hs, r0, r1)
            N, M = qb.shape[0], qb.shape[1]
            lse_b = lse4[bs, hs, :, r0:r1].reshape(N, M, 1).to(F32)
            dead = lse_b == _NEG_INF
            di = (dob * ob).sum(dim=-1, keepdim=True).masked_fill_(dead, 0.0)
            lse2 = (lse_b * LOG2E).masked_fill_(dead, float("inf"))
            lse2, rz = _normalisers(ctx, pl, qb, k, lse2, dead, bs, hs, r0, r1, sbuf)
            dq_acc = torch.zeros((N, M, D), dtype=F32, device=dev)
            fresh = N == 1 and _onednn()        # _nt returns new tensors
            if fresh:
                dobt, qbt = dob.transpose(1, 2).contiguous(), qb.transpose(1, 2).contiguous()
            for c0, c1, needs_vis in _blocks(ctx, pl, bs, r0, r1):
                nc = c1 - c0
                kb = _keys_f32(k, bs, hs, c0, c1)
                vb = _keys_f32(v, bs, hs, c0, c1)
                s = _nt(qb, kb, out=_tile(sbuf, N, M, nc))
                ctx.mask_tile(s.view(nb, nh, G, nr, nc), bs, hs, r0, r1, c0, c1, needs_vis)
                p = s.sub_(lse2).exp2_()
                if rz is not None:
                    p.mul_(rz)
                dp = _nt(dob, vb, out=_tile(dpbuf, N, M, nc))
                if drop:
                    keep = ctx.keep_tile(bs, hs, r0, r1, c0, c1).view(N, M, -1)
                    pd = torch.mul(p, keep, out=_tile(pdbuf, N, M, nc)).mul_(kscale)
                    dp.mul_(keep).mul_(kscale)
                else:
                    pd = p
                ds = dp.sub_(di).mul_(p)
                dq_acc = _nt(ds, kb.transpose(1, 2), acc=dq_acc)
                if fresh:
                    # oneDNN: per key block accumulators of dV^T = dO^T P and dK^T = Q^T dS,
                    # the += fused as a post-op; the big tiles are the (transposed) weight
                    # operand, which oneDNN reads in place (an input operand gets copied)
                    dvb[c0, c1] = _nt(dobt, pd.transpose(1, 2), acc=dvb.get((c0, c1)))
                    dkb[c0, c1] = _nt(qbt, ds.transpose(1, 2), acc=dkb.get((c0, c1)))
                else:
                    dv_acc[:, c0:c1].baddbmm_(pd.transpose(1, 2), dob)
                    dk_acc[:, c0:c1].baddbmm_(ds.transpose(1, 2), qb)
            # qb carries scale * log2(e): dK = scale dS^T Q = dS^T qb / log2(e)
            dq5[bs, hs, :, r0:r1] = dq_acc.mul_(ctx.scale).view(nb, nh, G, nr, D)
        for (c0, c1), blk in dkb.items():     # (causal row blocks end key blocks at other c1)
            dk_acc[:, c0:c1] += blk.transpose(1, 2)
            dv_acc[:, c0:c1] += dvb[c0, c1].transpose(1, 2)
        dk[bs, hs] = dk_acc.mul_(LN2).view(nb, nh, Sk, D)
        dv[bs, hs] = dv_acc.view(nb, nh, Sk, Dv)
    return dq, dk, dv


# ---- solvers --------------------------------------------------------------------------

CPU_GFLOPS = 100.0


class _CpuFlashBase(Solver):
    family = "flash"
    primitive = "attention"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    uses_triton = False

    def estimate(self, problem: AttentionProblem) -> float:
        """FLOPs at ~100 GFLOP/s (f32 GEMMs on a few cores) plus a fixed call overhead."""
        return problem.flops() / (CPU_GFLOPS * 1e9) * 1e3 + 0.05


def _fp8_invoker(problem: AttentionProblem, pl: Plan):
    """FP8 q/k/v (nnprim.fp8): dequantised with their descales to f32 tensors, then the f32
    forward; o cast to problem.out_dtype. (The CPU has no FP8 arithmetic; not a fast path.)"""
    p32 = replace(problem, dtype=F32, out_dtype=None, descale=None)

    def invoke(args: AttnArgs):
        a = replace(args, q=fp8.dequantize(args.q, args.q_descale, F32), k=fp8.dequantize(args.k, args.k_descale, F32),
                    v=fp8.dequantize(args.v, args.v_descale, F32), q_descale=None, k_descale=None, v_descale=None)
        o, lse = cpu_forward(p32, a, pl)
        return o.to(problem.result_dtype), (lse if problem.return_lse else None)
    return invoke


@register
class CpuFlashForward(_CpuFlashBase):
    """Forward: invoker(args) -> (o in q's dtype (FP8: out_dtype), lse f32 or None unless
    return_lse)."""
    id = 115
    name = "cpu_flash_fwd"
    directions = frozenset({"fwd"})
    paged = True  # pages gathered into a contiguous cache first (nnprim.paged)
    dtypes = _CpuFlashBase.dtypes | {fp8.FP8}

    def prepare(self, problem: AttentionProblem):
        pl = plan(problem)
        if problem.fp8:
            return _fp8_invoker(problem, pl)

        def invoke(args: AttnArgs):
            o, lse = cpu_forward(problem, args, pl)
            return o, (lse if problem.return_lse else None)
        return gathering(invoke) if problem.page_size else invoke


@register
class CpuFlashBackward(_CpuFlashBase):
    """Backward: invoker(args) -> (dq, dk, dv) in q's, k's and v's dtypes."""
    id = 116
    name = "cpu_flash_bwd"
    directions = frozenset({"bwd"})

    def prepare(self, problem: AttentionProblem):
        pl = plan(problem)

        def invoke(args: AttnArgs):
            return cpu_backward(problem, args, pl)
        return invoke


__all__ = ["Plan", "plan", "cpu_forward", "cpu_backward", "CpuFlashForward", "CpuFlashBackward"]
