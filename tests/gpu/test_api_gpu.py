"""Every public function on the GPU at real sizes, through autograd, against torch's own
ops (cuDNN, torch SDPA) with errors bounded by torch's same-dtype error against float64;
and no problem falls back to the float64 reference."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_close, chosen_solvers, no_reference

import nnprim
from nnprim.problems.conv import layout_of

DEV = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@pytest.fixture(autouse=True)
def _no_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="nnprim: solver .* failed")
        yield


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "nchw":
        return t.contiguous()
    fmt = {3: None, 4: torch.channels_last, 5: torch.channels_last_3d}[t.dim()]
    if fmt is None:  # 1D channels-last: (N, L, C) storage
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous(memory_format=fmt)


CONV_CASES = [
    # x shape, w shape, options, layout, dtype
    ((32, 128, 28, 28), (128, 128, 3, 3), dict(padding=1), "nhwc", BF16),
    ((16, 256, 14, 14), (512, 256, 1, 1), dict(stride=2), "nhwc", BF16),
    ((8, 64, 56, 56), (64, 64, 3, 3), dict(padding=1), "nchw", F16),
    ((8, 96, 33, 33), (96, 1, 3, 3), dict(padding=1, groups=96), "nhwc", BF16),
    ((4, 128, 17, 17), (128, 4, 3, 3), dict(padding=1, groups=32), "nhwc", BF16),
    ((4, 3, 224, 224), (64, 3, 7, 7), dict(stride=2, padding=3), "nhwc", BF16),
    ((8, 64, 1000), (64, 64, 3), dict(padding=1), "nhwc", BF16),
    ((2, 32, 8, 16, 16), (32, 32, 3, 3, 3), dict(padding=1), "nhwc", BF16),
    ((4, 64, 30, 30), (64, 64, 3, 3), dict(padding=2, dilation=2), "nhwc", F32),
]


def _conv_id(c) -> str:
    return f"x{'x'.join(map(str, c[0]))}-w{'x'.join(map(str, c[1]))}-{c[3]}-{str(c[4])[6:]}"


@pytest.mark.parametrize("case", CONV_CASES, ids=_conv_id)
def test_conv_autograd(case):
    xs, ws, kw, layout, dt = case
    g = torch.Generator(device=DEV).manual_seed(0)
    x64 = torch.randn(xs, device=DEV, dtype=torch.float64, generator=g)
    w64 = torch.randn(ws, device=DEV, dtype=torch.float64, generator=g) / (ws[1] * max(1, ws[2] ** 2)) ** 0.5
    b64 = torch.randn(ws[0], device=DEV, dtype=torch.float64, generator=g)
    conv = _CONV[len(xs) - 2]
    leaves = {}
    outs = {}
    dy64 = None
    for name, dtype, fn in (("ref", torch.float64, conv), ("torch", dt, conv), ("ours", dt, nnprim.conv_forward)):
        x = _layout(x64.to(dtype, copy=True), layout).requires_grad_()
        w = _layout(w64.to(dtype, copy=True), layout).requires_grad_()
        b = b64.to(dtype, copy=True).requires_grad_()
        y = fn(x, w, b, **kw)
        if dy64 is None:
            dy64 = torch.randn(y.shape, device=DEV, dtype=torch.float64, generator=g)
        y.backward(_layout(dy64.to(y.dtype), layout))
        leaves[name], outs[name] = (x, w, b), y
    assert layout_of(outs["ours"]) == layout
    assert_close("y", outs["ours"].detach(), outs["torch"].detach(), outs["ref"].detach())
    for i, name in enumerate(("dx", "dw", "db")):
        assert_close(f"{name} (solvers {sorted(set(chosen_solvers().values()))})", leaves["ours"][i].grad,
                     leaves["torch"][i].grad, leaves["ref"][i].grad)
    no_reference()


def test_conv_and_sdpa_under_autocast():
    """Mixed-precision training as users run it: nn.Conv2d and sdpa under torch.autocast with
    f32 leaves, on the memoised hot path (inputs cast first), against torch's same calls under
    autocast and float64; repeated steps build each problem once (forward and the backward's
    keyed calls)."""
    from nnprim import api
    g = torch.Generator(device=DEV).manual_seed(1)
    x64 = torch.randn(16, 64, 28, 28, device=DEV, dtype=torch.float64, generator=g)
    w64 = torch.randn(64, 64, 3, 3, device=DEV, dtype=torch.float64, generator=g) / 24
    dy64 = torch.randn(16, 64, 28, 28, device=DEV, dtype=torch.float64, generator=g)
    ref_x, ref_w = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    F.conv2d(ref_x, ref_w, padding=1).backward(dy64)
    grads = {}
    for name, fn in (("torch", F.conv2d), ("ours", nnprim.conv_forward)):
        for _ in range(3):
            x = _layout(x64.float(), "nhwc").requires_grad_()
            w = _layout(w64.float(), "nhwc").requires_grad_()
            with torch.autocast(DEV, dtype=BF16):
                y = fn(x, w, None, padding=1)
            assert y.dtype == BF16
            y.backward(_layout(dy64.to(BF16), "nhwc"))
            grads[name] = (y.detach(), x.grad, w.grad)
    assert grads["ours"][1].dtype == F32 and grads["ours"][2].dtype == F32
    y_ref = F.conv2d(x64, w64, padding=1)
    for i, (name, ref) in enumerate((("y", y_ref), ("dx", ref_x.grad), ("dw", ref_w.grad))):
        assert_close(f"autocast {name}", grads["ours"][i], grads["torch"][i], ref)
    sig_keys = [k for k in api.context(torch.device(DEV)).calls if isinstance(k, tuple) and k and k[0] in
                ("conv_forward", "of")]
    assert len(sig_keys) >= 3
    q64, k64, v64 = (torch.randn(2, 8, 256, 64, device=DEV, dtype=torch.float64, generator=g) for _ in range(3))
    o = {}
    for name, fn in (("torch", F.scaled_dot_product_attention), ("ours", nnprim.sdpa)):
        q = q64.float().requires_grad_()
        with torch.autocast(DEV, dtype=BF16):
            o[name] = fn(q, k64.float(), v64.float())
        assert o[name].dtype == BF16
        o[name].float().sum().backward()
        assert q.grad is not None and q.grad.dtype == F32 and torch.isfinite(q.grad).all()
    assert_close("autocast sdpa", o["ours"].detach(), o["torch"].detach(),
                 F.scaled_dot_product_attention(q64, k64, v64))
    no_reference()


def test_conv_fused_post_ops_and_direct_backward_calls():
    g = torch.Generator(device=DEV).manual_seed(2)
    x = _layout(torch.randn(16, 64, 28, 28, device=DEV, generator=g), "nhwc")
    w = _layout(torch.randn(64, 64, 3, 3, device=DEV, generator=g) / 24, "nhwc")
    b = torch.randn(64, device=DEV, generator=g)
    res = _layout(torch.randn(16, 64, 28, 28, device=DEV, generator=g), "nhwc")
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1) + res.double())
    tor = F.relu(F.conv2d(x.bfloat16(), w.bfloat16(), b.bfloat16(), padding=1) + res.bfloat16())
    y = nnprim.conv_forward(x.bfloat16(), w.bfloat16(), b.bfloat16(), padding=1,
                            post_ops=[nnprim.Sum(res.bfloat16()), nnprim.Eltwise("relu")])
    assert_close("fused", y, tor, ref)
    dy = torch.randn_like(y)
    dx = nnprim.conv_backward_data(dy, w.bfloat16(), x.shape, padding=1)
    dw = nnprim.conv_backward_weights(dy, x.bfloat16(), w.shape, padding=1)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    F.conv2d(xr, wr, padding=1).backward(dy.double())
    xt, wt = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    F.conv2d(xt, wt, padding=1).backward(dy)
    assert_close("dx", dx, xt.grad, xr.grad)
    assert_close("dw", dw, wt.grad, wr.grad)
    assert torch.equal(nnprim.conv_backward_bias(dy).float(), dy.float().sum((0, 2, 3)).bfloat16().float()) or \
        torch.allclose(nnprim.conv_backward_bias(dy).float(), dy.double().sum((0, 2, 3)).float(), rtol=1e-2, atol=1e-1)
    no_reference()


ATTN_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, causal, mask, dtype
    (2, 16, 4, 2048, 2048, 128, "top_left", None, BF16),
    (2, 8, 8, 1000, 1000, 64, None, None, BF16),
    (1, 8, 2, 512, 1536, 128, "bottom_right", None, F16),
    (2, 4, 4, 333, 333, 256, "top_left", None, BF16),
    (2, 8, 2, 256, 300, 64, None, "bool", BF16),
    (2, 4, 1, 128, 200, 96, None, "additive", F32),
]


def _attn_id(c) -> str:
    return f"b{c[0]}h{c[1]}-{c[2]}-s{c[3]}-{c[4]}-d{c[5]}-{c[6]}-{c[7]}-{str(c[8])[6:]}"


def _torch_sdpa(q, k, v, mask, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if causal == "bottom_right":
        Sq, Sk = q.shape[2], k.shape[2]
        keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal == "top_left")


@pytest.mark.parametrize("case", ATTN_CASES, ids=_attn_id)
def test_sdpa_autograd(case):
    B, Hq, Hkv, Sq, Sk, D, causal, mask_kind, dt = case
    g = torch.Generator(device=DEV).manual_seed(3)
    q64 = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.float64, generator=g)
    k64 = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.float64, generator=g)
    v64 = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.float64, generator=g)
    do64 = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.float64, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Sq, Sk, device=DEV, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "additive":
        mask = torch.randn(1, Hq, Sq, Sk, device=DEV, dtype=torch.float64, generator=g)
    grads, outs = {}, {}
    for name, dtype in (("ref", torch.float64), ("torch", dt), ("ours", dt)):
        q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (q64, k64, v64))
        m = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
        if name == "ours":
            o = nnprim.sdpa(q, k, v, attn_mask=m, causal=causal)
        else:
            o = _torch_sdpa(q, k, v, m, causal)
        o.backward(do64.to(dtype))
        outs[name], grads[name] = o.detach(), (q.grad, k.grad, v.grad)
    assert_close("o", outs["ours"], outs["torch"], outs["ref"])
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close(name, grads["ours"][i], grads["torch"][i], grads["ref"][i])
    no_reference()


def test_sdpa_backward_and_lse():
    g = torch.Generator(device=DEV).manual_seed(4)
    q, k, v, do = (torch.randn(2, 8, 512, 64, device=DEV, dtype=BF16, generator=g) for _ in range(4))
    o, lse = nnprim.sdpa(q, k, v, causal=True, return_lse=True)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8
    s = s.masked_fill(~torch.ones(512, 512, dtype=torch.bool, device=DEV).tril(), float("-inf"))
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=2e-2)
    dq, dk, dv = nnprim.sdpa_backward(do, q, k, v, o, lse, causal=True)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).backward(do.double())
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(do)
    for name, a, b_, r in (("dq", dq, qt.grad, qr.grad), ("dk", dk, kt.grad, kr.grad), ("dv", dv, vt.grad, vr.grad)):
        assert_close(name, a, b_, r)
    no_reference()


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_sdpa_gradient_through_lse(causal):
    """A loss through o and the returned lse (GQA, kv_lens), bf16 on the GPU's solvers, against
    the float64 definition (torch's SDPA has no differentiable lse to compare with)."""
    g = torch.Generator(device=DEV).manual_seed(5)
    B, Hq, Hkv, Sq, Sk, D = 2, 8, 2, 300, 700, 128
    q64, k64, v64 = (torch.randn(B, h, s, D, device=DEV, dtype=torch.float64, generator=g)
                     for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    wo = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.float64, generator=g)
    wl = torch.randn(B, Hq, Sq, device=DEV, dtype=torch.float64, generator=g)
    lens = torch.tensor([Sk, 450], device=DEV, dtype=torch.int32)
    keep = torch.zeros(B, 1, Sq, Sk, dtype=torch.bool, device=DEV)
    for b, n in enumerate(lens.tolist()):
        keep[b, :, :, :n] = torch.ones(Sq, n, dtype=torch.bool, device=DEV).tril(n - Sq) if causal else True
    grads = {}
    for name, dt in (("ours", BF16), ("ref", torch.float64)):
        q, k, v = (t.to(dt, copy=True).requires_grad_() for t in (q64, k64, v64))
        if name == "ours":
            o, lse = nnprim.sdpa(q, k, v, causal=causal, kv_lens=lens, return_lse=True)
        else:
            kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
            s = (q @ kk.transpose(-1, -2) / D ** 0.5).masked_fill(~keep, float("-inf"))
            o, lse = s.softmax(-1) @ vv, s.logsumexp(-1)
        ((o.double() * wo).sum() + (lse.double() * wl).sum()).backward()
        grads[name] = (q.grad, k.grad, v.grad)
    for name, a, r in zip(("dq", "dk", "dv"), grads["ours"], grads["ref"]):
        err = ((a.double() - r).norm() / r.norm()).item()
        assert err < 2e-2, (name, err)
    no_reference()


@pytest.mark.parametrize("fmt", ["bf16", "s8", "s4", "u4"])
def test_decode(fmt):
    g = torch.Generator(device=DEV).manual_seed(5)
    B, Hq, Hkv, Sk, D = 8, 32, 8, 8192, 128
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=BF16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16, generator=g)
    lens = torch.randint(1, Sk + 1, (B,), device=DEV, generator=g).int()
    kk, vv = k, v
    if fmt != "bf16":
        kk = nnprim.quantize_kv(k, fmt, group_size=64, symmetric=fmt != "u4")
        vv = nnprim.quantize_kv(v, fmt, group_size=64, symmetric=fmt != "u4")
    o = nnprim.sdpa(q, kk, vv, kv_lens=lens)
    kd = kk.dequantize(torch.float64) if fmt != "bf16" else k.double()
    vd = vv.dequantize(torch.float64) if fmt != "bf16" else v.double()
    keep = torch.arange(Sk, device=DEV)[None, :] < lens[:, None].long()
    ref = F.scaled_dot_product_attention(q.double(), kd.repeat_interleave(4, 1), vd.repeat_interleave(4, 1),
                                         attn_mask=keep[:, None, None, :])
    tor = F.scaled_dot_product_attention(q, kd.to(BF16).repeat_interleave(4, 1), vd.to(BF16).repeat_interleave(4, 1),
                                         attn_mask=keep[:, None, None, :])
    assert_close("o", o, tor, ref)
    no_reference()
