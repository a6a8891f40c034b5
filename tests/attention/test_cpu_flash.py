"""CPU flash attention solvers (115 cpu_flash_fwd, 116 cpu_flash_bwd) against the float64
reference, over test_reference.py's grid: GQA/MQA, both causal alignments, bool/additive
masks with broadcasting, scales, kv_lens with fully masked rows, dropout, quantized K/V,
odd sizes, f32/f16/bf16. Outputs are poisoned (NaN-filled allocations) and every grid
point also runs with tiny blocks (several chunks of heads, row blocks and key blocks)."""
from __future__ import annotations

import math

import pytest
import torch

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import cpu_flash as cf
from nnprim.attention.reference import reference_backward, reference_forward
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.ranking import heuristic_order
from nnprim.search.solver import REGISTRY

from .test_reference import BWD_CASES, MASK_SHAPES, rnd

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
BWD_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# name -> (tile elems, kv block, min GEMM rows): "tiny" gives chunks of one (batch, kv
# head), single rows and 4-key blocks; "mid" whole-problem chunks, few-row blocks, 5 keys
BLOCKS = {"default": None, "tiny": (12, 4, 1), "mid": (96, 5, 4)}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(cf, "_empty", lambda shape, dtype, device: torch.full(shape, math.nan, dtype=dtype,
                                                                            device=device))


@pytest.fixture(params=list(BLOCKS))
def blocks(request, monkeypatch):
    b = BLOCKS[request.param]
    if b is not None:
        monkeypatch.setattr(cf, "_TILE_ELEMS", b[0])
        monkeypatch.setattr(cf, "_KV_BLOCK", b[1])
        monkeypatch.setattr(cf, "_MIN_GEMM_ROWS", b[2])
    return request.param


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """Relative norm error over the finite reference entries (the norm is taken at least
    `floor` per element RMS: gradients that cancel to ~0 in float64, e.g. dq of a row that
    sees one key, are compared absolutely); NaN/inf positions must match."""
    x = x.double()
    bad = ~torch.isfinite(ref)
    assert torch.equal(~torch.isfinite(x), bad), "non-finite entries differ from the reference"
    if bad.any():
        assert torch.equal(x[bad].nan_to_num(), ref[bad].nan_to_num())
    x, ref = x[~bad], ref[~bad]
    if ref.numel() == 0:
        return 0.0
    return ((x - ref).norm() / ref.norm().clamp_min(max(1e-30, floor * ref.numel() ** 0.5))).item()


def check(q, k, v, *, backward=True, seed=0, offset=0, **opts):
    """Solvers 115/116 through their invokers vs reference_forward/backward."""
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, seed=seed, offset=offset, **opts)
    fwd = REGISTRY.get("cpu_flash_fwd")
    assert fwd.is_applicable(p), fwd.not_supported_reasons(p)
    args = AttnArgs(q, k, v, attn_mask=opts.get("attn_mask"), scale=opts.get("scale"), seed=seed,
                    offset=offset, kv_lens=opts.get("kv_lens"))
    o, lse = fwd.prepare(p)(args)
    ro, rl = reference_forward(p, args)
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == rl.shape
    assert rel_err(o, ro) < TOL[q.dtype]
    assert rel_err(lse, rl) < 1e-5
    if not backward:
        return o, lse, None
    pb = p.with_direction("bwd")
    bwd = REGISTRY.get("cpu_flash_bwd")
    assert bwd.is_applicable(pb), bwd.not_supported_reasons(pb)
    do = rnd(*o.shape, seed=99, dtype=q.dtype)
    bargs = AttnArgs(q, k, v, attn_mask=args.attn_mask, scale=args.scale, seed=seed, offset=offset,
                     kv_lens=args.kv_lens, do=do, o=o, lse=lse)
    grads = bwd.prepare(pb)(bargs)
    refs = reference_backward(pb, bargs)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == q.dtype and g.shape == r.shape
        assert not g.isnan().any(), name
        err = rel_err(g, r, floor=0.1)
        assert err < BWD_TOL[q.dtype], f"{name}: rel err {err:.3e}"
    return o, lse, grads


# ---- the reference's grid ---------------------------------------------------------------

@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("Sq,Sk", [(5, 7), (7, 5), (15, 31), (1, 9)])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
def test_grid(Hq, Hkv, Sq, Sk, causal, blocks):
    B, D, Dv = 2, 8, 6
    q, k, v = (rnd(B, Hq, Sq, D, seed=1, dtype=torch.float32), rnd(B, Hkv, Sk, D, seed=2, dtype=torch.float32),
               rnd(B, Hkv, Sk, Dv, seed=3, dtype=torch.float32))
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", list(IDS), ids=IDS.get)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_dtypes(dtype, causal, blocks):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 37, 29, 24
    q, k, v = (rnd(B, Hq, Sq, D, seed=4, dtype=dtype), rnd(B, Hkv, Sk, D, seed=5, dtype=dtype),
               rnd(B, Hkv, Sk, D, seed=6, dtype=dtype))
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("D,Dv", [(72, 40), (3, 5), (128, 128)])
def test_head_dims(D, Dv, blocks):
    q, k, v = rnd(1, 4, 9, D, seed=7), rnd(1, 2, 13, D, seed=8), rnd(1, 2, 13, Dv, seed=9)
    check(*(t.float() for t in (q, k, v)), causal="top_left")


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("mshape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_masks_broadcast(kind, mshape, blocks):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 9, 8
    q, k, v = (rnd(B, Hq, Sq, D, seed=10, dtype=torch.float32), rnd(B, Hkv, Sk, D, seed=11, dtype=torch.float32),
               rnd(B, Hkv, Sk, D, seed=12, dtype=torch.float32))
    g = torch.Generator().manual_seed(13)
    if kind == "bool":
        mask = torch.rand(mshape, generator=g) > 0.3
    else:
        mask = torch.randn(mshape, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(mshape, generator=g) < 0.2, -math.inf)
    for causal in (None, "bottom_right"):
        check(q, k, v, attn_mask=mask, causal=causal)


@pytest.mark.parametrize("inf_as_zero", [False, True])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_kv_lens_and_fully_masked_rows(causal, inf_as_zero, blocks):
    B, Hq, Hkv, Sq, Sk, D = 4, 2, 1, 4, 6, 8
    q, k, v = (rnd(B, Hq, Sq, D, seed=15, dtype=torch.float32), rnd(B, Hkv, Sk, D, seed=16, dtype=torch.float32),
               rnd(B, Hkv, Sk, D, seed=17, dtype=torch.float32))
    kv_lens = torch.tensor([0, 1, 6, 3], dtype=torch.int32)
    o, lse, (dq, _, _) = check(q, k, v, causal=causal, kv_lens=kv_lens, softmax_inf_as_zero=inf_as_zero)
    dead = lse == -math.inf
    assert dead[0].all()
    assert (o[dead] == 0).all() if inf_as_zero else o[dead].isnan().all()
    assert (dq[dead] == 0).all()


@pytest.mark.parametrize("scale,invert", [(0.3, False), (0.3, True), (torch.tensor(2.5), False),
                                          (torch.tensor([2.5], dtype=torch.bfloat16), True), (-0.4, False)])
def test_scale(scale, invert, blocks):
    q, k, v = (rnd(1, 2, 4, 8, seed=18, dtype=torch.float32), rnd(1, 2, 5, 8, seed=19, dtype=torch.float32),
               rnd(1, 2, 5, 8, seed=20, dtype=torch.float32))
    check(q, k, v, scale=scale, invert_scale=invert, causal="bottom_right")


def _against_float64(q, k, v, mask, **opts):
    """nnprim.sdpa (cpu_flash_fwd) and its autograd against softmax(q k^T / sqrt(D) + mask) v
    written out in float64 (torch's own SDPA backward, f32 or float64, has these rows' P summing
    to Sk). The rows under a huge mask have q = 0, so that their scores are the mask exactly in
    any precision (with q.k below the mask's ulp, f32 and float64 would differ by design)."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.softmax(qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask.double(), -1) @ vd
    do = rnd(*ref.shape, seed=27, dtype=q.dtype)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = nnprim.sdpa(qg, kg, vg, attn_mask=mask, solver="cpu_flash_fwd", **opts)
    assert rel_err(o, ref.detach()) < TOL[q.dtype]
    for g, r in zip(torch.autograd.grad(o, (qg, kg, vg), do), ref_grads):
        assert rel_err(g, r, floor=0.1) < BWD_TOL[q.dtype]


def _huge_rows(dtype, value, seed):
    q, k, v = (rnd(1, 2, 4, 8, seed=seed, dtype=dtype), rnd(1, 2, 6, 8, seed=seed + 1, dtype=dtype),
               rnd(1, 2, 6, 8, seed=seed + 2, dtype=dtype))
    mask = torch.zeros(1, 1, 4, 6, dtype=dtype)
    mask[..., 1, :] = value            # every key: the softmax of equal scores, not a masked row
    mask[..., 2, :3] = value           # some keys: those get 0
    q[:, :, 1:3] = 0
    return q, k, v, mask


@pytest.mark.parametrize("value", [-1e9, -1e30])
def test_huge_finite_mask_rows(value, blocks):
    """A row whose keys all carry a huge finite additive mask ((1 - m) * -1e9 padding): its f32
    lse lost the log-sum term, so the backward's exp2(s - lse) summed to Sk (dv Sk times too
    large; torch's CPU flash backward does the same) until renormalised."""
    _against_float64(*_huge_rows(torch.float32, value, 21))
    check(*_huge_rows(torch.float32, value, 21)[:3], attn_mask=_huge_rows(torch.float32, value, 21)[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finfo_min_mask_row(dtype):
    """A row of finfo.min (Hugging Face's masking value): x log2(e) overflowed to -inf, the row
    came out NaN (0 with softmax_inf_as_zero); torch gives the softmax of equal scores."""
    for inf_as_zero in (False, True):
        _against_float64(*_huge_rows(dtype, torch.finfo(dtype).min, 24), softmax_inf_as_zero=inf_as_zero)


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_reference_backward_cases(name, blocks):
    c = dict(B=2, Hq=4, Hkv=4, Sq=6, Sk=7, D=8, Dv=8, causal=None, mask=None, scale=None, invert=False,
             p=0.0, kv_lens=None, inf_as_zero=False)
    c.update(BWD_CASES[name])
    B, Hq, Hkv, Sq, Sk, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv"))
    f32 = torch.float32
    q, k, v = rnd(B, Hq, Sq, D, seed=31, dtype=f32), rnd(B, Hkv, Sk, D, seed=32, dtype=f32), \
        rnd(B, Hkv, Sk, Dv, seed=33, dtype=f32)
    g = torch.Generator().manual_seed(35)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    elif c["mask"] == "additive":
        mask = torch.randn(1, Hq, Sq, Sk, generator=g)
    kv_lens = None if c["kv_lens"] is None else torch.tensor(c["kv_lens"])
    check(q, k, v, attn_mask=mask, causal=c["causal"], scale=c["scale"], invert_scale=c["invert"],
          dropout_p=c["p"], seed=9, offset=3, kv_lens=kv_lens, softmax_inf_as_zero=c["inf_as_zero"])


# ---- dropout: bit-identical masks, forward and backward ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_dropout(dtype, blocks):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 11, 8
    q, k, v = rnd(B, Hq, Sq, D, seed=25, dtype=dtype), rnd(B, Hkv, Sk, D, seed=26, dtype=dtype), \
        rnd(B, Hkv, Sk, D, seed=27, dtype=dtype)
    opts = dict(dropout_p=0.4, causal="top_left", kv_lens=torch.tensor([11, 6]))
    o, lse, _ = check(q, k, v, seed=123, offset=2**40 + 5, **opts)
    o0, lse0, _ = check(q, k, v, backward=False, **{**opts, "dropout_p": 0.0})
    assert torch.equal(lse, lse0)                       # lse is taken before dropout
    assert (o.float() - o0.float()).abs().max() > 1e-2


# ---- quantized K/V ------------------------------------------------------------------------

@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("qdtype", ["s8", "u8", "s4", "u4"])
def test_quantized_kv(qdtype, grouped, blocks):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 3, 7, 8
    q = rnd(B, Hq, Sq, D, seed=21, dtype=torch.float32)
    k, v = rnd(B, Hkv, Sk, D, seed=22, dtype=torch.float32), rnd(B, Hkv, Sk, D, seed=23, dtype=torch.float32)
    if grouped:
        kq = quantize_kv(k, qdtype, group_size=4, symmetric=False)
        vq = quantize_kv(v, qdtype, group_size=None, symmetric=True)
    else:
        g = torch.Generator().manual_seed(24)
        lo, hi = {"s8": (-128, 127), "u8": (0, 255), "s4": (-8, 7), "u4": (0, 15)}[qdtype]
        codes = [torch.randint(lo, hi + 1, (B, Hkv, Sk, D), generator=g) for _ in range(2)]
        if qdtype in ("s4", "u4"):
            codes = [(c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4) for c in codes]
        dt = torch.int8 if qdtype == "s8" else torch.uint8
        zp = torch.tensor(float((lo + hi) // 2))
        kq = KVQuant(codes[0].to(dt), torch.tensor(0.05, dtype=torch.float16), zp, qdtype)
        vq = KVQuant(codes[1].to(dt), torch.tensor([0.1]), None, qdtype)
    check(q, kq, vq, backward=False, causal="bottom_right")
    check(q, k, vq, backward=False, kv_lens=torch.tensor([7, 2]))


# ---- layouts, public API, registration, planning ----------------------------------------

def test_strided_inputs_and_public_api():
    """(B, S, H, D)-strided inputs through nnprim.sdpa / autograd with the solver forced."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 15, 31, 16
    q = rnd(B, Sq, Hq, D, seed=41, dtype=torch.float32).transpose(1, 2)
    k = rnd(B, Sk, Hkv, D, seed=42, dtype=torch.float32).transpose(1, 2)
    v = rnd(B, Sk, Hkv, D, seed=43, dtype=torch.float32).transpose(1, 2)
    check(q, k, v, causal="bottom_right")
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = nnprim.sdpa(qa, ka, va, causal=True, solver="cpu_flash_fwd")
    o.backward(rnd(*o.shape, seed=44, dtype=torch.float32))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
    want.backward(rnd(*o.shape, seed=44, dtype=torch.float32).double())
    assert rel_err(o.detach(), want.detach()) < 1e-5
    for got, ref in ((qa.grad, qr.grad), (ka.grad, kr.grad), (va.grad, vr.grad)):
        assert rel_err(got, ref) < 1e-5


def test_registration_and_estimate():
    fwd, bwd = REGISTRY.get(115), REGISTRY.get(116)
    assert (fwd.name, bwd.name) == ("cpu_flash_fwd", "cpu_flash_bwd")
    assert fwd.family == bwd.family == "flash" and not fwd.uses_triton and not bwd.uses_triton
    assert fwd.devices == frozenset({"cpu"})
    q = rnd(1, 8, 256, 64, dtype=torch.float32)
    p = AttentionProblem.from_tensors(q, q, q)
    assert fwd.is_applicable(p) and not bwd.is_applicable(p)
    assert 0 < fwd.estimate(p) < REGISTRY.get(100).estimate(p)
    pb = p.with_direction("bwd")
    assert bwd.is_applicable(pb) and 0 < bwd.estimate(pb) < REGISTRY.get(101).estimate(pb)
    assert fwd.workspace_size(p) == 0
    p64 = AttentionProblem.from_tensors(q.double(), q.double(), q.double())
    assert any("dtype" in r for r in fwd.not_supported_reasons(p64))
    ids = [s.name for s in heuristic_order(p)]
    assert ids.index("cpu_flash_fwd") < ids.index("attn_reference_fwd")


@pytest.mark.parametrize("B,H,G,S", [(1, 8, 1, 1024), (1, 8, 1, 65536), (64, 16, 4, 2048), (1, 1, 32, 9)])
def test_plan_bounds_the_tile(B, H, G, S):
    p = AttentionProblem(direction="fwd", B=B, Hq=H * G, Hkv=H, Sq=S, Sk=S, D=64, Dv=64,
                         dtype=torch.float32, device="cpu")
    pl = cf.plan(p)
    assert pl.nb * pl.nh * G * pl.nr * pl.nc <= max(cf._TILE_ELEMS, G * pl.nc)
    assert 1 <= pl.nb <= B and 1 <= pl.nh <= H and 1 <= pl.nr <= S and 1 <= pl.nc <= S
    assert 4 * pl.nb * pl.nh * G * pl.nr * pl.nc < 8 << 20


@pytest.mark.parametrize("case", ["plain", "gqa_causal", "bool_mask", "kv_lens"])
def test_bf16_whole_row_pv(case):
    """bf16 forward on a native-bf16 CPU: whole rows, P V as one bf16 GEMM (P rounded to
    bf16, f32 accumulation inside). Error within 2x of torch's own bf16 SDPA error."""
    if not cf._native_bf16():
        pytest.skip("CPU without avx512_bf16")
    g = torch.Generator().manual_seed(3)
    Hq, Hkv = (4, 2) if case == "gqa_causal" else (2, 2)
    q = torch.randn(2, Hq, 37, 24, generator=g).bfloat16()
    k = torch.randn(2, Hkv, 45, 24, generator=g).bfloat16()
    v = torch.randn(2, Hkv, 45, 16, generator=g).bfloat16()
    opts = {}
    if case == "gqa_causal":
        opts["causal"] = "bottom_right"
    if case == "bool_mask":
        opts["attn_mask"] = torch.rand(1, 1, 37, 45, generator=g) > 0.3
    if case == "kv_lens":
        opts["kv_lens"] = torch.tensor([45, 17])
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **opts)
    assert cf.plan(p).nc == 45 and cf._pv_native(p, AttnArgs(q, k, v))
    args = AttnArgs(q, k, v, attn_mask=opts.get("attn_mask"), kv_lens=opts.get("kv_lens"))
    o, lse = cf.cpu_forward(p, args)
    ro, rlse = reference_forward(p, args)
    # torch's bf16 error on the same inputs (its CPU SDPA; masks as an additive/bool mask)
    mask = opts.get("attn_mask")
    if case == "kv_lens":
        mask = (torch.arange(45).view(1, 1, 1, -1) < opts["kv_lens"].view(-1, 1, 1, 1))
    kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    if case == "gqa_causal":
        mask = torch.ones(37, 45, dtype=torch.bool).tril(45 - 37)
    to = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    assert rel_err(lse, rlse) < 1e-5
    assert rel_err(o, ro) <= 2 * rel_err(to, ro) + 1e-4, (rel_err(o, ro), rel_err(to, ro))


@pytest.mark.parametrize("case", ["plain", "gqa_causal_top_left", "kv_lens_dead"])
def test_bf16_whole_backward(case, monkeypatch):
    """bf16 backward on a native-bf16 CPU: whole (Sq x Sk) tiles, dV / dQ / dK each one
    bf16 GEMM (P, dS rounded to bf16). Errors within 2x of torch's own bf16 SDPA backward."""
    if not cf._native_bf16():
        pytest.skip("CPU without avx512_bf16")
    calls = []
    real = cf._backward_whole
    monkeypatch.setattr(cf, "_backward_whole", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    Hq, Hkv = (4, 2) if case.startswith("gqa") else (2, 2)
    Sq, Sk = (33, 20) if case.startswith("gqa") else (29, 41)
    q = torch.randn(2, Hq, Sq, 24, generator=g).bfloat16()
    k = torch.randn(2, Hkv, Sk, 24, generator=g).bfloat16()
    v = torch.randn(2, Hkv, Sk, 16, generator=g).bfloat16()
    do = torch.randn(2, Hq, Sq, 16, generator=g).bfloat16()
    opts, mask = {}, None
    if case.startswith("gqa"):
        opts["causal"] = "top_left"            # keys >= Sq... none here; rows see j <= i
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril()
    if case == "kv_lens_dead":
        opts["kv_lens"] = torch.tensor([41, 0])
        opts["softmax_inf_as_zero"] = True
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **opts)
    pb = p.with_direction("bwd")
    assert (cf.plan(pb).nr, cf.plan(pb).nc) == (Sq, Sk)
    args = AttnArgs(q, k, v, kv_lens=opts.get("kv_lens"))
    o, lse = cf.cpu_forward(p, args)
    dq, dk, dv = cf.cpu_backward(pb, AttnArgs(q, k, v, kv_lens=opts.get("kv_lens"), o=o, lse=lse, do=do))
    assert calls
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_backward(pb, AttnArgs(q64, k64, v64, kv_lens=opts.get("kv_lens"), do=do.double()))
    if case == "kv_lens_dead":   # torch: batch 1 sees no key -> compare batch 0 only for the peer
        mask = None
    kk, vv = (t.repeat_interleave(Hq // Hkv, 1).detach().requires_grad_() for t in (k, v))
    qq = q.detach().requires_grad_()
    sl = slice(0, 1) if case == "kv_lens_dead" else slice(None)
    to = torch.nn.functional.scaled_dot_product_attention(qq[sl], kk[sl], vv[sl], attn_mask=mask)
    tg = torch.autograd.grad(to, (qq, kk, vv), do[sl], allow_unused=True)
    for name, ours, r, t in zip("qkv", (dq, dk, dv), ref, tg):
        assert not ours.isnan().any(), name
        err = rel_err(ours, r, floor=1e-3)
        peer = rel_err(t[sl].unflatten(1, (Hkv, -1)).sum(2) if name != "q" and Hq != Hkv else t[sl],
                       r[sl], floor=1e-3)
        assert err <= 2 * peer + 1e-4, (name, err, peer)
    if case == "kv_lens_dead":
        assert dk[1].abs().max() == 0 and dv[1].abs().max() == 0 and dq[1].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
@pytest.mark.parametrize("case", ["gqa_causal_mask", "dropout_kv_lens", "strided_dv"])
def test_one_head_chunks_onednn(dtype, case, monkeypatch):
    """Chunks of one (batch, kv head) pair (the f32 GEMMs on oneDNN's matmul, dV / dK
    accumulated transposed per key block), several row and uneven key blocks."""
    if not cf._onednn():
        pytest.skip("no oneDNN matmul in this torch build")
    monkeypatch.setattr(cf, "_ONE_HEAD_WORK", 1)
    monkeypatch.setattr(cf, "_TILE_ELEMS", 40 * 48)
    monkeypatch.setattr(cf, "_KV_BLOCK", 48)
    B, Hq, Hkv, Sq, Sk, D, Dv = 2, 4, 2, 53, 101, 24, 16
    q = rnd(B, Hq, Sq, D, seed=40, dtype=dtype)
    k = rnd(B, Hkv, Sk, D, seed=41, dtype=dtype)
    v = rnd(B, Hkv, Sk, Dv if case == "strided_dv" else D, seed=42, dtype=dtype)
    opts = {}
    if case == "gqa_causal_mask":
        opts["causal"] = "bottom_right"
        mask = torch.randn(B, 1, Sq, Sk, generator=torch.Generator().manual_seed(43), dtype=torch.float64)
        opts["attn_mask"] = mask.masked_fill(mask > 1.2, -math.inf)
    if case == "dropout_kv_lens":
        opts.update(dropout_p=0.2, kv_lens=torch.tensor([101, 30], dtype=torch.int32), causal="top_left")
    if case == "strided_dv":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)      # (B, Sk, H, D) memory
        q = q[..., :D]
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **opts)
    for pr in (p, p.with_direction("bwd")):
        pl = cf.plan(pr)
        assert (pl.nb, pl.nh) == (1, 1) and (pl.nr < Sq or dtype == torch.bfloat16)  # bf16: whole rows
    check(q, k, v, **opts)
