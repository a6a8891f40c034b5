"""Decode attention solvers (ids 120, 121) against the float64 reference, through the
Triton interpreter at small shapes. Every buffer the launcher allocates is poisoned
(filled with a sentinel) so unwritten elements show."""
import math

import pytest
import torch

from nnprim.args import AttnArgs
from nnprim.attention.decode import DecodeConfig, choose_splits, decode_forward
from nnprim.attention.reference import reference_forward
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.solver import REGISTRY

from .decode_checks import SMALL, check_decode, make_case, poison_buffers


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_buffers(monkeypatch)


def check(q, k, v, cfg=SMALL, solver_id=None, kernel_kv=None, **opts):
    """decode_forward (solver 120, or 121 on quantized K/V) against the reference."""
    quantized = any(not isinstance(t, torch.Tensor) for t in (k, v))
    return check_decode(q, k, v, lambda problem, args: decode_forward(problem, args, cfg),
                        solver_id or (121 if quantized else 120), kernel_kv, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (8, 2), (8, 1)], ids=["g1", "g4", "g8"])
def test_dtypes_gqa(dtype, Hq, Hkv):
    q, k, v = make_case(B=2, Hq=Hq, Hkv=Hkv, Sk=45, D=32, dtype=dtype)
    check(q, k, v)


@pytest.mark.parametrize("Sq", [1, 2, 5, 16])
@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
def test_sq_causal(Sq, causal):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=Sq, Sk=39, D=16)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("splits", [1, 3, 7, 37])   # 37: the combine reads them 16 at a time, most empty
def test_splits_not_dividing_sk(splits):
    q, k, v = make_case(B=1, Hq=8, Hkv=2, Sq=3, Sk=101, D=16, dtype=torch.float32)
    cfg = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=splits)
    check(q, k, v, cfg=cfg, causal="bottom_right")


def test_block_m_tiling_many_rows():
    """G * Sq = 8 * 5 = 40 rows: three 16-row blocks per KV head."""
    q, k, v = make_case(B=1, Hq=8, Hkv=1, Sq=5, Sk=33, D=16, dtype=torch.float32)
    check(q, k, v, causal="bottom_right")


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("inf_as_zero", [False, True])
def test_ragged_kv_lens(causal, inf_as_zero):
    q, k, v = make_case(B=5, Hq=4, Hkv=1, Sq=3, Sk=50, D=16)
    lens = torch.tensor([0, 1, 50, 17, 2], dtype=torch.int32)
    # unused cache slots hold NaN in the kernel's copy: they must never be read
    kd, vd = k.clone(), v.clone()
    for b, L in enumerate(lens.tolist()):
        kd[b, :, L:] = float("nan")
        vd[b, :, L:] = float("nan")
    cfg = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=2)
    check(q, k, v, cfg=cfg, kernel_kv=(kd, vd), kv_lens=lens, causal=causal, softmax_inf_as_zero=inf_as_zero)


def test_causal_top_left_short_rows():
    q, k, v = make_case(B=1, Hq=2, Hkv=1, Sq=4, Sk=40, D=16, dtype=torch.float32)
    check(q, k, v, causal="top_left", kv_lens=torch.tensor([3]), softmax_inf_as_zero=True)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", ["full", "bcast"])
def test_masks(kind, shape):
    B, Hq, Sq, Sk = 2, 4, 3, 35
    q, k, v = make_case(B=B, Hq=Hq, Hkv=2, Sq=Sq, Sk=Sk, D=16, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    mshape = (B, Hq, Sq, Sk) if shape == "full" else (Hq, 1, Sk)
    if kind == "bool":
        m = torch.rand(mshape, generator=g) > 0.3
        if shape == "full":
            m[0, 1, 2] = False  # one fully masked row
    else:
        m = torch.randn(mshape, generator=g)
        m[torch.rand(mshape, generator=g) > 0.8] = float("-inf")
    check(q, k, v, attn_mask=m)


@pytest.mark.parametrize("scale,invert", [(0.3, False), (2.0, True), (torch.tensor(0.7), False),
                                          (torch.tensor([1.5]), True)], ids=["f", "finv", "t", "tinv"])
def test_scale_options(scale, invert):
    q, k, v = make_case(B=1, Hq=4, Hkv=2, Sq=2, Sk=20, D=24, dtype=torch.float32)
    check(q, k, v, scale=scale, invert_scale=invert)


@pytest.mark.parametrize("D,Dv", [(24, 40), (96, 96), (256, 256)])
def test_head_dims(D, Dv):
    q, k, v = make_case(B=1, Hq=2, Hkv=1, Sq=1, Sk=21, D=D, Dv=Dv, dtype=torch.bfloat16)
    check(q, k, v)


def test_strided_inputs():
    """(B, S, H, D) caches viewed as (B, H, S, D)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 16, generator=g).transpose(1, 2)
    k = torch.randn(2, 30, 2, 16, generator=g).transpose(1, 2)
    v = torch.randn(2, 30, 2, 16, generator=g).transpose(1, 2)
    check(q, k, v, causal="bottom_right")


@pytest.mark.parametrize("splits", [1, 3])
def test_dropout_matches_reference(splits):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=2, Sk=40, D=16, dtype=torch.float32)
    cfg = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=splits)
    check(q, k, v, cfg=cfg, dropout_p=0.3, seed=1234567890123, offset=77)


# ---- quantized K/V ----------------------------------------------------------------

@pytest.mark.parametrize("qdt", ["s8", "u8", "s4", "u4"])
@pytest.mark.parametrize("group", [16, 32, 64], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zp"])
def test_quant_dtypes_groups(qdt, group, symmetric):
    q, k, v = make_case(B=1, Hq=4, Hkv=1, Sq=2, Sk=23, D=64, dtype=torch.float16)
    kq = quantize_kv(k, qdt, group_size=group, symmetric=symmetric)
    vq = quantize_kv(v, qdt, group_size=group, symmetric=symmetric)
    check(q, kq, vq, causal="bottom_right")


@pytest.mark.parametrize("which", ["k", "v"])
def test_quant_only_one(which):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=1, Sk=30, D=32, dtype=torch.bfloat16)
    if which == "k":
        k = quantize_kv(k, "s4", group_size=32)
    else:
        v = quantize_kv(v, "u8", group_size=None, symmetric=False)
    check(q, k, v)


@pytest.mark.parametrize("sdt", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_quant_per_tensor_scales(sdt):
    """Per-tensor scale and zero point, scales in every dtype."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 3, 32, generator=g).to(torch.float16)
    kd = torch.randint(0, 256, (1, 1, 26, 16), generator=g, dtype=torch.uint8)
    vd = torch.randint(-128, 128, (1, 1, 26, 32), generator=g, dtype=torch.int8)
    k = KVQuant(kd, torch.tensor(0.05).to(sdt), torch.tensor(3.0), "u4", 32)
    v = KVQuant(vd, torch.tensor(0.02).to(sdt), None, "s8", None)
    check(q, k, v, causal="bottom_right", kv_lens=None)


def test_quant_non_pow2_group_and_ragged():
    """D = 96 with group 32 and group 48 (gather path), ragged lengths."""
    q, k, v = make_case(B=3, Hq=4, Hkv=1, Sq=2, Sk=33, D=96, dtype=torch.bfloat16)
    kq = quantize_kv(k, "s8", group_size=32, symmetric=False)
    vq = quantize_kv(v, "u4", group_size=48, symmetric=False)
    check(q, kq, vq, kv_lens=torch.tensor([0, 1, 33]), causal="bottom_right", softmax_inf_as_zero=True)


@pytest.mark.parametrize("qdt,bound", [("s8", 127), ("u8", 255), ("s4", 7), ("u4", 15)])
def test_quant_round_trip_bound(qdt, bound):
    """|dequantize(quantize(x)) - x| <= scale / 2 per group (+ rounding of the scale dtype)."""
    x = torch.randn(1, 2, 9, 64, generator=torch.Generator().manual_seed(7))
    kq = quantize_kv(x, qdt, group_size=32, symmetric=False, scale_dtype=torch.float32)
    err = (kq.dequantize(torch.float64) - x.double()).abs()
    half = kq.scales.double().repeat_interleave(32, dim=-1) / 2
    assert (err <= half * (1 + 1e-5) + 1e-7).all()


# ---- solver plumbing --------------------------------------------------------------

def test_registry_and_applicability():
    s120, s121 = REGISTRY.get(120), REGISTRY.get(121)
    assert (s120.name, s121.name) == ("decode_split_k", "decode_split_k_quant")
    assert s120.family == s121.family == "decode"
    q, k, v = make_case(Sq=17)
    p = AttentionProblem.from_tensors(q, k, v)
    assert any("Sq=17" in r for r in s120.not_supported_reasons(p))
    q, k, v = make_case(Sq=4)
    p = AttentionProblem.from_tensors(q, k, v)
    assert s120.is_applicable(p) and not s121.is_applicable(p)
    pq = AttentionProblem.from_tensors(q, quantize_kv(k, "s8", group_size=None), v)
    assert s121.is_applicable(pq) and not s120.is_applicable(pq)
    pb = AttentionProblem.from_tensors(q, k, v, direction="bwd")
    assert not s120.is_applicable(pb)


def test_invoker_and_estimate():
    q, k, v = make_case(B=1, Hq=4, Hkv=1, Sq=1, Sk=40, D=16)
    p = AttentionProblem.from_tensors(q, k, v)
    o, lse = REGISTRY.get(120).prepare(p)(AttnArgs(q=q, k=k, v=v))
    assert lse is None and o.shape == (1, 4, 1, 16)
    assert not o.isnan().any()
    est = REGISTRY.get(120).estimate(p)
    assert 0 < est < 1


def test_split_heuristic_fills_gpu():
    """Batch-1 decode with a long cache gets enough programs for >= 2 waves of 132 SMs."""
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 131072, 128, dtype=torch.bfloat16, device="meta")
    p = AttentionProblem.from_tensors(q, k, k)
    cfg = DecodeConfig(block_n=64)
    s = choose_splits(p, cfg, num_sms=132)
    assert p.B * p.Hkv * s >= 2 * 132
    assert math.ceil(131072 / s) >= 4 * 64
    big = AttentionProblem.from_tensors(torch.empty(64, 32, 1, 128, device="meta"),
                                        torch.empty(64, 8, 8192, 128, device="meta"),
                                        torch.empty(64, 8, 8192, 128, device="meta"))
    assert choose_splits(big, cfg, num_sms=132) in (1, 2)


def test_split_model_whole_waves():
    """The H200's bf16 tiles (one 128-key program per SM): the measured best split counts
    (b64 x 8k: 1, b8 x 32k: 2), never a partial last wave of many short programs."""
    cfg = DecodeConfig(block_n=128, num_warps=4, num_stages=3)

    def prob(B, Sk):
        return AttentionProblem.from_tensors(torch.empty(B, 32, 1, 128, dtype=torch.bfloat16, device="meta"),
                                             torch.empty(B, 8, Sk, 128, dtype=torch.bfloat16, device="meta"),
                                             torch.empty(B, 8, Sk, 128, dtype=torch.bfloat16, device="meta"))
    assert choose_splits(prob(64, 8192), cfg, num_sms=132) == 1
    assert choose_splits(prob(8, 32768), cfg, num_sms=132) == 2
    for B, Sk in ((1, 131072), (3, 50000), (2, 4096)):
        s = choose_splits(prob(B, Sk), cfg, num_sms=132)
        programs = B * 8 * s
        assert math.ceil(Sk / s) >= 4 * 128 or s == 1
        assert programs >= 120 or s == math.ceil(Sk / 512), (B, Sk, s)   # fills the SMs unless chunks hit 4 blocks


def test_public_api_forced_solver():
    import nnprim
    q, k, v = make_case(B=2, Hq=8, Hkv=2, Sq=3, Sk=29, D=32, dtype=torch.bfloat16)
    kq = quantize_kv(k, "s4", group_size=32)
    lens = torch.tensor([29, 5])
    o, lse = nnprim.sdpa(q, kq, v, causal="bottom_right", kv_lens=lens, return_lse=True,
                         solver="decode_split_k_quant")
    p = AttentionProblem.from_tensors(q, kq, v, causal="bottom_right", kv_lens=lens)
    ro, rlse = reference_forward(p, AttnArgs(q=q, k=kq, v=v, kv_lens=lens))
    assert (o.double() - ro).norm() / ro.norm() < 1e-2
    assert (lse.double() - rlse).abs().max() < 1e-2

