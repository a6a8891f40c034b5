"""Flash attention solvers (110 flash_fwd, 111 flash_bwd) against the float64 reference,
under TRITON_INTERPRET=1 (set by tests/conftest.py) at small shapes with tails: Sq, Sk not
multiples of the 16-wide tiles, odd head dims, Dv != D, GQA/MQA, every mask kind, scales,
kv_lens, dropout, poisoned (NaN-filled) outputs."""
from __future__ import annotations

import pytest
import torch

from nnprim.args import AttnArgs
from nnprim.attention import configs, flash_bwd, flash_fwd
from nnprim.attention.reference import reference_backward, reference_forward
from nnprim.errors import BadParameterError
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import quantize_kv
from nnprim.search.solver import REGISTRY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
BWD_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative norm error over the finite reference entries; NaN/inf positions must match."""
    x = x.double()
    bad_ref = ~torch.isfinite(ref)
    assert torch.equal(~torch.isfinite(x), bad_ref), "non-finite entries differ from the reference"
    if bad_ref.any():
        assert torch.equal(x[bad_ref], ref[bad_ref]) or torch.isnan(ref[bad_ref]).all()
    x, ref = x[~bad_ref], ref[~bad_ref]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make(B=2, Hq=4, Hkv=2, Sq=37, Sk=29, D=24, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, Dv, generator=g).to(dtype)
    return q, k, v


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def check(q, k, v, *, backward=True, seed=0, offset=0, **opts):
    """Run forward (and backward) with poisoned outputs and compare with the reference."""
    scale = opts.get("scale")
    mask, kv_lens = opts.get("attn_mask"), opts.get("kv_lens")
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **opts)
    assert REGISTRY.get("flash_fwd").is_applicable(p), REGISTRY.get("flash_fwd").not_supported_reasons(p)
    args = AttnArgs(q, k, v, attn_mask=mask, scale=scale, seed=seed, offset=offset, kv_lens=kv_lens)
    fcfg, bcfg = configs.choose(p)
    B, Hq, Sq, _ = q.shape
    o, lse = flash_fwd.flash_forward(p, args, fcfg, out=poisoned((B, Hq, Sq, v.shape[-1]), q.dtype),
                                     lse_out=poisoned((B, Hq, Sq), torch.float32))
    ro, rl = reference_forward(p, args)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert rel_err(o, ro) < TOL[q.dtype]
    assert rel_err(lse, rl) < 1e-5
    if not backward:
        return o, lse
    pb = p.with_direction("bwd")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)
    bargs = AttnArgs(q, k, v, attn_mask=mask, scale=scale, seed=seed, offset=offset,
                     kv_lens=kv_lens, do=do, o=o, lse=lse)
    out = (poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype))
    grads = flash_bwd.flash_backward(pb, bargs, bcfg, out=out)
    refs = reference_backward(pb, bargs)
    for name, g_, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g_.dtype == q.dtype and g_.shape == r.shape
        err = rel_err(g_, r)
        assert err < BWD_TOL[q.dtype], f"{name}: rel err {err:.3e}"
    return o, lse


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_basic_gqa_tails_dv(dtype):
    check(*make(Sq=37, Sk=29, D=24, Dv=40, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_causal(dtype, causal):
    check(*make(B=1, Hq=2, Hkv=1, Sq=33, Sk=33, D=40, dtype=dtype), causal=causal)


@pytest.mark.parametrize("Sq,Sk", [(19, 41), (40, 23)])
def test_causal_bottom_right_rectangular(Sq, Sk):
    # Sq > Sk leaves the first rows fully masked: gradients compared with inf_as_zero
    check(*make(B=1, Hq=3, Hkv=1, Sq=Sq, Sk=Sk, D=72, Dv=16), causal="bottom_right",
          softmax_inf_as_zero=True)


def test_causal_top_left_rectangular_mqa():
    check(*make(B=2, Hq=4, Hkv=1, Sq=21, Sk=38, D=16), causal=True)


def test_even_head_dims_f16():
    check(*make(B=1, Hq=2, Hkv=2, Sq=32, Sk=48, D=32, dtype=torch.float16), causal="top_left")


def test_fully_masked_rows_nan_and_inf_lse():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=20, Sk=9, D=16)
    o, lse = check(q, k, v, causal="bottom_right", backward=False)
    assert torch.isnan(o[:, :, :11]).all() and torch.isfinite(o[:, :, 11:]).all()
    assert (lse[:, :, :11] == float("-inf")).all()


@pytest.mark.parametrize("shape", [(1, 1, 37, 29), (2, 1, 1, 29), (1, 4, 37, 1), (2, 4, 37, 29)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bool_mask_broadcast(shape):
    q, k, v = make()
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(shape, generator=g) > 0.3
    check(q, k, v, attn_mask=mask, softmax_inf_as_zero=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_additive_mask_3d_with_inf(dtype):
    q, k, v = make(dtype=dtype)
    g = torch.Generator().manual_seed(4)
    mask = torch.randn(4, 37, 29, generator=g)
    mask[torch.rand(4, 37, 29, generator=g) > 0.8] = float("-inf")
    check(q, k, v, attn_mask=mask.to(dtype), causal="bottom_right", softmax_inf_as_zero=True)


def test_bool_mask_fully_masked_row_zero():
    q, k, v = make(B=1, Hq=2, Hkv=2, Sq=18, Sk=21, D=16)
    mask = torch.ones(1, 1, 18, 21, dtype=torch.bool)
    mask[..., 5, :] = False
    o, lse = check(q, k, v, attn_mask=mask, softmax_inf_as_zero=True)
    assert (o[:, :, 5] == 0).all() and (lse[:, :, 5] == float("-inf")).all()


@pytest.mark.parametrize("kind", ["float", "float_inv", "float_neg", "tensor", "tensor_inv"])
def test_scales(kind):
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=17, Sk=33, D=24)
    val = {"float": 0.37, "float_inv": 3.0, "float_neg": -0.3}.get(kind, torch.tensor(2.5))
    check(q, k, v, scale=val, invert_scale=kind.endswith("inv"), causal="top_left")


def test_kv_lens_bottom_right():
    q, k, v = make(B=3, Hq=2, Hkv=1, Sq=13, Sk=37, D=24)
    kv_lens = torch.tensor([37, 20, 0], dtype=torch.int32)
    check(q, k, v, kv_lens=kv_lens, causal="bottom_right", softmax_inf_as_zero=True)


def test_kv_lens_with_mask():
    q, k, v = make(B=2, Hq=2, Hkv=2, Sq=21, Sk=35, D=16)
    kv_lens = torch.tensor([35, 17], dtype=torch.int64)
    mask = torch.randn(2, 1, 21, 35)
    check(q, k, v, kv_lens=kv_lens, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_dropout(dtype):
    q, k, v = make(B=2, Hq=2, Hkv=1, Sq=23, Sk=35, D=24, Dv=16, dtype=dtype)
    check(q, k, v, dropout_p=0.3, causal="top_left", seed=2**40 + 12345, offset=2**33 + 7)


def test_dropout_changes_output():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=17, Sk=19, D=16)
    o1, _ = check(q, k, v, dropout_p=0.5, seed=1, backward=False)
    o2, _ = check(q, k, v, dropout_p=0.5, seed=2, backward=False)
    assert not torch.allclose(o1, o2)


def test_any_strides():
    B, H, Sq, Sk, D = 2, 4, 19, 27, 40
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Sq, H, D, generator=g).transpose(1, 2)          # BSHD layout
    k = torch.randn(B, H, D, Sk, generator=g).transpose(2, 3)          # transposed K
    v = torch.randn(B, H, Sk, 2 * D, generator=g)[..., ::2]            # strided head dim
    check(q, k, v, causal="top_left")


def test_backward_deterministic():
    q, k, v = make(B=1, Hq=4, Hkv=1, Sq=35, Sk=35, D=24, dtype=torch.bfloat16)
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd", return_lse=True, causal=True)
    pf = p.with_direction("fwd")
    o, lse = REGISTRY.get("flash_fwd").prepare(pf)(AttnArgs(q, k, v))
    do = torch.randn_like(o)
    inv = REGISTRY.get(111).prepare(p)
    a = AttnArgs(q, k, v, do=do, o=o, lse=lse)
    g1, g2 = inv(a), inv(a)
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))


def test_solver_registration_and_reasons():
    fwd, bwd = REGISTRY.get(110), REGISTRY.get(111)
    assert (fwd.name, fwd.family, bwd.name, bwd.family) == ("flash_fwd", "flash", "flash_bwd", "flash")
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=16, Sk=64, D=64)
    p = AttentionProblem.from_tensors(q, k, v)
    assert fwd.is_applicable(p) and not bwd.is_applicable(p)
    assert fwd.estimate(p) > 0 and bwd.estimate(p.with_direction("bwd")) > 0
    pq = AttentionProblem.from_tensors(q, quantize_kv(k, "s8", 64), v)
    assert any("quantized" in r for r in fwd.not_supported_reasons(pq))
    big = AttentionProblem.from_tensors(*make(B=1, Hq=1, Hkv=1, Sq=2, Sk=2, D=320))
    assert any("head dim" in r for r in fwd.not_supported_reasons(big))


def test_config_override(monkeypatch):
    q, k, v = make(B=1, Hq=1, Hkv=1, Sq=20, Sk=20, D=16)
    p = AttentionProblem.from_tensors(q, k, v)
    monkeypatch.setenv(configs.ENV, "32,16,4,2")
    fwd, _ = configs.choose(p)
    assert fwd.as_tuple() == (32, 16, 4, 2)
    monkeypatch.setenv(configs.ENV, "fwd=16,32,4,1; bwd=32,16,2,1")
    fwd, bwd = configs.choose(p)
    assert fwd.as_tuple() == (16, 32, 4, 1) and bwd.as_tuple() == (32, 16, 2, 1)
    check(q, k, v)  # runs with the overridden tiles
    for bad in ("32,16,4", "48,16,4,2", "32,16,3,2", "fwd=32,16,4,0", "mid=16,16,4,1", "a,b,c,d"):
        monkeypatch.setenv(configs.ENV, bad)
        with pytest.raises(BadParameterError, match=configs.ENV):
            configs.choose(p)


def test_table_keys_cover_gpu_buckets():
    q, k, v = make(B=1, Hq=1, Hkv=1, Sq=2, Sk=4096, D=128)
    p = AttentionProblem.from_tensors(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert configs.table_key(p, "sm90") in configs.TABLE
    fwd, bwd = configs.choose(p, arch="sm90")
    assert fwd.block_m >= 64 and bwd.block_n >= 64


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_tma_path_in_interpreter(causal):
    """The tensor-descriptor (TMA) loads used on Hopper, run through the interpreter."""
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=37, Sk=45, D=24, Dv=40)
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, causal=causal)
    args = AttnArgs(q, k, v)
    o, lse = flash_fwd.flash_forward(p, args, configs.choose(p)[0], use_tma=True,
                                     out=poisoned((1, 2, 37, 40), q.dtype))
    ro, rl = reference_forward(p, args)
    assert rel_err(o, ro) < 1e-5 and rel_err(lse, rl) < 1e-5


def test_tma_path_backward_in_interpreter():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=37, Sk=45, D=24, Dv=40)
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd", causal="bottom_right")
    o, lse = flash_fwd.flash_forward(p.with_direction("fwd"), AttnArgs(q, k, v),
                                     configs.choose(p)[0], lse_out=poisoned((1, 2, 37), torch.float32))
    a = AttnArgs(q, k, v, do=torch.randn_like(o), o=o, lse=lse)
    out = (poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype))
    grads = flash_bwd.flash_backward(p, a, configs.choose(p)[1], use_tma=True, out=out)
    for g_, r in zip(grads, reference_backward(p, a)):
        assert rel_err(g_, r) < 1e-5


def test_shrink_sequence():
    c = configs.TileConfig(128, 64, 8, 3)
    seen = []
    while True:
        try:
            c = configs.shrink(c)
        except Exception as e:
            assert "shared memory" in str(e)
            break
        seen.append(c.as_tuple())
    assert seen[:3] == [(128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 2)] and seen[-1][:2] == (16, 16)


def test_tiny_head_dims_and_single_key():
    # one key: P = 1 and dQ = 0 exactly, so only the forward is meaningful there
    check(*make(B=1, Hq=2, Hkv=1, Sq=5, Sk=1, D=5, Dv=3), backward=False)
    check(*make(B=1, Hq=2, Hkv=1, Sq=5, Sk=2, D=5, Dv=3))
    check(*make(B=1, Hq=1, Hkv=1, Sq=1, Sk=19, D=8), causal="bottom_right")


# ---- head-dim split backward (max(D, Dv) > 128): dK/dV and dQ by column halves -------------

@pytest.mark.parametrize("D,Dv,dtype", [(160, 160, torch.float32), (192, 64, torch.bfloat16),
                                        (256, 256, torch.float16), (72, 200, torch.float32)],
                         ids=["d160", "d192_dv64_bf16", "d256_f16", "d72_dv200"])
def test_split_gqa_causal(D, Dv, dtype):
    q, k, v = make(B=1, Hq=4, Hkv=2, Sq=31, Sk=19, D=D, Dv=Dv, dtype=dtype)
    assert flash_bwd.use_split(AttentionProblem.from_tensors(q, k, v))
    check(q, k, v, causal="bottom_right", softmax_inf_as_zero=True)


def test_split_masks_kvlens_dropout():
    q, k, v = make(B=2, Hq=2, Hkv=1, Sq=23, Sk=35, D=160, Dv=144, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    mask = torch.randn(2, 1, 23, 35, generator=g)
    mask[torch.rand(2, 1, 23, 35, generator=g) > 0.85] = float("-inf")
    check(q, k, v, attn_mask=mask.bfloat16(), kv_lens=torch.tensor([35, 12]), dropout_p=0.25,
          seed=2**35 + 3, offset=17, causal="top_left", softmax_inf_as_zero=True)


def test_split_bool_mask_mqa_scale():
    q, k, v = make(B=1, Hq=3, Hkv=1, Sq=15, Sk=33, D=256, Dv=130)
    mask = torch.rand(1, 3, 15, 33, generator=torch.Generator().manual_seed(12)) > 0.3
    check(q, k, v, attn_mask=mask, scale=torch.tensor(4.0), invert_scale=True,
          softmax_inf_as_zero=True)


def _bwd_setup(B=1, Hq=2, Hkv=1, Sq=37, Sk=45, D=192, Dv=176, causal="bottom_right"):
    q, k, v = make(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv)
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd", causal=causal, return_lse=True)
    o, lse = flash_fwd.flash_forward(p.with_direction("fwd"), AttnArgs(q, k, v), configs.choose(p)[0])
    a = AttnArgs(q, k, v, do=torch.randn_like(o), o=o, lse=lse)
    return q, k, v, p, a


def test_split_tma_own_dq_tiles_and_forced_split():
    """TMA descriptor loads, separate dQ tiles, and the split kernels forced at D <= 128
    (one chunk: C1 = 0) all against the reference; outputs poisoned."""
    q, k, v, p, a = _bwd_setup()
    refs = reference_backward(p, a)
    out = (poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype))
    grads = flash_bwd.flash_backward(p, a, configs.TileConfig(16, 32, 4, 1), use_tma=True, out=out,
                                     dq_cfg=configs.TileConfig(32, 16, 4, 1))
    for g_, r in zip(grads, refs):
        assert rel_err(g_, r) < 1e-5
    q, k, v, p, a = _bwd_setup(D=40, Dv=24, causal=None)
    out = (poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype))
    grads = flash_bwd.flash_backward(p, a, configs.choose(p)[1], split=True, out=out)
    for g_, r in zip(grads, reference_backward(p, a)):
        assert rel_err(g_, r) < 1e-5


@pytest.mark.parametrize("split,dq_split", [(True, False), (False, True), ("separate", None)])
def test_split_mixed_kernels(split, dq_split):
    """Split dK/dV with the fused dQ kernel (own tiles), the other way round, and the
    separate dV-only / dK-only launches of the fused kernel."""
    q, k, v, p, a = _bwd_setup(Hq=4, Hkv=2, Sq=29, Sk=40, D=256, Dv=136)
    out = (poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype))
    grads = flash_bwd.flash_backward(p, a, configs.TileConfig(16, 16, 4, 1), split=split,
                                     dq_split=dq_split, dq_cfg=configs.TileConfig(16, 32, 4, 1),
                                     out=out)
    for g_, r in zip(grads, reference_backward(p, a)):
        assert rel_err(g_, r) < 1e-5


def test_split_deterministic_and_solver_path():
    q, k, v, p, _ = _bwd_setup(Hq=4, D=160, Dv=160)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd", return_lse=True, causal=True)
    o, lse = REGISTRY.get("flash_fwd").prepare(p.with_direction("fwd"))(AttnArgs(q, k, v))
    inv = REGISTRY.get(111).prepare(p)
    a = AttnArgs(q, k, v, do=torch.randn_like(o), o=o, lse=lse)
    g1, g2 = inv(a), inv(a)
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))
    for g_, r in zip(g1, reference_backward(p, a)):
        assert rel_err(g_, r) < BWD_TOL[torch.bfloat16]


def test_split_chunks_and_dq_table(monkeypatch):
    assert flash_bwd.split_chunks(256) == (128, 128)
    assert flash_bwd.split_chunks(160) == (128, 32)
    assert flash_bwd.split_chunks(130) == (128, 16)
    assert flash_bwd.split_chunks(64) == (64, 0)
    q, k, v = make(B=1, Hq=1, Hkv=1, Sq=2, Sk=4096, D=256)
    p = AttentionProblem.from_tensors(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert configs.choose_dq(p, arch="interp") == (None, None)
    dq_cfg, dq_split = configs.choose_dq(p, arch="sm90")
    assert (dq_cfg, dq_split) == configs.DQ_TABLE[configs.table_key(p, "sm90")]
    assert dq_cfg.block_n >= 64 and isinstance(dq_split, bool)
    monkeypatch.setenv(configs.ENV, "fwd=16,32,4,1; bwd=32,16,2,1")
    assert configs.choose_dq(p, arch="sm90") == (None, None)


def test_separate_dkdv_dropout_masks():
    q, k, v = make(B=2, Hq=4, Hkv=2, Sq=27, Sk=33, D=192, Dv=160, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 27, 33, generator=torch.Generator().manual_seed(13)) > 0.2
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd", causal="bottom_right",
                                      attn_mask=mask, dropout_p=0.2, return_lse=True,
                                      softmax_inf_as_zero=True)
    fargs = AttnArgs(q, k, v, attn_mask=mask, seed=99, offset=5)
    o, lse = flash_fwd.flash_forward(p.with_direction("fwd"), fargs, configs.choose(p)[0])
    a = AttnArgs(q, k, v, attn_mask=mask, seed=99, offset=5, do=torch.randn_like(o), o=o, lse=lse)
    out = (poisoned(q.shape, q.dtype), poisoned(k.shape, q.dtype), poisoned(v.shape, q.dtype))
    grads = flash_bwd.flash_backward(p, a, configs.choose(p)[1], split="separate", out=out)
    for g_, r in zip(grads, reference_backward(p, a)):
        assert rel_err(g_, r) < BWD_TOL[torch.bfloat16]


def test_forward_estimate_counts_the_padded_query_block():
    """A 4-row decode step through flash_fwd computes whole 64-row tiles: 4 rows cost as
    much as 64 (decode_split_k packs the rows of a KV head group instead)."""
    s = REGISTRY.get("flash_fwd")

    def est(sq):
        return s.estimate(AttentionProblem(direction="fwd", B=4, Hq=32, Hkv=8, Sq=sq, Sk=5000, D=128, Dv=128,
                                           dtype=torch.bfloat16, device="cuda", causal="bottom_right"))
    assert est(4) > flash_fwd.HOST_FLOOR_MS
    assert est(4) == pytest.approx(est(64), rel=0.1)
