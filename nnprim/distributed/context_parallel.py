"""Context-parallel (ring) attention: the schedule, the LSE merge, forward and backward
rings, and the public `context_parallel_sdpa` (the math is in the package docstring,
nnprim/distributed/__init__.py)."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import sdpa, sdpa_backward
from ..errors import BadParameterError, NotSupportedError
from ..problems.attention import normalize_causal
from ..quant import KVQuant
from .comm import TAG_DKV, TAG_KV, P2PRing
from .sharding import LOAD_BALANCE, check_load_balance

F32 = torch.float32
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- the schedule ----------------------------------------------------------------------

@dataclass(frozen=True)
class RingPlan:
    """What every rank agreed on: its place in the ring and the options."""
    rank: int
    world: int
    causal: bool
    zigzag: bool
    scale: float | None


@dataclass(frozen=True)
class BlockWork:
    """What the local queries do with one rank's K/V block."""
    rows: slice    # local query rows that see the block
    keys: slice    # the block's keys they see
    causal: bool   # the diagonal block: causal (top-left) within it


def block_work(plan: RingPlan, src: int, sq: int, sk: int) -> BlockWork | None:
    """The work of the local queries (sq rows) on the K/V block of rank `src` (sk keys);
    None when no query sees any of its keys.

    Causal with zigzag (rank r holds chunks r and 2W-1-r, both halves of its shard):
    src == r is the diagonal: the shard's order is the sequence order, so a top-left causal
    mask on the whole shard is exact. src < r: both query chunks lie after src's early chunk
    and before its late one: all rows, the first half of the keys. src > r: the early query
    chunk lies before both of src's chunks and the late one after both: the second half of
    the rows, all keys. Off the diagonal each step is (2c x c) or (c x 2c) scores, the
    diagonal 2c x 2c causal: every step of every rank costs about 2c^2.
    Causal without balancing: full below the diagonal, nothing above it."""
    if not plan.causal:
        return BlockWork(slice(0, sq), slice(0, sk), False)
    if src == plan.rank:
        return BlockWork(slice(0, sq), slice(0, sk), True)
    if plan.zigzag:
        if src < plan.rank:
            return BlockWork(slice(0, sq), slice(0, sk // 2), False)
        return BlockWork(slice(sq // 2, sq), slice(0, sk), False)
    return BlockWork(slice(0, sq), slice(0, sk), False) if src < plan.rank else None


def _rows(t: torch.Tensor, s: slice) -> torch.Tensor:
    """t[:, :, s] (sequence dim 2), a view."""
    return t[:, :, s]


# ---- K/V travel as one flat buffer (one send per step) ---------------------------------

def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


# ---- forward ---------------------------------------------------------------------------

def _merge(o: torch.Tensor | None, lse: torch.Tensor | None, o_b: torch.Tensor, lse_b: torch.Tensor,
           rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (o_b, lse_b) into the f32 accumulators' `rows`, in place:
    o += sigmoid(lse_b - lse) (o_b - o),  lse = logaddexp(lse, lse_b)."""
    if o is None:  # the first block (the diagonal) covers every row
        return o_b.to(F32), lse_b
    oa, la = _rows(o, rows), _rows(lse, rows)
    oa.lerp_(o_b.to(F32), torch.sigmoid(lse_b - la).unsqueeze(-1))
    la.copy_(torch.logaddexp(la, lse_b))
    return o, lse


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, ring
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o in q's dtype, lse f32) of the local queries against the whole ring's K/V. Step i
    attends to rank (r - i)'s block while the next block is in flight."""
    sq, sk = q.shape[2], k.shape[2]
    kv = _pack(k, v)
    spare = torch.empty_like(kv) if plan.world > 1 else kv
    o = lse = None
    for step in range(plan.world):
        pending = ring.start(kv, spare, TAG_KV) if step < plan.world - 1 else None
        work = block_work(plan, (plan.rank - step) % plan.world, sq, sk)
        if work is not None:
            kb, vb = _unpack(kv, k.shape, v.shape)
            o_b, lse_b = sdpa(_rows(q, work.rows), _rows(kb, work.keys), _rows(vb, work.keys),
                              causal="top_left" if work.causal else None, scale=plan.scale, return_lse=True)
            o, lse = _merge(o, lse, o_b, lse_b, work.rows)
        if pending is not None:
            kv, spare = pending.wait(), kv
    return o.to(q.dtype), lse


# ---- backward --------------------------------------------------------------------------

def ring_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, plan: RingPlan, ring) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the local shards. The K/V blocks go round the ring again; each
    block's dK/dV partial sums (f32) travel with it, one step behind, and arrive back at
    their owner after the last rank has added its share."""
    sq, sk = q.shape[2], k.shape[2]
    kv = _pack(k, v)
    spare = torch.empty_like(kv) if plan.world > 1 else kv
    dq = torch.zeros(q.shape, dtype=F32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=F32, device=kv.device)
    dkv_spare = torch.empty_like(dkv) if plan.world > 1 else dkv
    dkv_pending = None
    for step in range(plan.world):
        pending = ring.start(kv, spare, TAG_KV) if step < plan.world - 1 else None
        work = block_work(plan, (plan.rank - step) % plan.world, sq, sk)
        grads = None
        if work is not None:
            kb, vb = _unpack(kv, k.shape, v.shape)
            r, c = work.rows, work.keys
            grads = sdpa_backward(_rows(do, r), _rows(q, r), _rows(kb, c), _rows(vb, c), _rows(o, r), _rows(lse, r),
                                  causal="top_left" if work.causal else None, scale=plan.scale)
            _rows(dq, r).add_(grads[0])
        if dkv_pending is not None:  # this block's sums from the ranks before (arrived during the compute)
            dkv, dkv_spare = dkv_pending.wait(), dkv
        if grads is not None:
            dk, dv = _unpack(dkv, k.shape, v.shape)
            _rows(dk, work.keys).add_(grads[1])
            _rows(dv, work.keys).add_(grads[2])
        if plan.world > 1:
            dkv_pending = ring.start(dkv, dkv_spare, TAG_DKV)
        if pending is not None:
            kv, spare = pending.wait(), kv
    if dkv_pending is not None:  # our own block, back from the last rank that used it
        dkv = dkv_pending.wait()
    dk, dv = _unpack(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, ring):
        o, lse = ring_forward(q, k, v, plan, ring)
        ctx.plan, ctx.ring = plan, ring
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        if dlse is not None:
            raise NotSupportedError("context_parallel_sdpa: a gradient through the returned lse is not "
                                    "supported (use lse.detach(), or nnprim.sdpa on one device)")
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            return None, None, None, None, None
        dq, dk, dv = ring_backward(do.contiguous(), q, k, v, o, lse, ctx.plan, ctx.ring)
        return dq, dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, ring
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) through the ring `ring` (P2PRing, or NullRing to time the compute alone);
    differentiable when q, k or v require grad."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _RingAttention.apply(q, k, v, plan, ring)
    return ring_forward(q, k, v, plan, ring)


# ---- validation: local checks, then every rank's view compared -------------------------

_FIELDS = ("q.shape[0] (B)", "q.shape[1] (Hq)", "k.shape[1] (Hkv)", "q.shape[2] (local Sq)",
           "k.shape[2] (local Sk)", "q.shape[3] (D)", "v.shape[3] (Dv)", "dtype", "device type", "causal",
           "load_balance", "scale", "requires_grad")


def _check_scale(scale) -> float | None:
    if scale is None:
        return None
    try:
        s = float(scale) if not isinstance(scale, bool) else math.nan
    except (TypeError, ValueError, RuntimeError):
        s = math.nan
    if not math.isfinite(s):
        raise BadParameterError(f"scale={scale!r} must be None or a finite real number")
    return s


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _backend_for(group, device: torch.device) -> str:
    """The group's backend serving `device` ("nccl", "gloo", ...)."""
    b = str(dist.get_backend(group))
    if ":" not in b:
        return b
    table = dict(part.split(":") for part in b.split(","))
    return table.get(device.type, b)


def _local_signature(q, k, v, causal, load_balance, scale, group) -> tuple[list[int], RingPlan]:
    """Checks what one rank can check alone; its signature (compared across ranks) and plan."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, KVQuant):
            raise NotSupportedError(f"{name}: quantized K/V (KVQuant) is not supported by context_parallel_sdpa")
        if not isinstance(t, torch.Tensor):
            raise BadParameterError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise BadParameterError(f"{name} must be 4-D (B, H, S, D) with the sequence on dim 2, got shape {tuple(t.shape)}")
    if q.dtype not in DTYPES:
        raise NotSupportedError(f"q.dtype={q.dtype}: context_parallel_sdpa supports {', '.join(map(str, DTYPES))}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise BadParameterError(f"q, k, v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise BadParameterError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    B, Hq, Sq, D = q.shape
    _, Hkv, Sk, _ = k.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise BadParameterError(f"k shape {tuple(k.shape)} must be (B={B}, Hkv, Sk, D={D}) for q shape {tuple(q.shape)}")
    if tuple(v.shape[:3]) != (B, Hkv, Sk):
        raise BadParameterError(f"v shape {tuple(v.shape)} must be (B, Hkv, Sk, Dv)=({B}, {Hkv}, {Sk}, Dv) as k")
    if Hkv == 0 or Hq % Hkv:
        raise BadParameterError(f"q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv} (GQA)")
    if min(Sq, Sk) < 1:
        raise BadParameterError(f"shards must not be empty: q.shape[2]={Sq}, k.shape[2]={Sk}")
    cz = normalize_causal(causal)
    lb = check_load_balance(load_balance)
    if cz is not None and Sq != Sk:
        raise BadParameterError(f"causal={causal!r} needs equal query and key sequences (total Sq == Sk, so top_left "
                                f"== bottom_right): got local q.shape[2]={Sq}, k.shape[2]={Sk}")
    if lb == "zigzag" and (Sq % 2 or Sk % 2):
        raise BadParameterError(f"load_balance='zigzag' needs an even shard length (two equal chunks per rank: the "
                                f"total divisible by 2*world_size), got q.shape[2]={Sq}, k.shape[2]={Sk}")
    backend = _backend_for(group, q.device)
    if backend == "nccl" and q.device.type != "cuda":
        raise BadParameterError(f"q is on {q.device} but the group's backend is nccl, which needs CUDA tensors")
    s = _check_scale(scale)
    bits = _f64_bits(D ** -0.5 if s is None else s)  # None and an explicit 1/sqrt(D) agree
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    sig = [B, Hq, Hkv, Sq, Sk, D, v.shape[3], DTYPES.index(q.dtype), int(q.device.type == "cuda"),
           int(cz is not None), LOAD_BALANCE.index(lb), bits, int(grad)]
    plan = RingPlan(dist.get_rank(group), dist.get_world_size(group), cz is not None, lb == "zigzag", s)
    return sig, plan


def _exchange_device(q, group) -> torch.device:
    if isinstance(q, torch.Tensor) and q.device.type == "cuda":
        return q.device
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe(field: int, value: int) -> str:
    if _FIELDS[field] == "dtype":
        return str(DTYPES[value])
    if _FIELDS[field] == "load_balance":
        return LOAD_BALANCE[value]
    if _FIELDS[field] == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    return str(value)


def make_plan(q, k, v, *, group=None, causal=None, load_balance: str = "zigzag", scale=None) -> RingPlan:
    """Validate the arguments on every rank of `group` (a collective: every rank calls it)
    and agree on a RingPlan. Any rank's bad argument raises on every rank (never a hang):
    that rank's own error there, a BadParameterError naming it elsewhere."""
    if not (dist.is_available() and dist.is_initialized()):
        raise BadParameterError("group: torch.distributed is not initialised; call torch.distributed.init_process_group first")
    err: Exception | None = None
    try:
        sig, plan = _local_signature(q, k, v, causal, load_balance, scale, group)
    except (BadParameterError, NotSupportedError) as e:
        err, sig = e, [0] * len(_FIELDS)
    mine = torch.tensor([int(err is None)] + sig, dtype=torch.int64, device=_exchange_device(q, group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    rows = [p.tolist() for p in parts]
    if err is not None:
        raise err
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    if bad:
        raise BadParameterError(f"context_parallel_sdpa: invalid arguments on rank(s) {bad} of the group "
                                "(see the error raised there)")
    for f, name in enumerate(_FIELDS):
        vals = [row[f + 1] for row in rows]
        if len(set(vals)) > 1:
            raise BadParameterError(
                f"{name} differs across ranks ({', '.join(f'rank {r}: {_describe(f, x)}' for r, x in enumerate(vals))}); "
                "every rank must pass equal-sized shards (the sequence cut by shard_sequence) and the same options")
    return plan


def context_parallel_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal=None,
                          load_balance: str = "zigzag", return_lse: bool = False, scale: float | None = None):
    """This rank's shard of softmax(scale q K^T + causal mask) V over the whole sequence.

    q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv): this rank's shards along dim 2,
    cut as `load_balance` says (nnprim.distributed.shard_sequence); every rank of `group`
    (default: the world) calls this with equal-sized shards and the same options. causal:
    None, True / "top_left" / "bottom_right" (equal totals: the same mask). Returns o in
    q's dtype, (o, lse) with lse f32 (B, Hq, Sq) when return_lse. Differentiable in q, k, v:
    the backward is collective too (every rank runs it)."""
    plan = make_plan(q, k, v, group=group, causal=causal, load_balance=load_balance, scale=scale)
    o, lse = ring_attention(q, k, v, plan, P2PRing(group, q.device))
    return (o, lse) if return_lse else o
