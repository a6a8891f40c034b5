"""im2col + GEMM convolution (solvers 30/31/32) against the float64 reference, through
TRITON_INTERPRET=1, with NaN-poisoned outputs."""
import pytest
import torch

from nnprim.conv import im2col_gemm as gm
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search.solver import REGISTRY

from . import solver_check

RUN = {"fwd": gm.conv_fwd, "bwd_data": gm.conv_bwd_data, "bwd_weights": gm.conv_bwd_weights}
CASES = [
    ((2, 5, 7, 9), (6, 5, 3, 3), dict(padding=1)),
    ((2, 8, 7, 9), (6, 4, 3, 2), dict(stride=(2, 1), padding=((1, 0), (0, 2)), dilation=(1, 2), groups=2)),
    ((3, 40, 6, 5), (20, 20, 1, 1), dict(groups=2)),                   # pointwise: no im2col (nhwc)
    ((2, 34, 6, 5), (20, 34, 1, 1), dict(stride=2)),
    ((2, 3, 5, 6, 7), (4, 3, 2, 3, 3), dict(padding=1, stride=(1, 2, 2))),
    ((2, 3, 17), (4, 3, 3), dict(padding=((2, 1),), stride=3)),
    ((2, 6, 6, 6), (6, 1, 3, 3), dict(padding=1, groups=6)),
]


def check(p, bias=None, post_ops=()):
    solver_check.check(RUN, p, bias, post_ops, seed=1)


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_f32_vs_reference(direction, case, layout):
    xs, ws, kw = case
    check(ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout=layout, **kw))


@pytest.mark.parametrize("direction", list(RUN))
def test_bf16(direction):
    check(ConvProblem.create(direction, (2, 6, 7, 5), (10, 3, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                             padding=1, groups=2))


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("images", [0, 2])
def test_row_blocks(monkeypatch, layout, direction, images):
    """A small workspace cap cuts the GEMM rows into slices of one image (images=0) or
    blocks of two whole images (NCHW backward weights then packs dy); results stay exact."""
    p = ConvProblem.create(direction, (5, 4, 6, 7), (6, 2, 3, 3), dtype=torch.float32, layout=layout,
                           padding=((1, 0), (2, 1)), stride=(1, 2), groups=2)
    rows = 6 * 7 if direction == "bwd_data" else p.out_size[0] * p.out_size[1]
    per_row = gm._per_row(p, gm.geom(p))
    monkeypatch.setattr(gm, "WORKSPACE_CAP", per_row * (rows * images if images else 10) + gm.fixed_bytes(p))
    blocks = gm.row_blocks(p)
    if images:
        assert [mc for _, mc in blocks] == [2 * rows, 2 * rows, rows]
    else:
        assert all(mc <= 10 for _, mc in blocks) and len(blocks) == 5 * -(-rows // 10)
    plan = gm.Plan(p)
    assert plan.pack_dy == (direction == "bwd_weights" and layout == "nchw" and images == 2)
    check(p)


def test_one_row_over_the_cap(monkeypatch):
    p = ConvProblem.create("fwd", (1, 4, 9), (4, 4, 3), dtype=torch.float32)
    monkeypatch.setattr(gm, "WORKSPACE_CAP", gm._per_row(p, gm.geom(p)) - 1)
    (reason,) = [r for r in REGISTRY.get("gemm_fwd").not_supported_reasons(p) if "cap" in r]
    assert "one GEMM row needs" in reason


def test_fused_epilogue_bf16_f32_out():
    g = torch.Generator().manual_seed(3)
    y = (2, 6, 6, 7)
    res = to_layout(torch.randn(y, generator=g), "nhwc").to(torch.bfloat16)
    chain = (Sum(res, 1.0), Binary("mul", torch.rand(1, 6, 1, 1, generator=g).to(torch.bfloat16) + 0.5),
             Eltwise("gelu_erf"))
    p = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.bfloat16, out_dtype=torch.float32,
                           layout="nhwc", padding=1, has_bias=True, post_ops=tuple(o.signature() for o in chain))
    check(p, bias=torch.randn(6, generator=g), post_ops=chain)


def test_solvers_registered():
    p = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.float32, layout="nhwc", padding=1)
    for sid, d in ((30, "fwd"), (31, "bwd_data"), (32, "bwd_weights")):
        s = REGISTRY.get(sid)
        q = p.with_direction(d)
        assert s.family == "gemm" and s.is_applicable(q)
        assert 0 < s.workspace_size(q) <= gm.WORKSPACE_CAP
        assert s.estimate(q) > 0
