"""Chunks shared by kv_lens (decode.balanced_counts, the kernels' balanced_chunk / chunk_count):
the counts' invariants and the combine kernel's BALANCED mode on partials laid out as
solver 133 writes them (its Gluon kernel runs only on the H200: tests/gpu)."""
import math

import pytest
import torch
import triton
import triton.language as tl

from nnprim.attention import decode as dec
from nnprim.problems.attention import AttentionProblem


@triton.jit
def _muldiv_kernel(A, K, D, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i, dec.floor_muldiv(tl.load(A + i), tl.load(K + i), tl.load(D + i)))


def test_floor_muldiv_is_exact():
    """The schedule's division without an int64 `//` (floor_muldiv) equals the exact floor over
    its range: a <= d up to 2^27 key blocks, k < MAX_BALANCED_SLOTS, results on and next to
    whole numbers (where an f32 estimate truncates the wrong way)."""
    g = torch.Generator().manual_seed(0)
    n = 256
    d = torch.randint(1, 1 << 27, (n,), generator=g)
    d[:32] = torch.randint(1, 64, (32,), generator=g)
    a = (torch.rand(n, generator=g, dtype=torch.float64) * (d + 1)).long().clamp(max=d)
    a[32:48] = d[32:48]
    k = torch.randint(1, dec.MAX_BALANCED_SLOTS, (n,), generator=g)
    k[48:64] = dec.MAX_BALANCED_SLOTS - 1
    # a * k a multiple of d, or one short of it
    d[64:96] = k[64:96] * 3
    a[64:96] = 3 * torch.arange(32)
    a[80:96] = d[80:96] - 1
    out = torch.empty(n, dtype=torch.int32)
    _muldiv_kernel[(1,)](a.int(), k.int(), d.int(), out, N=n)
    assert torch.equal(out.long(), a * k // d)


@pytest.mark.parametrize("seed", range(6))
def test_counts_fill_at_most_the_programs(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 70, (1,), generator=g))
    splits = int(torch.randint(1, 40, (1,), generator=g))
    Sk = int(torch.randint(1, 5000, (1,), generator=g))
    lens = torch.randint(-3, Sk + 50, (B,), generator=g)   # out-of-range lengths are clamped
    for causal in (None, "top_left", "bottom_right"):
        c = dec.balanced_counts(lens, 3, Sk, splits, 32, causal)
        assert c.min() >= 1 and int(c.sum()) <= B * splits


def test_equal_lengths_keep_the_even_split():
    """Full lengths: every sequence gets `splits` chunks, as without kv_lens."""
    for B, splits, Sk in ((8, 24, 32768), (64, 3, 8192), (1, 32, 4096), (5, 7, 1000)):   # splits <= blocks / 4, as choose_splits
        c = dec.balanced_counts(torch.full((B,), Sk), 1, Sk, splits, 32)
        assert c.tolist() == [splits] * B


def test_long_sequences_get_more_chunks():
    lens = torch.tensor([32768, 1024, 2048, 512, 30000, 100, 0, 8192])
    c = dec.balanced_counts(lens, 1, 32768, 24, 32)
    per = [math.ceil(math.ceil(n / 32) / k) for n, k in zip(lens.tolist(), c.tolist())]
    assert c[0] > 24 and max(per) < math.ceil(1024 / 24) * 0.7   # the longest chunk shrinks
    assert int(c.sum()) <= 8 * 24


def _partials(q, k, v, lens, splits, bn, causal):
    """o_s / lse_s of every chunk (f32), at the slots 133 writes (BALANCED)."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    P = B * splits
    counts = dec.balanced_counts(lens, Sq, k.shape[2], splits, bn, causal)
    first = torch.cumsum(counts, 0) - counts
    po = torch.full((Hkv * P * G * Sq, D), float("nan"))   # poisoned: only chunks are read
    pl = torch.full((Hkv * P * G * Sq,), float("nan"))
    for b in range(B):
        L = int(lens[b].clamp(0, k.shape[2]))
        kv_end = min(L, Sq) if causal == "top_left" else L
        nb = -(-kv_end // bn)
        per = -(-nb // int(counts[b]))
        for c in range(int(counts[b])):
            lo, hi = c * per * bn, min((c + 1) * per * bn, kv_end)
            for hk in range(Hkv):
                for hl in range(G):
                    h = hk * G + hl
                    s = (q[b, h].double() @ k[b, hk].double().T) / math.sqrt(D)
                    j = torch.arange(k.shape[2])
                    ok = (j >= lo) & (j < hi)
                    if causal:
                        shift = 0 if causal == "top_left" else L - Sq
                        ok = ok[None, :] & (j[None, :] <= torch.arange(Sq)[:, None] + shift)
                    else:
                        ok = ok[None, :].expand(Sq, -1)
                    s = s.masked_fill(~ok, float("-inf"))
                    lse = torch.logsumexp(s, 1)
                    p = torch.where(ok, torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[:, None]), 0.0)
                    o = p @ v[b, hk].double()
                    row = ((hk * P + int(first[b]) + c) * G + hl) * Sq + torch.arange(Sq)
                    po[row], pl[row] = o.float(), lse.float()
    return po, pl


@pytest.mark.parametrize("causal,Sq", [(None, 1), ("bottom_right", 3), ("top_left", 2)])
def test_combine_balanced_matches_reference(causal, Sq):
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, Sk, D, splits, bn = 5, 4, 2, 300, 16, 6, 16
    q = torch.randn(B, Hq, Sq, D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    v = torch.randn(B, Hkv, Sk, D, generator=g)
    lens = torch.tensor([300, 17, 0, 160, 299], dtype=torch.int32)
    po, pl = _partials(q, k, v, lens, splits, bn, causal)
    prob = AttentionProblem(direction="fwd", device="cpu", B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=D,
                            dtype=torch.float32, causal=causal, has_kv_lens=True, inf_as_zero=True, return_lse=True)
    comb = dec.combine_launch(prob, splits, bn)
    o = torch.full((B, Hq, Sq, D), float("nan"))
    lse = torch.full((B, Hq, Sq), float("nan"))
    comb(po, pl, o, lse, lens)
    for b in range(B):
        L = int(lens[b])
        shift = 0 if causal == "top_left" else L - Sq
        for h in range(Hq):
            s = (q[b, h].double() @ k[b, h // (Hq // Hkv)].double().T) / math.sqrt(D)
            j = torch.arange(Sk)
            ok = (j < L)[None, :].expand(Sq, -1)
            if causal:
                ok = ok & (j[None, :] <= torch.arange(Sq)[:, None] + shift)
            s = s.masked_fill(~ok, float("-inf"))
            ref_lse = torch.logsumexp(s, 1)
            p = torch.where(ok, torch.softmax(s.masked_fill(~ok.any(1, keepdim=True), 0.0), 1), 0.0)
            ref = p @ v[b, h // (Hq // Hkv)].double()
            rows_ok = ok.any(1)
            torch.testing.assert_close(o[b, h][rows_ok].double(), ref[rows_ok], rtol=1e-4, atol=1e-5)
            assert (o[b, h][~rows_ok] == 0).all()   # inf_as_zero: rows with no key
            torch.testing.assert_close(lse[b, h][rows_ok].double(), ref_lse[rows_ok], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("solver,B", [("120", 33), ("122", 33), ("128", 33), ("120", 9)])
def test_triton_solvers_balanced_equal_even(solver, B):
    """The Triton decode kernels (120 bf16 / f32, 122 and 128 on quantized K/V) with their
    chunks shared by kv_lens agree with the even split: 33 sequences (past decode.LENS_PER_LOAD:
    the schedule loops over the rest) and 9 (one load), lengths 0 to Sk, one far longer, and
    every output written."""
    from dataclasses import replace

    from nnprim.args import AttnArgs
    from nnprim.attention import decode_quant, decode_swap
    from nnprim.quant import quantize_kv
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, Sk, D = 4, 2, 96, 16
    q = torch.randn(B, Hq, 2, D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    v = torch.randn(B, Hkv, Sk, D, generator=g)
    lens = torch.randint(0, 30, (B,), generator=g).to(torch.int32)
    lens[3], lens[B - 1] = Sk, Sk - 7
    mod = {"120": dec, "122": decode_quant, "128": decode_swap}[solver]
    if solver != "120":
        q = q.to(torch.bfloat16)
        k, v = quantize_kv(k, "s4", group_size=16), quantize_kv(v, "u4", group_size=16, symmetric=False)
    args = AttnArgs(q=q, k=k, v=v, kv_lens=lens)
    p = AttentionProblem.from_tensors(q, k, v, kv_lens=lens, causal="bottom_right", return_lse=True)
    cfg = replace(mod.default_config(p), block_n=16, splits=3)
    outs = {}
    for bal in (True, False):
        planned = mod.plan(p, args, replace(cfg, balanced=bal))
        assert bool(planned[1].options["BALANCED"] if planned[1] else 0) == bal
        outs[bal] = dec.run_planned(p, args, planned)
    torch.testing.assert_close(outs[True][0].float(), outs[False][0].float(), rtol=2e-3, atol=2e-3, equal_nan=True)
    torch.testing.assert_close(outs[True][1], outs[False][1], rtol=1e-4, atol=1e-4, equal_nan=True)
