"""gradcheck in float64 through the library's autograd Functions (which call its own
backward primitives), and the nn modules."""
import torch

import nnprim


def test_conv_gradcheck_2d_groups_stride():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 2, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    f = lambda x, w, b: nnprim.conv_forward(x, w, b, stride=(2, 1), padding=((1, 0), (0, 1)), dilation=(1, 2), groups=2)
    assert torch.autograd.gradcheck(f, (x, w, b))


def test_conv_gradcheck_1d_3d_with_post_ops():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(1, 2, 7, generator=g, dtype=torch.float64, requires_grad=True)
    f = lambda x, w, r: nnprim.conv_forward(x, w, padding=1, post_ops=[nnprim.Sum(r, 0.5), nnprim.Eltwise("tanh")])
    assert torch.autograd.gradcheck(f, (x, w, r))
    x3 = torch.randn(1, 2, 3, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w3 = torch.randn(2, 2, 2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: nnprim.conv_forward(x, w, padding=1, stride=2), (x3, w3))


def test_sdpa_gradcheck_gqa_causal_mask():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    m = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)
    f = lambda q, k, v: nnprim.sdpa(q, k, v, attn_mask=m, causal="bottom_right")
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_sdpa_gradcheck_dropout_kv_lens():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([5, 2])
    f = lambda q, k, v: nnprim.sdpa(q, k, v, dropout_p=0.3, seed=7, kv_lens=lens, scale=0.7)
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_sdpa_backward_memoised_by_the_forward_call():
    """The autograd backward of a memoised forward call is keyed by that call: the same
    gradients as sdpa_backward called directly, on repeated calls and for a gradient that
    reaches o non-contiguous (through a transpose)."""
    from nnprim.search.context import context

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    w = torch.randn(2, 9, 4, 8, generator=g)
    o, lse = nnprim.sdpa(q, k, v, causal="top_left", return_lse=True)
    do = w.transpose(1, 2)
    keyed = lambda: {key for key in context("cpu").calls if type(key) is tuple and key[0] == "bwd_of"}
    before = keyed()
    want = nnprim.sdpa_backward(do, q, k, v, o, lse, causal="top_left")
    for _ in range(3):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        og = nnprim.sdpa(qg, kg, vg, causal="top_left")
        (og.transpose(1, 2) * w).sum().backward()
        for got, ref in zip((qg.grad, kg.grad, vg.grad), want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert len(keyed() - before) == 1


def test_nn_modules_train_step():
    torch.manual_seed(0)
    conv = nnprim.nn.Conv2d(3, 4, 3, padding=1, post_ops=[nnprim.Eltwise("relu")])
    ref = torch.nn.Conv2d(3, 4, 3, padding=1)
    ref.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 8, 8)
    y, yr = conv(x), torch.relu(ref(x))
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    for cls, shape in ((nnprim.nn.Conv1d, (2, 3, 9)), (nnprim.nn.Conv3d, (1, 3, 4, 5, 6))):
        m = cls(3, 2, 3, padding=1)
        assert m(torch.randn(shape)).shape[:2] == shape[:1] + (2,)
    attn = nnprim.nn.Attention(32, num_heads=4, num_kv_heads=2, causal=True)
    xs = torch.randn(2, 6, 32, requires_grad=True)
    out = attn(xs)
    assert out.shape == xs.shape
    out.square().mean().backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all()
