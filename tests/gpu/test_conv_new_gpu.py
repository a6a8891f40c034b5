"""Depthwise (43/44/45, and the row-walking 46/47/48: backward data at stride 1 only) and
NCHW-through-NHWC (23/24/25, with the Triton layout copies) solvers at real sizes on the GPU,
forced through the public API, against float64, bounded by torch's same-dtype error."""
import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_close

import nnprim

DW = [((32, 144, 56, 56), 1, 1), ((16, 96, 112, 111), 2, 1), ((64, 960, 7, 7), 1, 1), ((8, 40, 33, 17), 1, 2),
      ((8, 24, 113, 57), 1, 1)]
FAMILIES = {"tile": ("depthwise_fwd", "depthwise_bwd_data", "depthwise_bwd_weights"),
            "walk": ("depthwise_walk_fwd", "depthwise_walk_bwd_data", "depthwise_walk_bwd_weights")}


def _bwd(dy, x, w, stride, pad, groups, mask):
    nd = x.dim() - 2
    return torch.ops.aten.convolution_backward(dy, x, w, None, [stride] * nd, [pad] * nd, [1] * nd, False,
                                               [0] * nd, groups, mask)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shape,stride,pad", DW)
def test_depthwise(shape, stride, pad, family):
    fwd, bwd_data, bwd_weights = FAMILIES[family]
    if family == "walk" and stride != 1:      # a transposed convolution: the tile solver's
        bwd_data = FAMILIES["tile"][1]
    torch.manual_seed(0)
    C = shape[1]
    cl = torch.channels_last
    x = torch.randn(shape, device="cuda").to(torch.bfloat16).to(memory_format=cl)
    w = (torch.randn(C, 1, 3, 3, device="cuda") / 3).to(torch.bfloat16).to(memory_format=cl)
    kw = dict(stride=stride, padding=pad, groups=C)
    y_t = F.conv2d(x, w, **kw)
    dy = torch.randn_like(y_t)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y = nnprim.conv_forward(x, w, solver=fwd, **kw)
    assert_close("fwd", y, y_t, F.conv2d(x64, w64, **kw))
    dx_ref, dw_ref, _ = _bwd(dy64, x64, w64, stride, pad, C, [True, True, False])
    dx_t, dw_t, _ = _bwd(dy, x, w, stride, pad, C, [True, True, False])
    dx = nnprim.conv_backward_data(dy, w, tuple(x.shape), solver=bwd_data, **kw)
    assert_close("bwd_data", dx, dx_t, dx_ref)
    dw = nnprim.conv_backward_weights(dy, x, tuple(w.shape), solver=bwd_weights, **kw)
    assert_close("bwd_weights", dw, dw_t, dw_ref)


@pytest.mark.parametrize("shape,filt,pad", [((32, 128, 28, 28), 3, 1), ((16, 256, 14, 15), 1, 0),
                                            ((4, 64, 8, 20, 20), 3, 1)])
def test_nchw_via_nhwc(shape, filt, pad):
    torch.manual_seed(0)
    nd = len(shape) - 2
    conv = F.conv2d if nd == 2 else F.conv3d
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    w = (torch.randn(shape[1], shape[1], *([filt] * nd), device="cuda") / (filt * shape[1] ** 0.5)).to(torch.bfloat16)
    y_t = conv(x, w, padding=pad)
    dy = torch.randn_like(y_t)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y = nnprim.conv_forward(x, w, padding=pad, solver="nchw_via_nhwc_fwd")
    assert y.is_contiguous()
    assert_close("fwd", y, y_t, conv(x64, w64, padding=pad))
    dx_ref, dw_ref, _ = _bwd(dy64, x64, w64, 1, pad, 1, [True, True, False])
    dx_t, dw_t, _ = _bwd(dy, x, w, 1, pad, 1, [True, True, False])
    dx = nnprim.conv_backward_data(dy, w, tuple(x.shape), padding=pad, solver="nchw_via_nhwc_bwd_data")
    assert_close("bwd_data", dx, dx_t, dx_ref)
    dw = nnprim.conv_backward_weights(dy, x, tuple(w.shape), padding=pad, solver="nchw_via_nhwc_bwd_weights")
    assert_close("bwd_weights", dw, dw_t, dw_ref)
