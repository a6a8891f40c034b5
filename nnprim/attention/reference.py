"""Reference attention (family "reference"): float64, from first principles.

Functions for tests of other solvers (all return float64 tensors on q's device):

    reference_forward(problem, args)  -> (o64 (B, Hq, Sq, Dv), lse64 (B, Hq, Sq))
    reference_backward(problem, args) -> (dq64, dk64, dv64)        uses args.do
    sdpa_reference(q, k, v, **options)              -> (o64, lse64)
    sdpa_backward_reference(do, q, k, v, **options) -> (dq64, dk64, dv64)
(options as nnprim.sdpa: attn_mask, causal, scale, invert_scale, dropout_p, seed,
offset, kv_lens, softmax_inf_as_zero; sdpa_reference also block_table.)

Solvers: id 100 `attn_reference_fwd` (invoker(args) -> (o, lse)) and id 101
`attn_reference_bwd` (invoker(args) -> (dq, dk, dv)); devices cpu and cuda; dtypes f32,
f16, bf16, f64; every option of the contract (GQA, both causal alignments, bool/additive
masks, scalar/tensor scale and its inverse, softmax_inf_as_zero, dropout, quantized K/V,
kv_lens, paged K/V (forward), return_lse), and FP8 (float8_e4m3fn) q/k/v, dequantised with
their descale factors (nnprim.fp8). Outputs have the inputs' dtypes (FP8: problem.out_dtype),
lse is f32.

Math (per batch entry b, query head h, K/V head h // (Hq / Hkv)):
    S   = scale * Q K^T + bias          bias: additive mask, -inf where masked (masking.py)
    lse = logsumexp_j S                 (-inf for a fully masked row)
    P   = exp(S - lse)                  (NaN for a fully masked row; 0 with softmax_inf_as_zero)
    Pd  = P * keep / (1 - p)            keep: nnprim.dropout mask of (seed, offset, b, h, i, j)
    O   = Pd V
Backward:
    dV  = Pd^T dO            dPd = dO V^T          dP = dPd * keep / (1 - p)
    Di  = rowsum(dO * O)     dS  = P * (dP - Di)
    dQ  = scale * dS K       dK  = scale * dS^T Q
dK, dV are summed over the query heads sharing a K/V head. `reference_backward` recomputes
O and P in float64 from q, k, v (args.o and args.lse are not needed), so it is the exact
gradient of the float64 forward; the solver (id 101) and `saved=True` instead take P from
the given lse and Di from the given O, as every backward solver does (sdpa_backward's
meaning: with the o and lse of a larger softmax, this K/V block's share of its gradient,
which ring attention sums over blocks). A fully masked row (o = NaN, or 0 with
softmax_inf_as_zero) contributes zero gradients: its dq row is 0 and it adds nothing to
dk/dv (the gradient of the softmax_inf_as_zero form; autograd of the NaN form would
spread NaN into dk/dv). Solvers' backward kernels must match this.

Work is chunked over (batch entry, block of K/V heads, block of query rows) so the
float64 score block stays near `_CHUNK_ELEMS` elements."""
from __future__ import annotations

import torch

from .. import fp8
from ..args import AttnArgs
from ..dropout import dropout_keep_mask, dropout_scale
from ..paged import gathered
from ..problems.attention import AttentionProblem
from ..quant import KVQuant
from ..search.solver import Solver, register
from .masking import problem_bias

_F64 = torch.float64
_CHUNK_ELEMS = 1 << 24


def _empty(shape, device) -> torch.Tensor:
    """Output allocation (tests swap in a NaN-filled allocator to catch unwritten elements)."""
    return torch.empty(shape, dtype=_F64, device=device)


def _as64(t, descale=None) -> torch.Tensor:
    if isinstance(t, KVQuant):
        return t.dequantize(_F64)
    return fp8.dequantize(t, descale, _F64)


def _chunks(problem: AttentionProblem):
    """Yield (b, kv-head slice, q-head slice, row slice) blocks of ~_CHUNK_ELEMS scores at
    most (one query row of one K/V head group at least)."""
    G, Sq, Sk = problem.group, problem.Sq, problem.Sk
    hc = max(1, min(problem.Hkv, _CHUNK_ELEMS // (G * Sq * Sk)))
    rc = Sq if hc > 1 else max(1, min(Sq, _CHUNK_ELEMS // (G * Sk)))
    for b in range(problem.B):
        for h0 in range(0, problem.Hkv, hc):
            h1 = min(problem.Hkv, h0 + hc)
            for r0 in range(0, Sq, rc):
                yield b, slice(h0, h1), slice(h0 * G, h1 * G), slice(r0, min(Sq, r0 + rc))


def _probs(problem, args, q, k, blk, scale, zero_dead, lse=None):
    """Scores of block `blk` -> (P (1, nq, nr, Sk), lse (1, nq, nr), dropout multiplier or
    None); P of a fully masked row is NaN, or 0 when `zero_dead`. A given `lse` (the block's
    rows of a saved one) normalises P instead of the scores' own logsumexp."""
    b, kvs, qs, rows = blk
    kb = k[b:b + 1, kvs].repeat_interleave(problem.group, dim=1)
    s = torch.matmul(q[b:b + 1, qs, rows], kb.transpose(-1, -2)) * scale
    if problem.causal or problem.mask != "none" or problem.has_kv_lens:
        s = s + problem_bias(problem, args, batches=slice(b, b + 1), heads=qs, rows=rows)
    # with a huge finite mask (-1e30) lse = max + log(sum) loses the log-sum to rounding, and
    # exp(s - lse) rows summed to Sk: the forward takes softmax itself; a given lse is used as it
    # is (context parallel's per-block gradients take the global lse: rows below 1) except rows
    # past 1, which only that rounding makes, and rows it under- or overflows whole (a saved f32
    # lse of ~-2e38 is off by its ulp, 1e31): those take softmax
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)                 # a fully masked row: NaN
    else:
        p = torch.exp(s - lse.unsqueeze(-1))
        tot = p.sum(dim=-1, keepdim=True)
        p = torch.where(tot > 1, p / tot, p)
        lost = ((tot == 0) | torch.isinf(tot)) & torch.isfinite(lse).unsqueeze(-1)
        if bool(lost.any()):
            p = torch.where(lost, torch.softmax(s, dim=-1), p)
    if zero_dead:
        p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros((), dtype=_F64, device=p.device), p)
    drop = None
    if problem.dropout_p > 0:
        keep = dropout_keep_mask(args.seed, args.offset, problem.B, problem.Hq, problem.Sq, problem.Sk,
                                 problem.dropout_p, q.device, batches=slice(b, b + 1), heads=qs, rows=rows)
        drop = keep.to(_F64) * dropout_scale(problem.dropout_p)
    return p, lse, drop


def reference_forward(problem: AttentionProblem, args: AttnArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (o (B, Hq, Sq, Dv), lse (B, Hq, Sq)) of the attention described by problem
    (page pools are gathered into the contiguous cache first)."""
    if args.block_table is not None:
        args = gathered(args)
    q, k, v = _as64(args.q, args.q_descale), _as64(args.k, args.k_descale), _as64(args.v, args.v_descale)
    scale = args.scale_value(problem.invert_scale)
    o = _empty((problem.B, problem.Hq, problem.Sq, problem.Dv), q.device)
    lse = _empty((problem.B, problem.Hq, problem.Sq), q.device)
    for blk in _chunks(problem):
        b, kvs, qs, rows = blk
        p, lse_b, drop = _probs(problem, args, q, k, blk, scale, problem.inf_as_zero)
        if drop is not None:
            p = p * drop
        o[b:b + 1, qs, rows] = torch.matmul(p, v[b:b + 1, kvs].repeat_interleave(problem.group, dim=1))
        lse[b:b + 1, qs, rows] = lse_b
    return o, lse


def reference_backward(problem: AttentionProblem, args: AttnArgs, *, saved: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (dq, dk, dv) for upstream gradient args.do (explicit formulas, module doc).

    saved=True takes P = exp(S - args.lse) and D = rowsum(dO * args.o) from the given
    forward outputs, as the flash solvers do, instead of recomputing them: with o and lse of
    a larger softmax (a block of ring / blockwise attention) the result is this K/V block's
    share of that softmax's gradient, and it equals the default for matching o and lse."""
    q, k, v = _as64(args.q), _as64(args.k), _as64(args.v)
    do = args.do.to(_F64)
    lse_all = args.lse.to(_F64) if saved else None
    o_all = args.o.to(_F64) if saved else None
    scale = args.scale_value(problem.invert_scale)
    G = problem.group
    dq, dk, dv = (_empty(t.shape, q.device) for t in (q, k, v))
    for blk in _chunks(problem):
        b, kvs, qs, rows = blk
        lse_b = None if lse_all is None else lse_all[b:b + 1, qs, rows]
        p, _, drop = _probs(problem, args, q, k, blk, scale, zero_dead=True, lse=lse_b)
        pd = p if drop is None else p * drop
        kb = k[b:b + 1, kvs].repeat_interleave(G, dim=1)
        vb = v[b:b + 1, kvs].repeat_interleave(G, dim=1)
        dob = do[b:b + 1, qs, rows]
        dpd = torch.matmul(dob, vb.transpose(-1, -2))
        dp = dpd if drop is None else dpd * drop
        if o_all is None:
            di = (dob * torch.matmul(pd, vb)).sum(dim=-1, keepdim=True)
        else:  # a dead row's saved o is NaN (0 with softmax_inf_as_zero): its D is 0
            di = (dob * o_all[b:b + 1, qs, rows]).sum(dim=-1, keepdim=True)
            di = torch.where(torch.isneginf(lse_b).unsqueeze(-1), torch.zeros((), dtype=_F64, device=di.device), di)
        ds = p * (dp - di)
        dq[b:b + 1, qs, rows] = torch.matmul(ds, kb) * scale
        nkv = kvs.stop - kvs.start
        dk_b = (torch.matmul(ds.transpose(-1, -2), q[b:b + 1, qs, rows]) * scale
                ).view(1, nkv, G, problem.Sk, problem.D).sum(dim=2)
        dv_b = torch.matmul(pd.transpose(-1, -2), dob).view(1, nkv, G, problem.Sk, problem.Dv).sum(dim=2)
        if rows.start == 0:          # first row block of this (b, kv heads): assign, then accumulate
            dk[b:b + 1, kvs], dv[b:b + 1, kvs] = dk_b, dv_b
        else:
            dk[b:b + 1, kvs] += dk_b
            dv[b:b + 1, kvs] += dv_b
    return dq, dk, dv


def _problem_and_args(q, k, v, do=None, *, attn_mask=None, causal=None, scale=None, invert_scale=False,
                      dropout_p=0.0, seed=0, offset=0, kv_lens=None, softmax_inf_as_zero=False,
                      return_lse=False, direction="fwd", block_table=None, q_descale=None, k_descale=None,
                      v_descale=None, out_dtype=None):
    problem = AttentionProblem.from_tensors(
        q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, invert_scale=invert_scale,
        dropout_p=dropout_p, kv_lens=kv_lens, softmax_inf_as_zero=softmax_inf_as_zero,
        return_lse=return_lse, direction=direction, seed=seed, offset=offset, block_table=block_table,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype)
    args = AttnArgs(q=q, k=k, v=v, attn_mask=attn_mask, scale=scale, seed=seed, offset=offset,
                    kv_lens=kv_lens, do=do, block_table=block_table, q_descale=q_descale, k_descale=k_descale,
                    v_descale=v_descale)
    return problem, args


def sdpa_reference(q, k, v, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (o, lse) for the options of nnprim.sdpa (return_lse is ignored)."""
    options.pop("return_lse", None)
    return reference_forward(*_problem_and_args(q, k, v, **options))


def sdpa_backward_reference(do, q, k, v, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (dq, dk, dv) for the options of nnprim.sdpa_backward."""
    options.pop("return_lse", None)
    return reference_backward(*_problem_and_args(q, k, v, do, direction="bwd", **options))


# ---- solvers ---------------------------------------------------------------------------

class _ReferenceBase(Solver):
    family = "reference"
    primitive = "attention"
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, fp8.FP8})

    def estimate(self, problem: AttentionProblem) -> float:
        """Roofline of float64 torch ops: GEMMs at ~50 GFLOP/s (CPU) / ~30 TFLOP/s (H200
        f64), plus ~12 passes over the float64 score matrix (mask, softmax, dropout)."""
        cpu = problem.device == "cpu"
        flops, bw = (50e9, 20e9) if cpu else (30e12, 3e12)
        score_bytes = 12 * 8.0 * problem.B * problem.Hq * problem.Sq * problem.Sk
        if problem.direction == "bwd":
            score_bytes *= 2
        return 1e3 * (problem.flops() / flops + score_bytes / bw)


@register
class AttentionReferenceFwd(_ReferenceBase):
    """Forward: invoker(args) -> (o in problem.result_dtype (q's dtype; FP8: out_dtype), lse f32
    or None unless return_lse)."""
    id = 100
    name = "attn_reference_fwd"
    directions = frozenset({"fwd"})
    paged = True

    def prepare(self, problem: AttentionProblem):
        def invoke(args: AttnArgs):
            o, lse = reference_forward(problem, args)
            return o.to(problem.result_dtype), (lse.to(torch.float32) if problem.return_lse else None)
        return invoke


@register
class AttentionReferenceBwd(_ReferenceBase):
    """Backward: invoker(args) -> (dq, dk, dv) in q's, k's and v's dtypes. Like every
    backward solver it uses the given args.o and args.lse (`saved=True`), so that
    sdpa_backward means the same thing whichever solver runs it (ring attention relies on
    it) and find's check of the other solvers holds for any o and lse."""
    id = 101
    name = "attn_reference_bwd"
    directions = frozenset({"bwd"})

    def prepare(self, problem: AttentionProblem):
        def invoke(args: AttnArgs):
            dq, dk, dv = reference_backward(problem, args, saved=args.o is not None and args.lse is not None)
            return dq.to(args.q.dtype), dk.to(args.k.dtype), dv.to(args.v.dtype)
        return invoke
