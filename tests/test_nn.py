"""nnprim.nn modules: dropout seeds under torch.compile (no graph break for a host value,
a fresh mask per call); on CUDA, CUDA-graph replays in tests/gpu/test_integration_gpu.py."""
import pytest
import torch
import torch._dynamo.testing

import nnprim


def test_attention_dropout_compiles_without_a_graph_break():
    torch.manual_seed(0)
    attn = nnprim.nn.Attention(32, num_heads=4, num_kv_heads=2, dropout=0.3).train()
    x = torch.randn(2, 5, 32)
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(attn, backend=counter, fullgraph=True)   # a graph break raises here
    y1, y2 = f(x), f(x)
    assert counter.frame_count == 1
    assert not torch.equal(y1, y2)                              # a new seed per call
    y1.sum().backward()
    assert attn.q_proj.weight.grad is not None and torch.isfinite(attn.q_proj.weight.grad).all()


def test_attention_dropout_eager_is_reproducible_under_manual_seed():
    attn = nnprim.nn.Attention(32, num_heads=4, num_kv_heads=2, dropout=0.3).train()
    x = torch.randn(2, 5, 32)
    torch.manual_seed(1)
    a = attn(x)
    torch.manual_seed(1)
    assert torch.equal(a, attn(x))
    assert torch.equal(attn.eval()(x), attn(x))                 # eval: no dropout


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
def test_conv_padding_modes_and_repr_as_torch(mode):
    """padding_mode as torch.nn.ConvNd (pad in the mode, then convolve unpadded), and the same
    repr fields."""
    a = nnprim.nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode=mode)
    b = torch.nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode=mode)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 4, 9, 8)
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)
    assert repr(a).startswith("Conv2d(4, 6, kernel_size=(3, 3), stride=1, padding=(1, 2)")
    assert (mode != "zeros") == ("padding_mode" in repr(a))
    with pytest.raises(nnprim.BadParameterError, match="padding_mode"):
        nnprim.nn.Conv1d(4, 6, 3, padding_mode="mirror")


def test_attention_of_an_empty_sequence():
    assert nnprim.nn.Attention(16, 4)(torch.randn(2, 0, 16)).shape == (2, 0, 16)


def test_jit_trace_records_the_ops():
    """torch.jit.trace of a cold call: the op is recorded (it once crashed the process while
    tracing nnprim's own code and running a find)."""
    import warnings
    x, w, q = torch.randn(1, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(1, 2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = torch.jit.trace(lambda a, b: nnprim.conv_forward(a, b, padding=1), (torch.randn(1, 4, 8, 8), w))
        ts = torch.jit.trace(lambda t: nnprim.sdpa(t, t, t, causal=True), (torch.randn(1, 2, 5, 8),))
    assert "nnprim::conv_forward" in str(tc.graph) and "nnprim::sdpa_forward" in str(ts.graph)
    torch.testing.assert_close(tc(x, w), torch.nn.functional.conv2d(x, w, padding=1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ts(q), torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_conv_named_padding_with_a_mode(padding):
    """torch.nn takes 'same' / 'valid' with any padding_mode (they were NotSupportedError)."""
    a = nnprim.nn.Conv2d(4, 6, (3, 4), padding=padding, padding_mode="reflect", dilation=(1, 2))
    b = torch.nn.Conv2d(4, 6, (3, 4), padding=padding, padding_mode="reflect", dilation=(1, 2))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 4, 9, 10)
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


def test_conv_module_bad_arguments():
    with pytest.raises(nnprim.BadParameterError, match="kernel_size"):
        nnprim.nn.Conv2d(4, 6, kernel_size=2.5)
    with pytest.raises(nnprim.BadParameterError, match="padding"):
        nnprim.nn.Conv2d(4, 6, 3, padding=1.5, padding_mode="reflect")
    with pytest.raises(nnprim.BadParameterError, match="padding"):       # reflect: a pad as large as x
        nnprim.nn.Conv2d(4, 6, 3, padding=9, padding_mode="reflect")(torch.randn(1, 4, 8, 8))
