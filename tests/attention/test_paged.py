"""Paged K/V (nnprim.paged, block_table=): every paged solver (decode 120/121/122, flash 110,
cpu_flash 115, reference 100) against the contiguous cache, through the Triton interpreter
at small sizes. The pools hold NaN everywhere no sequence's valid keys are (unused pages,
page tails past kv_lens), and the block tables -1 past each sequence's pages, so a read
of either shows; launcher buffers are poisoned."""
import pytest
import torch

import nnprim
from nnprim import paged
from nnprim.args import AttnArgs
from nnprim.attention import decode
from nnprim.attention.decode import DecodeConfig, decode_forward
from nnprim.attention.reference import reference_forward, sdpa_reference
from nnprim.paged import append_kv, gather_pages, to_pages
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import KVQuant, quantize_kv
from nnprim.search.random_args import random_args
from nnprim.search.solver import REGISTRY

SENTINEL = 1234.5
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(decode, "_empty", lambda shape, dtype, device: torch.full(shape, SENTINEL, dtype=dtype,
                                                                                   device=device))


def _nan_fill(pool, bt, lens, page):
    """NaN (float pools; 0x7f codes and NaN scales for KVQuant) in every row no valid key uses."""
    keep = torch.zeros(pool.shape[0], pool.shape[2], dtype=torch.bool)
    for b in range(bt.shape[0]):
        for j in range(int(lens[b])):
            keep[int(bt[b, j // page]), j % page] = True
    hole = ~keep[:, None, :, None]
    if isinstance(pool, KVQuant):
        if pool.scale_kind == "g":
            pool.scales.masked_fill_(hole, float("nan"))
        return pool
    return pool.masked_fill_(hole, float("nan"))


def make_paged(k, v, page, lens, seed=0, spare=3):
    """Shuffled pages of a pool with `spare` extra pages; -1 past each sequence's pages."""
    B, _, Sk, _ = k.shape if isinstance(k, torch.Tensor) else k.shape
    M = Sk // page
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(B * M + spare, generator=g)[:B * M].reshape(B, M).to(torch.int32)
    kp, vp = to_pages(k, bt, B * M + spare), to_pages(v, bt, B * M + spare)
    kp, vp = _nan_fill(kp, bt, lens, page), _nan_fill(vp, bt, lens, page)
    used = (lens + page - 1) // page
    bt = torch.where(torch.arange(M)[None, :] < used[:, None], bt, torch.full_like(bt, -1))
    return kp, vp, bt


def rand_kv(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Sq, D, generator=g).to(dtype), torch.randn(B, Hkv, Sk, D, generator=g).to(dtype),
            torch.randn(B, Hkv, Sk, D, generator=g).to(dtype))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


def check_vs_reference(o, q, k, v, lens, **opts):
    ro, _ = sdpa_reference(q, k, v, kv_lens=lens, **opts)
    live = ~ro.isnan()
    assert live.any()
    err = (o.double()[live] - ro[live]).norm() / ro[live].norm()
    assert err < TOL[q.dtype], f"rel err {err:.3g}"


DECODE_CASES = [  # solver, dtype, K/V format, page, Sq, (Hq, Hkv)
    (120, torch.float32, None, 16, 1, (4, 2)),
    (120, torch.float16, None, 32, 4, (8, 2)),
    (120, torch.bfloat16, None, 64, 16, (4, 1)),
    (121, torch.float16, ("s8", None, False), 16, 1, (4, 2)),
    (121, torch.bfloat16, ("s4", 16, True), 32, 4, (4, 1)),
    (122, torch.float16, ("s4", 16, True), 16, 4, (8, 2)),
    (122, torch.bfloat16, ("s8", 16, False), 64, 1, (4, 2)),
    (128, torch.float16, ("u4", 16, False), 16, 4, (8, 2)),
    (128, torch.bfloat16, ("s8", 16, True), 64, 1, (4, 2)),
]


@pytest.mark.parametrize("sid,dtype,fmt,page,Sq,heads", DECODE_CASES)
def test_decode_paged_equals_contiguous(sid, dtype, fmt, page, Sq, heads):
    Hq, Hkv = heads
    B, D, M = 3, 32, 3
    q, k, v = rand_kv(B, Hq, Hkv, Sq, M * page, D, dtype, seed=sid + page)
    if fmt is not None:
        k = quantize_kv(k, fmt[0], fmt[1], symmetric=fmt[2])
        v = quantize_kv(v, fmt[0], fmt[1], symmetric=fmt[2])
    lens = torch.tensor([M * page, page + 3, 2 * page - 1], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, page, lens, seed=page)
    opts = dict(kv_lens=lens, causal="bottom_right")
    o = nnprim.sdpa(q, kp, vp, block_table=bt, solver=sid, **opts)
    oc = nnprim.sdpa(q, k, v, solver=sid, **opts)
    assert same(o, oc)
    check_vs_reference(o, q, k, v, lens, causal="bottom_right")


def test_decode_page_below_key_block():
    """page 16 < block_n 32 (per-row page lookup), lse too, against the contiguous launch."""
    q, k, v = rand_kv(2, 4, 2, 2, 96, 32, torch.float16, seed=5)
    lens = torch.tensor([83, 40], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, 16, lens)
    cfg = DecodeConfig(block_n=32, block_m=16, num_warps=4, num_stages=1, splits=2)
    p = AttentionProblem.from_tensors(q, kp, vp, kv_lens=lens, block_table=bt, return_lse=True)
    pc = AttentionProblem.from_tensors(q, k, v, kv_lens=lens, return_lse=True)
    o, lse = decode_forward(p, AttnArgs(q=q, k=kp, v=vp, kv_lens=lens, block_table=bt), cfg)
    oc, lsec = decode_forward(pc, AttnArgs(q=q, k=k, v=v, kv_lens=lens), cfg)
    assert same(o, oc) and same(lse, lsec)


@pytest.mark.parametrize("dtype,page,heads", [(torch.float32, 16, (4, 2)), (torch.bfloat16, 32, (4, 1)),
                                              (torch.float16, 8, (2, 2))])
def test_chunked_prefill_flash(dtype, page, heads):
    """flash_fwd (110) over pages: a chunk of 24 queries against ragged caches, causal bottom-right."""
    Hq, Hkv = heads
    B, Sq, D, M = 2, 24, 32, 4
    q, k, v = rand_kv(B, Hq, Hkv, Sq, M * page, D, dtype, seed=page)
    lens = torch.tensor([M * page - 3, Sq + page // 2], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, page, lens, seed=1)
    opts = dict(kv_lens=lens, causal="bottom_right", return_lse=True)
    o, lse = nnprim.sdpa(q, kp, vp, block_table=bt, solver=110, **opts)
    oc, lsec = nnprim.sdpa(q, k, v, solver=110, **opts)
    assert same(o, oc) and same(lse, lsec)
    check_vs_reference(o, q, k, v, lens, causal="bottom_right")


def test_cpu_and_reference_gather():
    q, k, v = rand_kv(2, 4, 2, 5, 64, 16, torch.float32, seed=3)
    lens = torch.tensor([64, 20], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, 16, lens)
    for sid in ("cpu_flash_fwd", "attn_reference_fwd"):
        o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, causal="bottom_right", solver=sid)
        oc = nnprim.sdpa(q, k, v, kv_lens=lens, causal="bottom_right", solver=sid)
        assert torch.allclose(o, oc, atol=1e-6, rtol=1e-6), sid
    # chosen by the find mode (no solver forced): some paged solver, same answer
    o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens)
    check_vs_reference(o, q, k, v, lens)


def test_unsupported_solvers_and_key():
    q, k, v = rand_kv(1, 2, 2, 1, 32, 16, torch.float32)
    lens = torch.tensor([20], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, 16, lens)
    p = AttentionProblem.from_tensors(q, kp, vp, kv_lens=lens, block_table=bt)
    assert "pg16" in p.key() and p.Sk == 32 and p.page_size == 16
    pc = AttentionProblem.from_tensors(q, k, v, kv_lens=lens)
    assert pc.key() != p.key()
    paged_ids = {s.id for s in REGISTRY.all("attention") if s.is_applicable(p)}
    assert {100, 110, 115, 120} <= paged_ids
    assert not [s for s in REGISTRY.all("attention") if s.id in paged_ids and not s.paged]
    with pytest.raises(nnprim.NotSupportedError, match="paged"):
        nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, solver=111)


def test_random_args_paged():
    q, k, v = rand_kv(2, 2, 1, 1, 32, 16, torch.float16)
    lens = torch.tensor([20, 32], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, 16, lens)
    p = AttentionProblem.from_tensors(q, kp, vp, kv_lens=lens, block_table=bt)
    a = random_args(p)
    assert a.block_table.shape == (2, 2) and a.k.shape[2] == 16
    o, _ = reference_forward(p, a)
    o2, _ = reference_forward(p, paged.gathered(a))
    assert torch.equal(o, o2)


# ---- append ---------------------------------------------------------------------------

@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("fmt", [None, ("s8", None, True), ("s4", 16, True), ("u4", 8, False)],
                         ids=["bf16", "s8", "s4", "u4asym"])
def test_append_then_attend(monkeypatch, triton_path, fmt):
    """Chunks appended into empty pools hold exactly the contiguous cache (quantized as
    quantize_kv quantizes it), and attending over them equals attending over that cache."""
    monkeypatch.setattr(paged, "_interpret", lambda: triton_path)
    B, Hkv, D, page, M = 2, 2, 16, 16, 3
    g = torch.Generator().manual_seed(7)
    k = torch.randn(B, Hkv, M * page, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, Hkv, M * page, D, generator=g).to(torch.bfloat16)
    bt = torch.randperm(B * M + 1, generator=g)[:B * M].reshape(B, M).to(torch.int32)
    if fmt is None:
        kp = torch.full((B * M + 1, Hkv, page, D), float("nan"), dtype=torch.bfloat16)
        vp = kp.clone()
        kc, vc = k, v
    else:
        kc = quantize_kv(k, fmt[0], fmt[1], symmetric=fmt[2])
        vc = quantize_kv(v, fmt[0], fmt[1], symmetric=fmt[2])
        kp, vp = to_pages(kc, bt, B * M + 1), to_pages(vc, bt, B * M + 1)
        for t in (kp, vp):
            t.data.zero_()
            t.scales.fill_(float("nan"))
    lens = torch.tensor([0, 5], dtype=torch.int32)
    for n in (7, 1, 20):  # a prefill chunk, a decode step, a chunk across pages
        lens2 = append_kv(kp, vp, bt, lens, k[:, :, :n], v[:, :, :n], symmetric=None if fmt is None else fmt[2])
        k, v = k[:, :, n:], v[:, :, n:]
        assert lens2.tolist() == [x + n for x in lens.tolist()] and lens2.dtype == lens.dtype
        lens = lens2
    # what was written, position by position, is the contiguous cache
    gk, gv = gather_pages(kp, bt), gather_pages(vp, bt)
    for b in range(B):
        lo, hi = [0, 5][b], int(lens[b])
        sl = slice(lo, hi)
        src = slice(0, hi - lo)
        for got, want in ((gk, kc), (gv, vc)):
            if fmt is None:
                assert torch.equal(got[b, :, sl], want[b, :, src])
            else:
                assert torch.equal(got.data[b, :, sl], want.data[b, :, src])
                assert torch.equal(got.scales[b, :, sl], want.scales[b, :, src])
                if want.zero_points is not None:
                    assert torch.equal(got.zero_points[b, :, sl], want.zero_points[b, :, src])


def test_append_then_decode_equals_contiguous():
    B, Hq, Hkv, D, page, M = 2, 4, 2, 32, 16, 3
    g = torch.Generator().manual_seed(1)
    k = torch.randn(B, Hkv, M * page, D, generator=g).half()
    v = torch.randn(B, Hkv, M * page, D, generator=g).half()
    q = torch.randn(B, Hq, 1, D, generator=g).half()
    bt = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    kp = torch.full((6, Hkv, page, D), float("nan"), dtype=torch.float16)
    vp = kp.clone()
    lens = append_kv(kp, vp, bt, torch.zeros(B, dtype=torch.int32), k[:, :, :33], v[:, :, :33])
    o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, solver=120)
    oc = nnprim.sdpa(q, k, v, kv_lens=lens, solver=120)
    assert same(o, oc)


# ---- bad inputs ------------------------------------------------------------------------

def _bad_case():
    q, k, v = rand_kv(2, 2, 1, 1, 32, 16, torch.float32)
    lens = torch.tensor([20, 32], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, 16, lens)
    return q, kp, vp, bt, lens


@pytest.mark.parametrize("what,needle", [
    ("int64", "block_table.dtype"), ("1d", "2-D"), ("batch", "B=2"), ("no_lens", "kv_lens"),
    ("long_lens", "kv_lens"), ("page_oob", r"block_table\[1, 1\]"), ("pool_mismatch", "page pool"),
    ("list", "block_table must be"),
])
def test_bad_inputs(what, needle):
    q, kp, vp, bt, lens = _bad_case()
    kw = dict(block_table=bt, kv_lens=lens)
    if what == "int64":
        kw["block_table"] = bt.long()
    elif what == "1d":
        kw["block_table"] = bt.reshape(-1)
    elif what == "batch":
        kw["block_table"] = bt[:1]
    elif what == "no_lens":
        kw["kv_lens"] = None
    elif what == "long_lens":
        kw["kv_lens"] = torch.tensor([20, 33], dtype=torch.int32)
    elif what == "page_oob":
        bt = bt.clone()
        bt[1, 1] = 99
        kw["block_table"] = bt
    elif what == "pool_mismatch":
        vp = vp[:, :, :8]
    elif what == "list":
        kw["block_table"] = bt.tolist()
    with pytest.raises(nnprim.BadParameterError, match=needle):
        nnprim.sdpa(q, kp, vp, **kw)


def test_paged_needs_no_grad():
    q, kp, vp, bt, lens = _bad_case()
    q.requires_grad_(True)
    with pytest.raises(nnprim.NotSupportedError, match="paged"):
        nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens)
    with pytest.raises(nnprim.NotSupportedError, match="paged"):
        AttentionProblem.from_tensors(q, kp, vp, block_table=bt, kv_lens=lens, direction="bwd")
    with torch.no_grad():
        assert nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens).shape == (2, 2, 1, 16)


def test_append_bad_inputs(monkeypatch):
    kp = torch.zeros(4, 2, 16, 8)
    vp = torch.zeros(4, 2, 16, 8)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    new = torch.randn(2, 2, 5, 8)
    with pytest.raises(nnprim.BadParameterError, match="overflow"):
        append_kv(kp, vp, bt, torch.tensor([30, 0], dtype=torch.int32), new, new)
    for triton_path in (True, False):  # check=False: no host check, the rows past the table are skipped
        monkeypatch.setattr(paged, "_interpret", lambda t=triton_path: t)
        kp2 = torch.zeros(4, 2, 16, 8)
        lens = append_kv(kp2, kp2.clone(), bt, torch.tensor([30, 0], dtype=torch.int32), new, new, check=False)
        assert lens.tolist() == [35, 5]
        assert torch.equal(kp2[1, :, 14:], new[0, :, :2]) and torch.equal(kp2[2, :, :5], new[1])
    with pytest.raises(nnprim.BadParameterError, match="k_new"):
        append_kv(kp, vp, bt, torch.tensor([0, 0], dtype=torch.int32), new[:, :1], new)
    with pytest.raises(nnprim.BadParameterError, match="dtype"):
        append_kv(kp, vp, bt, torch.tensor([0, 0], dtype=torch.int32), new.half(), new.half())
    with pytest.raises(nnprim.BadParameterError, match=r"block_table\[0, 1\]"):
        append_kv(kp, vp, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), torch.tensor([14, 0],
                  dtype=torch.int32), new, new)
    qk = quantize_kv(torch.randn(4, 2, 16, 8), "s8", None, symmetric=False)
    qk = KVQuant(qk.data, qk.scales, torch.zeros(1), "u8" if qk.data.dtype == torch.uint8 else "s8")
    with pytest.raises(nnprim.NotSupportedError, match="zero point"):
        append_kv(qk, qk, bt, torch.tensor([0, 0], dtype=torch.int32), new, new)
    ph = quantize_kv(torch.randn(4, 2, 16, 8), "fp8_e4m3")   # per (page, head) scales: not a pool's
    with pytest.raises(nnprim.BadParameterError, match="shared by every page"):
        append_kv(ph, ph, bt, torch.tensor([0, 0], dtype=torch.int32), new, new)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "s8"])
def test_append_static_scale_then_decode(fmt):
    """Pools with a fixed scale (fp8 per head, s8 per tensor): append stores x / scale in
    codes, and paged decode equals decode over the gathered cache."""
    B, Hq, Hkv, D, page, M = 2, 4, 2, 32, 16, 3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, Hkv, 40, D, generator=g).half()
    n = B * M
    if fmt == "fp8_e4m3":
        sc = torch.tensor([0.01, 0.02]).reshape(1, Hkv).expand(n, Hkv)
    else:
        sc = torch.tensor([0.03])
    dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.int8
    kp = KVQuant(torch.zeros(n, Hkv, page, D, dtype=dt), sc, None, fmt)
    vp = KVQuant(torch.zeros(n, Hkv, page, D, dtype=dt), sc, None, fmt)
    bt = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
    lens = append_kv(kp, vp, bt, torch.zeros(B, dtype=torch.int32), x, x)
    gk = gather_pages(kp, bt, lens)
    want = (x.float() / sc[:1].float().reshape(1, -1, 1, 1) if sc.numel() > 1 else x.float() / sc)
    want = want.to(dt) if fmt == "fp8_e4m3" else torch.round(want).clamp(-128, 127).to(dt)
    assert torch.equal(gk.data[:, :, :40].view(torch.int8), want.view(torch.int8))
    q = torch.randn(B, Hq, 1, D, generator=g).half()
    sids = [s.id for s in REGISTRY.all("attention") if s.id in (121, 122, 128)
            and s.is_applicable(AttentionProblem.from_tensors(q, kp, vp, kv_lens=lens, block_table=bt))]
    assert sids
    for sid in sids:
        o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, solver=sid)
        oc = nnprim.sdpa(q, gk, gather_pages(vp, bt, lens), kv_lens=lens, solver=sid)
        assert same(o, oc), sid


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, kp, vp, bt, lens = _bad_case()
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        fq, fk, fv, fb, fl = (m.from_tensor(t) for t in (q, kp, vp, bt, lens))
        o, lse = torch.ops.nnprim.sdpa_forward(fq, fk, fv, None, None, None, None, "", "", None, None, fl, "",
                                               None, False, 0.0, 0, 0, False, True, None, fb)
    assert tuple(o.shape) == (2, 2, 1, 16) and tuple(lse.shape) == (2, 2, 1)


@pytest.mark.parametrize("page", [16, 32])
def test_flash_tma_paged(page):
    """The TMA variant of the paged flash forward (descriptors over the pool as rows; the
    interpreter runs tensor descriptors): equals the contiguous TMA launch, NaN page tails."""
    from nnprim.attention import flash_fwd
    from nnprim.attention.configs import TileConfig
    q, k, v = rand_kv(2, 4, 2, 20, 4 * page, 32, torch.float32, seed=page)
    lens = torch.tensor([4 * page - 5, 27], dtype=torch.int32)
    kp, vp, bt = make_paged(k, v, page, lens, seed=2)
    cfg = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    p = AttentionProblem.from_tensors(q, kp, vp, kv_lens=lens, block_table=bt, causal="bottom_right")
    pc = AttentionProblem.from_tensors(q, k, v, kv_lens=lens, causal="bottom_right")
    o, _ = flash_fwd.flash_forward(p, AttnArgs(q=q, k=kp, v=vp, kv_lens=lens, block_table=bt), cfg, use_tma=True)
    oc, _ = flash_fwd.flash_forward(pc, AttnArgs(q=q, k=k, v=v, kv_lens=lens), cfg, use_tma=True)
    assert same(o, oc)
    assert flash_fwd.paged_tma_ok(p, AttnArgs(q=q, k=kp, v=vp), 16) is False  # interpreter: no TMA by default


def test_pipeline_stages_for_paged_loops():
    """A paged key loop compiles with 2 * num_stages - 1 stages (the block-table load is one
    level of indirection ahead of K/V); the contiguous loop and single-stage loops as asked."""
    from nnprim.attention.paging import pipeline_stages
    assert [pipeline_stages(s, 16) for s in (1, 2, 3, 4)] == [1, 3, 5, 7]
    assert [pipeline_stages(s, 0) for s in (1, 2, 3, 4)] == [1, 2, 3, 4]


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
def test_prefill_tiles_for_pages_below_the_key_block(page):
    """On the H200, pages shorter than the table's key block take the gather tiles; pages the
    block divides keep the table's (TMA boxes within a page)."""
    from nnprim.attention import configs
    q = torch.empty(2, 32, 2048, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 8, 16384, 128, dtype=torch.bfloat16, device="meta")
    base = configs.choose(AttentionProblem.from_tensors(q, kv, kv, causal="bottom_right"), "sm90")[0]
    p = AttentionProblem(**{**AttentionProblem.from_tensors(q, kv, kv, causal="bottom_right").__dict__,
                            "device": "cuda", "page_size": page})
    fwd = configs.choose(p, "sm90")[0]
    assert fwd == (configs.PAGED_ROWS_FWD if page % base.block_n else base)
