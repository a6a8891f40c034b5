"""Decode attention on quantized K/V, solver 122 (decode_split_k_quant_grouped), against the
float64 reference (dequantize then attend) through the Triton interpreter at small shapes.
Every buffer the launcher allocates is poisoned (filled with a sentinel) so unwritten
elements show."""
import pytest
import torch

from nnprim.args import AttnArgs
from nnprim.attention import decode
from nnprim.attention.decode import DecodeConfig
from nnprim.attention.decode_quant import QuantDecodeConfig, choose_splits, decode_quant_forward, row_block
from nnprim.attention.reference import reference_forward
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.solver import REGISTRY

from .decode_checks import SMALL, check_decode, make_case, poison_buffers


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_buffers(monkeypatch)


def check(q, k, v, cfg=SMALL, kernel_kv=None, **opts):
    """Solver 122's launcher (on `kernel_kv` = (k, v) when given) against the reference on (k, v)."""
    return check_decode(q, k, v, lambda problem, args: decode_quant_forward(problem, args, cfg), 122, kernel_kv,
                        **opts)


def quant(x, qdt, group, zp, per_tensor=False):
    """quantize_kv, or per-tensor scale (and zero point) on random codes when per_tensor."""
    if not per_tensor:
        return quantize_kv(x, qdt, group_size=group, symmetric=not zp)
    g = torch.Generator().manual_seed(11)
    B, H, S, D = x.shape
    lo, hi = {"s8": (-128, 128), "u8": (0, 256), "s4": (0, 256), "u4": (0, 256)}[qdt]
    cols = D // 2 if qdt in ("s4", "u4") else D
    data = torch.randint(lo, hi, (B, H, S, cols), generator=g).to(torch.int8 if qdt == "s8" else torch.uint8)
    z = torch.tensor(3.0 if qdt[0] == "u" else -1.0) if zp else None
    return KVQuant(data, torch.tensor(0.03, dtype=x.dtype), z, qdt, group)


# ---- numerics over the quantization formats ---------------------------------------

@pytest.mark.parametrize("qdt", ["s8", "u8", "s4", "u4"])
@pytest.mark.parametrize("group", [16, 32, 64], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_dtypes_groups(qdt, group, zp):
    """D = 64: groups 16 (4 per row), 32 (2 per row), 64 (= D, per-token scales)."""
    q, k, v = make_case(B=1, Hq=4, Hkv=1, Sq=2, Sk=23, D=64, dtype=torch.bfloat16)
    check(q, quant(k, qdt, group, zp), quant(v, qdt, group, zp), causal="bottom_right")


@pytest.mark.parametrize("qdt", ["s8", "u4"])
@pytest.mark.parametrize("group", [32, 128], ids=lambda g: f"g{g}")
def test_d128_groups(qdt, group):
    q, k, v = make_case(B=1, Hq=8, Hkv=2, Sq=1, Sk=40, D=128, dtype=torch.float16)
    check(q, quant(k, qdt, group, True), quant(v, qdt, group, True))


@pytest.mark.parametrize("qdt", ["s8", "u8", "s4", "u4"])
@pytest.mark.parametrize("zp", [False, True], ids=["nozp", "zp"])
def test_per_tensor_scales(qdt, zp):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=3, Sk=26, D=32, dtype=torch.float16)
    check(q, quant(k, qdt, None, zp, per_tensor=True), quant(v, qdt, 16, zp, per_tensor=True),
          causal="bottom_right")


def test_mixed_grouped_scales_per_tensor_zp():
    """Grouped scales with one zero point (K), per-tensor scale with grouped zero points (V)."""
    q, k, v = make_case(B=1, Hq=4, Hkv=1, Sq=2, Sk=21, D=64, dtype=torch.float32)
    kq = quantize_kv(k, "u8", group_size=16, symmetric=True, scale_dtype=torch.float32)
    kq = KVQuant(kq.data, kq.scales, torch.tensor(128.0), "u8", 16)
    g = torch.Generator().manual_seed(2)
    vd = torch.randint(0, 256, (1, 1, 21, 32), generator=g, dtype=torch.uint8)
    vzp = torch.randint(0, 16, (1, 1, 21, 2), generator=g).float()
    vq = KVQuant(vd, torch.tensor(0.1), vzp, "u4", 32)
    check(q, kq, vq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_u8_grouped_scales_without_zero_points(dtype):
    """u8 codes are read as s8 against zero points 128 lower; with no stored zero points that
    is -128 alone, per group (K: 4 groups, V: 2) and with one scale per head; codes at 0 and
    255 included."""
    q, k, v = make_case(B=2, Hq=8, Hkv=2, Sq=2, Sk=35, D=64, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    kd = torch.randint(0, 256, (2, 2, 35, 64), generator=g, dtype=torch.uint8)
    kd[0, 0, :3] = torch.tensor([0, 255], dtype=torch.uint8).repeat(32)
    vd = torch.randint(0, 256, (2, 2, 35, 64), generator=g, dtype=torch.uint8)
    ks = torch.rand(2, 2, 35, 4, generator=g) * 0.01 + 0.001
    kq = KVQuant(kd, ks.to(dtype), None, "u8", 16)
    vq = KVQuant(vd, (torch.rand(2, 2, 35, 2, generator=g) * 0.01 + 0.001).to(dtype), None, "u8", 32)
    check(q, kq, vq, causal="bottom_right", kv_lens=torch.tensor([35, 9], dtype=torch.int32))
    vh = KVQuant(vd, torch.rand(2, 2, generator=g) * 0.01 + 0.001, None, "u8")
    check(q, kq, vh)


@pytest.mark.parametrize("sdt", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_scale_dtypes_f32_q(sdt):
    q, k, v = make_case(B=1, Hq=3, Hkv=3, Sq=2, Sk=19, D=32, dtype=torch.float32)
    kq = quantize_kv(k, "s4", group_size=16, symmetric=False, scale_dtype=sdt)
    vq = quantize_kv(v, "s8", group_size=16, symmetric=False, scale_dtype=sdt)
    check(q, kq, vq)


@pytest.mark.parametrize("which", ["k", "v"])
def test_only_one_quantized(which):
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=1, Sk=30, D=32, dtype=torch.bfloat16)
    if which == "k":
        k = quantize_kv(k, "s4", group_size=16)
    else:
        v = quantize_kv(v, "u8", group_size=16, symmetric=False)
    check(q, k, v)


def test_non_pow2_head_dim_and_group():
    """D = 96 (3 groups of 32, padded to 4), V group 48 (2 groups), ragged lengths."""
    q, k, v = make_case(B=3, Hq=4, Hkv=1, Sq=2, Sk=33, D=96, dtype=torch.bfloat16)
    kq = quantize_kv(k, "s8", group_size=32, symmetric=False)
    vq = quantize_kv(v, "u4", group_size=48, symmetric=False)
    check(q, kq, vq, kv_lens=torch.tensor([0, 1, 33]), causal="bottom_right", softmax_inf_as_zero=True)


# ---- attention options ------------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (8, 2), (8, 1)], ids=["g1", "g4", "g8"])
@pytest.mark.parametrize("Sq", [1, 5, 16])
def test_gqa_sq_causal(Hq, Hkv, Sq):
    q, k, v = make_case(B=1, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=31, D=32, dtype=torch.float16)
    check(q, quantize_kv(k, "s8", group_size=16), quantize_kv(v, "u4", group_size=16, symmetric=False),
          causal="bottom_right" if Sq > 1 else None)


def test_causal_top_left():
    q, k, v = make_case(B=1, Hq=2, Hkv=1, Sq=4, Sk=40, D=32, dtype=torch.float32)
    check(q, quantize_kv(k, "u8", group_size=16), quantize_kv(v, "s4", group_size=32),
          causal="top_left", kv_lens=torch.tensor([3]), softmax_inf_as_zero=True)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_splits_not_dividing_sk(splits):
    q, k, v = make_case(B=1, Hq=8, Hkv=2, Sq=3, Sk=101, D=32, dtype=torch.float32)
    cfg = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=splits)
    check(q, quantize_kv(k, "s4", group_size=16, symmetric=False),
          quantize_kv(v, "s8", group_size=16, symmetric=False), cfg=cfg, causal="bottom_right")


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("inf_as_zero", [False, True])
def test_ragged_kv_lens(causal, inf_as_zero):
    """kv_lens 0 and 1; unused cache slots hold garbage codes and NaN scales: never read."""
    q, k, v = make_case(B=4, Hq=4, Hkv=1, Sq=3, Sk=50, D=32)
    lens = torch.tensor([0, 1, 50, 17], dtype=torch.int32)
    kq = quantize_kv(k, "u4", group_size=16, symmetric=False)
    vq = quantize_kv(v, "s8", group_size=16, symmetric=False)
    kd, ks, kz = kq.data.clone(), kq.scales.clone(), kq.zero_points.clone()
    vd, vs, vz = vq.data.clone(), vq.scales.clone(), vq.zero_points.clone()
    for b, L in enumerate(lens.tolist()):
        for t in (ks, kz, vs, vz):
            t[b, :, L:] = float("nan")
        kd[b, :, L:] = 255
        vd[b, :, L:] = -128
    kk = KVQuant(kd, ks, kz, "u4", 16, kq.layout)
    vk = KVQuant(vd, vs, vz, "s8", 16)
    cfg = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=2)
    check(q, kq, vq, cfg=cfg, kernel_kv=(kk, vk), kv_lens=lens, causal=causal, softmax_inf_as_zero=inf_as_zero)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks(kind):
    B, Hq, Sq, Sk = 2, 4, 3, 35
    q, k, v = make_case(B=B, Hq=Hq, Hkv=2, Sq=Sq, Sk=Sk, D=32, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        m = torch.rand(B, Hq, Sq, Sk, generator=g) > 0.3
        m[0, 1, 2] = False  # one fully masked row
    else:
        m = torch.randn(Hq, 1, Sk, generator=g)
        m[torch.rand(Hq, 1, Sk, generator=g) > 0.8] = float("-inf")
    check(q, quantize_kv(k, "s8", group_size=16), quantize_kv(v, "u8", group_size=16, symmetric=False),
          attn_mask=m)


@pytest.mark.parametrize("scale,invert", [(0.3, False), (torch.tensor([1.5]), True)], ids=["f", "tinv"])
def test_scale_options(scale, invert):
    q, k, v = make_case(B=1, Hq=4, Hkv=2, Sq=2, Sk=20, D=32, dtype=torch.float32)
    check(q, quantize_kv(k, "s4", group_size=16), quantize_kv(v, "s4", group_size=16),
          scale=scale, invert_scale=invert)


def test_dropout_matches_reference():
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=2, Sk=40, D=32, dtype=torch.float32)
    cfg = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=3)
    check(q, quantize_kv(k, "u4", group_size=16, symmetric=False),
          quantize_kv(v, "u4", group_size=16, symmetric=False), cfg=cfg, dropout_p=0.3,
          seed=1234567890123, offset=77)


def test_strided_inputs():
    """(B, S, H, D) q and codes viewed as (B, H, S, D)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 32, generator=g).transpose(1, 2)
    kd = torch.randint(-128, 128, (2, 30, 2, 32), generator=g, dtype=torch.int8).transpose(1, 2)
    vd = torch.randint(0, 256, (2, 30, 2, 16), generator=g, dtype=torch.uint8).transpose(1, 2)
    ks = (torch.rand(2, 30, 2, 2, generator=g) * 0.05 + 0.01).transpose(1, 2)
    vs = (torch.rand(2, 30, 2, 2, generator=g) * 0.05 + 0.01).transpose(1, 2)
    check(q, KVQuant(kd, ks, None, "s8", 16), KVQuant(vd, vs, None, "s4", 16), causal="bottom_right")


# ---- solver plumbing --------------------------------------------------------------

def test_registry_applicability_and_estimate():
    s121, s122 = REGISTRY.get(121), REGISTRY.get(122)
    assert s122.name == "decode_split_k_quant_grouped" and s122.family == "decode"
    q, k, v = make_case(B=1, Hq=4, Hkv=1, Sq=1, Sk=64, D=128)
    assert not s122.is_applicable(AttentionProblem.from_tensors(q, k, v))
    pq = AttentionProblem.from_tensors(q, quantize_kv(k, "s8", group_size=32), quantize_kv(v, "s4", group_size=32))
    assert s122.is_applicable(pq) and s121.is_applicable(pq)
    assert s122.estimate(pq) < s121.estimate(pq)
    # 16 groups per row: only the fallback
    p16 = AttentionProblem.from_tensors(q, quantize_kv(k, "s8", group_size=8), v)
    assert s121.is_applicable(p16)
    assert any("groups per row" in r for r in s122.not_supported_reasons(p16))
    # per-tensor scales need no expansion, whatever the group size
    pt = AttentionProblem.from_tensors(q, quant(k, "s8", 8, False, per_tensor=True), v)
    assert s122.is_applicable(pt)


def test_immediate_mode_prefers_122():
    import nnprim
    q, k, v = make_case(B=2, Hq=8, Hkv=2, Sq=3, Sk=29, D=32, dtype=torch.bfloat16)
    kq = quantize_kv(k, "s4", group_size=16)
    lens = torch.tensor([29, 5])
    p = AttentionProblem.from_tensors(q, kq, v, causal="bottom_right", kv_lens=lens)
    ranked = sorted((s for s in REGISTRY.all("attention") if s.is_applicable(p) and s.estimate(p) is not None
                     and s.estimate(p) > 0), key=lambda s: s.estimate(p))
    assert ranked[0].id == 122
    o, lse = nnprim.sdpa(q, kq, v, causal="bottom_right", kv_lens=lens, return_lse=True,
                         solver="decode_split_k_quant_grouped")
    ro, rlse = reference_forward(p, AttnArgs(q=q, k=kq, v=v, kv_lens=lens))
    assert (o.double() - ro).norm() / ro.norm() < 1e-2
    assert (lse.double() - rlse).abs().max() < 1e-2


def test_row_blocks_and_splits():
    """Expanded tiles have >= 16 rows and <= 128; the split heuristic fills the GPU."""
    kq = ("s8", 32, "g", "bfloat16", None)
    p = AttentionProblem(direction="fwd", B=1, Hq=32, Hkv=8, Sq=1, Sk=131072, D=128, Dv=128,
                         dtype=torch.bfloat16, device="cuda", k_quant=kq, v_quant=kq)
    cfg = DecodeConfig(block_n=128, block_m=16)
    assert row_block(p, cfg) == (4, 1)   # 4 rows x 4 groups = 16 expanded rows
    s = choose_splits(p, cfg, num_sms=132)
    assert p.Hkv * s >= 2 * 132
    pt = AttentionProblem(direction="fwd", B=1, Hq=32, Hkv=1, Sq=16, Sk=64, D=128, Dv=128,
                          dtype=torch.bfloat16, device="cuda", k_quant=kq, v_quant=kq)
    bm, nm = row_block(pt, cfg)
    assert bm * 4 <= 128 and bm * nm >= 32 * 16


@pytest.mark.parametrize("qdt,group", [("s4", 16), ("u4", 32), ("u4", 64)])
def test_v_join_variant(qdt, group):
    """4-bit V with the nibbles interleaved into one operand (QuantDecodeConfig.v_join)."""
    q, k, v = make_case(B=2, Hq=4, Hkv=1, Sq=2, Sk=29, D=64, dtype=torch.float16)
    cfg = QuantDecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, splits=2, v_join=True)
    check(q, quant(k, "u8", 32, True), quant(v, qdt, group, True), cfg=cfg, causal="bottom_right")


# ---- issue 14: FP8 K/V, per-head scales, layout 1, keys-contiguous V ---------------

@pytest.mark.parametrize("per", ["head", "tensor"])
@pytest.mark.parametrize("Sq", [1, 3])
def test_fp8_kv(per, Sq):
    """fp8_e4m3 codes with per-head / per-tensor scales (K scale in the softmax scale, V's on o)."""
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=Sq, Sk=29, D=32, dtype=torch.bfloat16)
    kq, vq = quantize_kv(k, "fp8_e4m3", scale_per=per), quantize_kv(v, "fp8_e4m3", scale_per=per, order="keys")
    check(q, kq, vq, causal="bottom_right", kv_lens=torch.tensor([29, 5], dtype=torch.int32))


def test_fp8_per_head_expanded_and_mixed():
    """One scale per head shared by the batch (an expanded (B, H) view); fp8 K with s4 V."""
    q, k, v = make_case(B=2, Hq=4, Hkv=2, Sq=2, Sk=19, D=32, dtype=torch.float16)
    kq = quantize_kv(k, "fp8_e4m3")
    ks = kq.scales.amax(0, keepdim=True).expand(2, 2)
    kq = KVQuant((k.float() / ks[:, :, None, None]).to(torch.float8_e4m3fn), ks, None, "fp8_e4m3")
    check(q, kq, quantize_kv(v, "s4", group_size=16))


@pytest.mark.parametrize("qdt", ["s4", "u4"])
@pytest.mark.parametrize("group", [8, 32, 64], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_layout1_equals_layout0(qdt, group, zp):
    """Layout 1 (nibbles interleaved per 32-bit word) gives layout 0's result, K and V."""
    q, k, v = make_case(B=1, Hq=8, Hkv=2, Sq=1, Sk=21, D=64, dtype=torch.bfloat16)
    k1, v1 = quantize_kv(k, qdt, group, not zp), quantize_kv(v, qdt, group, not zp)
    assert k1.layout == 1 and v1.layout == 1
    k0, v0 = k1.to_layout(0), v1.to_layout(0)
    _, o1, _ = check(q, k1, v1)
    _, o0, _ = check(q, k0, v0)
    assert (o1.float() - o0.float()).abs().max() < 2e-2


@pytest.mark.parametrize("qdt", ["s8", "u4"])
def test_keys_contiguous_v_and_per_head(qdt):
    """V codes keys-contiguous (order="keys") and per-head scales / zero points, Sq 4, ragged."""
    q, k, v = make_case(B=2, Hq=4, Hkv=1, Sq=4, Sk=33, D=32, dtype=torch.float16)
    kq = quantize_kv(k, qdt, symmetric=False, scale_per="head")
    vq = quantize_kv(v, qdt, group_size=16, symmetric=False, order="keys")
    assert vq.data.stride(-2) == 1
    check(q, kq, vq, causal="bottom_right", kv_lens=torch.tensor([33, 9], dtype=torch.int32))


def test_solver_121_fp8_and_layout1():
    """The per-element fallback (121) reads fp8 and layout-1 codes too."""
    q, k, v = make_case(B=1, Hq=4, Hkv=2, Sq=2, Sk=20, D=32, dtype=torch.float16)
    kq, vq = quantize_kv(k, "fp8_e4m3"), quantize_kv(v, "u4", group_size=8, symmetric=False)
    problem = AttentionProblem.from_tensors(q, kq, vq, return_lse=True)
    args = AttnArgs(q=q, k=kq, v=vq)
    o, _ = decode.decode_forward(problem, args, SMALL)
    ro, _ = reference_forward(problem, args)
    assert (o.double() - ro).norm() / ro.norm() < 1e-2


def test_sdpa_public_fp8_layout1():
    """Through nnprim.sdpa (the op carries the layout in its spec)."""
    import nnprim
    q, k, v = make_case(B=1, Hq=4, Hkv=2, Sq=1, Sk=24, D=32, dtype=torch.float16)
    kq, vq = quantize_kv(k, "fp8_e4m3"), quantize_kv(v, "s4", group_size=16, role="v")
    o = nnprim.sdpa(q, kq, vq)
    problem = AttentionProblem.from_tensors(q, kq, vq)
    ro, _ = reference_forward(problem, AttnArgs(q=q, k=kq, v=vq))
    assert (o.double() - ro).norm() / ro.norm() < 1e-2
