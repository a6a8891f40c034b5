"""Convolution options a torch user passes: padding strings, list arguments, dtype mixes."""
import pytest
import torch
import torch.nn.functional as F

import nnprim


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("shape", [((2, 3, 9), (4, 3, 4)), ((2, 3, 9, 8), (4, 3, 4, 3)), ((1, 2, 5, 6, 7), (3, 2, 2, 3, 3))])
def test_padding_strings_match_torch(padding, dilation, shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape[0], generator=g), torch.randn(shape[1], generator=g)
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[x.dim()]
    ref = conv(x.double(), w.double(), padding=padding, dilation=dilation)
    y = nnprim.conv_forward(x, w, padding=padding, dilation=dilation)
    assert y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_padding_same_needs_stride_1():
    with pytest.raises(nnprim.BadParameterError, match="stride"):
        nnprim.conv_forward(torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), padding="same", stride=2)
    with pytest.raises(nnprim.BadParameterError, match="'full'"):
        nnprim.conv_forward(torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), padding="full")


def test_list_arguments_and_mixed_bias_dtype():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 11, 10, generator=g).bfloat16()
    w = torch.randn(6, 4, 3, 3, generator=g).bfloat16()
    b = torch.randn(6, generator=g)  # f32 bias with bf16 data
    y = nnprim.conv_forward(x, w, b, stride=[2, 1], padding=[1, 0], dilation=[1, 2], out_dtype=torch.float32)
    ref = F.conv2d(x.double(), w.double(), b.double(), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    assert y.dtype == torch.float32
    assert ((y.double() - ref).norm() / ref.norm()) < 1e-5
