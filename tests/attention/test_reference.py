"""Attention reference (ids 100/101) against independent computations: torch's float64
scaled_dot_product_attention with explicit masks, explicit Python loops on tiny shapes,
and torch.autograd of an independent float64 forward for the backward."""
import math

import pytest
import torch
import torch.nn.functional as F

from nnprim.args import AttnArgs
from nnprim.attention import reference as ref
from nnprim.attention.masking import fully_masked_rows, score_bias, visibility
from nnprim.dropout import dropout_keep_mask
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.solver import REGISTRY

F64 = torch.float64


def rnd(*shape, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) + 0.1).to(dtype)


# ---- independent pieces (no nnprim code) ------------------------------------------------

def vis_by_loops(B, Hq, Sq, Sk, causal=None, kv_lens=None):
    vis = torch.ones(B, Hq, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        L = Sk if kv_lens is None else int(kv_lens[b])
        for i in range(Sq):
            for j in range(Sk):
                ok = j < L
                if causal == "top_left":
                    ok = ok and j <= i
                elif causal == "bottom_right":
                    ok = ok and j <= i + L - Sq
                vis[b, :, i, j] = ok
    return vis


def indep_forward(q, k, v, *, vis, add=None, scale, keep=None, p=0.0, inf_as_zero=False):
    """Differentiable float64 forward from torch primitives: (o, lse, fully masked rows)."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = scale * q @ kk.transpose(-1, -2)
    if add is not None:
        s = s + add
        vis = vis & (add != -math.inf)
    s = s.masked_fill(~vis, -math.inf)
    dead = ~vis.any(-1, keepdim=True)
    lse = torch.logsumexp(s, -1)
    if inf_as_zero:
        pr = torch.where(dead, 0.0, torch.softmax(s.masked_fill(dead, 0.0), -1))
    else:
        pr = torch.softmax(s, -1)
    if keep is not None:
        pr = pr * keep / (1 - p)
    return pr @ vv, lse, dead.squeeze(-1)


def fwd(q, k, v, **opts):
    """Reference solver invoked through the registry, outputs in q's dtype."""
    prob = AttentionProblem.from_tensors(q, k, v, **{k_: v_ for k_, v_ in opts.items() if k_ not in ("seed", "offset")},
                                         return_lse=True, seed=opts.get("seed", 0), offset=opts.get("offset", 0))
    solver = REGISTRY.get("attn_reference_fwd")
    assert solver.is_applicable(prob), solver.not_supported_reasons(prob)
    args = AttnArgs(q=q, k=k, v=v, attn_mask=opts.get("attn_mask"), scale=opts.get("scale"),
                    seed=opts.get("seed", 0), offset=opts.get("offset", 0), kv_lens=opts.get("kv_lens"))
    return solver.prepare(prob)(args)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Outputs start as NaN and chunks are small: unwritten elements would show."""
    monkeypatch.setattr(ref, "_empty", lambda shape, device: torch.full(shape, math.nan, dtype=F64, device=device))
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 40)


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


# ---- forward: torch SDPA in float64 ----------------------------------------------------

@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("Sq,Sk", [(5, 7), (7, 5), (6, 6), (1, 9)])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
def test_forward_vs_torch_sdpa(Hq, Hkv, Sq, Sk, causal):
    B, D, Dv = 2, 8, 6
    q, k, v = rnd(B, Hq, Sq, D, seed=1), rnd(B, Hkv, Sk, D, seed=2), rnd(B, Hkv, Sk, Dv, seed=3)
    o, lse = ref.sdpa_reference(q, k, v, causal=causal)
    vis = vis_by_loops(B, Hq, Sq, Sk, causal)
    live = vis.any(-1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=vis, enable_gqa=True)
    close(o[live], want[live])
    s = (q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2)) / math.sqrt(D)
    close(lse, torch.logsumexp(s.masked_fill(~vis, -math.inf), -1))
    assert o[~live].isnan().all() and (lse[~live] == -math.inf).all()


@pytest.mark.parametrize("D,Dv", [(72, 72), (80, 80), (72, 40), (3, 5)])
def test_forward_head_dims(D, Dv):
    B, Hq, Hkv, Sq, Sk = 1, 4, 2, 5, 9
    q, k, v = rnd(B, Hq, Sq, D, seed=4), rnd(B, Hkv, Sk, D, seed=5), rnd(B, Hkv, Sk, Dv, seed=6)
    o, _ = ref.sdpa_reference(q, k, v, causal="top_left")
    close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


MASK_SHAPES = [(9,), (5, 9), (1, 4, 1, 9), (2, 1, 5, 9), (2, 4, 5, 9), (4, 5, 9), (2, 1, 1, 1)]


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("mshape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_masks_broadcast(kind, mshape):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 9, 8
    q, k, v = rnd(B, Hq, Sq, D, seed=7), rnd(B, Hkv, Sk, D, seed=8), rnd(B, Hkv, Sk, D, seed=9)
    g = torch.Generator().manual_seed(10)
    if kind == "bool":
        mask = torch.rand(mshape, generator=g) > 0.3
    else:
        mask = torch.randn(mshape, generator=g, dtype=F64)
        mask = mask.masked_fill(torch.rand(mshape, generator=g) < 0.2, -math.inf)
    for causal in (None, "bottom_right"):
        o, lse = ref.sdpa_reference(q, k, v, attn_mask=mask, causal=causal)
        vis = vis_by_loops(B, Hq, Sq, Sk, causal)
        if kind == "bool":
            full = vis & mask.expand(B, Hq, Sq, Sk)
            add = None
        else:
            full, add = vis, mask.expand(B, Hq, Sq, Sk)
        want, want_lse, dead = indep_forward(q, k, v, vis=full, add=add, scale=D ** -0.5)
        close(o, want)
        close(lse, want_lse)
        fm = torch.where(full if add is None else full & (add != -math.inf), 0.0, -math.inf)
        sd = F.scaled_dot_product_attention(q, k, v, attn_mask=fm + (0 if add is None else add.nan_to_num(neginf=0)),
                                            enable_gqa=True)
        close(o[~dead], sd[~dead])


def test_forward_python_loops():
    """Every option at once on a tiny problem, against scalar Python arithmetic."""
    B, Hq, Hkv, Sq, Sk, D, Dv = 2, 4, 2, 3, 5, 3, 2
    q, k, v = rnd(B, Hq, Sq, D, seed=11), rnd(B, Hkv, Sk, D, seed=12), rnd(B, Hkv, Sk, Dv, seed=13)
    mask = rnd(1, Hq, 1, Sk, seed=14)
    kv_lens = torch.tensor([4, 2])   # b=1: query 0 sees no key (bottom_right, L=2 < Sq=3)
    scale_t, p, seed, offset = torch.tensor(1.7), 0.3, 42, 1000
    o, lse = ref.sdpa_reference(q, k, v, attn_mask=mask, causal="bottom_right", scale=scale_t, invert_scale=True,
                                dropout_p=p, seed=seed, offset=offset, kv_lens=kv_lens)
    keep = dropout_keep_mask(seed, offset, B, Hq, Sq, Sk, p)
    for b in range(B):
        L = int(kv_lens[b])
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Sq):
                sc = {}
                for j in range(Sk):
                    if j < L and j <= i + L - Sq:
                        dot = sum(float(q[b, h, i, d]) * float(k[b, hk, j, d]) for d in range(D))
                        sc[j] = dot / float(scale_t) + float(mask[0, h, 0, j])
                if not sc:
                    assert lse[b, h, i] == -math.inf and o[b, h, i].isnan().all()
                    continue
                m = max(sc.values())
                den = sum(math.exp(s - m) for s in sc.values())
                assert float(lse[b, h, i]) == pytest.approx(m + math.log(den), rel=1e-12)
                for e in range(Dv):
                    acc = sum(math.exp(s - m) / den * bool(keep[b, h, i, j]) / (1 - p) * float(v[b, hk, j, e])
                              for j, s in sc.items())
                    assert float(o[b, h, i, e]) == pytest.approx(acc, rel=1e-12, abs=1e-13)


# ---- kv_lens, fully masked rows, scale -------------------------------------------------

@pytest.mark.parametrize("inf_as_zero", [False, True])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_kv_lens_and_fully_masked_rows(causal, inf_as_zero):
    B, Hq, Hkv, Sq, Sk, D = 4, 2, 1, 4, 6, 8
    q, k, v = rnd(B, Hq, Sq, D, seed=15), rnd(B, Hkv, Sk, D, seed=16), rnd(B, Hkv, Sk, D, seed=17)
    kv_lens = torch.tensor([0, 1, 6, 3], dtype=torch.int32)
    o, lse = ref.sdpa_reference(q, k, v, causal=causal, kv_lens=kv_lens, softmax_inf_as_zero=inf_as_zero)
    vis = vis_by_loops(B, Hq, Sq, Sk, causal, kv_lens)
    want, want_lse, dead = indep_forward(q, k, v, vis=vis, scale=D ** -0.5, inf_as_zero=inf_as_zero)
    assert dead[0].all() and dead.any()
    close(o, want)
    close(lse, want_lse)
    assert (lse[dead] == -math.inf).all()
    if inf_as_zero:
        assert (o[dead] == 0).all()
    else:
        assert o[dead].isnan().all()
    assert not o[~dead].isnan().any()
    prob = AttentionProblem.from_tensors(q, k, v, causal=causal, kv_lens=kv_lens)
    assert torch.equal(fully_masked_rows(prob, AttnArgs(q, k, v, kv_lens=kv_lens)), dead)


@pytest.mark.parametrize("scale,invert", [(0.3, False), (0.3, True), (torch.tensor(2.5), False),
                                          (torch.tensor([2.5], dtype=torch.bfloat16), True)])
def test_scale(scale, invert):
    B, Hq, Sq, Sk, D = 1, 2, 4, 5, 8
    q, k, v = rnd(B, Hq, Sq, D, seed=18), rnd(B, Hq, Sk, D, seed=19), rnd(B, Hq, Sk, D, seed=20)
    s = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.double())
    eff = 1 / s if invert else s
    o, lse = ref.sdpa_reference(q, k, v, scale=scale, invert_scale=invert)
    close(o, F.scaled_dot_product_attention(q, k, v, scale=eff))
    close(lse, torch.logsumexp(eff * q @ k.transpose(-1, -2), -1))


# ---- quantized K/V ---------------------------------------------------------------------

def dequant_indep(kq: KVQuant) -> torch.Tensor:
    """(code - zp) * scale, nibbles unpacked by integer arithmetic (independent of quant.py)."""
    d = kq.data.to(torch.int64)
    if kq.dtype in ("s4", "u4"):
        lo, hi = d % 16, d // 16
        if kq.dtype == "s4":
            lo, hi = lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)
        d = torch.stack((lo, hi), -1).flatten(-2)
        if kq.layout == 1:   # element e of each 8 sits in nibble (0, 1, 4, 5, 2, 3, 6, 7)[e]
            d = d.reshape(*d.shape[:-1], -1, 8)[..., [0, 1, 4, 5, 2, 3, 6, 7]].flatten(-2)
    G = kq.group
    sc = kq.scales.double()
    sc = sc.reshape(()) if sc.numel() == 1 else sc.repeat_interleave(G, -1)
    zp = 0.0 if kq.zero_points is None else kq.zero_points.double()
    if isinstance(zp, torch.Tensor):
        zp = zp.reshape(()) if zp.numel() == 1 else zp.repeat_interleave(G, -1)
    return (d.double() - zp) * sc


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("qdtype", ["s8", "u8", "s4", "u4"])
def test_quantized_kv(qdtype, zero_points, grouped):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 3, 7, 8
    q = rnd(B, Hq, Sq, D, seed=21, dtype=torch.float32)
    k, v = rnd(B, Hkv, Sk, D, seed=22, dtype=torch.float32), rnd(B, Hkv, Sk, D, seed=23, dtype=torch.float32)
    if grouped:
        kq = quantize_kv(k, qdtype, group_size=4, symmetric=not zero_points)
        vq = quantize_kv(v, qdtype, group_size=None, symmetric=not zero_points)
        if not zero_points and qdtype in ("u8", "u4"):  # unsigned symmetric has a mid-range zp: drop it
            kq = KVQuant(kq.data, kq.scales, None, qdtype, 4, kq.layout)
            vq = KVQuant(vq.data, vq.scales, None, qdtype, None, vq.layout)
    else:
        g = torch.Generator().manual_seed(24)
        lo, hi = {"s8": (-128, 127), "u8": (0, 255), "s4": (-8, 7), "u4": (0, 15)}[qdtype]
        codes = [torch.randint(lo, hi + 1, (B, Hkv, Sk, D), generator=g) for _ in range(2)]
        if qdtype in ("s4", "u4"):
            codes = [(c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4) for c in codes]
        dt = torch.int8 if qdtype == "s8" else torch.uint8
        zp = torch.tensor(float((lo + hi) // 2)) if zero_points else None
        kq = KVQuant(codes[0].to(dt), torch.tensor(0.05, dtype=torch.float16), zp, qdtype)
        vq = KVQuant(codes[1].to(dt), torch.tensor([0.1]), zp, qdtype)
    o, lse = ref.sdpa_reference(q, kq, vq, causal="bottom_right")
    kd, vd = dequant_indep(kq), dequant_indep(vq)
    want = F.scaled_dot_product_attention(q.double(), kd, vd, is_causal=False, enable_gqa=True,
                                          attn_mask=vis_by_loops(B, Hq, Sq, Sk, "bottom_right"))
    close(o, want)
    (o2, lse2) = fwd(q, kq, vq, causal="bottom_right")
    assert o2.dtype == torch.float32 and lse2.dtype == torch.float32
    close(o2.double(), want, tol=1e-6)


# ---- dropout ----------------------------------------------------------------------------

def test_dropout_forward_and_lse():
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 11, 8
    q, k, v = rnd(B, Hq, Sq, D, seed=25), rnd(B, Hkv, Sk, D, seed=26), rnd(B, Hkv, Sk, D, seed=27)
    p, seed, offset = 0.4, 123, 77
    o, lse = ref.sdpa_reference(q, k, v, dropout_p=p, seed=seed, offset=offset, causal="top_left")
    o0, lse0 = ref.sdpa_reference(q, k, v, causal="top_left")
    close(lse, lse0)                       # lse is taken before dropout
    keep = dropout_keep_mask(seed, offset, B, Hq, Sq, Sk, p).double()
    want, _, _ = indep_forward(q, k, v, vis=vis_by_loops(B, Hq, Sq, Sk, "top_left"), scale=D ** -0.5, keep=keep, p=p)
    close(o, want)
    assert (o - o0).abs().max() > 1e-3
    o3, _ = ref.sdpa_reference(q, k, v, dropout_p=p, seed=seed + 1, offset=offset, causal="top_left")
    assert (o3 - o).abs().max() > 1e-3


# ---- backward: explicit formulas vs torch.autograd ------------------------------------

BWD_CASES = {
    "plain": dict(),
    "gqa2-causal-tl": dict(Hkv=2, causal="top_left"),
    "mqa-causal-br-long-q": dict(Hkv=1, Sq=9, Sk=5, causal="bottom_right"),
    "gqa2-br-long-k": dict(Hkv=2, Sq=4, Sk=10, causal="bottom_right"),
    "bool-mask": dict(mask="bool"),
    "additive-mask-gqa4": dict(Hkv=1, mask="additive"),
    "scale-tensor-inv": dict(scale=torch.tensor(0.7), invert=True),
    "dropout-gqa2": dict(Hkv=2, p=0.3, causal="top_left"),
    "dropout-mask": dict(p=0.6, mask="additive", Dv=5),
    "kvlens-inf0": dict(kv_lens=[0, 3], causal="bottom_right", inf_as_zero=True),
    "kvlens-dropout": dict(Hkv=2, kv_lens=[0, 1], p=0.2, inf_as_zero=True),
    "kvlens-nan-rows": dict(kv_lens=[7, 0], causal="bottom_right"),
    "d72": dict(D=72, Dv=72, Hkv=2, causal="top_left"),
}


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_backward_vs_autograd(name):
    c = dict(B=2, Hq=4, Hkv=4, Sq=6, Sk=7, D=8, Dv=8, causal=None, mask=None, scale=None, invert=False,
             p=0.0, kv_lens=None, inf_as_zero=False)
    c.update(BWD_CASES[name])
    B, Hq, Hkv, Sq, Sk, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv"))
    q, k, v = rnd(B, Hq, Sq, D, seed=31), rnd(B, Hkv, Sk, D, seed=32), rnd(B, Hkv, Sk, Dv, seed=33)
    do = rnd(B, Hq, Sq, Dv, seed=34)
    g = torch.Generator().manual_seed(35)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    elif c["mask"] == "additive":
        mask = torch.randn(1, Hq, Sq, Sk, generator=g, dtype=F64)
    kv_lens = None if c["kv_lens"] is None else torch.tensor(c["kv_lens"])
    opts = dict(attn_mask=mask, causal=c["causal"], scale=c["scale"], invert_scale=c["invert"], dropout_p=c["p"],
                seed=9, offset=3, kv_lens=kv_lens, softmax_inf_as_zero=c["inf_as_zero"])
    dq, dk, dv = ref.sdpa_backward_reference(do, q, k, v, **opts)

    vis = vis_by_loops(B, Hq, Sq, Sk, c["causal"], kv_lens)
    add = None
    if mask is not None and mask.dtype == torch.bool:
        vis = vis & mask
    elif mask is not None:
        add = mask.expand(B, Hq, Sq, Sk)
    sc = D ** -0.5 if c["scale"] is None else (1 / float(c["scale"]) if c["invert"] else float(c["scale"]))
    keep = dropout_keep_mask(9, 3, B, Hq, Sq, Sk, c["p"]).double() if c["p"] else None
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    # the contract: fully masked rows have zero gradients, with or without softmax_inf_as_zero
    # (autograd of the NaN-row forward would put NaN into dk/dv), so differentiate the 0-row form
    o, _, dead = indep_forward(qa, ka, va, vis=vis, add=add, scale=sc, keep=keep, p=c["p"], inf_as_zero=True)
    want = torch.autograd.grad(o, (qa, ka, va), do)
    for got, exp in zip((dq, dk, dv), want):
        close(got, exp, tol=1e-11)
    # fully masked rows (with or without softmax_inf_as_zero) contribute zero gradients
    assert (dq[dead] == 0).all() and not any(t.isnan().any() for t in (dq, dk, dv))


# ---- solver invokers: dtypes, lse, poisoning, chunking --------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_solver_invokers(dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 7, 8
    q, k, v = (rnd(B, Hq, Sq, D, seed=41, dtype=dtype), rnd(B, Hkv, Sk, D, seed=42, dtype=dtype),
               rnd(B, Hkv, Sk, D, seed=43, dtype=dtype))
    o, lse = fwd(q, k, v, causal="top_left")
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, Hq, Sq)
    o64, lse64 = ref.sdpa_reference(q, k, v, causal="top_left")
    close(o.double(), o64, tol={torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2))
    close(lse.double(), lse64, tol=1e-6)

    prob = AttentionProblem.from_tensors(q, k, v)
    o_nolse, none = REGISTRY.get(100).prepare(prob)(AttnArgs(q, k, v))
    assert none is None and o_nolse.dtype == dtype

    bprob = AttentionProblem.from_tensors(q, k, v, causal="top_left", direction="bwd")
    bwd = REGISTRY.get("attn_reference_bwd")
    assert bwd.is_applicable(bprob) and not bwd.is_applicable(prob) and not REGISTRY.get(100).is_applicable(bprob)
    do = rnd(B, Hq, Sq, D, seed=44, dtype=dtype)
    # the solver uses the given lse: float64 exactness needs a float64 one (sdpa's is f32)
    lse_in = lse64 if dtype == torch.float64 else lse
    dq, dk, dv = bwd.prepare(bprob)(AttnArgs(q, k, v, do=do, o=o, lse=lse_in))
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    want = ref.sdpa_backward_reference(do, q, k, v, causal="top_left")
    for got, exp in zip((dq, dk, dv), want):
        assert not got.isnan().any()
        close(got.double(), exp, tol={torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 3e-2))


def test_bwd_rejects_quantized_and_estimates():
    q = rnd(1, 2, 3, 8, dtype=torch.float32)
    kq = quantize_kv(rnd(1, 2, 4, 8, dtype=torch.float32), "s8", group_size=None)
    p = AttentionProblem.from_tensors(q, kq, kq)
    assert REGISTRY.get(100).is_applicable(p)
    assert REGISTRY.get(100).estimate(p) > 0 and REGISTRY.get(100).workspace_size(p) == 0
    assert REGISTRY.get(100).family == "reference" and REGISTRY.get(101).family == "reference"


@pytest.mark.parametrize("chunk", [1, 13, 80])
def test_chunking_independent(monkeypatch, chunk):
    B, Hq, Hkv, Sq, Sk, D = 2, 6, 3, 5, 4, 8
    q, k, v = rnd(B, Hq, Sq, D, seed=51), rnd(B, Hkv, Sk, D, seed=52), rnd(B, Hkv, Sk, D, seed=53)
    do = rnd(B, Hq, Sq, D, seed=54)
    opts = dict(causal="bottom_right", dropout_p=0.5, seed=3, attn_mask=rnd(Hq, Sq, Sk, seed=55),
                kv_lens=torch.tensor([3, 4]))
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", chunk)   # row blocks (1, 13) and head blocks (80)
    small = ref.sdpa_reference(q, k, v, **opts) + ref.sdpa_backward_reference(do, q, k, v, **opts)
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 1 << 30)
    big = ref.sdpa_reference(q, k, v, **opts) + ref.sdpa_backward_reference(do, q, k, v, **opts)
    for a, b in zip(small, big):
        close(a, b, tol=1e-14)


# ---- masking helpers (used by other solvers' tests) ------------------------------------

@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_masking_helpers_subblocks(causal):
    B, Hq, Sq, Sk = 3, 4, 5, 6
    kv_lens = torch.tensor([6, 0, 2])
    mask = torch.randn(1, Hq, Sq, 1, dtype=F64)
    vis = vis_by_loops(B, Hq, Sq, Sk, causal, kv_lens)
    full = score_bias(B, Hq, Sq, Sk, causal=causal, attn_mask=mask, kv_lens=kv_lens)
    want = torch.where(vis, mask.expand(B, Hq, Sq, Sk), -math.inf)
    assert torch.equal(full, want)
    sub = score_bias(B, Hq, Sq, Sk, causal=causal, attn_mask=mask, kv_lens=kv_lens,
                     batches=slice(1, 3), heads=slice(1, 3))
    assert torch.equal(sub, full[1:3, 1:3])
    sub = score_bias(B, Hq, Sq, Sk, causal=causal, attn_mask=mask, kv_lens=kv_lens, rows=slice(2, 5))
    assert torch.equal(sub, full[:, :, 2:5])
    bmask = torch.rand(B, 1, 1, Sk) > 0.5
    v2 = visibility(B, Hq, Sq, Sk, causal=causal, attn_mask=bmask, kv_lens=kv_lens, heads=slice(2, 4))
    assert torch.equal(v2, (vis & bmask)[:, 2:4])
