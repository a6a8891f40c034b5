"""The float64 conv reference against independent computations: explicit loops on tiny
shapes, and torch's float64 convolution / autograd on a grid of options."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import nnprim
from nnprim.problems.conv import layout_of, to_layout

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def loop_conv2d(x, w, stride, pad_b, dil, groups):
    """Direct definition: y[n,k,oh,ow] = sum_{c,r,s} x[n, g*Cg+c, oh*sh - ph + r*dh, ...] w[k,c,r,s]."""
    N, C, H, W = x.shape
    K, Cg, R, S = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad_b, dil
    OH = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    OW = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    y = torch.zeros(N, K, OH, OW, dtype=torch.float64)
    Kg = K // groups
    for n, k, oh, ow in itertools.product(range(N), range(K), range(OH), range(OW)):
        g = k // Kg
        acc = 0.0
        for c, r, s in itertools.product(range(Cg), range(R), range(S)):
            ih, iw = oh * sh - ph + r * dh, ow * sw - pw + s * dw
            if 0 <= ih < H and 0 <= iw < W:
                acc += float(x[n, g * Cg + c, ih, iw]) * float(w[k, c, r, s])
        y[n, k, oh, ow] = acc
    return y


@pytest.mark.parametrize("groups,stride,pad,dil", [(1, 1, 1, 1), (2, 2, 0, 1), (3, 1, 2, 2), (6, 2, 1, 1)])
def test_forward_matches_loops(groups, stride, pad, dil):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 7, 5, generator=g, dtype=torch.float64)
    w = torch.randn(6, 6 // groups, 3, 2, generator=g, dtype=torch.float64)
    y = nnprim.conv_forward(x, w, stride=stride, padding=pad, dilation=dil, groups=groups, solver="ConvReference")
    ref = loop_conv2d(x, w, (stride,) * 2, (pad,) * 2, (dil,) * 2, groups)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


GRID = [
    # (x shape, w shape, stride, padding, dilation, groups)
    ((2, 4, 11), (6, 4, 3), 1, 1, 1, 1),
    ((1, 6, 15), (6, 1, 5), 2, ((2, 1),), 1, 6),
    ((2, 4, 9, 7), (8, 2, 3, 3), (2, 1), ((1, 0), (2, 1)), (1, 2), 2),
    ((3, 3, 8, 8), (5, 3, 1, 1), 1, 0, 1, 1),
    ((1, 4, 5, 6, 7), (4, 4, 3, 2, 3), (1, 2, 1), 1, (2, 1, 1), 1),
    ((2, 6, 4, 5, 5), (6, 2, 2, 3, 3), 2, ((0, 1), (1, 1), (2, 0)), 1, 3),
]


def _torch_pad(x, padding, nd):
    if isinstance(padding, int):
        padding = [padding] * nd
    spec = []
    for p in reversed(list(padding)):
        b, a = (p, p) if isinstance(p, int) else p
        spec += [b, a]
    return F.pad(x, spec)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", GRID, ids=lambda c: f"x{c[0]}")
def test_all_directions_vs_torch_f64(case, layout):
    xs, ws, stride, padding, dil, groups = case
    nd = len(xs) - 2
    g = torch.Generator().manual_seed(1)
    x = to_layout(torch.randn(xs, generator=g), layout)
    w = to_layout(torch.randn(ws, generator=g), layout)
    b = torch.randn(ws[0], generator=g)
    kw = dict(stride=stride, padding=padding, dilation=dil, groups=groups, solver="ConvReference")
    y = nnprim.conv_forward(x, w, b, **kw)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    ref = CONV[nd](_torch_pad(x64, padding, nd), w64, b.double(), stride, 0, dil, groups)
    assert y.shape == ref.shape and layout_of(y) == layout
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy = to_layout(torch.randn(ref.shape, generator=g), layout)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x64, w64), dy.double())
    dx = nnprim.conv_backward_data(dy, w, x.shape, **kw)
    dw = nnprim.conv_backward_weights(dy, x, w.shape, **kw)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-5, atol=1e-5)
    assert layout_of(dx) == layout
    db = nnprim.conv_backward_bias(dy)
    torch.testing.assert_close(db.double(), dy.double().sum(dim=[0, *range(2, nd + 2)]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                             (torch.float16, None)])
def test_low_precision_output_dtype(dtype, out_dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 9, 9, generator=g).to(dtype)
    w = torch.randn(4, 8, 3, 3, generator=g).to(dtype)
    y = nnprim.conv_forward(x, w, padding=1, out_dtype=out_dtype)
    assert y.dtype == (out_dtype or dtype)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    err = (y.double() - ref).norm() / ref.norm()
    assert err < 1e-2
