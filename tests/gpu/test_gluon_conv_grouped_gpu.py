"""Solvers 27/28 (Gluon implicit GEMM) on grouped convolutions, on the GPU: tiles of whole
groups over the packed block-diagonal filter (blockdiag.py). Random inputs, NaN-poisoned
outputs, against the float64 reference with an error bound relative to torch's same-dtype
grouped convolution (gpu_helpers.assert_close): ResNeXt's g32 (4 channels a group), 8-32
channel groups, K past the last whole tile, 3-D, bias and post-ops, backward data, bit-identical
reruns and the public API. Gated on test_gluon_conv_gpu.py's hang-safe smoke run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import GLUON_MODULE_MARKS, assert_close
from test_gluon_conv_gpu import smoked  # noqa: F401 - the smoke-gated fixture

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv.reference import conv_bwd_data_f64, conv_fwd_f64
from nnprim.post_ops import Eltwise, Sum, apply_post_ops
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

DEV = "cuda"
pytestmark = GLUON_MODULE_MARKS
_CONV = {4: F.conv2d, 5: F.conv3d}
_GRAD_INPUT = {4: torch.nn.grad.conv2d_input, 5: torch.nn.grad.conv3d_input}


def fmt(n: int):
    return torch.channels_last if n == 4 else torch.channels_last_3d


def case(x_shape, w_shape, seed=0, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*x_shape, generator=g, device=DEV).to(torch.bfloat16).to(memory_format=fmt(len(x_shape)))
    fan_in = 1
    for n in w_shape[1:]:
        fan_in *= n
    w = (torch.randn(*w_shape, generator=g, device=DEV) / fan_in ** 0.5).to(torch.bfloat16)
    w = w.to(memory_format=fmt(len(w_shape)))
    b = torch.randn(w_shape[0], generator=g, device=DEV).to(torch.bfloat16) if bias else None
    return x, w, b


SHAPES = [  # (x, w, groups, padding)
    ((4, 128, 28, 28), (128, 4, 3, 3), 32, 1),       # ResNeXt g32 (Cg = Kg = 4)
    ((3, 128, 13, 11), (256, 8, 3, 3), 16, 1),       # Kg 16, Cg 8: 32 input channels a tile, odd sizes
    ((2, 96, 9, 10), (48, 16, 3, 3), 6, 1),          # K 48: one short tile
    ((2, 256, 7, 7), (256, 64, 3, 3), 4, 1),         # wide groups, small image
    ((2, 128, 14, 15), (256, 32, 1, 1), 4, 0),       # 1x1 (flat rows)
    ((2, 64, 5, 9, 11), (64, 8, 3, 3, 3), 8, 1),     # 3-D
]
IDS = [f"g{s[2]}-{s[1]}" for s in SHAPES]


@pytest.mark.parametrize("x_shape,w_shape,groups,pad", SHAPES, ids=IDS)
def test_forward_vs_reference(smoked, x_shape, w_shape, groups, pad):  # noqa: F811
    x, w, _ = case(x_shape, w_shape)
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=DEV, padding=pad,
                           groups=groups)
    s = REGISTRY.get("gluon_implicit_gemm_fwd")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    out = torch.full(p.y_shape, float("nan"), dtype=x.dtype, device=DEV).to(memory_format=fmt(len(x_shape)))
    y = s.prepare(p)(ConvArgs(x=x, w=w), out)
    assert y.data_ptr() == out.data_ptr()
    theirs = _CONV[len(x_shape)](x, w, padding=pad, groups=groups)
    assert_close(str(p.key()), y, theirs, conv_fwd_f64(p, x, w))


@pytest.mark.parametrize("x_shape,w_shape,groups,pad", SHAPES, ids=IDS)
def test_backward_data_vs_reference(smoked, x_shape, w_shape, groups, pad):  # noqa: F811
    x, w, _ = case(x_shape, w_shape, seed=1)
    p = ConvProblem.create("bwd_data", x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=DEV, padding=pad,
                           groups=groups)
    s = REGISTRY.get("gluon_implicit_gemm_bwd_data")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    g = torch.Generator(device=DEV).manual_seed(2)
    dy = torch.randn(p.y_shape, generator=g, device=DEV).to(x.dtype).to(memory_format=fmt(len(x_shape)))
    out = torch.full(p.x_shape, float("nan"), dtype=x.dtype, device=DEV).to(memory_format=fmt(len(x_shape)))
    dx = s.prepare(p)(ConvArgs(dy=dy, w=w), out)
    assert dx.data_ptr() == out.data_ptr()
    theirs = _GRAD_INPUT[len(x_shape)](x.shape, w, dy, padding=pad, groups=groups)
    assert_close(str(p.key()), dx, theirs, conv_bwd_data_f64(p, dy, w))


@pytest.mark.parametrize("stride", [2, (2, 1)], ids=str)
def test_forward_stride2_vs_reference(smoked, stride):  # noqa: F811
    """Stride 2 reads x per stride phase (`_load_x`) at the tile's first input channel."""
    x, w, _ = case((2, 128, 15, 14), (256, 8, 3, 3), seed=5)
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=DEV, padding=1,
                           groups=16, stride=stride)
    s = REGISTRY.get("gluon_implicit_gemm_fwd")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    y = s.prepare(p)(ConvArgs(x=x, w=w))
    theirs = F.conv2d(x, w, padding=1, groups=16, stride=stride)
    assert_close(str(p.key()), y, theirs, conv_fwd_f64(p, x, w))


def test_bias_post_ops_bit_identical_and_api(smoked):  # noqa: F811
    x, w, b = case((4, 128, 28, 28), (128, 4, 3, 3), seed=3, bias=True)
    g = torch.Generator(device=DEV).manual_seed(4)
    r = torch.randn(4, 128, 28, 28, generator=g, device=DEV).to(torch.bfloat16).to(memory_format=torch.channels_last)
    ops = (Sum(r, 1.0), Eltwise("relu"))
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=DEV, padding=1, groups=32,
                           has_bias=True, post_ops=tuple(o.signature() for o in ops))
    inv = REGISTRY.get("gluon_implicit_gemm_fwd").prepare(p)
    y = inv(ConvArgs(x=x, w=w, bias=b, post_ops=ops))
    theirs = apply_post_ops(F.conv2d(x, w, b, padding=1, groups=32).float(), ops).to(x.dtype)
    assert_close(str(p.key()), y, theirs, conv_fwd_f64(p, x, w, b, ops))
    for _ in range(2):
        assert torch.equal(inv(ConvArgs(x=x, w=w, bias=b, post_ops=ops)), y)
    w2 = w * 2     # a new filter each call (training): packed again, not a stale block
    assert_close("new filter", inv(ConvArgs(x=x, w=w2, bias=b, post_ops=ops)),
                 apply_post_ops(F.conv2d(x, w2, b, padding=1, groups=32).float(), ops).to(x.dtype),
                 conv_fwd_f64(p, x, w2, b, ops))
    y_api = nnprim.conv_forward(x, w, b, padding=1, groups=32, post_ops=ops, solver="gluon_implicit_gemm_fwd")
    assert torch.equal(y_api, y)
    dy = torch.randn(p.y_shape, generator=g, device=DEV).to(torch.bfloat16).to(memory_format=torch.channels_last)
    dx = nnprim.conv_backward_data(dy, w, x.shape, padding=1, groups=32, solver="gluon_implicit_gemm_bwd_data")
    pd = ConvProblem.create("bwd_data", x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=DEV, padding=1,
                            groups=32)
    assert_close("api bwd_data", dx, torch.nn.grad.conv2d_input(x.shape, w, dy, padding=1, groups=32),
                 conv_bwd_data_f64(pd, dy, w))
