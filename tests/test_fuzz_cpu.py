"""The fuzz of issue 11 on the CPU (Triton kernels through the interpreter, tiny shapes):
the generator and the harness are tested here so that the GPU run (tests/gpu/test_fuzz.py,
benchmarks/fuzz_gpu.sh) only finds solver bugs. Covers: every CPU-scale case passes with
every applicable solver and the default call; the GPU suite is valid, deterministic and
sized for the H200; the sanitizer subset is small; sampled references equal the full
float64 result where they overlap; the harness reports wrong, NaN and failing solvers."""
from __future__ import annotations

import math
import random

import pytest
import torch

from nnprim.attention.reference import reference_backward, reference_forward
from nnprim.conv import reference as conv_ref
from nnprim.search import context
from nnprim.search.solver import REGISTRY, Solver
from nnprim.testing import fuzz

CPU_CASES = fuzz.suite("cpu")


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_cpu_case(case):
    r = fuzz.run_case(case, "cpu")
    assert not r.failures, r.report()
    ran = [o for o in r.outcomes if o.status == "ok"]
    assert any(o.solver == "default" for o in ran)
    assert len(ran) >= 3, r.report()       # the default call and at least two solvers


def test_gpu_suite_is_valid_deterministic_and_sized():
    a, b = fuzz.suite("gpu"), fuzz.suite("gpu")
    assert [(c.name, c.spec) for c in a] == [(c.name, c.spec) for c in b]
    assert len({c.name for c in a}) == len(a) >= 300
    for c in a:
        if c.kind == "conv":
            c.spec.problem("cuda")             # valid (raises otherwise)
        else:
            s = c.spec
            assert s.Hq % s.Hkv == 0 and max(s.D, s.Dv) <= 256 and (s.mask == "none") == (not s.mask_shape)
        limit = 32 * 2 ** 30 if "huge" in c.tags else 2 ** 30
        assert c.nbytes() <= limit, (c.name, c.nbytes())
    huge = [c for c in a if "huge" in c.tags]
    assert huge and all(c.sample for c in huge)
    names = {c.name for c in huge}
    assert {f"long-causal-dw-conv1d-{d}" for d in ("fwd", "bwd_data", "bwd_weights")} <= names
    kinds = {(c.kind, c.spec.direction) for c in a}
    assert kinds == {("conv", "fwd"), ("conv", "bwd_data"), ("conv", "bwd_weights"), ("attention", "fwd"),
                     ("attention", "bwd")}
    rand = [c.spec for c in a if "random" in c.tags]
    assert any(s.groups > 1 for s in rand if isinstance(s, fuzz.ConvSpec))
    assert any(isinstance(s, fuzz.AttnSpec) and s.k_quant for s in rand)
    assert any(isinstance(s, fuzz.AttnSpec) and s.Sk == 1 for s in rand)


def test_subsets_and_shards():
    everything = fuzz.suite("gpu")
    small, huge = fuzz.suite("gpu", "small"), fuzz.suite("gpu", "huge")
    assert len(small) + len(huge) == len(everything) and not {c.name for c in small} & {c.name for c in huge}
    san = fuzz.suite("gpu", "sanitizer")
    assert 15 <= len(san) <= 25
    assert all("huge" not in c.tags and c.nbytes() < 64 * 2 ** 20 for c in san)
    assert {(c.kind, c.spec.direction) for c in san} >= {("conv", "fwd"), ("conv", "bwd_data"),
                                                         ("conv", "bwd_weights"), ("attention", "fwd"),
                                                         ("attention", "bwd")}
    parts = [fuzz.shard(small, f"{i}/5") for i in range(5)]
    assert sorted(c.name for p in parts for c in p) == sorted(c.name for c in small)


def _full_reference(case):
    """The whole float64 result of a case, shaped like the public API's result."""
    s = case.spec
    if case.kind == "conv":
        t = fuzz.conv_tensors(s, s.problem("cpu"), "cpu", case.seed)
        p = fuzz.api_conv_problem(s, t)
        ref = {"fwd": lambda: conv_ref.conv_fwd_f64(p, t.x, t.w, t.bias, t.post_ops),
               "bwd_data": lambda: conv_ref.conv_bwd_data_f64(p, t.dy, t.w),
               "bwd_weights": lambda: conv_ref.conv_bwd_weights_f64(p, t.dy, t.x)}[s.direction]()
        return ref, fuzz.conv_checks(s, p, t, True, random.Random(case.seed))
    t = fuzz.attention_tensors(s, "cpu", case.seed)
    p = fuzz._attn_problem(s, t, t.q, t.k, t.v, t.mask, t.kv_lens, s.direction)
    checks = fuzz.attention_checks(s, p, t, True, random.Random(case.seed))
    args = fuzz._attn_args(t, t.q, t.k, t.v, t.mask, t.kv_lens, t.do, t.o, t.lse)
    if s.direction == "fwd":
        o, lse = reference_forward(p, args)
        return ((o, lse) if s.return_lse else o), checks
    return reference_backward(p, args), checks


@pytest.mark.parametrize("name", [c.name for c in CPU_CASES if c.sample])
def test_sampled_reference_equals_full(name):
    case = next(c for c in CPU_CASES if c.name == name)
    full, checks = _full_reference(case)
    assert len(checks) >= 2
    for chk in checks:
        got = chk.pick(full)
        assert got.shape == chk.ref.shape, chk.label
        assert torch.allclose(got, chk.ref, rtol=1e-9, atol=1e-9, equal_nan=True), chk.label


class _Broken(Solver):
    """A test-only conv solver: the reference's result spoiled in one way."""
    family = "reference"
    primitive = "conv"
    directions = frozenset({"fwd", "bwd_data", "bwd_weights"})
    devices = frozenset({"cpu"})

    def __init__(self, id_: int, mode: str) -> None:
        self.id, self.name, self.mode = id_, f"broken_{mode}", mode

    def prepare(self, problem):
        ref = REGISTRY.get("ConvReference").prepare(problem)

        def invoke(args):
            if self.mode == "raise":
                raise RuntimeError("kernel exploded")
            y = ref(args).clone()
            y.view(-1)[-1] = float("nan") if self.mode == "nan" else y.view(-1)[-1] + 10.0
            return y
        return invoke


def test_harness_reports_wrong_nan_and_errors():
    broken = [_Broken(1000 + i, m) for i, m in enumerate(("wrong", "nan", "raise"))]
    for s in broken:
        REGISTRY.add(s)
    try:
        case = fuzz.Case("probe", fuzz._conv("fwd", (2, 3, 6, 6), (4, 3, 3, 3), pad=1), seed=3)
        r = fuzz.run_case(case, "cpu")
    finally:
        for s in broken:
            REGISTRY.remove(s)
        context.reset()
    status = {o.solver: o.status for o in r.outcomes}
    assert status["broken_wrong"] == "wrong" and status["broken_nan"] == "nan" and status["broken_raise"] == "error"
    assert status["ConvReference"] == "ok" and status["default"] == "ok"
    assert {o.solver for o in r.failures} == {"broken_wrong", "broken_nan", "broken_raise"}
    assert "kernel exploded" in next(o.detail for o in r.outcomes if o.solver == "broken_raise")


def test_tolerance_and_rel_error():
    assert fuzz.tolerance("bf16", 10 ** 6) == 1e-2
    assert fuzz.tolerance("f32", 1024) == 1e-5 and fuzz.tolerance("f32", 4096) == pytest.approx(2e-5)
    ref = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64)
    assert fuzz.rel_error(torch.tensor([1.0, float("nan"), 2.0]), ref) == (0.0, "")
    err, why = fuzz.rel_error(torch.tensor([1.0, 1.0, 2.0]), ref)
    assert math.isinf(err) and "finite" in why
