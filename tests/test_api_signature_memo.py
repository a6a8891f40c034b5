"""The public calls' signature memo (api.py: the raw call signature as the context's memo
key): every way of spelling the same call gives the same result as the general path, a
call that differs in anything validated is validated again, and the paths it does not take
(unhashable arguments, autocast, gradients, dropout) still work."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nnprim
from nnprim.search.context import context

CL = torch.channels_last


@pytest.fixture(autouse=True)
def _immediate_mode():
    """Heuristic choices (no find): the memo, not the search, is under test."""
    mode = nnprim.get_find_mode()
    nnprim.set_find_mode("fast")
    yield
    nnprim.set_find_mode(mode)


def _xw(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 9, 7, generator=g).to(dtype).to(memory_format=CL)
    w = torch.randn(8, 8, 3, 3, generator=g).to(dtype).to(memory_format=CL)
    b = torch.randn(8, generator=g).to(dtype)
    return x, w, b


def test_conv_spellings_agree():
    x, w, b = _xw()
    ref = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    outs = [nnprim.conv_forward(x, w, b, padding=1), nnprim.conv_forward(x, w, b, padding=(1, 1)),
            nnprim.conv_forward(x, w, b, padding=[1, 1], stride=[1, 1]),   # lists: the general path
            nnprim.conv_forward(x, w, b, padding="same"), nnprim.conv_forward(x, w, b, padding=1)]
    for y in outs:
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)


def test_conv_validated_when_the_signature_changes():
    x, w, b = _xw()
    nnprim.conv_forward(x, w, b, padding=1)
    with pytest.raises(nnprim.BadParameterError):
        nnprim.conv_forward(x, w.double(), b, padding=1)          # dtypes differ
    with pytest.raises(nnprim.BadParameterError):
        nnprim.conv_forward(x, w, b[:4], padding=1)               # bias shape
    with pytest.raises(nnprim.BadParameterError):
        nnprim.conv_forward(x, w, b, padding=-1)
    with pytest.raises(nnprim.BadParameterError):
        nnprim.conv_forward(x, w, b, padding=1, solver=1.5)       # not a solver name or id
    with pytest.raises(nnprim.BadParameterError):
        nnprim.conv_backward_data(x, w, (2, 8, 9), padding=1)     # x_shape of the wrong rank
    with pytest.raises(nnprim.BadParameterError):
        nnprim.conv_backward_weights(x, x, (8, 8, 3), padding=1)


def test_conv_grad_and_no_grad_share_the_choice():
    x, w, b = _xw()
    with torch.no_grad():
        y0 = nnprim.conv_forward(x, w, b, padding=1)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    xg = xg.detach().to(memory_format=CL).requires_grad_()
    for _ in range(2):
        y = nnprim.conv_forward(xg, wg, bg, padding=1)
        assert torch.equal(y.detach(), y0)
        y.sum().backward()
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.conv2d(xr, wr, br, padding=1).sum().backward()
    for ours, ref in ((xg, xr), (wg, wr), (bg, br)):
        torch.testing.assert_close(ours.grad.double(), 2 * ref.grad, rtol=1e-4, atol=1e-4)


def test_fused_conv_memo_agrees_and_validates():
    """Post-op chains take the memo too (api._fused_fast); the chain's tensors are part of the
    signature, bad ones are validated on every call, and the paths the memo leaves (a Binary
    tensor below y's rank, gradients, a list stride) give the same answers."""
    from nnprim.post_ops import Binary, Eltwise, Sum
    x, w, b = _xw()
    g = torch.Generator().manual_seed(3)
    r = torch.randn(2, 8, 9, 7, generator=g).to(memory_format=CL)
    r2 = torch.randn(2, 8, 9, 7, generator=g)                        # NCHW residual: another signature
    m = torch.randn(8, generator=g)
    conv = F.conv2d(x.double(), w.double(), b.double(), padding=1)

    def ref(res, scale=1.0, mul=None):
        y = conv + scale * res.double()
        y = y if mul is None else y * mul.double().reshape(1, 8, 1, 1)
        return torch.relu(y)
    for _ in range(2):
        for res, scale in ((r, 1.0), (r2, 1.0), (r, 0.5)):
            y = nnprim.conv_forward(x, w, b, padding=1, post_ops=(Sum(res, scale), Eltwise("relu")))
            torch.testing.assert_close(y.double(), ref(res, scale), rtol=1e-4, atol=1e-4)
        for mul in (m, m.reshape(1, 8, 1, 1)):                       # general path, then the memo
            y = nnprim.conv_forward(x, w, b, padding=1, post_ops=[Sum(r), Binary("mul", mul), Eltwise("relu")])
            z = conv + r.double()
            torch.testing.assert_close(y.double(), torch.relu(z * mul.double().reshape(1, 8, 1, 1)),
                                       rtol=1e-4, atol=1e-4)
        y = nnprim.conv_forward(x, w, b, padding=[1, 1], post_ops=(Sum(r), Eltwise("relu")))
        torch.testing.assert_close(y.double(), ref(r), rtol=1e-4, atol=1e-4)
    for bad in ((Sum(r[:, :, :8]),), (Sum(r.long()),), (Binary("add", torch.randn(1, 3, 1, 1)),), ("relu",)):
        for _ in range(2):
            with pytest.raises(nnprim.BadParameterError):
                nnprim.conv_forward(x, w, b, padding=1, post_ops=bad)
    rg = r.clone().requires_grad_()
    y = nnprim.conv_forward(x, w, b, padding=1, post_ops=(Sum(rg), Eltwise("relu")))
    y.sum().backward()
    torch.testing.assert_close(rg.grad.double(), (ref(r) > 0).double(), rtol=0, atol=0)


def test_conv_autocast_on_the_hot_path(monkeypatch):
    """Under autocast the inputs are cast first and the cast call is memoised like any other
    (a model trained under autocast called the general path for every conv): the same
    result as the explicitly cast call, gradients into the f32 leaves, one problem build."""
    from nnprim import api
    x, w, b = _xw()
    exp = nnprim.conv_forward(x.bfloat16(), w.bfloat16(), b.bfloat16(), padding=1)
    builds = []
    raw = api._raw_fwd_problem
    monkeypatch.setattr(api, "_raw_fwd_problem", lambda *a: builds.append(1) or raw(*a))
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = nnprim.conv_forward(x, w, b, padding=1)
        assert y.dtype == torch.bfloat16 and torch.equal(y, exp)
    assert len(builds) <= 1
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = nnprim.conv_forward(x, wg, bg, padding=1)
    assert torch.equal(y, exp)
    y.float().sum().backward()
    assert wg.grad.dtype == torch.float32 and bg.grad.dtype == torch.float32
    ref_w = torch.nn.grad.conv2d_weight(x.double(), w.shape, torch.ones_like(exp, dtype=torch.double), padding=1)
    torch.testing.assert_close(wg.grad.double(), ref_w, rtol=2e-2, atol=2e-2 * ref_w.abs().max().item())


def test_sdpa_autocast_on_the_hot_path():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
    exp = nnprim.sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal="top_left")
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = nnprim.sdpa(q, k, v, causal="top_left")
        assert o.dtype == torch.bfloat16 and torch.equal(o, exp)
    qg = q.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = nnprim.sdpa(qg, k, v, causal="top_left")
    o.float().sum().backward()
    assert qg.grad is not None and qg.grad.dtype == torch.float32 and torch.isfinite(qg.grad).all()


def test_conv_forced_solver_spellings():
    x, w, b = _xw()
    name = context("cpu").resolve(
        nnprim.ConvProblem.create("fwd", x.shape, w.shape, dtype=x.dtype, layout="nhwc", device="cpu", padding=1,
                                  has_bias=True),
        None).name
    from nnprim.search.solver import REGISTRY
    s = REGISTRY.get(name)
    outs = [nnprim.conv_forward(x, w, b, padding=1, solver=v) for v in (name, s.id, s)]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_backward_calls_agree_with_torch():
    x, w, _ = _xw()
    dy = torch.randn(2, 8, 9, 7).to(memory_format=CL)
    for shape in (x.shape, tuple(x.shape), list(x.shape)):
        dx = nnprim.conv_backward_data(dy, w, shape, padding=1)
        torch.testing.assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w, dy, padding=1), rtol=1e-4, atol=1e-4)
    for shape in (w.shape, tuple(w.shape), list(w.shape)):
        dw = nnprim.conv_backward_weights(dy, x, shape, padding=1)
        torch.testing.assert_close(dw, torch.nn.grad.conv2d_weight(x, w.shape, dy, padding=1), rtol=1e-4, atol=1e-4)


def test_sdpa_spellings_and_paths():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 13, 16, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    for kw in (dict(causal=True), dict(causal="top_left"), dict(causal=True, scale=0.25), dict(causal=True)):
        o = nnprim.sdpa(q, k, v, **kw)
        r = ref if "scale" not in kw else F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                         is_causal=True, scale=0.25)
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)
    o, lse = nnprim.sdpa(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (2, 4, 13)
    with pytest.raises(nnprim.BadParameterError):
        nnprim.sdpa(q, k, v, causal="bottom")
    with pytest.raises(nnprim.BadParameterError):
        nnprim.sdpa(q, k, v, seed=-1)
    # gradients through the memoised path, twice
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for _ in range(2):
        nnprim.sdpa(qg, kg, vg, causal=True).sum().backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).sum().backward()
    for ours, r in ((qg, qr), (kg, kr), (vg, vr)):
        torch.testing.assert_close(ours.grad.double(), 2 * r.grad, rtol=1e-4, atol=1e-4)
    # dropout takes the general path (a fresh mask per seed)
    a = nnprim.sdpa(q, k, v, dropout_p=0.5, seed=1)
    b = nnprim.sdpa(q, k, v, dropout_p=0.5, seed=2)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_grad_path_takes_each_calls_mask(kind):
    """Gradient calls of one signature with masks of equal shape and other values: each call
    its own mask, forward and backward (the memo once held the first call's mask)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    keep = [torch.ones(8, 8, dtype=torch.bool), torch.ones(8, 8, dtype=torch.bool).tril(),
            torch.rand(8, 8, generator=g) > 0.3]
    for m in keep:
        m[:, 0] = True       # no fully masked row
    masks = keep if kind == "bool" else [torch.zeros(8, 8).masked_fill(~m, -1e4) for m in keep]
    for m in masks:
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        o = nnprim.sdpa(qg, kg, vg, attn_mask=m)
        o.backward(torch.ones_like(o))
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        r = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=m if kind == "bool" else m.double())
        r.backward(torch.ones_like(r))
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)
        for ours, ref in ((qg, qr), (kg, kr), (vg, vr)):
            torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-4)


def test_sdpa_quantized_kv_memo(monkeypatch):
    """KVQuant caches take the memoised path: the same results as the general path (a tensor
    scale takes it), a new problem
    when the quantization differs (format, group, layout, zero points), and a q that
    requires grad still takes the op's path."""
    from nnprim.ops import attention as attn_ops
    from nnprim.quant import quantize_kv
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 1, 32, generator=g)
    k, v = (torch.randn(2, 2, 40, 32, generator=g) for _ in range(2))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    variants = [dict(dtype="s8", group_size=32), dict(dtype="s4", group_size=16),
                dict(dtype="u4", group_size=16, symmetric=False), dict(dtype="s4", group_size=16, layout=1),
                dict(dtype="s4", group_size=8)]
    outs = []
    for kw in variants:
        dt = kw.pop("dtype")
        kq, vq = quantize_kv(k, dt, **kw), quantize_kv(v, dt, **kw)
        o = nnprim.sdpa(q, kq, vq)
        torch.testing.assert_close(o.double(), ref, rtol=0.2, atol=0.2)
        outs.append(o)
        # the general path (the op) gives the same bits
        og = nnprim.sdpa(q, kq, vq, scale=torch.tensor(32 ** -0.5))
        torch.testing.assert_close(og, o, rtol=1e-5, atol=1e-5)
    assert all(not torch.equal(a, b) for a, b in zip(outs, outs[1:])), "a quantization reused another's problem"
    # the memoised path skips the op once the signature is known
    kq, vq = quantize_kv(k, "s8", group_size=32), quantize_kv(v, "s8", group_size=32)
    nnprim.sdpa(q, kq, vq)
    monkeypatch.setattr(attn_ops, "sdpa_forward", lambda *a, **kw: pytest.fail("general path taken"))
    nnprim.sdpa(q, quantize_kv(k * 2, "s8", group_size=32), vq)
    monkeypatch.undo()
    # a q that requires grad takes the general path, which refuses gradients through quantized K/V
    with pytest.raises(nnprim.NotSupportedError):
        nnprim.sdpa(q.clone().requires_grad_(), kq, vq)


def test_conv_backward_keyed_by_the_forward_call():
    """The backward of a memoised forward runs under keys of that call and dy's strides: grads
    of repeated calls, with dy in y's layout and in another, equal the float64 ones."""
    x, w, b = _xw()
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    yd = F.conv2d(xd, wd, bd, padding=1)
    for dy_layout in (CL, torch.contiguous_format, CL):
        g = torch.Generator().manual_seed(3)
        dy = torch.randn(yd.shape, generator=g).contiguous(memory_format=dy_layout)
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        y = nnprim.conv_forward(xg, wg, bg, padding=1)
        y.backward(dy)
        ref = torch.autograd.grad(yd, (xd, wd, bd), dy.double(), retain_graph=True)
        for got, exp in zip((xg.grad, wg.grad, bg.grad), ref):
            torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-4)
