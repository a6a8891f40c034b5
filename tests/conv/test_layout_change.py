"""NCHW through the NHWC solvers (23/24/25) against the float64 reference, through
TRITON_INTERPRET=1, with NaN-poisoned outputs."""
import pytest
import torch

from nnprim.conv import layout_change
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search.solver import REGISTRY

from . import solver_check


def _run(p, a, out):
    return layout_change.LayoutChangePlan(p)(a, out)


RUN = {"fwd": _run, "bwd_data": _run, "bwd_weights": _run}
CASES = [
    ((2, 16, 6, 7), (24, 16, 3, 3), dict(padding=1)),
    ((2, 32, 5, 7), (16, 32, 1, 1), dict()),
    ((1, 8, 4, 5, 6), (16, 8, 3, 3, 3), dict(padding=1)),
]


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_bf16_vs_reference(direction, case):
    xs, ws, kw = case
    solver_check.check(RUN, ConvProblem.create(direction, xs, ws, dtype=torch.bfloat16, layout="nchw", **kw))


def test_fused_epilogue_nchw_tensors():
    p = ConvProblem.create("fwd", (2, 16, 5, 6), (16, 16, 3, 3), dtype=torch.bfloat16, layout="nchw", padding=1,
                           has_bias=True, post_ops=(("sum", 1.0), ("binary", "mul", (1, 16, 1, 1)),
                                                    ("eltwise", "relu", 0.0, 0.0)))
    resid = torch.randn(p.y_shape).to(torch.bfloat16)
    scale = torch.randn(1, 16, 1, 1).to(torch.bfloat16)
    solver_check.check(RUN, p, bias=torch.randn(16).to(torch.bfloat16),
                       post_ops=(Sum(resid), Binary("mul", scale), Eltwise("relu")))


def test_applicability():
    s = REGISTRY.get("nchw_via_nhwc_fwd")
    mk = lambda **kw: ConvProblem.create("fwd", (2, 16, 8, 8), (16, 16 // kw.get("groups", 1), 3, 3),  # noqa: E731
                                         device="cuda", padding=1, **{"dtype": torch.bfloat16, "layout": "nchw", **kw})
    assert s.is_applicable(mk())
    assert not s.is_applicable(mk(layout="nhwc"))
    assert not s.is_applicable(mk(dtype=torch.float32))      # no TMA kernel for f32
    assert not s.is_applicable(mk(groups=2))
    p = mk()
    assert s.workspace_size(p) >= sum(torch.Size(t).numel() for t in (p.x_shape, p.w_shape)) * 2


def test_to_layout_roundtrip():
    t = torch.randn(2, 3, 4, 5)
    assert torch.equal(to_layout(to_layout(t, "nhwc"), "nchw"), t)

