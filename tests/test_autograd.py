"""gradcheck in float64 through the library's autograd Functions (which call its own
backward primitives), and the nn modules."""
import pytest
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


def _attention_f64(q, k, v, mask, causal, scale, lens):
    """(o, lse) in float64 by the definition (GQA, an additive mask, causal bottom-right
    aligned to each entry's kv_lens)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = scale * q @ k.transpose(-1, -2) + mask
    sq, sk = s.shape[-2:]
    keep = torch.zeros_like(s, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        keep[b, :, :, :n] = torch.ones(sq, n, dtype=torch.bool).tril(n - sq) if causal else True
    s = s.masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("use_o", [True, False])
def test_sdpa_gradient_through_lse(causal, use_o):
    """lse is differentiable (d lse / d S = P): o and lse in one loss or lse alone, GQA, a
    mask, causal bottom-right aligned per kv_lens, an inverted tensor scale; against the
    float64 definition (lse is f32 by the contract, so not gradcheck)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 3, 8), (2, 2, 6, 8), (2, 2, 6, 5)))
    m = torch.randn(1, 1, 3, 6, generator=g)
    lens = torch.tensor([6, 4])
    wo, wl = torch.randn(2, 4, 3, 5, generator=g), torch.randn(2, 4, 3, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = nnprim.sdpa(qg, kg, vg, attn_mask=m, causal=causal, kv_lens=lens, scale=torch.tensor(2.0),
                         invert_scale=True, return_lse=True)
    ((o * wo).sum() * use_o + (lse * wl).sum()).backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    o2, lse2 = _attention_f64(qr, kr, vr, m.double(), causal, 0.5, lens)
    ((o2 * wo.double()).sum() * use_o + (lse2 * wl.double()).sum()).backward()
    for ours, ref in ((qg, qr), (kg, kr), (vg, vr)):
        if not use_o and ours is vg:
            assert ours.grad is None or not ours.grad.any()
            continue
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_sdpa_lse_gradient_ignores_dropout():
    """lse is taken before dropout: its gradient is the dropout-free one."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    grads = []
    for p in (0.0, 0.4):
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        nnprim.sdpa(qg, kg, v, dropout_p=p, seed=3, return_lse=True)[1].sum().backward()
        grads.append((qg.grad, kg.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sdpa_lse_gradient_through_the_op():
    """The op path (what torch.compile runs) takes lse's gradient too."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(3))

    def loss(q, k, v):
        o, lse = nnprim.sdpa(q, k, v, causal=True, return_lse=True)
        return (o * o).sum() + (lse * lse).sum()
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


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
