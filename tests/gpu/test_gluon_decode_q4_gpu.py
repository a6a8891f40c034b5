"""Solver 133 (`gluon_decode_q4`: 4-bit K/V unpacked in registers into mma.sync operands) at
real and odd sizes on the H200, against the float64 reference of the dequantised cache:
s4 / u4, groups 32 / 64 / 128, per head and per tensor, with and without zero points,
layouts 0 and 1, D 64 / 128, bf16 and f16 q, GQA 4 and 8, Sq 1-4 causal (both alignments),
ragged kv_lens (0 included), one split and many; paged pools (page sizes 16-256) against the
same cache contiguous, bit for bit. Outputs are poisoned (NaN) before each run, and so are
the scales, zero points and codes past each sequence's length (page tails, unused pages,
keys past kv_lens); the bound is relative to torch's same-dtype SDPA on the same
dequantised cache."""
import pytest
import torch
from gpu_helpers import assert_close, dequant_reference

import nnprim
from nnprim.attention import decode
from nnprim.paged import to_pages
from nnprim.quant import KVQuant, quantize_kv

DEV = "cuda"
SOLVER = "gluon_decode_q4"
pytestmark = pytest.mark.bigmem   # float64 references of 8k-32k caches: few at a time (conftest)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    real = decode._empty
    monkeypatch.setattr(decode, "_empty", lambda shape, dtype, device: real(shape, dtype, device).fill_(float("nan"))
                        if dtype.is_floating_point else real(shape, dtype, device))


def _quant(x, dt, group, zp, layout):
    if group in ("head", "tensor"):
        return quantize_kv(x, dt, scale_per=group, symmetric=not zp, layout=layout)
    return quantize_kv(x, dt, group_size=group, symmetric=not zp, scale_dtype=torch.bfloat16, layout=layout)


CASES = [  # (dtype, group, zero points, layout, D, q dtype)
    ("s4", 64, False, 1, 128, torch.bfloat16), ("u4", 64, True, 1, 128, torch.bfloat16),
    ("s4", 32, True, 1, 128, torch.bfloat16), ("u4", 128, False, 1, 128, torch.float16),
    ("s4", "head", False, 1, 128, torch.bfloat16), ("u4", "tensor", True, 0, 128, torch.bfloat16),
    ("s4", 64, True, 0, 64, torch.float16), ("u4", 32, False, 1, 64, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-zp' if c[2] else ''}-l{c[3]}-d{c[4]}-"
                         f"{str(c[5])[6:]}")
@pytest.mark.parametrize("B,Hq,Hkv,Sk", [(4, 32, 8, 8192), (3, 16, 2, 1037)], ids=str)
def test_formats(case, B, Hq, Hkv, Sk):
    dt, group, zp, layout, D, qdt = case
    g = torch.Generator(device=DEV).manual_seed(Sk + D)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=qdt, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=qdt, generator=g) * 2
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=qdt, generator=g)
    kq, vq = _quant(k, dt, group, zp, layout), _quant(v, dt, group, zp, layout)
    ng = 1 if group in ("head", "tensor") else D // group
    if (Hq // Hkv) * ng > 16:
        pytest.skip("G * groups > 16 rows: not this solver's")
    ref, theirs = dequant_reference(q, kq, vq)
    o = nnprim.sdpa(q, kq, vq, solver=SOLVER)
    assert_close(f"{case} {B}x{Sk}", o, theirs, ref)


@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
@pytest.mark.parametrize("Sq", [1, 2, 4])
def test_rows_lens_causal(Sq, causal):
    """G * Sq * groups up to 16 rows, ragged lengths (one 0), lse with splits."""
    B, Hq, Hkv, Sk, D = 5, 8, 2, 3001, 128
    g = torch.Generator(device=DEV).manual_seed(Sq)
    q = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    group = 128 if Sq == 4 else 64
    kq, vq = _quant(k, "u4", group, True, 1), _quant(v, "s4", group, False, 1)
    lens = torch.tensor([Sk, 0, 1, 777, Sk - 5], device=DEV, dtype=torch.int32)
    ref, theirs = dequant_reference(q, kq, vq, lens, causal)
    o, lse = nnprim.sdpa(q, kq, vq, solver=SOLVER, kv_lens=lens, causal=causal, return_lse=True,
                         softmax_inf_as_zero=True)
    assert_close(f"Sq{Sq} {causal}", o, theirs, ref)
    o2 = nnprim.sdpa(q, kq, vq, kv_lens=lens, causal=causal, return_lse=True, softmax_inf_as_zero=True,
                     solver="decode_split_k_quant_grouped")[1]
    ok = torch.isfinite(o2)
    assert torch.equal(ok, torch.isfinite(lse))
    assert torch.allclose(lse[ok], o2[ok], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("page", [0, 16])
def test_ragged_batch_shares_chunks_by_length(page):
    """40 sequences (two of the schedule's 32-lane passes), lengths from 0 to Sk, one far longer
    than the rest, through the default config and with the chunks shared by length
    (Q4Config.balanced, decode.balanced_counts: the long one spans more programs than the even
    split gives it; idle programs write slots nothing reads), by default and with the even split."""
    B, Hq, Hkv, Sk, D = 40, 8, 2, 4096, 128
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    kq, vq = _quant(k, "s4", 64, False, 1), _quant(v, "u4", 64, True, 1)
    lens = torch.randint(0, 300, (B,), device=DEV, generator=g).to(torch.int32)
    lens[7], lens[0], lens[33] = Sk, 0, Sk - 1
    ref, theirs = dequant_reference(q, kq, vq, lens)
    kw = dict(kv_lens=lens, return_lse=True, softmax_inf_as_zero=True, solver=SOLVER)
    from dataclasses import replace

    from nnprim.args import AttnArgs
    from nnprim.attention import gluon_decode_quant as q4
    from nnprim.problems.attention import AttentionProblem
    bt = None
    kk, vv = kq, vq
    if page:
        M = Sk // page
        bt = torch.randperm(B * M + 3, device=DEV)[:B * M].reshape(B, M).to(torch.int32)
        kk, vv = to_pages(kq, bt, B * M + 3), to_pages(vq, bt, B * M + 3)
        kw["block_table"] = bt
    o, lse = nnprim.sdpa(q, kk, vv, **kw)
    assert_close(f"ragged B{B} p{page}", o, theirs, ref)
    p = AttentionProblem.from_tensors(q, kk, vv, kv_lens=lens, block_table=bt, return_lse=True,
                                      softmax_inf_as_zero=True)
    # the default shares chunks by length; the even split (balanced=False) must agree with it
    assert q4.default_config(p).balanced
    planned = q4.plan(p, AttnArgs(q=q, k=kk, v=vv, kv_lens=lens, block_table=bt),
                      replace(q4.default_config(p), balanced=False))
    assert planned[1] is not None and not planned[1].options["BALANCED"]
    ob, lseb = decode.run_planned(p, AttnArgs(q=q, k=kk, v=vv, kv_lens=lens, block_table=bt), planned)
    assert_close(f"ragged B{B} p{page} even", ob, theirs, ref)
    okb = torch.isfinite(lse)
    assert torch.equal(okb, torch.isfinite(lseb)) and torch.allclose(lse[okb], lseb[okb], atol=1e-3, rtol=1e-3)
    lse2 = nnprim.sdpa(q, kq, vq, kv_lens=lens, return_lse=True, softmax_inf_as_zero=True,
                       solver="decode_split_k_quant_grouped")[1]
    ok = torch.isfinite(lse2)
    assert torch.equal(ok, torch.isfinite(lse)) and torch.allclose(lse[ok], lse2[ok], atol=2e-3, rtol=1e-3)


def test_default_chooses_among_applicable():
    """The public call on the suite's s4 decode runs (find may pick 133 or another) and agrees."""
    q = torch.randn(8, 32, 1, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(8, 8, 32768, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(8, 8, 32768, 128, device=DEV, dtype=torch.bfloat16)
    kq, vq = _quant(k, "s4", 64, False, 1), _quant(v, "s4", 64, False, 1)
    ref, theirs = dequant_reference(q, kq, vq)
    assert_close("default", nnprim.sdpa(q, kq, vq), theirs, ref)
    assert_close("forced", nnprim.sdpa(q, kq, vq, solver=SOLVER), theirs, ref)


def _past(t: KVQuant, valid: torch.Tensor, scale: float = float("nan"), zp: float = float("nan"),
          codes: bool = True) -> KVQuant:
    """t with its grouped scales / zero points set to `scale` / `zp` (and, with `codes`, random
    codes) where `valid` (B or pages, S) is False: NaN poison past each sequence's keys, or the
    reference's finite view of it (1, 0)."""
    bad = ~valid[:, None, :, None]
    data = torch.where(bad, torch.randint_like(t.data, 0, 256), t.data) if codes else t.data
    grouped = lambda x: x is not None and x.dim() == 4  # noqa: E731
    sc = t.scales.masked_fill(bad, scale) if grouped(t.scales) else t.scales
    zps = t.zero_points.masked_fill(bad, zp) if grouped(t.zero_points) else t.zero_points
    return KVQuant.trusted(data, sc, zps, t.dtype, t.group_size, t.layout)


SK_PAGED = 3000
PAGED = [  # (dtype, group, zero points, page size)
    ("s4", 64, False, 64), ("u4", 64, True, 16), ("u4", 32, True, 256), ("s4", "tensor", False, 32),
    ("s4", 128, True, 48),
]


@pytest.mark.parametrize("case", PAGED, ids=lambda c: f"{c[0]}-{c[1]}{'-zp' if c[2] else ''}-p{c[3]}")
@pytest.mark.parametrize("Sq", [1, 4])
def test_paged_equals_contiguous(case, Sq):
    """Shuffled pages with NaN past each sequence's length: the same bits as the contiguous
    cache (whose keys past kv_lens are poisoned the same way), both close to the reference."""
    dt, group, zp, page = case
    B, Hq, Hkv, D = 4, 32 if Sq == 1 else 8, 8 if Sq == 1 else 4, 128
    n_pages = -(-SK_PAGED // page)
    Sk = n_pages * page
    g = torch.Generator(device=DEV).manual_seed(page + Sq)
    q = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    kq, vq = _quant(k, dt, group, zp, 1), _quant(v, dt, group, zp, 1)
    ng = 1 if group in ("head", "tensor") else D // group
    if (Hq // Hkv) * Sq * ng > 16:
        pytest.skip("G * Sq * groups > 16 rows: not this solver's")
    lens = torch.tensor([Sk, 1, min(page + 1, Sk), Sk - page // 2 - 3], device=DEV, dtype=torch.int32)
    valid = torch.arange(Sk, device=DEV)[None, :] < lens[:, None].long()
    kq, vq = _past(kq, valid), _past(vq, valid)
    bt = torch.randperm(B * n_pages + 3, device=DEV)[:B * n_pages].reshape(B, n_pages).to(torch.int32)
    kp, vp = to_pages(kq, bt, B * n_pages + 3), to_pages(vq, bt, B * n_pages + 3)
    used = torch.zeros(B * n_pages + 3, Sk // n_pages, dtype=torch.bool, device=DEV)
    used[bt.reshape(-1).long()] = valid.reshape(B * n_pages, page)
    kp, vp = _past(kp, used), _past(vp, used)     # unused pages and page tails
    bt[1, 1:] = -1      # entries past a sequence's pages may hold anything
    finite = dict(scale=1.0, zp=0.0, codes=False)
    ref, theirs = dequant_reference(q, _past(kq, valid, **finite), _past(vq, valid, **finite), lens, "bottom_right")
    kw = dict(kv_lens=lens, causal="bottom_right", softmax_inf_as_zero=True, solver=SOLVER)
    o = nnprim.sdpa(q, kp, vp, block_table=bt, **kw)
    assert_close(f"paged {case} Sq{Sq}", o, theirs, ref)
    oc = nnprim.sdpa(q, kq, vq, **kw)
    assert torch.equal(o, oc), "paged and contiguous caches differ"



@pytest.mark.parametrize("splits", ["one", "many"])
def test_running_max_grows(splits):
    """Scores that grow along the keys (key norms up to 9x) move each row's running max by far
    more than the kernel's lazy-rescale threshold many times; a chunk's first block holds the
    smallest scores. One split (B x Hkv = 1024 programs fill the H200's slots: 63 blocks a
    chunk) and many (a few blocks a chunk)."""
    B, Hq, Hkv, Sk, D = (128, 8, 8, 2001, 128) if splits == "one" else (2, 32, 8, 6000, 128)
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=g) * 3
    ramp = torch.linspace(1, 9, Sk, device=DEV).view(1, 1, Sk, 1)
    k = (torch.randn(B, Hkv, Sk, D, device=DEV, generator=g) * ramp).to(torch.bfloat16)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    kq, vq = _quant(k, "s4", 64, False, 1), _quant(v, "u4", 64, True, 1)
    ref, theirs = dequant_reference(q, kq, vq)
    o, lse = nnprim.sdpa(q, kq, vq, solver=SOLVER, return_lse=True)
    assert_close(f"grows {splits}", o, theirs, ref)
    lse2 = nnprim.sdpa(q, kq, vq, solver="decode_split_k_quant_grouped", return_lse=True)[1]
    assert torch.allclose(lse, lse2, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("page", [0, 16, 64, 48])
def test_ring_equals_registers(page):
    """The words through the cp.async ring (Q4Config.ring) and through registers: the same bits
    (same splits), on ragged lengths whose chunks end inside a block and hold fewer blocks
    than the ring has slots."""
    from dataclasses import replace

    from nnprim.args import AttnArgs
    from nnprim.attention import gluon_decode_quant as q4
    from nnprim.problems.attention import AttentionProblem
    B, Hq, Hkv, D = 5, 32, 8, 128
    Sk = 1968 // page * page if page else 1999
    g = torch.Generator(device=DEV).manual_seed(page)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16, generator=g)
    kq, vq = _quant(k, "u4", 64, True, 1), _quant(v, "s4", 64, False, 1)
    lens = torch.tensor([Sk, 1, 33, 95, Sk - 17], device=DEV, dtype=torch.int32)
    bt = None
    if page:
        n_pages = Sk // page
        bt = torch.randperm(B * n_pages, device=DEV).reshape(B, n_pages).to(torch.int32)
        kq, vq = to_pages(kq, bt, B * n_pages), to_pages(vq, bt, B * n_pages)
    args = AttnArgs(q=q, k=kq, v=vq, kv_lens=lens, block_table=bt)
    p = AttentionProblem.from_tensors(q, kq, vq, kv_lens=lens, block_table=bt)
    outs = []
    for splits in (1, 7):
        for ring in (0, 2, 3, 4):
            cfg = replace(q4.default_config(p), ring=ring, splits=splits, maxnreg=None)
            outs.append(decode.run_planned(p, args, q4.plan(p, args, cfg))[0])
        for o in outs[-3:]:
            assert torch.equal(o, outs[-4]), f"splits {splits}: ring and registers differ"
