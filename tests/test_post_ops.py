"""Every post-op kind through conv_forward against an independent float64 formula."""
import math

import pytest
import torch
import torch.nn.functional as F

import nnprim
from nnprim.post_ops import ELTWISE_KINDS

INDEPENDENT = {
    "relu": lambda x, a, b: F.leaky_relu(x, a),
    "gelu_tanh": lambda x, a, b: F.gelu(x, approximate="tanh"),
    "gelu_erf": lambda x, a, b: F.gelu(x),
    "silu": lambda x, a, b: F.silu(x),
    "sigmoid": lambda x, a, b: torch.sigmoid(x),
    "tanh": lambda x, a, b: torch.tanh(x),
    "elu": lambda x, a, b: F.elu(x, a),
    "clip": lambda x, a, b: x.clamp(a, b),
    "linear": lambda x, a, b: a * x + b,
    "square": lambda x, a, b: x ** 2,
    "abs": lambda x, a, b: x.abs(),
    "sqrt": lambda x, a, b: x.sqrt(),
    "exp": lambda x, a, b: x.exp(),
    "log": lambda x, a, b: x.log(),
    "hardswish": lambda x, a, b: F.hardswish(x),
    "mish": lambda x, a, b: F.mish(x),
}


def _xw():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 3, 6, 5, generator=g), torch.randn(4, 3, 3, 3, generator=g) * 0.3, g


@pytest.mark.parametrize("kind", ELTWISE_KINDS)
def test_eltwise(kind):
    x, w, g = _xw()
    a, b = {"relu": (0.1, 0), "elu": (0.7, 0), "clip": (-0.5, 0.8), "linear": (1.5, -0.25)}.get(kind, (0.0, 0.0))
    pre = F.conv2d(x.double(), w.double(), padding=1)
    if kind in ("sqrt", "log"):
        x, w, pre = x.abs(), w.abs(), F.conv2d(x.abs().double(), w.abs().double(), padding=1) + 0.0
    y = nnprim.conv_forward(x, w, padding=1, post_ops=[nnprim.Eltwise(kind, a, b)])
    ref = INDEPENDENT[kind](pre, a, b)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min"])
@pytest.mark.parametrize("shape", ["scalar", "channel", "full", "spatial"])
def test_binary_broadcast(op, shape):
    x, w, g = _xw()
    yshape = (2, 4, 6, 5)
    t = {"scalar": torch.rand(1, generator=g) + 0.5, "channel": torch.rand(4, generator=g) + 0.5,
         "full": torch.rand(yshape, generator=g) + 0.5, "spatial": torch.rand(6, 5, generator=g) + 0.5}[shape]
    y = nnprim.conv_forward(x, w, padding=1, post_ops=[nnprim.Binary(op, t)])
    pre = F.conv2d(x.double(), w.double(), padding=1)
    tt = t.double().reshape(1, 4, 1, 1) if shape == "channel" else t.double()
    fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
          "max": torch.maximum, "min": torch.minimum}[op]
    torch.testing.assert_close(y.double(), fn(pre, tt), rtol=1e-5, atol=1e-5)


def test_chain_order_bias_sum_relu():
    x, w, g = _xw()
    b = torch.randn(4, generator=g)
    r = torch.randn(2, 4, 6, 5, generator=g)
    y = nnprim.conv_forward(x, w, b, padding=1,
                            post_ops=[nnprim.Sum(r, 0.5), nnprim.Eltwise("relu"), nnprim.Binary("mul", torch.tensor(2.0))])
    ref = 2.0 * torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1) + 0.5 * r.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(y.sum()))
