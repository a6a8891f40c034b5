"""Grouped per-tap batched GEMMs (solvers 17, 18) against the float64 reference: NaN-poisoned
workspace and output, odd sizes, strides, dilation, asymmetric padding, groups 2/3/8/C,
f32 and bf16, bias and post-ops, image chunks with a short last chunk."""

import pytest
import torch

from nnprim.args import ConvArgs
from nnprim.conv import cpu_group
from nnprim.conv.cpu_group import CpuGroupTapBwdData, CpuGroupTapFwd
from nnprim.conv.reference import reference
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout

from . import solver_check

SOLVERS = {"fwd": CpuGroupTapFwd, "bwd_data": CpuGroupTapBwdData}
SHAPES = {
    "g2_3x3_pad": ((3, 6, 9, 11), (4, 3, 3, 3), dict(padding=1, groups=2)),
    "g3_odd": ((2, 9, 7, 5), (6, 3, 3, 2), dict(padding=((1, 0), (2, 1)), groups=3)),
    "g8_dil": ((2, 16, 9, 8), (16, 2, 3, 3), dict(padding=2, dilation=2, groups=8)),
    "depthwise": ((2, 5, 7, 9), (10, 1, 3, 3), dict(padding=1, groups=5)),
    "g2_s2": ((2, 4, 9, 11), (6, 2, 3, 3), dict(stride=2, padding=1, groups=2)),
    "g2_s21_nopad": ((1, 4, 8, 7), (4, 2, 2, 3), dict(stride=(2, 1), groups=2)),
    "1d_g4": ((2, 8, 15), (8, 2, 3), dict(padding=((2, 1),), groups=4)),
    "3d_g2": ((2, 4, 5, 6, 7), (6, 2, 3, 1, 2), dict(groups=2, padding=1)),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    solver_check.poison_cpu(monkeypatch, cpu_group)


def run(direction, xs, ws, layout, dtype, bias=False, post_ops=(), **kw):
    p = ConvProblem.create(direction, xs, ws, dtype=dtype, layout=layout, has_bias=bias,
                           post_ops=tuple(o.signature() for o in post_ops), **kw)
    g = torch.Generator().manual_seed(0)
    rnd = lambda s: to_layout(torch.randn(s, generator=g).to(dtype), layout)  # noqa: E731
    args = ConvArgs(x=rnd(p.x_shape), w=rnd(p.w_shape), dy=rnd(p.y_shape),
                    bias=torch.randn(p.K, generator=g) if bias else None, post_ops=post_ops)
    s = SOLVERS[direction]()
    reasons = s.not_supported_reasons(p)
    if reasons:
        return p, None, None, reasons
    return p, s.prepare(p)(args), reference(p, args), []


def check(p, out, ref):
    solver_check.check_result(p, out, ref, TOL[p.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("direction", list(SOLVERS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_directions(shape, direction, layout, dtype):
    xs, ws, kw = SHAPES[shape]
    p, out, ref, reasons = run(direction, xs, ws, layout, dtype, **kw)
    if reasons:
        assert direction == "bwd_data", reasons     # strided, or padding past the span
        pytest.skip("; ".join(reasons))
    check(p, out, ref)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fwd_bias_post_ops(dtype, layout):
    xs, ws, kw = (3, 6, 9, 7), (9, 2, 3, 3), dict(padding=1, groups=3)
    g = torch.Generator().manual_seed(3)
    y_shape = (3, 9, 9, 7)
    ops = (Sum(torch.randn(y_shape, generator=g), scale=0.5), Eltwise("gelu_tanh"),
           Binary("mul", torch.randn(1, 9, 1, 1, generator=g)), Eltwise("relu", alpha=0.1))
    p, out, ref, _ = run("fwd", xs, ws, layout, dtype, bias=True, post_ops=ops, **kw)
    check(p, out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_image_chunks(dtype, monkeypatch):
    """Chunks of 2 images over 5 (a short last chunk): the staged halo stays zero across
    chunks."""
    monkeypatch.setattr(cpu_group, "_images_per_chunk", lambda p: 2)
    p, out, ref, _ = run("fwd", (5, 6, 7, 9), (6, 2, 3, 3), "nchw", dtype,
                         stride=(1, 2), padding=1, groups=3)
    check(p, out, ref)


def test_not_applicable():
    ungrouped = ConvProblem.create("fwd", (1, 8, 8, 8), (8, 8, 3, 3), dtype=torch.float32)
    assert CpuGroupTapFwd().not_supported_reasons(ungrouped)
    strided = ConvProblem.create("bwd_data", (1, 8, 8, 8), (8, 4, 3, 3), dtype=torch.float32,
                                  stride=2, padding=1, groups=2)
    assert CpuGroupTapBwdData().not_supported_reasons(strided)


def test_estimate_ranks_first_for_grouped_g8():
    """grouped_g8 (conv_cpu.json) f32 picks a grouped solver by heuristic (bf16 on
    native-bf16 CPUs keeps the im2col solvers' bf16 GEMM)."""
    from nnprim.search.ranking import heuristic_order
    for d in ("fwd", "bwd_data"):
        for dt in (torch.float32,):
            p = ConvProblem.create(d, (8, 128, 28, 28), (128, 16, 3, 3), dtype=dt, padding=1, groups=8)
            # the native direct kernel (83, 84) where it builds; else these
            assert heuristic_order(p)[0].id in (17, 18, 83, 84), (d, dt, [s.name for s in heuristic_order(p)[:3]])
