"""The torch integration: nnprim:: custom ops, their fake implementations (FakeTensor and
meta shapes/strides/dtypes equal the real ones), autograd through the ops and through
the eager path alike, torch.compile(fullgraph=True) without graph breaks, errors raised
through the dispatcher keep their types."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import nnprim
from nnprim.ops.conv import post_op_spec

CL = torch.channels_last


def _conv_tensors(layout="nhwc", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 9, 7, generator=g, dtype=dtype)
    w = torch.randn(10, 3, 3, 3, generator=g, dtype=dtype)
    b = torch.randn(10, generator=g, dtype=dtype)
    if layout == "nhwc":
        x, w = x.contiguous(memory_format=CL), w.contiguous(memory_format=CL)
    return x, w, b


def test_ops_are_registered():
    for name in ("conv_forward", "conv_backward_data", "conv_backward_weights", "sdpa_forward", "sdpa_backward"):
        assert hasattr(torch.ops.nnprim, name)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_fake_conv_matches_real(layout):
    x, w, b = _conv_tensors(layout)
    args = ([2, 1], [1, 0, 1, 2], [1, 1], 2, "eltwise,relu,0.0,0.0", [], None, None)
    real = torch.ops.nnprim.conv_forward(x, w, b, *args)
    with FakeTensorMode() as mode:
        fx, fw, fb = (mode.from_tensor(t) for t in (x, w, b))
        fake = torch.ops.nnprim.conv_forward(fx, fw, fb, *args)
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype
    dy = torch.randn_like(real)
    for op, a, shp in ((torch.ops.nnprim.conv_backward_data, w, x.shape),
                       (torch.ops.nnprim.conv_backward_weights, x, w.shape)):
        r = op(dy, a, list(shp), [2, 1], [1, 0, 1, 2], [1, 1], 2, None, None)
        with FakeTensorMode() as mode:
            f = op(mode.from_tensor(dy), mode.from_tensor(a), list(shp), [2, 1], [1, 0, 1, 2], [1, 1], 2, None, None)
        assert f.shape == r.shape and f.stride() == r.stride()


def test_fake_sdpa_matches_real():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    opts = (None, None, None, "bottom_right", None, False, 0.0, 0, 0, False)
    o, lse = torch.ops.nnprim.sdpa_forward(q, k, v, None, None, None, None, "", "", *opts, True, None)
    with FakeTensorMode() as mode:
        fo, flse = torch.ops.nnprim.sdpa_forward(*(mode.from_tensor(t) for t in (q, k, v)), None, None, None, None,
                                                 "", "", *opts, True, None)
    assert (fo.shape, fo.stride(), flse.shape, flse.dtype) == (o.shape, o.stride(), lse.shape, lse.dtype)


def test_errors_keep_their_type_through_the_dispatcher():
    x, w, b = _conv_tensors()
    with pytest.raises(nnprim.BadParameterError, match="groups=4 does not divide"):
        torch.ops.nnprim.conv_forward(x, w, b, [1, 1], [0, 0], [1, 1], 4, "", [], None, None)
    short = b[:3].clone()
    with FakeTensorMode() as mode, pytest.raises(nnprim.BadParameterError, match="bias shape"):
        torch.ops.nnprim.conv_forward(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(short),
                                      [1, 1], [0, 0], [1, 1], 2, "", [], None, None)


def test_post_op_spec_roundtrip():
    res = torch.randn(1, 3, 4, 4)
    ops = (nnprim.Sum(res, 0.5), nnprim.Eltwise("clip", -1.0, 2.5), nnprim.Binary("mul", torch.ones(1, 3, 1, 1)))
    spec, tensors = post_op_spec(ops)
    assert spec == "sum,0.5;eltwise,clip,-1.0,2.5;binary,mul" and len(tensors) == 2
    from nnprim.ops.conv import decode_post_ops
    back = decode_post_ops(spec, tensors)
    assert [o.signature() for o in back] == [o.signature() for o in ops]
    with pytest.raises(nnprim.BadParameterError):
        decode_post_ops("sum,0.5", [])


def _grads(fn, *ts):
    ts = [t.detach().clone().requires_grad_() for t in ts]
    out = fn(*ts)
    out.backward()
    return out.detach(), [t.grad for t in ts]


def test_op_autograd_equals_eager_autograd():
    """The registered autograd (the op path) and the eager Functions give the same grads."""
    x, w, b = _conv_tensors()

    def via_op(x, w, b):
        return torch.ops.nnprim.conv_forward(x, w, b, [1, 1], [1, 1, 1, 1], [1, 1], 2, "", [], None, None).square().sum()

    def via_api(x, w, b):
        return nnprim.conv_forward(x, w, b, padding=1, groups=2).square().sum()

    (y1, g1), (y2, g2) = _grads(via_op, x, w, b), _grads(via_api, x, w, b)
    assert torch.allclose(y1, y2)
    for a, c in zip(g1, g2):
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-5)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)

    def sdpa_op(q, k, v):
        opts = (None, None, None, "top_left", None, False, 0.0, 0, 0, False)
        return torch.ops.nnprim.sdpa_forward(q, k, v, None, None, None, None, "", "", *opts, True, None)[0].sum()

    (o1, h1), (o2, h2) = _grads(sdpa_op, q, k, v), _grads(lambda q, k, v: nnprim.sdpa(q, k, v, causal=True).sum(),
                                                          q, k, v)
    assert torch.allclose(o1, o2)
    for a, c in zip(h1, h2):
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_torch_compile_fullgraph_forward_backward(deterministic):
    """Also under torch's deterministic mode, where nnprim.alloc allocates without torch's fill
    in the real impls and hands back to torch.empty in the fake ones (FakeTensorMode)."""
    torch.use_deterministic_algorithms(deterministic)
    try:
        _compile_fullgraph_forward_backward()
    finally:
        torch.use_deterministic_algorithms(False)


def _compile_fullgraph_forward_backward():
    x, w, b = _conv_tensors()
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)

    def fn(x, w, b, q, k, v):
        y = nnprim.conv_forward(x, w, b, padding=1, groups=2, post_ops=[nnprim.Eltwise("silu")])
        o = nnprim.sdpa(q, k, v, causal="bottom_right")
        return y.square().mean() + o.square().mean()

    eager_out, eager_grads = _grads(fn, x, w, b, q, k, v)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    comp_out, comp_grads = _grads(compiled, x, w, b, q, k, v)
    assert torch.allclose(eager_out, comp_out, rtol=1e-5)
    for a, c in zip(eager_grads, comp_grads):
        assert torch.allclose(a, c, rtol=1e-4, atol=1e-6)


def test_torch_compile_modules_inference():
    torch.manual_seed(0)
    conv = nnprim.nn.Conv2d(4, 8, 3, padding=1, post_ops=[nnprim.Eltwise("relu")])
    attn = nnprim.nn.Attention(8, 2, causal=True)

    def fn(x):
        y = conv(x)
        return attn(y.flatten(2).transpose(1, 2))

    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        ref = fn(x)
        out = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(ref, out, atol=1e-6)
    assert torch.allclose(conv(x), F.relu(F.conv2d(x, conv.weight, conv.bias, padding=1)), atol=1e-5)


def test_quantized_kv_through_the_op():
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    kq, vq = nnprim.quantize_kv(k, "s8", group_size=8), nnprim.quantize_kv(v, "u4", group_size=16, symmetric=False)
    with torch.no_grad():
        direct = nnprim.sdpa(q, kq, vq)
        compiled = torch.compile(lambda q: nnprim.sdpa(q, kq, vq), fullgraph=True, backend="aot_eager")(q)
    ref = F.scaled_dot_product_attention(q, kq.dequantize().repeat_interleave(2, 1), vq.dequantize().repeat_interleave(2, 1))
    assert torch.allclose(direct, ref, atol=1e-5) and torch.allclose(compiled, direct)
    with pytest.raises(nnprim.NotSupportedError, match="quantized"):
        nnprim.sdpa(q.requires_grad_(), kq, vq)


def test_kv_lens_values_checked_on_cpu_every_call_and_clamped_in_kernels():
    q, k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    nnprim.sdpa(q, k, v, kv_lens=torch.tensor([5, 24]))
    with pytest.raises(nnprim.BadParameterError, match="kv_lens values"):
        nnprim.sdpa(q, k, v, kv_lens=torch.tensor([5, 25]))  # the same signature: still checked on CPU
    # the Triton kernels clamp what a stale device-side value could say (interpreter)
    over = torch.tensor([5, 1000], dtype=torch.int32)
    from nnprim.args import AttnArgs
    from nnprim.attention.decode import decode_forward
    from nnprim.problems.attention import AttentionProblem
    p = AttentionProblem.from_tensors(q, k, v, kv_lens=over, check_values=False)
    o, _ = decode_forward(p, AttnArgs(q=q, k=k, v=v, kv_lens=over))
    ref = nnprim.sdpa(q, k, v, kv_lens=torch.tensor([5, 24]), solver="attn_reference_fwd")
    assert torch.allclose(o, ref.float(), atol=1e-5)
