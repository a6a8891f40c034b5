"""Quantized / FP8 K/V decode at real sizes on the GPU (issue 14): every KV format (s8, u8, s4,
u4 with groups 32/64/128 and with / without zero points, fp8 e4m3 per head / per tensor),
layouts 0 and 1, V rows or keys-contiguous (order="keys"), forced solvers 121 / 122 and the
public choice, vs the float64 reference of the dequantised cache. Outputs are poisoned
(NaN) before each run; the bound is relative to torch's bf16 SDPA error on the same
dequantised cache (gpu_helpers.assert_close)."""
import pytest
import torch
from gpu_helpers import assert_close, dequant_reference

import nnprim
from nnprim.attention import decode
from nnprim.quant import quantize_kv

pytestmark = pytest.mark.bigmem   # several GiB per test: few at a time (conftest)

DEV = "cuda"
FORMATS = ([("s8", g, zp) for g in (32, 128) for zp in (False, True)] + [("u8", 64, True)]
           + [(d, g, zp) for d in ("s4", "u4") for g in (32, 64, 128) for zp in (False, True)]
           + [("fp8_e4m3", "head", False), ("fp8_e4m3", "tensor", False)])
SHAPES = [(8, 32768), (64, 8192), (16, 16384)]   # (B, Sk); Hq 32, Hkv 8, D 128


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    real = decode._empty
    monkeypatch.setattr(decode, "_empty", lambda shape, dtype, device: real(shape, dtype, device).fill_(float("nan"))
                        if dtype.is_floating_point else real(shape, dtype, device))


def _quant(x, fmt, layout, role):
    dt, g, zp = fmt
    if dt == "fp8_e4m3":
        return quantize_kv(x, dt, scale_per=g, layout=layout, order="keys" if role == "v" else None)
    return quantize_kv(x, dt, group_size=g, symmetric=not zp, scale_dtype=torch.bfloat16, layout=layout,
                       order="keys" if role == "v" else None)


@pytest.mark.parametrize("B,Sk", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}{'-zp' if f[2] else ''}")
def test_formats_real_sizes(B, Sk, fmt):
    if (B, Sk) == SHAPES[2] and fmt[0] not in ("s4", "fp8_e4m3"):
        pytest.skip("the third shape for s4 and fp8 only")
    g = torch.Generator(device=DEV).manual_seed(B + Sk)
    q = torch.randn(B, 32, 1, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, 8, Sk, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, 8, Sk, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    kq, vq = _quant(k, fmt, None, None), _quant(v, fmt, None, "v")
    ref, theirs = dequant_reference(q[:4], _slice(kq, 4), _slice(vq, 4))
    scaled = ("decode_split_k_scaled",) if fmt[0] == "fp8_e4m3" else ()
    for solver in (None, "decode_split_k_quant_grouped", "decode_split_k_quant") + scaled:
        o = nnprim.sdpa(q, kq, vq, solver=solver)
        assert_close(f"{fmt} {solver}", o[:4], theirs, ref)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "s8", "u8"])
@pytest.mark.parametrize("role", [None, "v"])
def test_scaled_codes_real_sizes(fmt, role):
    """Solver 131: 8-bit codes with per-head scales as f16 mma operands, bf16 q of very
    different row sizes (its per-row power-of-two scaling into f16's range), GQA, Sq 2
    causal, ragged lengths, V rows or keys-contiguous."""
    g = torch.Generator(device=DEV).manual_seed(5)
    B, Sk = 16, 16384
    q = torch.randn(B, 32, 2, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    q = q * torch.logspace(-6, 6, 32, device=DEV).view(1, 32, 1, 1).to(q.dtype)
    k = torch.randn(B, 8, Sk, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, 8, Sk, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    if fmt == "u8":
        k, v = k.abs(), v.abs()
    lens = torch.randint(1, Sk + 1, (B,), device=DEV, dtype=torch.int32, generator=g)

    def q8(x, r):
        if fmt == "fp8_e4m3":
            return quantize_kv(x, fmt, scale_per="head", order="keys" if r == "v" else None)
        if fmt == "s8":
            return quantize_kv(x, fmt, scale_per="head", order="keys" if r == "v" else None)
        from nnprim.quant import KVQuant  # u8, per head, no zero point (non-negative values)
        sc = x.float().amax(dim=(2, 3)) / 255
        codes = (x.float() / sc[:, :, None, None]).round().clamp(0, 255).to(torch.uint8)
        if r == "v":
            codes = codes.transpose(2, 3).contiguous().transpose(2, 3)
        return KVQuant(codes, sc, None, "u8")
    kq, vq = q8(k, None), q8(v, role)
    ref, theirs = dequant_reference(q[:4], _slice(kq, 4), _slice(vq, 4), lens[:4], causal=True)
    o = nnprim.sdpa(q, kq, vq, kv_lens=lens, causal="bottom_right", solver="decode_split_k_scaled")
    assert_close(f"131 {fmt} {role}", o[:4], theirs, ref)


def _slice(kv, n):
    from nnprim.quant import KVQuant
    s = kv.scales if kv.scales.numel() == 1 else kv.scales[:n]
    z = kv.zero_points if kv.zero_points is None or kv.zero_points.numel() == 1 else kv.zero_points[:n]
    return KVQuant(kv.data[:n], s, z, kv.dtype, kv.group_size, kv.layout)


@pytest.mark.parametrize("dtype", ["s4", "u4"])
@pytest.mark.parametrize("zp", [False, True])
def test_layouts_and_v_order_agree(dtype, zp):
    """Layout 0 vs 1, V rows vs keys-contiguous: all equal to the same reference; ragged, Sq 4 causal, GQA."""
    g = torch.Generator(device=DEV).manual_seed(7)
    B, Sk = 8, 8192
    q = torch.randn(B, 32, 4, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, 8, Sk, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, 8, Sk, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    lens = torch.randint(1, Sk + 1, (B,), device=DEV, dtype=torch.int32, generator=g)
    for layout in (0, 1):
        for role in (None, "v"):
            kq = _quant(k, (dtype, 64, zp), layout, None)
            vq = _quant(v, (dtype, 64, zp), layout, role)
            ref, theirs = dequant_reference(q, kq, vq, lens, causal=True)
            o = nnprim.sdpa(q, kq, vq, kv_lens=lens, causal="bottom_right")
            assert_close(f"{dtype} layout {layout} role {role}", o, theirs, ref)
