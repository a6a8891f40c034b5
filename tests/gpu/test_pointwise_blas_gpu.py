"""Pointwise cuBLAS solvers (33/34/35) at real sizes on the GPU, forced through the public
API, against float64, bounded by torch's (cuDNN's) same-dtype error."""
import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_close

import nnprim

CL = torch.channels_last
CASES = [  # (x shape, K)
    ((32, 64, 56, 56), 64),        # rn50_r2_1x1a at N=32
    ((16, 1024, 14, 14), 256),     # rn50_r4_1x1
    ((8, 2048, 7, 7), 512),        # rn50_r5_1x1
    ((3, 37, 13, 11), 72),         # odd sizes
]


@pytest.mark.parametrize("xs,K", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pointwise_api(xs, K, dtype):
    torch.manual_seed(0)
    x = torch.randn(xs, device="cuda").to(dtype).to(memory_format=CL)
    w = (torch.randn(K, xs[1], 1, 1, device="cuda") / xs[1] ** 0.5).to(dtype).to(memory_format=CL)
    bias = torch.randn(K, device="cuda", dtype=dtype)
    dy = torch.randn(xs[0], K, *xs[2:], device="cuda").to(dtype).to(memory_format=CL)
    x64, w64, b64, dy64 = x.double(), w.double(), bias.double(), dy.double()
    y = nnprim.conv_forward(x, w, solver="gemm_1x1_fwd")
    assert y.is_contiguous(memory_format=CL)
    assert_close("fwd", y, F.conv2d(x, w), F.conv2d(x64, w64))
    yb = nnprim.conv_forward(x, w, bias, solver="gemm_1x1_fwd")
    assert_close("fwd+bias", yb, F.conv2d(x, w, bias), F.conv2d(x64, w64, b64))
    y32 = nnprim.conv_forward(x, w, bias, out_dtype=torch.float32, solver="gemm_1x1_fwd")
    assert y32.dtype == torch.float32
    assert_close("fwd f32 out", y32, F.conv2d(x, w, bias).float(), F.conv2d(x64, w64, b64))
    dx = nnprim.conv_backward_data(dy, w, tuple(x.shape), solver="gemm_1x1_bwd_data")
    assert dx.is_contiguous(memory_format=CL)
    assert_close("bwd_data", dx, F.conv_transpose2d(dy, w), F.conv_transpose2d(dy64, w64))
    dw = nnprim.conv_backward_weights(dy, x, tuple(w.shape), solver="gemm_1x1_bwd_weights")
    assert dw.dtype == dtype and dw.shape == w.shape

    def wgrad(a, b):
        return torch.ops.aten.convolution_backward(a, b, w.to(a.dtype), None, [1, 1], [0, 0], [1, 1], False,
                                                   [0, 0], 1, [False, True, False])[1]
    assert_close("bwd_weights", dw, wgrad(dy, x), wgrad(dy64, x64))
    dw32 = nnprim.conv_backward_weights(dy, x, tuple(w.shape), solver="gemm_1x1_bwd_weights", out_dtype=torch.float32)
    assert_close("bwd_weights f32 out", dw32, wgrad(dy, x).float(), wgrad(dy64, x64))


@pytest.mark.parametrize("groups", [1, 2])
def test_gemm_bwd_weights_one_group_mm(groups):
    """gemm_bwd_weights: one group runs cuBLAS mm (split reductions in f32), groups bmm."""
    torch.manual_seed(1)
    x = torch.randn(16, 64, 28, 28, device="cuda").bfloat16().to(memory_format=CL)
    w = (torch.randn(96, 64 // groups, 3, 3, device="cuda") / 24).bfloat16().to(memory_format=CL)
    dy = torch.randn(16, 96, 28, 28, device="cuda").bfloat16().to(memory_format=CL)

    def wgrad(a, b):
        return torch.ops.aten.convolution_backward(a, b, w.to(a.dtype), None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], groups, [False, True, False])[1]
    dw = nnprim.conv_backward_weights(dy, x, tuple(w.shape), padding=1, groups=groups, solver="gemm_bwd_weights")
    assert_close(f"gemm_bwd_weights g{groups}", dw, wgrad(dy, x), wgrad(dy.double(), x.double()))
