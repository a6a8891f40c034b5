"""Direct grouped/depthwise convolution (solvers 40/41/42) against the float64
reference, through TRITON_INTERPRET=1, with NaN-poisoned outputs."""
import pytest
import torch

from nnprim.args import ConvArgs
from nnprim.conv import direct
from nnprim.conv import reference as ref
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, empty_in_layout, to_layout
from nnprim.search.solver import REGISTRY

from . import solver_check

RUN = {"fwd": direct.conv_fwd, "bwd_data": direct.conv_bwd_data, "bwd_weights": direct.conv_bwd_weights}
CASES = [
    ((2, 6, 6, 7), (6, 1, 3, 3), dict(padding=1, groups=6)),                        # depthwise
    ((2, 6, 6, 7), (12, 1, 3, 3), dict(padding=((1, 0), (2, 1)), stride=2, groups=6)),  # multiplier 2
    ((2, 32, 5, 7), (32, 4, 3, 3), dict(padding=1, groups=8)),                     # tensor-core path
    ((2, 24, 9, 7), (16, 3, 3, 2), dict(stride=(2, 1), dilation=(1, 2), padding=1, groups=8)),
    ((2, 6, 15), (6, 1, 5), dict(padding=2, groups=6)),
    ((1, 8, 4, 5, 6), (8, 2, 3, 3, 3), dict(padding=1, groups=4)),
]


def check(p, bias=None, post_ops=()):
    solver_check.check(RUN, p, bias, post_ops, seed=2)


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_f32_vs_reference(direction, case, layout):
    xs, ws, kw = case
    check(ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout=layout, **kw))


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half(direction, dtype):
    check(ConvProblem.create(direction, (2, 32, 5, 7), (32, 4, 3, 3), dtype=dtype, layout="nhwc",
                             padding=1, groups=8))
    check(ConvProblem.create(direction, (2, 6, 6, 7), (6, 1, 3, 3), dtype=dtype, layout="nhwc",
                             padding=1, groups=6))


@pytest.mark.parametrize("case", CASES[:4], ids=solver_check.case_id)
def test_bwd_weights_tap_grid(case):
    xs, ws, kw = case
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=torch.float32, layout="nhwc", **kw)
    saved = RUN["bwd_weights"]
    RUN["bwd_weights"] = lambda p, a, out: direct.conv_bwd_weights(p, a, out=out, tap_grid=True)
    try:
        check(p)
    finally:
        RUN["bwd_weights"] = saved


@pytest.mark.parametrize("groups", [6, 8])
def test_fused_epilogue(groups):
    g = torch.Generator().manual_seed(4)
    C = 6 if groups == 6 else 32
    y = (2, C, 6, 7)
    chain = (Sum(to_layout(torch.randn(y, generator=g), "nhwc"), 0.5),
             Binary("add", torch.randn(1, C, 1, 1, generator=g)), Eltwise("relu", 0.1))
    p = ConvProblem.create("fwd", (2, C, 6, 7), (C, C // groups, 3, 3), dtype=torch.float32, layout="nhwc",
                           padding=1, groups=groups, has_bias=True, post_ops=tuple(o.signature() for o in chain))
    check(p, bias=torch.randn(C, generator=g), post_ops=chain)


def test_applicability():
    p = ConvProblem.create("fwd", (2, 6, 6, 7), (6, 1, 3, 3), dtype=torch.float32, layout="nhwc",
                           padding=1, groups=6)
    for sid, d in ((40, "fwd"), (41, "bwd_data"), (42, "bwd_weights")):
        s = REGISTRY.get(sid)
        q = p.with_direction(d)
        assert s.family == "direct" and s.is_applicable(q) and s.estimate(q) > 0
    dense = ConvProblem.create("fwd", (2, 6, 6, 7), (6, 6, 3, 3), dtype=torch.float32)
    assert any("groups" in r for r in REGISTRY.get(40).not_supported_reasons(dense))
    wide = ConvProblem.create("fwd", (1, 64, 4, 4), (64, 32, 3, 3), dtype=torch.float32, groups=2)
    assert any("<= 16" in r for r in REGISTRY.get(40).not_supported_reasons(wide))


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("bw", [4, 16])
def test_spatial_tiles_tails(direction, bw):
    """2-D pixel tiles (BP/BW rows x BW columns) over 15x31 images leave row and column tails."""
    from nnprim.conv import configs
    p = ConvProblem.create(direction, (2, 16, 15, 31), (16, 1, 3, 3), dtype=torch.float32, layout="nhwc",
                           padding=1, groups=16)
    tile = configs.DirectTile(64, 16, 4, bw)
    g = torch.Generator().manual_seed(4)
    mk = lambda s: to_layout(torch.randn(s, generator=g), p.layout)  # noqa: E731
    x, w, dy = mk(p.x_shape), mk(p.w_shape), mk(p.y_shape)
    out = empty_in_layout(p.x_shape if direction == "bwd_data" else p.y_shape, p.layout,
                          dtype=p.out_dtype).fill_(float("nan"))
    out = RUN[direction](p, ConvArgs(x=x, w=w, dy=dy), tile=tile, out=out)
    exp = ref.conv_fwd_f64(p, x, w) if direction == "fwd" else ref.conv_bwd_data_f64(p, dy, w)
    assert not torch.isnan(out).any()
    assert ((out.double() - exp).norm() / exp.norm()).item() < 1e-5


@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_bwd_weights_spatial_tiles(case):
    """The 2-D-tile backward-weights kernel (BwdWeightsTilePlan) on every case shape."""
    from nnprim.conv import configs
    xs, ws, kw = case
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=torch.float32, layout="nhwc", **kw)
    g = torch.Generator().manual_seed(6)
    mk = lambda s: to_layout(torch.randn(s, generator=g), p.layout)  # noqa: E731
    x, dy = mk(p.x_shape), mk(p.y_shape)
    out = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype).fill_(float("nan"))
    plan = direct.BwdWeightsTilePlan(p, configs.DirectTile(64, 16, 4, 8))
    out = plan(ConvArgs(x=x, dy=dy), out)
    exp = ref.conv_bwd_weights_f64(p, dy, x)
    assert not torch.isnan(out).any()
    assert ((out.double() - exp).norm() / exp.norm()).item() < 1e-5
