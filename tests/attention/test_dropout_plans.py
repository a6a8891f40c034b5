"""Dropout counters are per-call values: a planned invoker keeps one plan per problem and
strides whatever the (seed, offset) of a call, and every call drops its own positions
(the flash forward, both flash backwards, decode, quantized decode; TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention.reference import reference_backward, reference_forward
from nnprim.launch import Launch, int_width
from nnprim.problems.attention import AttentionProblem
from nnprim.search.context import context

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

COUNTERS = [(5, 0), (2 ** 40 + 3, 2 ** 33 + 1), (7, 11), (5, 0)]   # i32 and i64 widths, then a repeat


DEVICE = "cpu"     # tests/gpu/test_dropout_plans_gpu.py runs these on CUDA at larger sizes
SK, D = 29, 16


def _inputs(Sq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, Sq, D, generator=g)
    k = torch.randn(2, 2, SK, D, generator=g)
    v = torch.randn(2, 2, SK, D, generator=g)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _plans(problem, solver: str) -> dict:
    inv = context(DEVICE).invoker_for(problem, nnprim.search.solver.REGISTRY.get(solver))
    inv = getattr(inv, "__wrapped__", inv)
    return inv.plans


@pytest.mark.parametrize("solver,Sq", [("flash_fwd", 23), ("decode_split_k", 2)])
def test_forward_each_call_its_own_mask_one_plan(solver, Sq):
    q, k, v = _inputs(Sq)
    p = AttentionProblem.from_tensors(q, k, v, dropout_p=0.3, return_lse=True)
    outs = []
    for seed, offset in COUNTERS:
        o, lse = nnprim.sdpa(q, k, v, dropout_p=0.3, seed=seed, offset=offset, solver=solver, return_lse=True)
        ro, _ = reference_forward(p, AttnArgs(q, k, v, seed=seed, offset=offset))
        assert torch.allclose(o.double(), ro.to(o.device), atol=1e-5, rtol=1e-5), (seed, offset)
        outs.append(o)
    assert not torch.allclose(outs[0], outs[1]) and torch.equal(outs[0], outs[3])
    # one plan per counter width (i32 / i64 seeds compile differently), not one per seed
    assert len(_plans(p, solver)) <= len({(int_width(s), int_width(o)) for s, o in COUNTERS})


@pytest.mark.parametrize("solver", ["flash_bwd", "flash_bwd_atomic"])
def test_backward_each_call_its_own_mask(solver):
    q, k, v = _inputs(23, seed=1)
    do = torch.randn(2, 4, 23, D, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    p = AttentionProblem.from_tensors(q, k, v, dropout_p=0.3, return_lse=True)
    for seed, offset in COUNTERS[:3]:
        args = AttnArgs(q, k, v, seed=seed, offset=offset)
        o, lse = reference_forward(p, args)
        o, lse = o.float(), lse.float()
        got = nnprim.sdpa_backward(do, q, k, v, o, lse, dropout_p=0.3, seed=seed, offset=offset, solver=solver)
        bp = AttentionProblem.from_tensors(q, k, v, dropout_p=0.3, direction="bwd")
        want = reference_backward(bp, AttnArgs(q, k, v, seed=seed, offset=offset, do=do, o=o, lse=lse), saved=True)
        for g, w in zip(got, want):
            assert torch.allclose(g.double(), w.to(g.device), atol=2e-5, rtol=1e-4), (solver, seed, offset)


def test_with_counters_shares_the_launch_state():
    def kernel():   # a stand-in: with_counters never calls it
        pass
    base = Launch(kernel, (1,), (1.0, 5, 0, 3), counters_at=1)
    base.compiled, base.full_tail = object(), (1.0, 5, 0, 3, "constexpr")
    assert base.with_counters(5, 0) is base
    new = base.with_counters(9, 4)
    assert new.tail == (1.0, 9, 4, 3) and new.full_tail == (1.0, 9, 4, 3, "constexpr")
    assert new.compiled is base.compiled and base.tail == (1.0, 5, 0, 3)
    assert Launch(kernel, (1,), (1.0, 5, 0, 3)).with_counters(9, 4).tail == (1.0, 5, 0, 3)   # no counters


def test_quantized_decode_each_call_its_own_mask_one_plan():
    q, k, v = _inputs(2, seed=3)
    kq, vq = nnprim.quantize_kv(k, "s8", 8), nnprim.quantize_kv(v, "s8", 8)
    p = AttentionProblem.from_tensors(q, kq, vq, dropout_p=0.3)
    solver = "decode_split_k_quant_grouped"
    for seed, offset in COUNTERS:
        o = nnprim.sdpa(q, kq, vq, dropout_p=0.3, seed=seed, offset=offset, solver=solver)
        ro, _ = reference_forward(p, AttnArgs(q, kq, vq, seed=seed, offset=offset))
        assert torch.allclose(o.double(), ro.to(o.device), atol=1e-4, rtol=1e-4), (seed, offset)
    assert len(_plans(p, solver)) <= 2
