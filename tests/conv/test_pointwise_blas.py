"""Pointwise cuBLAS solvers (33/34): the invoker on CPU tensors (torch.mm is the same
call there) against float64, NaN-poisoned outputs; applicability."""
import pytest
import torch

from nnprim.args import ConvArgs
from nnprim.conv import pointwise_blas as pb
from nnprim.post_ops import Eltwise
from nnprim.problems.conv import ConvProblem, empty_in_layout, to_layout
from nnprim.search.solver import REGISTRY

from . import solver_check

RUN = {d: (lambda p, args, out: pb.Plan(p)(args, out)) for d in ("fwd", "bwd_data", "bwd_weights")}
CASES = [
    ((3, 40, 7, 5), (24, 40, 1, 1), {}),
    ((2, 17, 9), (33, 17, 1), {}),                        # 1-D, odd channels
    ((2, 8, 3, 5, 7), (12, 8, 1, 1, 1), {}),              # 3-D
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_vs_reference(case, direction, dtype):
    xs, ws, kw = case
    p = ConvProblem.create(direction, xs, ws, dtype=dtype, layout="nhwc", **kw)
    solver_check.check(RUN, p)


def test_f32_out():
    g = torch.Generator().manual_seed(5)
    p = ConvProblem.create("fwd", (2, 16, 5, 6), (24, 16, 1, 1), dtype=torch.bfloat16, layout="nhwc",
                           has_bias=True, out_dtype=torch.float32)
    solver_check.check(RUN, p, bias=torch.randn(24, generator=g).bfloat16())
    solver_check.check(RUN, ConvProblem.create("bwd_weights", (2, 16, 5, 6), (24, 16, 1, 1), dtype=torch.float16,
                                               layout="nhwc", out_dtype=torch.float32))


def test_bias():
    p = ConvProblem.create("fwd", (2, 16, 5, 6), (24, 16, 1, 1), dtype=torch.bfloat16, layout="nhwc",
                           has_bias=True)
    solver_check.check(RUN, p, bias=torch.randn(24, generator=torch.Generator().manual_seed(2)).bfloat16())


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_strided_operands(direction):
    """An input that is not one row matrix (a channel slice) and an output that is not
    (NCHW strides) still give the right result: copy in, write through a temporary."""
    g = torch.Generator().manual_seed(4)
    p = ConvProblem.create(direction, (2, 16, 5, 6), (8, 16, 1, 1), dtype=torch.bfloat16, layout="nhwc")
    src_shape = p.x_shape if direction == "fwd" else p.y_shape
    wide = to_layout(torch.randn((src_shape[0], src_shape[1] + 3, *src_shape[2:]), generator=g), "nhwc")
    src = wide.bfloat16()[:, 1:1 + src_shape[1]]
    w = to_layout(torch.randn(p.w_shape, generator=g), "nhwc").bfloat16()
    out_shape = p.y_shape if direction == "fwd" else p.x_shape
    out = empty_in_layout(out_shape, "nchw", dtype=torch.bfloat16).fill_(float("nan"))
    args = ConvArgs(x=src, w=w) if direction == "fwd" else ConvArgs(dy=src, w=w)
    got = pb.Plan(p)(args, out)
    assert got is out
    s64, w64 = src.double(), w.double()
    exp = (torch.nn.functional.conv2d(s64, w64) if direction == "fwd"
           else torch.nn.functional.conv_transpose2d(s64, w64))
    assert ((got.double() - exp).norm() / exp.norm()).item() < 1e-2


@pytest.mark.parametrize("kw,why", [
    (dict(groups=2), "groups=2"),
    (dict(stride=2), "1x1, stride-1"),
    (dict(layout="nchw"), "1x1, stride-1"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(post_ops=(Eltwise("relu").signature(),)), "post-ops"),
])
def test_not_supported(kw, why):
    opts = dict(dtype=torch.bfloat16, layout="nhwc", device="cuda") | kw
    p = ConvProblem.create("fwd", (2, 16, 5, 6), (8, 16 // kw.get("groups", 1), 1, 1), **opts)
    reasons = REGISTRY.get("gemm_1x1_fwd").not_supported_reasons(p)
    assert any(why in r for r in reasons), reasons


def test_applicable_on_cuda_only():
    kw = dict(dtype=torch.bfloat16, layout="nhwc")
    assert REGISTRY.get(33).is_applicable(ConvProblem.create("fwd", (2, 16, 5, 6), (8, 16, 1, 1), device="cuda", **kw))
    assert not REGISTRY.get(34).is_applicable(
        ConvProblem.create("bwd_data", (2, 16, 5, 6), (8, 16, 1, 1), device="cpu", **kw))


def test_bwd_weights_strided():
    """dy a channel slice, x NCHW, dw NCHW-contiguous: views, copies, a direct (K, C) output."""
    g = torch.Generator().manual_seed(6)
    p = ConvProblem.create("bwd_weights", (2, 16, 5, 6), (8, 16, 1, 1), dtype=torch.bfloat16, layout="nhwc")
    dy = to_layout(torch.randn(2, 11, 5, 6, generator=g), "nhwc").bfloat16()[:, 2:10]
    x = torch.randn(p.x_shape, generator=g).bfloat16()
    dw = torch.full(p.w_shape, float("nan"), dtype=torch.bfloat16)
    got = pb.Plan(p)(ConvArgs(x=x, dy=dy), dw)
    exp = torch.einsum("nkhw,nchw->kc", dy.double(), x.double())[:, :, None, None]
    assert ((got.double() - exp).norm() / exp.norm()).item() < 1e-2
