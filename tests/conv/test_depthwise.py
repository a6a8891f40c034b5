"""Depthwise NHWC convolution (solvers 43/44/45) against the float64 reference, through
TRITON_INTERPRET=1, with NaN-poisoned outputs."""
import pytest
import torch

from nnprim.conv import depthwise
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

from . import solver_check


def _run(p, a, out):
    return (depthwise.DwBwdWeightsPlan(p) if p.direction == "bwd_weights" else depthwise.DwPlan(p))(a, out)


RUN = {"fwd": _run, "bwd_data": _run, "bwd_weights": _run}
CASES = [
    ((2, 6, 6, 7), (6, 1, 3, 3), dict(padding=1, groups=6)),
    ((2, 20, 9, 11), (20, 1, 3, 3), dict(padding=((1, 0), (2, 1)), stride=2, groups=20)),
    ((1, 24, 9, 7), (24, 1, 3, 2), dict(stride=(2, 1), dilation=(1, 2), padding=1, groups=24)),
    ((2, 17, 13, 12), (17, 1, 3, 3), dict(padding=2, dilation=2, groups=17)),
    ((2, 6, 15), (6, 1, 5), dict(padding=2, groups=6)),
    ((2, 6, 15), (6, 1, 9), dict(padding=4, stride=2, groups=6)),
]


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_f32_vs_reference(direction, case):
    xs, ws, kw = case
    solver_check.check(RUN, ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout="nhwc", **kw))


@pytest.mark.parametrize("direction", list(RUN))
def test_bf16(direction):
    solver_check.check_depthwise_bf16(RUN, direction)


def test_fused_epilogue():
    solver_check.check_depthwise_fused(RUN)


def test_applicability():
    s = REGISTRY.get("depthwise_fwd")
    ok = ConvProblem.create("fwd", (2, 8, 5, 5), (8, 1, 3, 3), dtype=torch.float32, layout="nhwc", groups=8,
                            device="cuda")
    assert s.is_applicable(ok)
    for bad in (ConvProblem.create("fwd", (2, 8, 5, 5), (16, 1, 3, 3), dtype=torch.float32, layout="nhwc",
                                   groups=8, device="cuda"),          # multiplier 2
                ConvProblem.create("fwd", (2, 8, 5, 5), (8, 1, 3, 3), dtype=torch.float32, layout="nchw",
                                   groups=8, device="cuda"),
                ConvProblem.create("fwd", (2, 8, 5, 5, 5), (8, 1, 3, 3, 3), dtype=torch.float32, layout="nhwc",
                                   groups=8, device="cuda")):
        assert not s.is_applicable(bad), bad


def test_large_filters_left_to_direct():
    p = ConvProblem.create("fwd", (2, 8, 9, 9), (8, 1, 5, 5), dtype=torch.float32, layout="nhwc", groups=8,
                           padding=2, device="cuda")
    assert not REGISTRY.get("depthwise_fwd").is_applicable(p)
    assert REGISTRY.get("direct_fwd").is_applicable(p)


def test_bwd_weights_workspace_matches_plan():
    import math
    p = ConvProblem.create("bwd_weights", (4, 40, 30, 31), (40, 1, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                           padding=1, groups=40, device="cuda")
    assert REGISTRY.get("depthwise_bwd_weights").workspace_size(p) == math.prod(depthwise.DwBwdWeightsPlan(p).ws_shape) * 4
