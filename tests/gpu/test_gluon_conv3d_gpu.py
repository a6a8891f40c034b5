"""Solvers 27/28/29 (Gluon implicit GEMM) on 3-D NDHWC convolutions, on the GPU: the output
planes are the kernels' images and each depth tap reads its x plane (`gluon_conv._x_plane`;
a tap in the depth padding loads a box wholly outside x, which TMA fills with zeros).
Random inputs, NaN-poisoned outputs, against the float64 reference with an error bound
relative to torch's same-dtype conv3d (gpu_helpers.assert_close): depth padding (symmetric
and not), depth stride 2 and 3, depth dilation 2, stride 2 over rows and columns, odd sizes,
bias and a post-op chain, the split and stream-K backward weights, bit-identical reruns, the
public API.

A TMA load that never completes its transaction would hang: the smoke test runs small 3-D
problems in a subprocess with a timeout, and every other test is skipped when it fails."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import GLUON_MODULE_MARKS, assert_close, smoke_fixture, smoke_gate, smoke_test

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv.reference import _pad_spec, conv_bwd_data_f64, conv_bwd_weights_f64, conv_fwd_f64
from nnprim.post_ops import Eltwise, Sum, apply_post_ops
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

DEV = "cuda"
CL3 = torch.channels_last_3d
pytestmark = GLUON_MODULE_MARKS

SMOKE = """
import torch
from nnprim.args import ConvArgs
from nnprim.conv import gluon_conv, gluon_conv_wgrad
from nnprim.problems.conv import ConvProblem

cl = torch.channels_last_3d
x = torch.randn(2, 64, 5, 9, 11, device="cuda").to(torch.bfloat16).to(memory_format=cl)
w = torch.randn(64, 64, 3, 3, 3, device="cuda").to(torch.bfloat16).to(memory_format=cl)
for d in ("fwd", "bwd_data", "bwd_weights"):
    p = ConvProblem.create(d, x.shape, w.shape, dtype=torch.bfloat16, layout="nhwc", device="cuda", padding=1)
    dy = torch.randn(p.y_shape, device="cuda").to(torch.bfloat16).to(memory_format=cl)
    if d == "fwd":
        got = gluon_conv.GluonConvPlan(p)(ConvArgs(x=x, w=w))
        ref = torch.nn.functional.conv3d(x.float(), w.float(), padding=1)
    elif d == "bwd_data":
        got = gluon_conv.GluonConvPlan(p)(ConvArgs(dy=dy, w=w))
        ref = torch.nn.grad.conv3d_input(x.shape, w.float(), dy.float(), padding=1)
    else:
        got = gluon_conv_wgrad.GluonWgradPlan(p)(ConvArgs(dy=dy, x=x))
        ref = torch.nn.grad.conv3d_weight(x.float(), w.shape, dy.float(), padding=1)
    torch.cuda.synchronize()
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"wrong result: 3-D {d} rel err {err}"
print("SMOKE-OK")
"""
smoke_failure = smoke_gate(SMOKE, 180, hang="a TMA box wholly outside x never completed?")


smoked = smoke_fixture(smoke_failure)
test_smoke_in_subprocess = smoke_test(smoke_failure)


def case(x_shape, w_shape, dtype=torch.bfloat16, seed=0, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*x_shape, generator=g, device=DEV).to(dtype).to(memory_format=CL3)
    fan_in = w_shape[1] * w_shape[2] * w_shape[3] * w_shape[4]
    w = (torch.randn(*w_shape, generator=g, device=DEV) / fan_in ** 0.5).to(dtype).to(memory_format=CL3)
    b = torch.randn(w_shape[0], generator=g, device=DEV).to(dtype) if bias else None
    return x, w, b


def make(direction, x, w, **kw) -> ConvProblem:
    return ConvProblem.create(direction, x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=DEV, **kw)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV).to(memory_format=CL3)


# (x, w, padding, dilation, stride): c3d's kind, depth padding/stride/dilation, tails
SHAPES = [
    ((2, 64, 8, 14, 14), (128, 64, 3, 3, 3), 1, 1, 1),               # c3d_3x3x3's kind
    ((3, 32, 5, 9, 11), (48, 32, 3, 3, 3), 1, 1, 1),                 # odd sizes, C/K tails in tiles
    ((2, 64, 7, 10, 10), (64, 64, 3, 3, 3), 1, 1, (2, 1, 1)),        # depth stride 2
    ((2, 64, 9, 11, 12), (64, 64, 3, 3, 3), 1, 1, 2),                # stride 2 everywhere
    ((2, 32, 9, 8, 8), (64, 32, 3, 1, 1), (2, 0, 0), (2, 1, 1), 1),  # depth-only filter, dilation 2
    ((1, 64, 6, 7, 9), (64, 64, 2, 3, 3), ((1, 0), (1, 1), (1, 1)), 1, (3, 1, 1)),   # asymmetric, stride 3
    ((2, 128, 4, 7, 7), (128, 128, 1, 1, 1), 0, 1, 1),               # 1x1x1
]
IDS = [f"{s[0]}-{s[1]}-p{s[2]}-d{s[3]}-s{s[4]}" for s in SHAPES]


@pytest.mark.parametrize("x_shape,w_shape,pad,dil,stride", SHAPES, ids=IDS)
def test_forward_vs_reference(smoked, x_shape, w_shape, pad, dil, stride):
    x, w, _ = case(x_shape, w_shape)
    p = make("fwd", x, w, padding=pad, dilation=dil, stride=stride)
    s = REGISTRY.get("gluon_implicit_gemm_fwd")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    out = poisoned(p.y_shape, x.dtype)
    y = s.prepare(p)(ConvArgs(x=x, w=w), out)
    assert y.data_ptr() == out.data_ptr()
    theirs = F.conv3d(F.pad(x, _pad_spec(p)), w, stride=stride, dilation=dil)
    assert_close(str(p.key()), y, theirs, conv_fwd_f64(p, x, w))


def test_forward_bias_post_ops_and_bit_identical(smoked):
    x, w, b = case((2, 64, 6, 13, 11), (96, 64, 3, 3, 3), bias=True, seed=3)
    g = torch.Generator(device=DEV).manual_seed(4)
    r = torch.randn(2, 96, 6, 13, 11, generator=g, device=DEV).to(torch.bfloat16).to(memory_format=CL3)
    ops = (Sum(r, 0.5), Eltwise("relu", 0.1))
    p = make("fwd", x, w, padding=1, has_bias=True, post_ops=tuple(o.signature() for o in ops))
    inv = REGISTRY.get("gluon_implicit_gemm_fwd").prepare(p)
    y = inv(ConvArgs(x=x, w=w, bias=b, post_ops=ops), poisoned(p.y_shape, x.dtype))
    theirs = apply_post_ops(F.conv3d(x, w, b, padding=1).float(), ops).to(x.dtype)
    assert_close(str(p.key()), y, theirs, conv_fwd_f64(p, x, w, b, ops))
    for _ in range(2):
        assert torch.equal(inv(ConvArgs(x=x, w=w, bias=b, post_ops=ops)), y)
    y_api = nnprim.conv_forward(x, w, b, padding=1, post_ops=ops, solver="gluon_implicit_gemm_fwd")
    assert torch.equal(y_api, y)


@pytest.mark.parametrize("x_shape,w_shape,pad,dil,stride", [s for s in SHAPES if s[4] == 1],
                         ids=[i for i, s in zip(IDS, SHAPES) if s[4] == 1])
def test_backward_data_vs_reference(smoked, x_shape, w_shape, pad, dil, stride):
    x, w, _ = case(x_shape, w_shape, seed=1)
    p = make("bwd_data", x, w, padding=pad, dilation=dil)
    s = REGISTRY.get("gluon_implicit_gemm_bwd_data")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    g = torch.Generator(device=DEV).manual_seed(2)
    dy = torch.randn(p.y_shape, generator=g, device=DEV).to(x.dtype).to(memory_format=CL3)
    out = poisoned(p.x_shape, x.dtype)
    dx = s.prepare(p)(ConvArgs(dy=dy, w=w), out)
    assert dx.data_ptr() == out.data_ptr()
    full = (p.N, p.C, *(n + a + b for n, (a, b) in zip(p.in_size, p.padding)))
    crop = tuple(slice(a, a + n) for n, (a, _) in zip(p.in_size, p.padding))
    theirs = torch.nn.grad.conv3d_input(full, w, dy, dilation=dil)[(slice(None), slice(None), *crop)]
    assert_close(str(p.key()), dx, theirs, conv_bwd_data_f64(p, dy, w))


@pytest.mark.parametrize("stream", [False, True], ids=["split", "stream_k"])
@pytest.mark.parametrize("x_shape,w_shape,pad,dil,stride", SHAPES, ids=IDS)
def test_backward_weights_vs_reference(smoked, x_shape, w_shape, pad, dil, stride, stream):
    from nnprim.conv import gluon_conv_wgrad
    x, w, _ = case(x_shape, w_shape, seed=5)
    p = make("bwd_weights", x, w, padding=pad, dilation=dil, stride=stride)
    s = REGISTRY.get("gluon_implicit_gemm_bwd_weights")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    g = torch.Generator(device=DEV).manual_seed(6)
    dy = torch.randn(p.y_shape, generator=g, device=DEV).to(x.dtype).to(memory_format=CL3)
    plan = gluon_conv_wgrad.GluonWgradPlan(p, stream=stream)
    out = poisoned(p.w_shape, x.dtype)
    dw = plan(ConvArgs(dy=dy, x=x), out)
    assert dw.data_ptr() == out.data_ptr() and plan.stream == stream
    theirs = torch.nn.grad.conv3d_weight(F.pad(x, _pad_spec(p)), w.shape, dy, stride=stride, dilation=dil)
    assert_close(str(p.key()), dw, theirs, conv_bwd_weights_f64(p, dy, x))
    assert torch.equal(plan(ConvArgs(dy=dy, x=x)), dw)


@pytest.mark.parametrize("x_shape,w_shape,pad,dil,stride", SHAPES[:4], ids=IDS[:4])
def test_backward_weights_two_taps_vs_reference(smoked, x_shape, w_shape, pad, dil, stride):
    """3-D with two taps a unit (`taps2_tile`): 27 taps, the last unit's second past them."""
    from nnprim.conv import gluon_conv_wgrad
    x, w, _ = case(x_shape, w_shape, seed=9)
    p = make("bwd_weights", x, w, padding=pad, dilation=dil, stride=stride)
    g = torch.Generator(device=DEV).manual_seed(10)
    dy = torch.randn(p.y_shape, generator=g, device=DEV).to(x.dtype).to(memory_format=CL3)
    plan = gluon_conv_wgrad.GluonWgradPlan(p, tile=gluon_conv_wgrad.taps2_tile(p))
    dw = plan(ConvArgs(dy=dy, x=x), poisoned(p.w_shape, x.dtype))
    theirs = torch.nn.grad.conv3d_weight(F.pad(x, _pad_spec(p)), w.shape, dy, stride=stride, dilation=dil)
    assert_close(str(p.key()), dw, theirs, conv_bwd_weights_f64(p, dy, x))


def test_backward_public_api_c3d_kind(smoked):
    """c3d_3x3x3's shape at a quarter of its batch through the public API, forced solvers
    against the default call's (other solvers, same f64 bound)."""
    x, w, _ = case((2, 64, 16, 28, 28), (128, 64, 3, 3, 3), seed=7)
    p = make("bwd_weights", x, w, padding=1)
    g = torch.Generator(device=DEV).manual_seed(8)
    dy = torch.randn(p.y_shape, generator=g, device=DEV).to(x.dtype).to(memory_format=CL3)
    dw = nnprim.conv_backward_weights(dy, x, w.shape, padding=1, solver="gluon_implicit_gemm_bwd_weights")
    theirs = torch.nn.grad.conv3d_weight(x, w.shape, dy, padding=1)
    assert_close("c3d bwd_weights", dw, theirs, conv_bwd_weights_f64(p, dy, x))
    dx = nnprim.conv_backward_data(dy, w, x.shape, padding=1, solver="gluon_implicit_gemm_bwd_data")
    pd = make("bwd_data", x, w, padding=1)
    assert_close("c3d bwd_data", dx, torch.nn.grad.conv3d_input(x.shape, w, dy, padding=1),
                 conv_bwd_data_f64(pd, dy, w))
