"""Decode attention on 8-bit codes with per-tensor / per-head scales, solver 131
(decode_split_k_scaled), against the float64 reference (dequantize then attend) through the
Triton interpreter at small shapes. The launcher's buffers are poisoned so unwritten
elements show."""
from dataclasses import replace

import pytest
import torch

from nnprim.attention import decode
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.solver import REGISTRY

from .decode_checks import SMALL, check_decode, make_case, poison_buffers

S131 = REGISTRY.get("decode_split_k_scaled")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_buffers(monkeypatch)


def quant(x, fmt: str, per: str = "head", role=None):
    if fmt == "fp8_e4m3":
        return quantize_kv(x, fmt, scale_per=per, order="keys" if role == "v" else None)
    return quantize_kv(x, fmt, scale_per=per, symmetric=True, order="keys" if role == "v" else None)


def check(q, k, v, cfg=SMALL, **opts):
    """Solver 131's plan with `cfg` against the reference."""
    def run(problem, args):
        return decode.DecodePlan(problem, cfg, S131.prepare(problem).plan_fn)(args)
    return check_decode(q, k, v, run, S131.id, **opts)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "s8", "u8"])
@pytest.mark.parametrize("per", ["head", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_formats_and_q_dtypes(fmt, per, dtype):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=1, Sk=45, D=32, dtype=dtype)
    if fmt == "u8":
        check(q, _codes(k.abs(), per), _codes(v.abs(), per))
    else:
        check(q, quant(k, fmt, per), quant(v, fmt, per, role="v"))


def _codes(x, per):
    """u8 codes with one scale per head / tensor and no zero point (quantize_kv's u8 has one)."""
    amax = x.float().abs().amax(dim=(2, 3)) if per == "head" else x.float().abs().amax().reshape(())
    sc = (amax / 255).clamp_min(1e-8)
    s4 = sc[:, :, None, None] if per == "head" else sc
    data = (x.float() / s4).round().clamp(0, 255).to(torch.uint8)
    return KVQuant(data, sc.to(torch.float32), None, "u8")


def test_large_bf16_q_stays_in_f16_range():
    """bf16 q far outside f16's range (and rows of very different size): Q_NORM's per-row
    power-of-two scaling keeps the f16 mma exact."""
    q, k, v = make_case(B=1, Hq=4, Hkv=1, Sq=2, Sk=40, D=32, dtype=torch.bfloat16)
    q = q * torch.tensor([1e9, 1e-9, 1.0, 3e5]).view(1, 4, 1, 1).to(q.dtype)
    check(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3"), scale=1e-9)


@pytest.mark.parametrize("Hq,Hkv,Sq", [(8, 2, 1), (6, 3, 3), (5, 5, 2), (16, 1, 4)])
def test_gqa_sq_causal(Hq, Hkv, Sq):
    q, k, v = make_case(B=2, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=33, D=48, Dv=40, dtype=torch.bfloat16)
    check(q, quant(k, "fp8_e4m3"), quant(v, "s8"), causal="bottom_right")


def test_ragged_kv_lens_and_empty_rows():
    q, k, v = make_case(B=3, Hq=4, Hkv=2, Sq=2, Sk=50, D=32, dtype=torch.bfloat16)
    lens = torch.tensor([50, 0, 7], dtype=torch.int32)
    check(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3"), kv_lens=lens, causal="bottom_right")
    check(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3"), kv_lens=lens, softmax_inf_as_zero=True)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks(kind):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=2, Sk=30, D=32, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    m = torch.rand(2, 1, 2, 30, generator=g) > 0.3 if kind == "bool" else torch.randn(1, 4, 2, 30, generator=g)
    check(q, quant(k, "s8", "tensor"), quant(v, "fp8_e4m3"), attn_mask=m)


@pytest.mark.parametrize("splits", [1, 3])
def test_splits(splits):
    q, k, v = make_case(B=2, Hq=4, Hkv=1, Sq=1, Sk=97, D=64, dtype=torch.bfloat16)
    check(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3", role="v"), cfg=replace(SMALL, splits=splits))


@pytest.mark.parametrize("which", ["k", "v"])
def test_only_one_quantized(which):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sk=26, D=32, dtype=torch.float16)
    if which == "k":
        check(q, quant(k, "fp8_e4m3"), v)
    else:
        check(q, k, quant(v, "s8"))


def test_strided_inputs_and_scale_options():
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=1, Sk=35, D=32, dtype=torch.bfloat16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)           # (B, Sq, H, D) storage
    check(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3"), scale=0.3)
    check(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3"), scale=torch.tensor(0.2))


def test_applicability_and_choice():
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sk=26, D=32, dtype=torch.bfloat16)
    ok = AttentionProblem.from_tensors(q, quant(k, "fp8_e4m3"), quant(v, "fp8_e4m3"))
    assert S131.is_applicable(ok)
    grouped = AttentionProblem.from_tensors(q, quantize_kv(k, "s8", group_size=16), quant(v, "fp8_e4m3"))
    reasons = S131.not_supported_reasons(grouped)
    assert any("K quantized as s8 with scales per token or group" in r for r in reasons), reasons
    zp = AttentionProblem.from_tensors(q, k, quantize_kv(v, "u4", group_size=32, symmetric=False))
    assert any("4-bit" in r for r in S131.not_supported_reasons(zp))
    assert not S131.is_applicable(AttentionProblem.from_tensors(q, k, v))
    bf16_v = S131.not_supported_reasons(AttentionProblem.from_tensors(q, quant(k, "fp8_e4m3"), v))
    assert any("bf16 V beside 8-bit codes" in r for r in bf16_v), bf16_v
    # the GPU estimate ranks 131 below 122 / 121 for fp8 per head (immediate mode takes it)
    gpu = replace(ok, device="cuda", B=64, Hq=32, Hkv=8, Sk=8192, D=128, Dv=128)
    est = {s.id: s.estimate(gpu) for s in REGISTRY.for_problem(gpu) if s.id in (121, 122, 131)}
    assert est[131] == min(est.values()), est
