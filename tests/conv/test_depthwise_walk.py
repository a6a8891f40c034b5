"""Depthwise solvers that walk the rows (46/47/48) against the float64 reference, through
TRITON_INTERPRET=1, with NaN-poisoned outputs: odd sizes, walks that end mid-row,
asymmetric padding, row dilation, 1-D, filters narrower than 3 x 3, tiles (forced) that
split rows and channels."""
import math

import pytest
import torch

from nnprim.conv import depthwise_walk as dw
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

from . import solver_check


def _runner(tile=None):
    def run(p, a, out):
        plan = dw.WalkWgradPlan(p, tile) if p.direction == "bwd_weights" else dw.WalkPlan(p, tile)
        return plan(a, out)
    return run


RUN = {"fwd": _runner(), "bwd_data": _runner(), "bwd_weights": _runner()}
SMALL = (4, 8, 5, 1, 3)    # BH 4, BC 8, walks of 5 columns, 3 in flight: several row, channel blocks and walks
RUN_SMALL = {d: _runner(SMALL) for d in RUN}
RUN_LOOK1 = {d: _runner((4, 16, 3, 2, 1)) for d in RUN}   # one column in flight, walks of 3
CASES = [
    ((2, 6, 6, 7), (6, 1, 3, 3), dict(padding=1, groups=6)),
    ((1, 17, 9, 8), (17, 1, 3, 3), dict(padding=((2, 1), (0, 2)), groups=17)),
    ((1, 24, 9, 11), (24, 1, 3, 2), dict(padding=(2, 1), dilation=(2, 1), groups=24)),
    ((2, 12, 5, 9), (12, 1, 2, 3), dict(padding=((1, 0), (1, 1)), groups=12)),
    ((2, 10, 7, 8), (10, 1, 1, 3), dict(padding=(0, 1), groups=10)),
    ((2, 10, 7, 8), (10, 1, 3, 1), dict(padding=(1, 0), groups=10)),
    ((2, 6, 15), (6, 1, 3), dict(padding=1, groups=6)),
    ((3, 9, 4, 4), (9, 1, 3, 3), dict(groups=9)),
    ((2, 20, 9, 11), (20, 1, 3, 3), dict(padding=((1, 0), (2, 1)), stride=2, groups=20)),
    ((1, 12, 10, 13), (12, 1, 3, 2), dict(padding=1, stride=(3, 2), dilation=(2, 1), groups=12)),
    ((2, 8, 7, 12), (8, 1, 1, 3), dict(padding=(0, 1), stride=(1, 2), groups=8)),
    ((2, 8, 8, 9), (8, 1, 2, 1), dict(stride=2, groups=8)),
    ((2, 6, 17), (6, 1, 3), dict(padding=1, stride=2, groups=6)),
]


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_f32_vs_reference(direction, case):
    xs, ws, kw = case
    p = ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout="nhwc", **kw)
    if dw.shape_reasons(p):
        pytest.skip("; ".join(dw.shape_reasons(p)))
    solver_check.check(RUN, p)
    solver_check.check(RUN_SMALL, p)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("case", CASES[:2], ids=solver_check.case_id)
def test_one_column_in_flight(direction, case):
    xs, ws, kw = case
    solver_check.check(RUN_LOOK1, ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout="nhwc", **kw))


@pytest.mark.parametrize("direction", list(RUN))
def test_bf16(direction):
    solver_check.check_depthwise_bf16(RUN, direction)


def test_fused_epilogue():
    solver_check.check_depthwise_fused(RUN_SMALL)


def test_applicability():
    s = REGISTRY.get("depthwise_walk_fwd")
    cuda = dict(dtype=torch.bfloat16, layout="nhwc", device="cuda")
    assert s.is_applicable(ConvProblem.create("fwd", (2, 8, 5, 5), (8, 1, 3, 3), groups=8, padding=1, **cuda))
    bad = {"stride": ConvProblem.create("fwd", (2, 8, 9, 9), (8, 1, 3, 3), groups=8, stride=3, **cuda),
           "filter": ConvProblem.create("fwd", (2, 8, 9, 9), (8, 1, 5, 5), groups=8, padding=2, **cuda),
           "dilation": ConvProblem.create("fwd", (2, 8, 9, 9), (8, 1, 3, 3), groups=8, dilation=(1, 2), **cuda),
           "groups": ConvProblem.create("fwd", (2, 8, 5, 5), (16, 1, 3, 3), groups=8, **cuda)}
    for name, p in bad.items():
        reasons = s.not_supported_reasons(p)
        assert any(name in r for r in reasons), (name, reasons)
    # stride 2 in the forward and backward weights (backward data at stride 2 is a transposed convolution)
    s2 = dict(groups=8, stride=2, padding=1, **cuda)
    assert s.is_applicable(ConvProblem.create("fwd", (2, 8, 9, 9), (8, 1, 3, 3), **s2))
    assert not REGISTRY.get("depthwise_walk_bwd_data").is_applicable(
        ConvProblem.create("bwd_data", (2, 8, 9, 9), (8, 1, 3, 3), **s2))


def test_bwd_weights_workspace_matches_plan():
    p = ConvProblem.create("bwd_weights", (4, 40, 30, 31), (40, 1, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                           padding=1, groups=40, device="cuda")
    plan = dw.WalkWgradPlan(p)
    assert REGISTRY.get("depthwise_walk_bwd_weights").workspace_size(p) == math.prod(plan.ws_shape) * 4
