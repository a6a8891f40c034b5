"""Paged K/V on the GPU at real sizes (Hq 32, Hkv 8, D 128): decode (B 8-64, 8k-32k keys,
pages 16/64/256; bf16/f16, KVQuant s8/s4) and chunked prefill (Sq 2k-8k over a 16k cache)
through nnprim.sdpa, against the contiguous cache (same call without block_table) and the
float64 reference (first two batch entries), errors bounded by torch's same-dtype error.
Pools hold NaN wherever no valid key is (unused pages, page tails past kv_lens) and block
tables -1 past each sequence's pages; decode buffers are poisoned. append_kv builds a
quantized cache equal to quantize_kv of the contiguous one."""
import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_close, no_reference

import nnprim
from nnprim.attention import decode
from nnprim.attention.reference import sdpa_reference
from nnprim.paged import append_kv, gather_pages, to_pages
from nnprim.quant import KVQuant, quantize_kv

pytestmark = pytest.mark.bigmem   # several GiB per test: few at a time (conftest)

DEV = "cuda"
HQ, HKV, D = 32, 8, 128


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(decode, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"),
                                                                                   dtype=dtype, device=device))


def paginate(k, v, page, lens, seed=0):
    """Shuffled pages of a pool with spare pages; NaN (scales) where no valid key is; -1
    past each sequence's pages."""
    B, _, S, _ = k.shape
    M = S // page
    g = torch.Generator().manual_seed(seed)
    n = B * M + 7
    bt = torch.randperm(n, generator=g)[:B * M].reshape(B, M).to(torch.int32).to(DEV)
    kp, vp = to_pages(k, bt, n), to_pages(v, bt, n)
    pos = torch.arange(S, device=DEV)
    valid = (pos[None, :] < lens[:, None]).reshape(B, M, page)          # (B, M, page)
    keep = torch.zeros(n, page, dtype=torch.bool, device=DEV)
    keep[bt.reshape(-1).long()] = valid.reshape(B * M, page)
    hole = ~keep[:, None, :, None]
    for t in (kp, vp):
        if not isinstance(t, KVQuant):
            t.masked_fill_(hole, float("nan"))
        elif t.scale_kind == "g":
            t.scales.masked_fill_(hole, float("nan"))
        elif t.is_fp8:
            t.data.view(torch.uint8).masked_fill_(hole, 0x7F)   # e4m3fn NaN
    used = (lens + page - 1) // page
    bt = torch.where(torch.arange(M, device=DEV)[None, :] < used[:, None], bt, torch.full_like(bt, -1))
    return kp, vp, bt


def torch_same_dtype(q, k, v, lens, Sq):
    """torch's SDPA in q's dtype with a kv_lens + bottom-right causal bool mask (GQA expanded)."""
    kf = k.dequantize(q.dtype) if isinstance(k, KVQuant) else k
    vf = v.dequantize(q.dtype) if isinstance(v, KVQuant) else v
    G = q.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1)
    Sk = kf.shape[2]
    j = torch.arange(Sk, device=DEV)
    i = torch.arange(Sq, device=DEV)
    L = lens.to(torch.int64)[:, None, None, None]
    mask = (j[None, None, None, :] < L) & (j[None, None, None, :] <= i[None, None, :, None] + L - Sq)
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask)


def check(q, k, v, lens, page, nb=2):
    kp, vp, bt = paginate(k, v, page, lens)
    Sq = q.shape[2]
    with torch.no_grad():
        o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, causal="bottom_right")
        oc = nnprim.sdpa(q, k, v, kv_lens=lens, causal="bottom_right")
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(oc).all()
    assert (o.float() - oc.float()).abs().max() <= 2e-2 * oc.float().abs().max(), "paged != contiguous"

    def sl(t):
        if isinstance(t, KVQuant):
            zp = t.zero_points
            return KVQuant(t.data[:nb], t.scales[:nb] if t.scales.numel() > 1 else t.scales,
                           None if zp is None else (zp[:nb] if zp.numel() > 1 else zp), t.dtype, t.group_size,
                           t.layout)
        return t[:nb]
    ref, _ = sdpa_reference(q[:nb], sl(k), sl(v), kv_lens=lens[:nb], causal="bottom_right")
    theirs = torch_same_dtype(q[:nb], sl(k), sl(v), lens[:nb], Sq)
    assert_close(f"paged page={page}", o[:nb], theirs, ref)
    no_reference()


def rand(B, Sq, Sk, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, HQ, Sq, D, generator=g, device=DEV).to(dtype)
    k = torch.randn(B, HKV, Sk, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(B, HKV, Sk, D, generator=g, device=DEV).to(dtype)
    lens = torch.randint(Sk // 2, Sk + 1, (B,), generator=g, device=DEV).to(torch.int32)
    lens[0] = Sk
    return q, k, v, lens


@pytest.mark.parametrize("B,Sk", [(8, 32768), (64, 8192)], ids=["b8_k32k", "b64_k8k"])
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("Sq", [1, 4, 16])
def test_decode_bf16(B, Sk, page, Sq):
    q, k, v, lens = rand(B, Sq, Sk, torch.bfloat16, seed=page + Sq)
    check(q, k, v, lens, page)


@pytest.mark.parametrize("fmt", [("s8", 64, True, None), ("s4", 64, True, None), ("u4", 32, False, None),
                                 ("s8", None, True, None), ("fp8_e4m3", None, True, "tensor"),
                                 ("s4", 64, True, "v")],
                         ids=["s8g64", "s4g64", "u4g32zp", "s8tok", "fp8", "s4g64_vkeys"])
@pytest.mark.parametrize("page", [16, 256])
def test_decode_quant(fmt, page):
    q, k, v, lens = rand(16, 1, 16384, torch.bfloat16, seed=3)
    extra = {"scale_per": "tensor"} if fmt[3] == "tensor" else {}
    kq = quantize_kv(k, fmt[0], fmt[1], symmetric=fmt[2], **extra)
    vq = quantize_kv(v, fmt[0], fmt[1], symmetric=fmt[2], **extra)
    if fmt[3] == "v":  # keys-contiguous V pool: pages of a (num_pages, H, D', page) buffer
        kp, vp, bt = paginate(kq, vq, page, lens)
        vt = vp.data.transpose(-1, -2).contiguous().transpose(-1, -2)
        vp = KVQuant(vt, vp.scales, vp.zero_points, vp.dtype, vp.group_size, vp.layout)
        with torch.no_grad():
            o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens)
            oc = nnprim.sdpa(q, kq, vq, kv_lens=lens)
        assert (o.float() - oc.float()).abs().max() <= 2e-2 * oc.float().abs().max()
        return
    check(q, kq, vq, lens, page)


def test_decode_f16():
    q, k, v, lens = rand(32, 1, 8192, torch.float16, seed=9)
    check(q, k, v, lens, 64)


@pytest.mark.parametrize("Sq", [2048, 8192])
@pytest.mark.parametrize("page", [16, 64, 256])
def test_chunked_prefill(Sq, page):
    q, k, v, lens = rand(2, Sq, 16384, torch.bfloat16, seed=Sq + page)
    lens = torch.tensor([16384, 12000 + Sq % 1000], dtype=torch.int32, device=DEV)
    check(q, k, v, lens, page)


@pytest.mark.parametrize("fmt", [None, ("s4", 64, True)], ids=["bf16", "s4g64"])
def test_append_decode_loop(fmt):
    """Prefill chunk + decode steps through append_kv equal the contiguous (quantized) cache."""
    B, page, M = 8, 64, 64
    g = torch.Generator(device=DEV).manual_seed(5)
    k = torch.randn(B, HKV, M * page, D, generator=g, device=DEV).bfloat16()
    v = torch.randn(B, HKV, M * page, D, generator=g, device=DEV).bfloat16()
    n = B * M
    bt = torch.randperm(n, device=DEV).reshape(B, M).to(torch.int32)
    if fmt is None:
        kp = torch.full((n, HKV, page, D), float("nan"), device=DEV, dtype=torch.bfloat16)
        vp = kp.clone()
        kc, vc = k, v
    else:
        kc, vc = (quantize_kv(t, fmt[0], fmt[1], symmetric=fmt[2]) for t in (k, v))
        kp, vp = to_pages(kc, bt, n), to_pages(vc, bt, n)
        for t in (kp, vp):
            t.data.zero_()
            t.scales.fill_(float("nan"))
    lens = torch.zeros(B, dtype=torch.int32, device=DEV)
    lens = append_kv(kp, vp, bt, lens, k[:, :, :3000], v[:, :, :3000])
    for s in range(3000, 3016):
        lens = append_kv(kp, vp, bt, lens, k[:, :, s:s + 1], v[:, :, s:s + 1])
    torch.cuda.synchronize()
    assert (lens == 3016).all()
    gk = gather_pages(kp, bt)
    want = kc if fmt is None else kc.data
    got = gk if fmt is None else gk.data
    assert torch.equal(got[:, :, :3016], want[:, :, :3016])
    q = torch.randn(B, HQ, 1, D, generator=g, device=DEV).bfloat16()
    with torch.no_grad():
        o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens)
        oc = nnprim.sdpa(q, kc, vc, kv_lens=lens)
    assert torch.isfinite(o).all()
    assert (o.float() - oc.float()).abs().max() <= 2e-2 * oc.float().abs().max()


def test_cuda_graph_decode_step():
    """A warmed-up paged decode step and append replay in a CUDA graph."""
    B, page, M = 8, 16, 128
    q, k, v, lens = rand(B, 1, M * page, torch.bfloat16, seed=11)
    kp, vp, bt = paginate(k, v, page, torch.full((B,), M * page, dtype=torch.int32, device=DEV))
    lens = torch.full((B,), 1000, dtype=torch.int32, device=DEV)
    knew = torch.randn(B, HKV, 1, D, device=DEV).bfloat16()
    with torch.no_grad():
        nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens)
        append_kv(kp, vp, bt, lens, knew, knew)
        torch.cuda.synchronize()
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph):
            new_lens = append_kv(kp, vp, bt, lens, knew, knew)
            o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=new_lens)
        gph.replay()
        torch.cuda.synchronize()
        want = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens + 1)
    assert torch.equal(o, want)


@pytest.mark.parametrize("solver", [None, 120, 110])
def test_column_strided_block_table(solver):
    """A block_table sliced by columns (bt[:, ::2]) was read as contiguous by the Triton kernels:
    wrong pages (error 3e19), and append_kv wrote past the pool."""
    torch.manual_seed(0)
    B, H, P, D, N = 2, 2, 16, 64, 8
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    kp, vp = (torch.randn(N, H, P, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    wide = torch.tensor([[5, 99, 2, 99, 7, 99], [1, 99, 4, 99, 0, 99]], dtype=torch.int32, device="cuda")
    bt = wide[:, ::2]
    lens = torch.tensor([40, 33], dtype=torch.int32, device="cuda")
    o = nnprim.sdpa(q, kp, vp, block_table=bt, kv_lens=lens, causal="bottom_right", solver=solver)
    ref = nnprim.sdpa(q, kp, vp, block_table=bt.contiguous(), kv_lens=lens, causal="bottom_right", solver=solver)
    assert torch.equal(o, ref)
    k_new, v_new = (torch.randn(B, H, 3, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kp2, vp2 = kp.clone(), vp.clone()
    append_kv(kp, vp, bt, lens, k_new, v_new)
    append_kv(kp2, vp2, bt.contiguous(), lens, k_new, v_new)
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)
