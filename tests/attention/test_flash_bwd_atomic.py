"""Five-GEMM backward solvers (123 flash_bwd_atomic, 124 flash_bwd_ordered) against the
float64 reference under TRITON_INTERPRET=1 at small odd shapes: tails, GQA, Dv != D,
D = 256, both causal alignments with Sq != Sk, masks, kv_lens, dropout, scales, strides,
tile shapes with BN != BM (the ordered dQ's turn order), poisoned outputs; selection
under determinism (123 never chosen)."""
from __future__ import annotations

import pytest
import torch

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import configs, flash_bwd_atomic, flash_fwd
from nnprim.attention.reference import reference_backward
from nnprim.problems.attention import AttentionProblem
from nnprim.search import immediate
from nnprim.search.ranking import heuristic_order
from nnprim.search.solver import REGISTRY

from .test_flash import BWD_TOL, IDS, make, poisoned, rel_err

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SOLVERS = ["flash_bwd_atomic", "flash_bwd_ordered"]


def setup(q, k, v, *, seed=0, offset=0, **opts):
    """(bwd problem, AttnArgs with do, o, lse) from the flash forward."""
    scale, mask, kv_lens = opts.get("scale"), opts.get("attn_mask"), opts.get("kv_lens")
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **opts)
    args = AttnArgs(q, k, v, attn_mask=mask, scale=scale, seed=seed, offset=offset, kv_lens=kv_lens)
    o, lse = flash_fwd.flash_forward(p, args, configs.choose(p)[0])
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype)
    return p.with_direction("bwd"), AttnArgs(q, k, v, attn_mask=mask, scale=scale, seed=seed, offset=offset,
                                             kv_lens=kv_lens, do=do, o=o, lse=lse)


def check(q, k, v, solvers=SOLVERS, cfg=None, use_tma=None, **opts):
    """Each solver's gradients (poisoned outputs) against the float64 reference."""
    pb, a = setup(q, k, v, **opts)
    refs = reference_backward(pb, a)
    for name in solvers:
        s = REGISTRY.get(name)
        assert s.is_applicable(pb), s.not_supported_reasons(pb)
        out = tuple(poisoned(t.shape, q.dtype) for t in (q, k, v))
        grads = flash_bwd_atomic.backward(pb, a, cfg or configs.choose_bwd_atomic(pb), ordered=s.ordered,
                                          out=out, use_tma=use_tma)
        for gname, g, r in zip(("dq", "dk", "dv"), grads, refs):
            assert g.dtype == q.dtype and g.shape == r.shape
            err = rel_err(g, r)
            assert err < BWD_TOL[q.dtype], f"{name} {gname}: rel err {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=IDS.get)
def test_gqa_tails_dv(dtype):
    check(*make(B=2, Hq=4, Hkv=2, Sq=37, Sk=29, D=24, Dv=40, dtype=dtype))


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Sq,Sk", [(33, 33), (19, 45), (45, 19)])
def test_causal_rectangular(causal, Sq, Sk):
    # Sq > Sk bottom-right leaves the first rows fully masked: compared with inf_as_zero
    check(*make(B=1, Hq=3, Hkv=1, Sq=Sq, Sk=Sk, D=20, Dv=12), causal=causal, softmax_inf_as_zero=True)


@pytest.mark.parametrize("tiles", [(16, 32), (32, 16)], ids=["bn32", "bm32"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_tile_shapes_turn_order(tiles, causal):
    # BN != BM changes which key blocks reach a dQ block; the ordered variant's turn
    # formula must match (an out-of-turn add poisons dQ in the interpreter)
    q, k, v = make(B=2, Hq=2, Hkv=1, Sq=53, Sk=70, D=16)
    check(q, k, v, cfg=configs.TileConfig(*tiles, 4, 1), causal=causal,
          kv_lens=torch.tensor([70, 23]) if causal else None, softmax_inf_as_zero=True)


@pytest.mark.parametrize("shape", [(1, 1, 37, 29), (2, 4, 37, 29)], ids=lambda s: "x".join(map(str, s)))
def test_bool_mask(shape):
    q, k, v = make()
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.3
    check(q, k, v, attn_mask=mask, softmax_inf_as_zero=True)


def test_additive_mask_with_inf_bf16():
    q, k, v = make(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    mask = torch.randn(4, 37, 29, generator=g)
    mask[torch.rand(4, 37, 29, generator=g) > 0.8] = float("-inf")
    check(q, k, v, attn_mask=mask.to(torch.bfloat16), causal="bottom_right", softmax_inf_as_zero=True)


def test_kv_lens_with_mask_and_clamp():
    q, k, v = make(B=3, Hq=2, Hkv=1, Sq=13, Sk=37, D=24)
    mask = torch.rand(3, 1, 13, 37, generator=torch.Generator().manual_seed(5)) > 0.2
    check(q, k, v, kv_lens=torch.tensor([37, 0, 11]), attn_mask=mask, causal="bottom_right",
          softmax_inf_as_zero=True)


@pytest.mark.parametrize("kind", ["float_neg", "tensor_inv"])
def test_scales(kind):
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=17, Sk=33, D=24)
    scale = -0.3 if kind == "float_neg" else torch.tensor(2.5)
    check(q, k, v, scale=scale, invert_scale=kind == "tensor_inv", causal="top_left")


def test_dropout_gqa():
    check(*make(B=1, Hq=4, Hkv=2, Sq=29, Sk=41, D=16, Dv=24), dropout_p=0.3, seed=11, offset=5,
          causal="bottom_right")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_d256_dv_differs(dtype):
    check(*make(B=1, Hq=2, Hkv=1, Sq=21, Sk=19, D=256, Dv=200, dtype=dtype), causal="bottom_right",
          softmax_inf_as_zero=True)


def test_any_strides_and_tma_path():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 32, 23, generator=g).transpose(2, 3)   # head dim not innermost
    k = torch.randn(2, 31, 2, 32, generator=g).transpose(1, 2)   # BSHD
    v = torch.randn(2, 2, 31, 48, generator=g)[..., :16]         # sliced head dim
    check(q, k, v, causal="top_left")
    check(q.contiguous(), k.contiguous(), v.contiguous(), use_tma=True, causal="bottom_right")


def test_public_api_forced_and_ordered_bit_identical():
    q, k, v = make(B=1, Hq=4, Hkv=2, Sq=27, Sk=35, D=16, dtype=torch.bfloat16)
    pb, a = setup(q, k, v, causal="bottom_right")
    refs = reference_backward(pb, a)
    runs = {}
    for name in ["flash_bwd_ordered", "flash_bwd_ordered", "flash_bwd_atomic"]:
        g = nnprim.sdpa_backward(a.do, q, k, v, a.o, a.lse, causal="bottom_right", solver=name)
        for x, r in zip(g, refs):
            assert rel_err(x, r) < BWD_TOL[q.dtype]
        runs.setdefault(name, []).append(g)
    assert all(torch.equal(x, y) for x, y in zip(*runs["flash_bwd_ordered"]))


def test_registration_and_applicability_mirror_111():
    s123, s124, s111 = (REGISTRY.get(i) for i in (123, 124, 111))
    assert (s123.name, s123.family, s123.deterministic) == ("flash_bwd_atomic", "flash", False)
    assert (s124.name, s124.family, s124.deterministic) == ("flash_bwd_ordered", "flash", True)
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=9, Sk=11, D=300)
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd")
    assert not s111.is_applicable(p) and not s123.is_applicable(p) and not s124.is_applicable(p)
    assert not s123.is_applicable(p.with_direction("fwd"))
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=9, Sk=11, D=256, Dv=64)
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd", dropout_p=0.1, causal=True)
    for s in (s123, s124):
        assert s.is_applicable(p) and s.estimate(p) > 0
    ws = flash_bwd_atomic.workspace_bytes(p, ordered=True)
    assert ws == s124.workspace_size(p) > s123.workspace_size(p) >= 4 * 2 * 9 * 257


def _cuda_problem(D=128, causal=True):
    # built directly: estimates and applicability need no device
    return AttentionProblem(direction="bwd", B=4, Hq=16, Hkv=16, Sq=2048, Sk=2048, D=D, Dv=D,
                            dtype=torch.bfloat16, device="cuda", causal="top_left" if causal else None)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_heuristic_ranks_by_measured_speed_and_deterministic_excludes_123(D):
    # measured on the H200 (untuned tiles): 111 > 123 > 124
    p = _cuda_problem(D)
    ids = [s.id for s in heuristic_order(p) if s.id in (111, 123, 124)]
    assert ids == [111, 123, 124]
    ids = [s.id for s in heuristic_order(p, deterministic=True) if s.id in (111, 123, 124)]
    assert ids == [111, 124]
    sols = immediate.heuristic_solutions(p, immediate.Constraints("fp", deterministic=True))
    assert 123 not in [s.solver_id for s in sols] and sols[0].solver_id == 111
    assert immediate.heuristic_solutions(p, immediate.Constraints("fp"))[0].solver_id == 111


def test_determinism_switches_exclude_123_on_this_device():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=9, Sk=11, D=16)
    p = AttentionProblem.from_tensors(q, k, v, direction="bwd")
    assert 123 in [s.solver_id for s in nnprim.get_solutions(p)]
    torch.use_deterministic_algorithms(True)
    try:
        assert 123 not in [s.solver_id for s in nnprim.get_solutions(p)]
    finally:
        torch.use_deterministic_algorithms(False)
    nnprim.set_deterministic(True)
    try:
        ids = [s.solver_id for s in nnprim.get_solutions(p)]
        assert 123 not in ids and 124 in ids
    finally:
        nnprim.set_deterministic(False)


@pytest.mark.parametrize("ordered", [False, True])
def test_preprocess_zeroes_the_dq_rows_and_counters(ordered):
    """The preprocess kernel (shared with the Gluon backward plans): delta, the dQ accumulator
    zeroed, and (ordered) one counter per dQ block zeroed, nothing past."""
    B, H, S, D, BM = 2, 3, 70, 40, 16
    g = torch.Generator().manual_seed(0)
    o, do = (torch.randn(B, H, S, D, generator=g) for _ in range(2))
    lse = torch.randn(B, H, S, generator=g)
    delta = torch.full((B, H, S), float("nan"))
    dqa = torch.full((B, H, S, D), float("nan"))
    nb = -(-S // BM)
    sem = torch.full((B * H * nb + 1,), -7, dtype=torch.int32)
    flash_bwd_atomic._pre_kernel[(nb, B * H)](o, do, lse, delta, dqa, sem, *o.stride(), *do.stride(), H, S, D, D,
                                               BLOCK_M=BM, BLOCK_D=64, BLOCK_DV=64, ORDERED=ordered)
    torch.testing.assert_close(delta, (o * do).sum(-1))
    assert (dqa == 0).all()
    assert ((sem[:-1] == 0).all() if ordered else (sem[:-1] == -7).all()) and sem[-1] == -7
