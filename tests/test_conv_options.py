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


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_empty_batch_as_torch(layout):
    """N = 0 (an empty batch, as detection heads produce): torch's empty results in the
    input's layout, zero weight and bias gradients, and the same shape errors as one image."""

    mf = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(0, 4, 8, 8).contiguous(memory_format=mf)
    w = torch.randn(6, 4, 3, 3).contiguous(memory_format=mf)
    b = torch.randn(6)
    for _ in range(2):      # the memoised path too
        y = nnprim.conv_forward(x, w, b, padding=1, stride=2)
        r = F.conv2d(x, w, b, padding=1, stride=2)
        assert y.shape == r.shape and y.dtype == r.dtype and y.stride() == r.stride()
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    nnprim.conv_forward(xg, wg, bg, padding=1, post_ops=[nnprim.Eltwise("relu")]).sum().backward()
    assert xg.grad.shape == x.shape and not wg.grad.any() and not bg.grad.any()
    dy = torch.randn(0, 6, 8, 8).contiguous(memory_format=mf)
    assert nnprim.conv_backward_data(dy, w, x.shape, padding=1).shape == x.shape
    dw = nnprim.conv_backward_weights(dy, x, w.shape, padding=1)
    assert dw.shape == w.shape and not dw.any()
    with pytest.raises(nnprim.BadParameterError, match="must equal x channels"):
        nnprim.conv_forward(x, torch.randn(6, 3, 3, 3))
    with pytest.raises(nnprim.BadParameterError, match="not positive"):
        nnprim.conv_forward(torch.randn(0, 4, 2, 2), w)
    with pytest.raises(nnprim.BadParameterError, match="x_shape"):
        nnprim.conv_backward_data(dy, w, (2, 4, 8, 8), padding=1)


def test_sdpa_no_query_rows_as_torch():
    """B = 0 or Sq = 0: empty o and lse, zero gradients, shape errors as with rows."""

    for qs, ks in (((0, 4, 5, 8), (0, 2, 6, 8)), ((1, 4, 0, 8), (1, 2, 6, 8))):
        q, k, v = torch.randn(*qs, requires_grad=True), torch.randn(*ks, requires_grad=True), torch.randn(*ks)
        for _ in range(2):
            o = nnprim.sdpa(q, k, v, causal=True)
            assert o.shape == F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                             v.repeat_interleave(2, 1)).shape
        o.sum().backward()
        assert q.grad.shape == q.shape and not k.grad.any()
        with torch.no_grad():
            o, lse = nnprim.sdpa(q, k, v, return_lse=True)
        assert lse.shape == qs[:3] and lse.dtype == torch.float32
    with pytest.raises(nnprim.BadParameterError, match="do not agree"):
        nnprim.sdpa(torch.randn(0, 3, 5, 8), torch.randn(0, 2, 6, 8), torch.randn(0, 2, 6, 8))
