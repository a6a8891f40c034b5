"""Decode attention on quantized K/V in the swap-AB form, solver 128 (decode_swap_ab_quant),
against the float64 reference (dequantize then attend) through the Triton interpreter at
small shapes. Every buffer the launcher allocates is poisoned (filled with a sentinel) so
unwritten elements show. (The magic-number conversion is CUDA-only: tests/gpu covers it.)"""
import pytest
import torch

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import decode
from nnprim.attention.decode import DecodeConfig
from nnprim.attention.decode_swap import (
    ISSUE_128,
    choose_splits,
    code_offset,
    default_config,
    row_block,
    swap_forward,
    tile_groups,
)
from nnprim.attention.reference import reference_forward
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.solver import REGISTRY

from .decode_checks import SMALL, TOL, check_decode, poison_buffers


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_buffers(monkeypatch)


def rand(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Sq, D, generator=g).to(dtype), torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
            torch.randn(B, Hkv, Sk, D, generator=g).to(dtype))


def quant(x, fmt, role=None, layout=None):
    dt, g, zp = fmt
    if dt == "fp8_e4m3":
        return quantize_kv(x, dt, scale_per=g, order="keys" if role == "v" else None)
    if g in ("head", "tensor"):
        return quantize_kv(x, dt, scale_per=g, symmetric=not zp, order="keys" if role == "v" else None, layout=layout)
    return quantize_kv(x, dt, group_size=g, symmetric=not zp, order="keys" if role == "v" else None, layout=layout)


def check(q, k, v, cfg=SMALL, **opts):
    """Solver 128's launcher against the reference; returns o."""
    return check_decode(q, k, v, lambda problem, args: swap_forward(problem, args, cfg), 128, **opts)[1]


FORMATS = [("s8", 16, False), ("u8", 32, True), ("s4", 16, False), ("u4", 8, True), ("s4", None, True),
           ("u8", "head", True), ("fp8_e4m3", "head", False), ("fp8_e4m3", "tensor", False)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}{'-zp' if f[2] else ''}")
def test_formats_gqa_ragged_causal(fmt):
    """Each format; GQA 4, Sq 3, ragged kv_lens (a partial last key block and an empty entry's
    neighbour), causal bottom-right, two splits, V keys-contiguous."""
    q, k, v = rand(3, 8, 2, 3, 45, 32, torch.float16, seed=1)
    lens = torch.tensor([45, 17, 2])
    check(q, quant(k, fmt), quant(v, fmt, role="v"), DecodeConfig(16, 16, 4, 1, splits=2), kv_lens=lens,
          causal="bottom_right")


@pytest.mark.parametrize("dtype,Sq,heads,role,layout", [
    (torch.bfloat16, 1, (4, 1), None, 0), (torch.float32, 16, (2, 2), "v", 1), (torch.float16, 16, (16, 1), "v", 1)])
def test_sq_gqa_layouts(dtype, Sq, heads, role, layout):
    """Sq 1 / 16, MHA and GQA 16 (G * Sq = 256 rows: several row blocks), V rows or
    keys-contiguous, 4-bit layouts 0 / 1 for K and V of different formats, f32 q, one split."""
    Hq, Hkv = heads
    q, k, v = rand(2, Hq, Hkv, Sq, 40, 32, dtype, seed=Sq)
    kq = quant(k, ("s4", 16, True), layout=layout)
    vq = quant(v, ("u4", 32, False), role=role, layout=layout)
    check(q, kq, vq, DecodeConfig(16, 16, 4, 1, splits=1), causal="bottom_right" if Sq > 1 else None)
    check(q, quant(k, ("s8", 8, False)), vq, DecodeConfig(16, 16, 4, 1, splits=3))


def test_masks_scale_lse_and_empty_rows():
    """bool and additive masks (broadcast over heads), float scale, a fully masked row
    (inf_as_zero and NaN), kv_lens 0."""
    q, k, v = rand(2, 4, 2, 2, 33, 32, torch.float16, seed=4)
    kq, vq = quant(k, ("u4", 16, True)), quant(v, ("s8", 32, False), role="v")
    m = torch.rand(2, 1, 2, 33, generator=torch.Generator().manual_seed(5)) > 0.3
    m[0, 0, 1] = False   # a fully masked row
    check(q, kq, vq, attn_mask=m, scale=0.3)
    check(q, kq, vq, attn_mask=m, softmax_inf_as_zero=True)
    add = torch.randn(2, 4, 2, 33, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    check(q, kq, vq, DecodeConfig(16, 16, 4, 1, splits=2), attn_mask=add)
    check(q, kq, vq, DecodeConfig(16, 16, 4, 1, splits=2), kv_lens=torch.tensor([0, 9]))


def test_per_tensor_scales_random_codes():
    """Per-tensor scale and zero point on random codes (every code value), D not a power of two."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 1, 48, generator=g).to(torch.bfloat16)
    kd = torch.randint(-128, 128, (2, 1, 37, 48), generator=g).to(torch.int8)
    vd = torch.randint(0, 256, (2, 1, 37, 24), generator=g).to(torch.uint8)
    kq = KVQuant(kd, torch.tensor(0.02), torch.tensor(-1.0), "s8", None)
    vq = KVQuant(vd, torch.tensor(0.05, dtype=torch.bfloat16), torch.tensor(3.0), "u4", 16, 0)
    check(q, kq, vq)


def test_public_api_and_applicability():
    q, k, v = rand(1, 4, 1, 1, 64, 128, torch.bfloat16)
    s128 = REGISTRY.get(128)
    assert s128.name == "decode_swap_ab_quant" and s128.family == "decode" and s128.deterministic
    kq, vq = quant(k, ("s4", 32, False)), quant(v, ("s4", 32, False), role="v")
    p = AttentionProblem.from_tensors(q, kq, vq)
    assert s128.is_applicable(p)
    o = nnprim.sdpa(q, kq, vq, solver="decode_swap_ab_quant")
    ro, _ = reference_forward(p, AttnArgs(q=q, k=kq, v=vq))
    assert (o.double() - ro).norm() / ro.norm() < 1e-2
    reasons = " ".join(s128.not_supported_reasons(AttentionProblem.from_tensors(q, kq, v)))
    assert "both be quantized" in reasons
    reasons = " ".join(s128.not_supported_reasons(AttentionProblem.from_tensors(q, kq, vq, dropout_p=0.1)))
    assert "dropout_p=0.1" in reasons
    p16 = AttentionProblem.from_tensors(q, quant(k, ("s8", 8, False)), vq)
    assert any("groups per row" in r for r in s128.not_supported_reasons(p16))


def test_estimates_rank_by_measured_rates():
    """On the GPU problem the estimates follow the H200 times (ISSUE_128 / ISSUE_122): 128
    first for 4-bit codes, 122 (V rows) first for 8-bit codes, 122 before 121; the
    roofline is at least the bytes over the bandwidth."""
    for sig, first in ((("s4", 32, "g", "bfloat16", None), 128), (("u4", 64, "g", "bfloat16", "g", 1), 128),
                       (("s8", 64, "g", "bfloat16", None), 122), (("fp8_e4m3", 128, "h", "float32", None), 122)):
        p = AttentionProblem(direction="fwd", device="cuda", B=64, Hq=32, Hkv=8, Sq=1, Sk=8192, D=128, Dv=128,
                             dtype=torch.bfloat16, k_quant=sig, v_quant=sig)
        e = {i: REGISTRY.get(i).estimate(p) for i in (121, 122, 128)}
        assert min(e, key=e.get) == first and e[121] > e[122], (sig, e)
        assert e[128] >= p.bytes() / decode._BW * 1e3
    assert set(ISSUE_128) == {"4", "8", "fp8"}
    # keys-contiguous V (the signature's "keys"): 122 gathers it byte by byte, so 128 ranks
    # first even for 8-bit codes
    sig = ("s8", 64, "g", "bfloat16", None)
    p = AttentionProblem(direction="fwd", device="cuda", B=64, Hq=32, Hkv=8, Sq=1, Sk=8192, D=128, Dv=128,
                         dtype=torch.bfloat16, k_quant=sig, v_quant=sig + ("keys",))
    e = {i: REGISTRY.get(i).estimate(p) for i in (122, 128)}
    assert e[128] < e[122], e


def test_tiles_and_offsets():
    kq = ("s4", 32, "g", "bfloat16", None)
    p = AttentionProblem(direction="fwd", B=1, Hq=32, Hkv=8, Sq=1, Sk=131072, D=128, Dv=128,
                         dtype=torch.bfloat16, device="cuda", k_quant=kq, v_quant=kq)
    cfg = default_config(p)
    assert cfg.block_n == 128 and cfg.num_warps == 4
    assert row_block(p, cfg) == (4, 1) and tile_groups(4, 4) == 4 and tile_groups(1, 4) == 4
    assert p.Hkv * choose_splits(p, cfg, num_sms=132) >= 2 * 132
    pt = AttentionProblem(direction="fwd", B=1, Hq=32, Hkv=1, Sq=16, Sk=64, D=128, Dv=128,
                          dtype=torch.bfloat16, device="cuda", k_quant=kq, v_quant=kq)
    bm, nm = row_block(pt, default_config(pt))
    assert bm * 4 <= 128 and bm * nm >= 32 * 16
    assert code_offset(4, True, True, torch.bfloat16) == 0 and code_offset(8, False, True, torch.float16) == 0
    assert code_offset(8, True, False, torch.bfloat16) == 0 and code_offset(8, True, True, torch.bfloat16, True) == 0


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_grouped_scales_key_stride(strided):
    """The kernels' PV: the groups of a key load as one vector when the key strides of the
    grouped scales / zero points are multiples of the group count, else one by one. A scale
    view whose key stride is odd (NG + 1) takes the scalar path and gives the same result;
    both solvers, a ragged tail included."""
    from nnprim.attention.decode_quant import decode_quant_forward, param_vector
    q, k, v = rand(2, 4, 2, 1, 53, 32, torch.float16)
    kq = quantize_kv(k, "u4", group_size=16, symmetric=False)
    vq = quantize_kv(v, "s8", group_size=8)
    if strided:
        def widen(t):   # the same values in a view of a (..., NG + 1) buffer
            buf = torch.full((*t.shape[:-1], t.shape[-1] + 1), 7.0, dtype=t.dtype)
            buf[..., :-1] = t
            return buf[..., :-1]
        kq = KVQuant(kq.data, widen(kq.scales), widen(kq.zero_points), kq.dtype, kq.group, kq.layout)
        vq = KVQuant(vq.data, widen(vq.scales), None, vq.dtype, vq.group, vq.layout)
    assert param_vector(kq, 2) == (1 if strided else 2) and param_vector(vq, 4) == (1 if strided else 4)
    check(q, kq, vq)
    p = AttentionProblem.from_tensors(q, kq, vq, return_lse=True)
    o, _ = decode_quant_forward(p, AttnArgs(q=q, k=kq, v=vq), SMALL)
    ro, _ = reference_forward(p, AttnArgs(q=q, k=kq, v=vq))
    assert (o.double() - ro).norm() / ro.norm() < TOL[q.dtype]
