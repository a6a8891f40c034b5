"""Solver 128 (decode_swap_ab_quant, swap-AB) at real sizes on the GPU (issue 14): every KV
format (s8 / u8, s4 / u4 with groups 32 / 64 / 128 with and without zero points, fp8 e4m3 per
head / per tensor), layouts 0 and 1, V keys-contiguous (order="keys") or rows, bf16 and f16 q,
Sq 1 and 4 causal ragged, paged, forced and through the public choice; against the float64
attention of the dequantised cache. Outputs are poisoned (NaN) before each run; the bound is
relative to torch's same-dtype SDPA error on the same cache (gpu_helpers.assert_close), as in
test_decode_quant_gpu.py."""
import pytest
import torch
from gpu_helpers import assert_close, dequant_reference

import nnprim
from nnprim.attention import decode
from nnprim.paged import to_pages
from nnprim.quant import KVQuant, quantize_kv

pytestmark = pytest.mark.bigmem   # several GiB per test: few at a time (conftest)

DEV = "cuda"
SOLVER = "decode_swap_ab_quant"
FORMATS = ([("s8", g, zp) for g in (32, 128) for zp in (False, True)] + [("u8", 64, True)]
           + [(d, g, zp) for d in ("s4", "u4") for g in (32, 64, 128) for zp in (False, True)]
           + [("fp8_e4m3", "head", False), ("fp8_e4m3", "tensor", False)])
SHAPES = [(64, 8192), (8, 32768)]   # (B, Sk): decode_b64_k8k, decode_b8_k32k; Hq 32, Hkv 8, D 128


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    real = decode._empty
    monkeypatch.setattr(decode, "_empty", lambda shape, dtype, device: real(shape, dtype, device).fill_(float("nan"))
                        if dtype.is_floating_point else real(shape, dtype, device))


def _quant(x, fmt, layout=None, role=None):
    dt, g, zp = fmt
    if dt == "fp8_e4m3":
        return quantize_kv(x, dt, scale_per=g, order="keys" if role == "v" else None)
    return quantize_kv(x, dt, group_size=g, symmetric=not zp, scale_dtype=torch.bfloat16, layout=layout,
                       order="keys" if role == "v" else None)


def _slice(kv, n):
    s = kv.scales if kv.scales.numel() == 1 else kv.scales[:n]
    z = kv.zero_points if kv.zero_points is None or kv.zero_points.numel() == 1 else kv.zero_points[:n]
    return KVQuant(kv.data[:n], s, z, kv.dtype, kv.group_size, kv.layout)


def _rand(B, Sq, Sk, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(B, 32, Sq, 128, device=DEV, dtype=dtype, generator=g),
            torch.randn(B, 8, Sk, 128, device=DEV, dtype=dtype, generator=g),
            torch.randn(B, 8, Sk, 128, device=DEV, dtype=dtype, generator=g))


@pytest.mark.parametrize("B,Sk", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}{'-zp' if f[2] else ''}")
def test_formats_real_sizes(B, Sk, fmt):
    q, k, v = _rand(B, 1, Sk, torch.bfloat16, B + Sk)
    kq, vq = _quant(k, fmt), _quant(v, fmt, role="v")
    ref, theirs = dequant_reference(q[:4], _slice(kq, 4), _slice(vq, 4))
    for solver in (SOLVER, None):
        o = nnprim.sdpa(q, kq, vq, solver=solver)
        assert_close(f"{fmt} {solver}", o[:4], theirs, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [("s4", 64, False), ("u4", 32, True), ("s8", 64, True), ("u8", 128, False),
                                 ("fp8_e4m3", "head", False)], ids=lambda f: f"{f[0]}-{f[1]}{'-zp' if f[2] else ''}")
def test_layouts_v_order_sq4_causal_ragged(dtype, fmt):
    """Layout 0 / 1, V rows / keys-contiguous, f16 and bf16 q, Sq 4 causal bottom-right with ragged
    kv_lens (partial last key blocks), return_lse finite where rows see keys."""
    q, k, v = _rand(8, 4, 8192, dtype, 7)
    lens = torch.randint(1, 8193, (8,), device=DEV, dtype=torch.int32,
                         generator=torch.Generator(device=DEV).manual_seed(3))
    for layout in ((0, 1) if fmt[0] in ("s4", "u4") else (None,)):
        for role in (None, "v"):
            kq, vq = _quant(k, fmt, layout), _quant(v, fmt, layout, role)
            ref, theirs = dequant_reference(q, kq, vq, lens, causal=True)
            o, lse = nnprim.sdpa(q, kq, vq, kv_lens=lens, causal="bottom_right", return_lse=True, solver=SOLVER)
            assert_close(f"{fmt} {dtype} layout {layout} role {role}", o, theirs, ref)
            assert torch.isfinite(lse).all()


@pytest.mark.parametrize("page", [16, 64, 256])
# fp8 per tensor: a page pool shares one scale per head across batch entries, and
# quantize_kv's per-head scales differ between them (to_pages rejects those)
@pytest.mark.parametrize("fmt", [("s4", 32, False), ("u4", 64, True), ("s8", 64, False), ("fp8_e4m3", "tensor", False)],
                         ids=lambda f: f"{f[0]}-{f[1]}{'-zp' if f[2] else ''}")
def test_paged_equals_contiguous(page, fmt):
    """Page pools (shuffled pages) give the contiguous cache's result, ragged kv_lens."""
    B, Sk = 8, 16384
    q, k, v = _rand(B, 1, Sk, torch.bfloat16, page)
    kq, vq = _quant(k, fmt), _quant(v, fmt)
    M = Sk // page
    g = torch.Generator(device=DEV).manual_seed(1)
    bt = torch.randperm(B * M, device=DEV, generator=g).reshape(B, M).to(torch.int32)
    lens = torch.randint(1, Sk + 1, (B,), device=DEV, dtype=torch.int32, generator=g)
    kp, vp = to_pages(kq, bt), to_pages(vq, bt)
    o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, solver=SOLVER)
    oc = nnprim.sdpa(q, kq, vq, kv_lens=lens, solver=SOLVER)
    ref, theirs = dequant_reference(q, kq, vq, lens)
    assert_close(f"paged {fmt} page {page}", o, theirs, ref)
    assert (o.float() - oc.float()).abs().max() <= 1e-2 * oc.float().abs().max()
