"""nnprim.distributed: the ring schedule and sharding (in-process), and
context_parallel_sdpa in 2 and 4 gloo processes against single-process attention.

One process group per world size runs every case (spawning is the slow part); each rank
writes its outcomes to a JSON file and the tests read them. Forward o and lse and the
gradients are compared with the float64 reference on the full sequence (relative norm
error: f32 1e-5; f16/bf16 1e-2 and at most 2x single-process nnprim.sdpa's own error)."""
from __future__ import annotations

import json
import os
import tempfile
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nnprim
from nnprim.attention.reference import sdpa_backward_reference, sdpa_reference
from nnprim.distributed import (
    RingPlan,
    assemble_shards,
    block_work,
    context_parallel_sdpa,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)

WORLDS = (2, 4)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ---- the schedule (no processes) --------------------------------------------------------

def _scores(plan: RingPlan, src: int, seq: int, lb: str) -> set[tuple[int, int]]:
    """Global (query, key) pairs the block work of `plan.rank` on `src`'s block computes."""
    qpos = shard_positions(seq, plan.rank, plan.world, lb).tolist()
    kpos = shard_positions(seq, src, plan.world, lb).tolist()
    w = block_work(plan, src, len(qpos), len(kpos))
    if w is None:
        return set()
    rows, keys = range(len(qpos))[w.rows], range(len(kpos))[w.keys]
    return {(qpos[i], kpos[j]) for i in rows for j in keys if not w.causal or j - keys.start <= i - rows.start}


@pytest.mark.parametrize("lb", ["zigzag", "none"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_computes_each_visible_score_once(world, lb, causal):
    c = 3
    seq = c * (2 * world if lb == "zigzag" else world)
    seen: list[tuple[int, int]] = []
    per_step: dict[tuple[int, int], int] = {}
    for r in range(world):
        plan = RingPlan(r, world, causal, lb == "zigzag", None)
        for step in range(world):
            pairs = _scores(plan, (r - step) % world, seq, lb)
            seen += pairs
            per_step[r, step] = len(pairs)
    want = {(i, j) for i in range(seq) for j in range(seq) if not causal or j <= i}
    assert len(seen) == len(set(seen)) and set(seen) == want
    if causal and lb == "zigzag":  # balanced: every step of every rank does ~2c^2 scores
        assert all(2 * c * c <= n <= 2 * c * c + c for n in per_step.values()), per_step


def test_shard_assemble_roundtrip_and_positions():
    x = torch.randn(2, 36, 3, 5)  # (B, S, H, D): the sequence on dim 1
    for lb in ("zigzag", "none"):
        for world in (1, 2, 3):
            shards = [shard_sequence(x, 1, load_balance=lb, rank=r, world_size=world) for r in range(world)]
            assert torch.equal(assemble_shards(shards, 1, lb), x)
            for r, s in enumerate(shards):
                assert torch.equal(s, x[:, shard_positions(36, r, world, lb)])
    assert shard_positions(8, 1, 2).tolist() == [2, 3, 4, 5]      # chunks 1 and 2 of 4
    assert shard_positions(8, 0, 2).tolist() == [0, 1, 6, 7]      # chunks 0 and 3


@pytest.mark.parametrize("call, match", [
    (lambda: shard_sequence(torch.zeros(1, 1, 10, 4), 2, rank=0, world_size=3), r"x.shape\[2\]=10 .*multiple of 6"),
    (lambda: shard_sequence(torch.zeros(1, 1, 10, 4), 2, load_balance="none", rank=0, world_size=3), "multiple of 3"),
    (lambda: shard_sequence(torch.zeros(1, 1, 12, 4), 2, load_balance="stripe", rank=0, world_size=3), "load_balance"),
    (lambda: shard_sequence(torch.zeros(1, 1, 12, 4), 4, rank=0, world_size=3), "dim=4"),
    (lambda: shard_sequence(torch.zeros(1, 1, 12, 4), 2, rank=3, world_size=3), "rank=3"),
    (lambda: shard_positions(12, 0, 0), "world_size=0"),
    (lambda: shard_sequence(torch.zeros(1, 1, 12, 4)), "not initialised"),
    (lambda: context_parallel_sdpa(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4)),
     "not initialised"),
])
def test_bad_arguments_without_processes(call, match):
    with pytest.raises(nnprim.BadParameterError, match=match):
        call()


def test_sdpa_backward_per_block_with_global_lse_sums_to_the_gradient():
    """What the ring's backward relies on: every backward solver, given the o and lse of
    the whole softmax, returns one key block's share of the gradient."""
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(1, 4, 10, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 14, 8, generator=g) for _ in range(2))
    o, lse = nnprim.sdpa(q, k, v, return_lse=True)
    want = sdpa_backward_reference(do, q, k, v)
    problem = nnprim.AttentionProblem.from_tensors(q, k[:, :, :6], v[:, :, :6], direction="bwd")
    solvers = [s.name for s in nnprim.REGISTRY.for_problem(problem) if s.is_applicable(problem)]
    assert {"attn_reference_bwd", "cpu_flash_bwd"} <= set(solvers)
    for name in solvers:
        a = nnprim.sdpa_backward(do, q, k[:, :, :6], v[:, :, :6], o, lse, solver=name)
        b = nnprim.sdpa_backward(do, q, k[:, :, 6:], v[:, :, 6:], o, lse, solver=name)
        assert rel(a[0] + b[0], want[0]) < 1e-5, name
        assert rel(torch.cat([a[1], b[1]], 2), want[1]) < 1e-5, name
        assert rel(torch.cat([a[2], b[2]], 2), want[2]) < 1e-5, name


def test_world_of_one_is_plain_attention(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(6)
        q, k, v = (torch.randn(2, 4, 10, 8, generator=g).requires_grad_() for _ in range(3))
        o, lse = context_parallel_sdpa(q, k, v, causal=True, return_lse=True)
        o.sum().backward()
        want = [t.detach().clone() for t in (o, lse, q.grad, k.grad, v.grad)]
        for t in (q, k, v):
            t.grad = None
        o1, lse1 = nnprim.sdpa(q, k, v, causal=True, return_lse=True)
        o1.sum().backward()
        for a, b in zip(want, (o1, lse1, q.grad, k.grad, v.grad)):
            assert rel(a, b.detach()) < 1e-6
        _, lse = context_parallel_sdpa(q, k, v, causal=True, return_lse=True)
        with pytest.raises(nnprim.NotSupportedError, match="lse"):     # not silently dropped
            lse.sum().backward()
    finally:
        dist.destroy_process_group()


# ---- across processes -------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    causal: object
    lb: str
    B: int
    Hq: int
    Hkv: int
    c: int          # tokens per chunk (queries)
    D: int
    ck: int = 0     # tokens per chunk of keys (cross attention), 0: = c
    Dv: int = 0     # 0: = D
    scale: float | None = None


CASES = [
    Case("f32-causal-zigzag-gqa", "float32", True, "zigzag", 1, 4, 2, 9, 16),
    Case("f32-causal-none-gqa-b2", "float32", "top_left", "none", 2, 4, 2, 7, 16),
    Case("f32-full-zigzag-cross-mqa-dv-scale", "float32", None, "zigzag", 1, 4, 1, 5, 16, ck=7, Dv=24, scale=0.3),
    Case("f32-full-none", "float32", None, "none", 1, 4, 4, 11, 32),
    Case("bf16-causal-zigzag-b2", "bfloat16", "bottom_right", "zigzag", 2, 4, 2, 8, 32),
    Case("f16-causal-zigzag", "float16", True, "zigzag", 1, 4, 2, 6, 16),
    Case("bf16-full-none-gqa", "bfloat16", None, "none", 1, 4, 2, 9, 16),
]

ERROR_CASES = ["unequal-shards", "zigzag-odd", "one-rank-bad", "causal-cross", "float64", "load-balance",
               "gqa-heads", "scale-differs", "then-valid"]


def _check_case(case: Case, world: int) -> None:
    dt = getattr(torch, case.dtype)
    chunks = 2 * world if case.lb == "zigzag" else world
    Sq, Sk = case.c * chunks, (case.ck or case.c) * chunks
    Dv = case.Dv or case.D
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # the same on every rank
    q, do = torch.randn(case.B, case.Hq, Sq, case.D, generator=g), torch.randn(case.B, case.Hq, Sq, Dv, generator=g)
    k = torch.randn(case.B, case.Hkv, Sk, case.D, generator=g)
    v = torch.randn(case.B, case.Hkv, Sk, Dv, generator=g)
    q, k, v, do = (t.to(dt) for t in (q, k, v, do))
    opts = dict(causal=case.causal, scale=case.scale)
    o64, lse64 = sdpa_reference(q, k, v, **opts)
    grads64 = sdpa_backward_reference(do, q, k, v, **opts)

    def shard(t):
        return shard_sequence(t, 2, load_balance=case.lb)

    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    o, lse = context_parallel_sdpa(ql, kl, vl, load_balance=case.lb, return_lse=True, **opts)
    o.backward(shard(do))
    assert o.dtype == dt and o.shape == ql.shape[:3] + (Dv,) and lse.dtype == torch.float32
    with torch.no_grad():  # the no-grad path computes the same
        assert torch.equal(context_parallel_sdpa(ql, kl, vl, load_balance=case.lb, **opts), o)
    got = {"o": o.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    want = {"o": shard(o64), "lse": shard(lse64), "dq": shard(grads64[0]), "dk": shard(grads64[1]),
            "dv": shard(grads64[2])}
    single = {}
    if dt != torch.float32:  # the same dtype on one process: its error bounds ours
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        os_, lses = nnprim.sdpa(qs, ks, vs, return_lse=True, **opts)
        os_.backward(do)
        single = {n: rel(shard(t), want[n]) for n, t in
                  (("o", os_.detach()), ("lse", lses), ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad))}
    for n in got:
        err = rel(got[n], want[n])
        tol = 1e-5 if dt == torch.float32 else min(1e-2, 2 * single[n] + 1e-3)
        assert err <= tol, f"{n}: relative error {err:.3g} > {tol:.3g}"
    x = torch.randn(3, Sq, 2, generator=g)
    assert torch.equal(unshard_sequence(shard_sequence(x, 1, load_balance=case.lb), 1, load_balance=case.lb), x)


def _raises(exc, match: str, fn) -> None:
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{type(e).__name__}: {e!s} does not mention {match!r}"
        return
    raise AssertionError(f"no {exc.__name__} raised (expected one mentioning {match!r})")


def _check_error(name: str, rank: int, world: int) -> None:
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype)
    q, kv = t(1, 4, 6, 8), t(1, 2, 6, 8)
    cp, bad = context_parallel_sdpa, nnprim.BadParameterError
    if name == "unequal-shards":
        s = 4 if rank == 0 else 6
        _raises(bad, "q.shape[2] (local Sq) differs across ranks (rank 0: 4, rank 1: 6",
                lambda: cp(t(1, 4, s, 8), t(1, 2, s, 8), t(1, 2, s, 8)))
    elif name == "zigzag-odd":
        _raises(bad, "load_balance='zigzag' needs an even shard length", lambda: cp(t(1, 4, 5, 8), t(1, 2, 5, 8), t(1, 2, 5, 8)))
    elif name == "one-rank-bad":
        qq = t(4, 6, 8) if rank == 1 else q
        _raises(bad, "q must be 4-D" if rank == 1 else "invalid arguments on rank(s) [1]", lambda: cp(qq, kv, kv))
    elif name == "causal-cross":
        _raises(bad, "causal=True needs equal query and key", lambda: cp(q, t(1, 2, 8, 8), t(1, 2, 8, 8), causal=True))
    elif name == "float64":
        _raises(nnprim.NotSupportedError, "q.dtype=torch.float64",
                lambda: cp(*(x.double() for x in (q, kv, kv))))
    elif name == "load-balance":
        _raises(bad, "load_balance='stripe'", lambda: cp(q, kv, kv, load_balance="stripe"))
    elif name == "gqa-heads":
        _raises(bad, "Hq=4 must be a multiple of k/v heads Hkv=3", lambda: cp(q, t(1, 3, 6, 8), t(1, 3, 6, 8)))
    elif name == "scale-differs":
        _raises(bad, "scale differs across ranks", lambda: cp(q, kv, kv, scale=0.5 + rank))
    elif name == "then-valid":  # the group still works after the errors
        o = cp(q, kv, kv, causal=True)
        assert o.shape == q.shape and torch.isfinite(o).all()


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = {}
    jobs = [(c.name, lambda c=c: _check_case(c, world)) for c in CASES]
    jobs += [(n, lambda n=n: _check_error(n, rank, world)) for n in ERROR_CASES]
    try:
        for name, job in jobs:
            try:
                job()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc(limit=4)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, list[str]]]:
    """{world: {case: [each rank's outcome]}}: every case run in one group per world size."""
    out = {}
    for world in WORLDS:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(world, os.path.join(d, "store"), d), nprocs=world, join=True)
            per_rank = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
        out[world] = {name: [p.get(name, "not run") for p in per_rank] for name in per_rank[0]}
    return out


def _assert_ok(outcomes, world: int, name: str) -> None:
    res = outcomes[world][name]
    failed = [f"rank {r}: {m}" for r, m in enumerate(res) if m != "ok"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_context_parallel_matches_single_process(outcomes, world, case):
    _assert_ok(outcomes, world, case.name)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ERROR_CASES)
def test_context_parallel_errors_on_every_rank(outcomes, world, name):
    _assert_ok(outcomes, world, name)
