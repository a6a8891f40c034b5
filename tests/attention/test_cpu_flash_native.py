"""Solvers 117 `cpu_flash_fwd_native` and 118 `cpu_flash_bwd_native` (C++ around oneDNN's
brgemm) against the float64 reference: f32 and bf16, GQA/MQA, both causal alignments, Sq != Sk (rows that see no key),
odd sizes and tails of every block, head dims that are not multiples of 64, D != Dv, scales
(negative, inverted), softmax_inf_as_zero, strided inputs; outputs poisoned; tiny blocks so
that several query and key blocks run. Its scope (what 115 keeps) and its selection."""
from __future__ import annotations

import math

import pytest
import torch

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import cpu_flash_native as cfn
from nnprim.attention.reference import reference_backward, reference_forward
from nnprim.native import ENV
from nnprim.problems.attention import AttentionProblem
from nnprim.search.solver import REGISTRY

pytestmark = pytest.mark.skipif(cfn.LIBRARY.ops() is None, reason="no C++ compiler: solver 117 is not applicable")
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
# the default (KV_BLOCK_VNNI keys where K / V are packed, else KV_BLOCK), both explicitly, tiny tiles
BLOCKS = [(cfn.Q_BLOCK, None), (cfn.Q_BLOCK, cfn.KV_BLOCK), (cfn.Q_BLOCK, cfn.KV_BLOCK_VNNI), (7, 64)]
# bf16 B operands in VNNI blocks (AMX CPUs), plain (the path of CPUs without AMX), and K / V
# read in place with S^T = K Q^T (few query rows: cfn.keys_as_rows)
LAYOUTS = ["vnni", "plain", "keys"]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(cfn, "_empty", lambda shape, dtype=torch.float32: torch.full(shape, math.nan, dtype=dtype))


def run(q, k, v, *, blocks=BLOCKS[0], vnni=True, by_keys=None, **opts):
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **opts)
    s = REGISTRY.get("cpu_flash_fwd_native")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    a = AttnArgs(q, k, v, scale=opts.get("scale"))
    o, lse = cfn.forward(p, a, cfn.LIBRARY.ops(), *blocks, vnni=vnni, by_keys=by_keys)
    ro, rl = reference_forward(p, a)
    return o, lse, ro, rl


def check(o, lse, ro, rl, dtype):
    dead = ~torch.isfinite(rl)
    assert torch.equal(~torch.isfinite(lse), dead)
    assert torch.isfinite(o[~dead]).all()
    if dead.any():
        assert (lse[dead] == -math.inf).all()
    err = ((o.double() - ro)[~dead].norm() / ro[~dead].norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], err
    # bf16: the fast exp's ~3e-5 in lse (relative in P), far below bf16's 4e-3 rounding
    assert (lse.double() - rl)[~dead].abs().max().item() < (1e-5 if dtype == torch.float32 else 1e-4)


def rnd(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("blocks", BLOCKS, ids=["default", "k1024", "k256", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 70, 130, 64, 64), (2, 6, 1, 131, 67, 32, 48),
                                   (1, 2, 2, 300, 257, 80, 80), (1, 3, 3, 1, 1, 16, 16), (1, 4, 1, 5, 1100, 128, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_against_reference(shape, causal, dtype, blocks, layout):
    if dtype == torch.float32 and layout == "plain":
        pytest.skip("f32 has no VNNI layout: vnni and plain are one path")
    B, Hq, Hkv, Sq, Sk, D, Dv = shape
    q, k, v = (rnd(B, h, S, d, dtype=dtype, seed=i) for i, (h, S, d) in
               enumerate(((Hq, Sq, D), (Hkv, Sk, D), (Hkv, Sk, Dv))))
    check(*run(q, k, v, causal=causal, blocks=blocks, vnni=layout == "vnni", by_keys=layout == "keys"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_scales_strides_and_rows_that_see_no_key(dtype):
    q = rnd(2, 40, 4, 64, dtype=dtype, seed=1).transpose(1, 2)          # (B, S, H, D) storage
    k, v = (rnd(2, 90, 2, 64, dtype=dtype, seed=s).transpose(1, 2) for s in (2, 3))
    for scale, invert in ((0.05, False), (-0.2, False), (8.0, True)):
        p = AttentionProblem.from_tensors(q, k, v, scale=scale, invert_scale=invert, return_lse=True)
        a = AttnArgs(q, k, v, scale=scale)
        o, lse = cfn.forward(p, a, cfn.LIBRARY.ops(), 7, 64)
        check(o, lse, *reference_forward(p, a), dtype)
    # K rows at an odd stride / offset (bf16 VNNI packing reads them as 32-bit words: copied)
    k3 = rnd(2, 4, 90, 67, dtype=dtype, seed=7)[..., 1:65]
    check(*run(q, k3, k3[:, :, :, :48], blocks=(7, 64)), dtype)
    check(*run(q, k3, k3[:, :, :, :48], blocks=(7, 64), by_keys=True), dtype)   # K, V read in place
    # Sq > Sk bottom-right: the first rows see no key (NaN, or 0 with softmax_inf_as_zero)
    q2 = rnd(1, 2, 50, 32, dtype=dtype, seed=4)
    k2, v2 = (rnd(1, 2, 20, 32, dtype=dtype, seed=s) for s in (5, 6))
    check(*run(q2, k2, v2, causal="bottom_right", blocks=(7, 64)), dtype)
    check(*run(q2, k2, v2, causal="bottom_right", blocks=(7, 64), by_keys=True), dtype)
    for inf_as_zero in (False, True):
        o, lse, _, _ = run(q2, k2, v2, causal="bottom_right", softmax_inf_as_zero=inf_as_zero)
        dead = o[:, :, :30]
        assert (dead == 0).all() if inf_as_zero else dead.isnan().all()
        assert torch.isfinite(o[:, :, 30:]).all()


def test_scope_and_selection(monkeypatch):
    s = REGISTRY.get("cpu_flash_fwd_native")
    q, k, v = (rnd(1, 2, 64, 32, dtype=torch.bfloat16, seed=i) for i in range(3))
    assert s.is_applicable(AttentionProblem.from_tensors(q, k, v))
    for kw, why in ((dict(attn_mask=torch.ones(64, 64, dtype=torch.bool)), "masks"),
                    (dict(kv_lens=torch.tensor([10])), "kv_lens")):
        assert any(why in r for r in s.not_supported_reasons(AttentionProblem.from_tensors(q, k, v, **kw)))
    assert not s.is_applicable(AttentionProblem.from_tensors(q.half(), k.half(), v.half()))
    assert not s.is_applicable(AttentionProblem.from_tensors(q, k, v, direction="bwd"))
    # immediate mode ranks it before 115 on plain problems; the public call agrees with 115
    monkeypatch.setenv("NNPRIM_FIND_MODE", "fast")
    p = AttentionProblem.from_tensors(q, k, v)
    assert s.estimate(p) < REGISTRY.get("cpu_flash_fwd").estimate(p)
    o = nnprim.sdpa(q, k, v, solver="cpu_flash_fwd_native")
    o115 = nnprim.sdpa(q, k, v, solver="cpu_flash_fwd")
    assert ((o.float() - o115.float()).norm() / o115.float().norm()) < 1e-2
    # switched off: not applicable, 115 serves
    monkeypatch.setenv(ENV, "0")
    assert not s.is_applicable(p)


def test_odd_head_dims_in_f32():
    q, k = rnd(1, 3, 9, 33, dtype=torch.float32, seed=7), rnd(1, 1, 70, 33, dtype=torch.float32, seed=8)
    v = rnd(1, 1, 70, 17, dtype=torch.float32, seed=9)
    check(*run(q, k, v, causal="top_left", blocks=(4, 64)), torch.float32)
    bf = [t.bfloat16() for t in (q, k, v)]
    assert not REGISTRY.get("cpu_flash_fwd_native").is_applicable(AttentionProblem.from_tensors(*bf))


@pytest.mark.parametrize("layout", ["vnni", "plain"])
@pytest.mark.parametrize("blocks", [(cfn.BWD_Q_BLOCK, cfn.BWD_KV_BLOCK), (7, 5), (6, 64)], ids=["default", "tiny", "q6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 70, 130, 64, 64), (2, 6, 1, 131, 67, 32, 48), (1, 2, 2, 1, 1, 16, 16),
                                   (1, 2, 1, 40, 300, 80, 64), (1, 2, 1, 33, 129, 144, 80)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_against_reference(shape, causal, dtype, blocks, layout, monkeypatch):
    """dq, dk, dv against float64 (the reference's own forward's o and lse, so the backward is
    checked alone); rows that see no key get zero gradients; outputs poisoned. bf16 "vnni": VNNI
    blocks where the CPU takes them (odd query / key tails padded: Sq 131, 33, Sk 67, 129; D 144
    past two 64-column blocks); "tiny" blocks run the plain layout either way."""
    if dtype == torch.float32 and layout == "vnni":
        pytest.skip("f32 has no VNNI layout")
    B, Hq, Hkv, Sq, Sk, D, Dv = shape
    q, k, v, do = (rnd(B, h, S, d, dtype=dtype, seed=i) for i, (h, S, d) in
                   enumerate(((Hq, Sq, D), (Hkv, Sk, D), (Hkv, Sk, Dv), (Hq, Sq, Dv))))
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd", return_lse=True)
    s = REGISTRY.get("cpu_flash_bwd_native")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    o, lse = reference_forward(p, AttnArgs(q, k, v))
    a = AttnArgs(q, k, v, do=do, o=o.to(dtype), lse=lse.float())
    got = cfn.backward(p, a, cfn.LIBRARY.ops(), *blocks, vnni=layout == "vnni")
    theirs = torch_grads(q, k, v, do, causal)
    for name, x, r, t, th in zip(("dq", "dk", "dv"), got, reference_backward(p, a), (q, k, v), theirs):
        assert x.dtype == t.dtype and x.shape == t.shape
        assert torch.isfinite(x).all(), name
        # bounded by torch's own same-dtype error where that is larger (a gradient that cancels
        # to ~0 in float64, e.g. dq with one key, has no meaningful relative error)
        err, bound = (x.double() - r).norm().item(), (th.double() - r).norm().item()
        assert err <= max((2e-6 if dtype == torch.float32 else 1e-2) * r.norm().item(), 8 * bound), (name, err, bound)


def torch_grads(q, k, v, do, causal):
    """torch's CPU SDPA gradients in the inputs' dtype (GQA by repeat), rows that see no key
    (NaN in torch) as 0."""
    G = q.shape[1] // k.shape[1]
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mask = None
    if causal is not None:
        Sq, Sk = q.shape[2], k.shape[2]
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq if causal == "bottom_right" else 0)
    o = torch.nn.functional.scaled_dot_product_attention(qa, ka.repeat_interleave(G, 1), va.repeat_interleave(G, 1),
                                                         attn_mask=mask)
    return [g.nan_to_num() for g in torch.autograd.grad(o, (qa, ka, va), do)]


DROP = dict(dropout_p=0.3, seed=2 ** 40 + 77, offset=2 ** 33 + 5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("blocks", [BLOCKS[0], BLOCKS[3]], ids=["default", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_dropout_forward_against_reference(causal, dtype, blocks, layout):
    """The keep flags of nnprim.dropout per tile row: the kept P scaled before P V, lse of all."""
    if dtype == torch.float32 and layout == "plain":
        pytest.skip("f32 has no VNNI layout")
    q, k, v = rnd(2, 4, 70, 64, dtype=dtype, seed=1), rnd(2, 2, 130, 64, dtype=dtype, seed=2), \
        rnd(2, 2, 130, 48, dtype=dtype, seed=3)
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, causal=causal, dropout_p=DROP["dropout_p"])
    assert REGISTRY.get("cpu_flash_fwd_native").is_applicable(p)
    a = AttnArgs(q, k, v, seed=DROP["seed"], offset=DROP["offset"])
    o, lse = cfn.forward(p, a, cfn.LIBRARY.ops(), *blocks, vnni=layout == "vnni", by_keys=layout == "keys")
    ro, rl = reference_forward(p, a)
    check(o, lse, ro, rl, dtype)
    plain, _ = reference_forward(AttentionProblem.from_tensors(q, k, v, return_lse=True, causal=causal), a)
    assert (o.double() - plain).abs().max() > 0.1                # the mask did apply


@pytest.mark.parametrize("layout", ["vnni", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_dropout_backward_against_reference(causal, dtype, layout):
    if dtype == torch.float32 and layout == "vnni":
        pytest.skip("f32 has no VNNI layout")
    q, k, v, do = (rnd(1, h, S, d, dtype=dtype, seed=i) for i, (h, S, d) in
                   enumerate(((4, 70, 64), (2, 130, 64), (2, 130, 48), (4, 70, 48))))
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd", return_lse=True,
                                      dropout_p=DROP["dropout_p"])
    assert REGISTRY.get("cpu_flash_bwd_native").is_applicable(p)
    a0 = AttnArgs(q, k, v, seed=DROP["seed"], offset=DROP["offset"])
    o, lse = reference_forward(p, a0)
    a = AttnArgs(q, k, v, do=do, o=o.to(dtype), lse=lse.float(), seed=DROP["seed"], offset=DROP["offset"])
    got = cfn.backward(p, a, cfn.LIBRARY.ops(), vnni=layout == "vnni")
    for name, x, r in zip(("dq", "dk", "dv"), got, reference_backward(p, a)):
        assert torch.isfinite(x).all(), name
        err = ((x.double() - r).norm() / r.norm()).item()
        assert err < (2e-6 if dtype == torch.float32 else 1.5e-2), (name, err)


def test_dropout_through_the_public_api_matches_the_torch_op_solvers():
    q, k, v = (rnd(1, 2, 40, 32, dtype=torch.float32, seed=i).requires_grad_() for i in range(3))
    o = nnprim.sdpa(q, k, v, dropout_p=0.2, seed=9, solver="cpu_flash_fwd_native")
    ref = nnprim.sdpa(q, k, v, dropout_p=0.2, seed=9, solver="cpu_flash_fwd")
    assert torch.allclose(o, ref, atol=1e-5)


def test_autograd_through_the_public_api():
    q, k, v = (rnd(1, 4, 90, 64, dtype=torch.bfloat16, seed=i).requires_grad_() for i in range(3))
    do = rnd(1, 4, 90, 64, dtype=torch.bfloat16, seed=9)
    o = nnprim.sdpa(q, k, v, causal="top_left", solver="cpu_flash_fwd_native")
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64 = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    for x, r in zip(grads, torch.autograd.grad(o64, ref, do.double())):
        assert ((x.double() - r).norm() / r.norm()).item() < 1e-2


def test_a_failed_build_serves_through_the_torch_op_path(monkeypatch, tmp_path):
    """The library cannot be built (no compiler): a call that had chosen 117/118 still gets the
    right result (115/116's path), and the solvers are not applicable afterwards."""
    from nnprim.native import NativeLibrary
    lib = NativeLibrary("nnprim_cpu_attn_missing", cfn.SOURCE, "native CPU flash attention (test)")
    monkeypatch.setattr(cfn, "LIBRARY", lib)
    monkeypatch.setattr(lib, "so_path", lambda: tmp_path / "missing.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    q, k, v, do = (rnd(1, 2, 40, 32, dtype=torch.float32, seed=i) for i in range(4))
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True)
    monkeypatch.setattr(lib, "expected", lambda: True)        # as before the first build attempt
    o, lse = REGISTRY.get("cpu_flash_fwd_native").prepare(p)(AttnArgs(q, k, v))
    ro, rl = reference_forward(p, AttnArgs(q, k, v))
    assert ((o.double() - ro).norm() / ro.norm()).item() < 1e-5
    pb = p.with_direction("bwd")
    a = AttnArgs(q, k, v, do=do, o=o, lse=lse)
    for x, r in zip(REGISTRY.get("cpu_flash_bwd_native").prepare(pb)(a), reference_backward(pb, a)):
        assert ((x.double() - r).norm() / r.norm()).item() < 1e-5
    monkeypatch.undo()
    monkeypatch.setattr(cfn, "LIBRARY", lib)
    assert not lib.expected() and not REGISTRY.get("cpu_flash_fwd_native").is_applicable(p)


def test_vnni_packs_with_avx512_bf16():
    """torch's could_pack answers for AMX only; with avx512_bf16 alone the forward packs K / V in
    VNNI blocks too (oneDNN's vdpbf16ps brgemm: 2.2-2.5x the plain layout's speed on an AMD EPYC)."""
    from nnprim.conv.cpu_gemm import cpu_has_native_bf16
    ops = cfn.LIBRARY.ops()
    assert cfn.vnni_packs(ops) == (bool(ops.vnni_packs()) or cpu_has_native_bf16())


def test_scores_past_1e9_stay_finite():
    """exp's argument bounded at 0: the row max is the rounded product max(s) scale, fmsub takes
    the exact one, half an ulp of the score apart (128 at 3e9): exp overflowed, o became NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
    o = nnprim.sdpa(q, k, v, scale=1e8, solver="cpu_flash_fwd_native")
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=1e8)
    assert torch.isfinite(o).all()
    assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-5
