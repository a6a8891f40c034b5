"""Solver 127 `gluon_flash_bwd` on CPU: never applicable here (no Hopper GPU, and
TRITON_INTERPRET=1 from tests/conftest.py), with reasons naming why, and the options it
leaves to solver 123. Its kernel is compiled for sm_90 by tests/test_compile_sm90.py and run
by tests/gpu/test_gluon_bwd_gpu.py."""
from __future__ import annotations

import pytest
import torch

import nnprim
from nnprim.attention import gluon_bwd, gluon_bwd_d256
from nnprim.problems.attention import AttentionProblem
from nnprim.search.context import get_solutions
from nnprim.search.solver import REGISTRY

from .gluon_bwd_tiles import flat_steps, padded, query_range

BF16 = torch.bfloat16


def problem(**kw) -> AttentionProblem:
    fields = dict(direction="bwd", B=1, Hq=4, Hkv=1, Sq=70, Sk=90, D=128, Dv=128, dtype=BF16, device="cpu",
                  return_lse=True)
    return AttentionProblem(**(fields | kw))


def test_registered_as_nondeterministic_flash_backward():
    s = REGISTRY.get(127)
    assert s is REGISTRY.get("gluon_flash_bwd")
    assert s.family == "flash" and not s.deterministic and s.directions == frozenset({"bwd"})


def test_not_applicable_on_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("NNPRIM_GLUON", "1")   # past the off switch: the device reasons
    s = REGISTRY.get("gluon_flash_bwd")
    reasons = " | ".join(s.not_supported_reasons(problem()))
    assert "not applicable" in reasons and "TRITON_INTERPRET" in reasons
    assert "not applicable" in " | ".join(s.not_supported_reasons(problem(device="cuda")))
    monkeypatch.setenv("NNPRIM_GLUON", "0")
    assert "NNPRIM_GLUON=0" in " | ".join(s.not_supported_reasons(problem(device="cuda")))


def test_options_left_to_solver_123_are_named():
    s = REGISTRY.get("gluon_flash_bwd")
    cases = {
        "mask=bool": dict(mask="bool", mask_shape=(1, 1, 70, 90)),
        "dropout_p=0.1": dict(dropout_p=0.1),
        "kv_lens": dict(has_kv_lens=True),
        "tensor scale": dict(scale="tensor"),
        "D=256": dict(D=256, Dv=256),
        "D=96": dict(D=96, Dv=96),
        "Dv=64": dict(Dv=64),
        "dtype torch.float32": dict(dtype=torch.float32),
    }
    for needle, kw in cases.items():
        reasons = " | ".join(s.not_supported_reasons(problem(device="cuda", **kw)))
        assert needle in reasons, (needle, reasons)
    fwd = " | ".join(s.not_supported_reasons(problem(device="cuda", direction="fwd")))
    assert "fwd" in fwd


def test_registry_keeps_choosing_triton_solvers_on_cpu():
    p = problem(causal="bottom_right")
    names = [sol.solver for sol in get_solutions(p)]
    assert names and "gluon_flash_bwd" not in names
    assert REGISTRY.get("flash_bwd_atomic").is_applicable(p)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 20, 64, generator=g).to(BF16)
    k = torch.randn(1, 1, 23, 64, generator=g).to(BF16)
    v = torch.randn(1, 1, 23, 64, generator=g).to(BF16)
    o, lse = nnprim.sdpa(q, k, v, return_lse=True)
    do = torch.randn(o.shape, generator=g).to(BF16)
    with pytest.raises(nnprim.NotSupportedError, match="gluon_flash_bwd|not applicable"):
        nnprim.sdpa_backward(do, q, k, v, o, lse, solver="gluon_flash_bwd")
    dq, dk, dv = nnprim.sdpa_backward(do, q, k, v, o, lse, solver="flash_bwd_atomic")
    assert dq.shape == q.shape and dk.shape == k.shape and torch.isfinite(dv.float()).all()


def test_tile_configs_fit_hopper_shared_memory_workspace_and_estimate():
    for d in gluon_bwd.HEAD_DIMS:
        c = gluon_bwd.tile_config(d)
        assert gluon_bwd.smem_bytes(d, c) <= gluon_bwd.SMEM_BYTES and c["maxnreg"] * 384 <= 65536
        assert c["BLOCK_N"] == 2 * c["BLOCK_M"] == 128   # two warpgroups of 64 keys; dQ's M == keys
        # dQ split by columns at d128 by default; at d64 on request (K again in column halves:
        # a d64 column half would cut a 128-byte swizzle row)
        assert c["SPLIT_DQ"] == (d == 128) and not gluon_bwd.tile_config(d, split_dq=False)["SPLIT_DQ"]
        assert gluon_bwd.CONFIGS["split"](d)["SPLIT_DQ"]
        c3 = gluon_bwd.CONFIGS["s3"](d)      # the benchmark's 3-stage variant fits too (f32 atomics)
        assert c3["STAGES"] == 3 and gluon_bwd.smem_bytes(d, c3) <= gluon_bwd.SMEM_BYTES
        assert c["REMAT"] and not gluon_bwd.CONFIGS["hoisted"](d)["REMAT"]
        for name, make in gluon_bwd.CONFIGS.items():  # every config the benchmark can time fits
            assert gluon_bwd.smem_bytes(d, make(d)) <= gluon_bwd.SMEM_BYTES, (name, d)
        assert gluon_bwd.CONFIGS["default"](d) == c
    s = REGISTRY.get("gluon_flash_bwd")
    p = problem(device="cuda", B=2, Hq=8, Hkv=2, Sq=1000, Sk=1000)
    assert s.workspace_size(p) == 4 * 2 * 8 * 1000 * 129
    big = problem(device="cuda", B=4, Hq=16, Hkv=16, Sq=4096, Sk=4096)
    tflops = big.flops() / s.estimate(big) / 1e9
    assert 480 < tflops < 560    # EFF_BY_D (d128: 0.72) of the bf16 peak the models use (750), wave fill 0.97
    assert s.estimate(problem(device="cuda", Sq=16, Sk=16)) == gluon_bwd.HOST_FLOOR_MS
    # solver 129: the same kernel with ordered dQ adds; deterministic, its counters in the workspace
    o = REGISTRY.get("gluon_flash_bwd_ordered")
    assert o.deterministic and not s.deterministic
    assert o.workspace_size(p) == s.workspace_size(p) + 4 * (2 * 8 * 16 + 1)
    assert o.estimate(big) == pytest.approx(s.estimate(big) * gluon_bwd.ORDERED_COST)
    assert gluon_bwd.CONFIGS["ordered"](128)["TMA_DQ"] == 2 and gluon_bwd.tile_config(128)["TMA_DQ"] == 1


BLOCKS = [(gluon_bwd.BLOCK_M, gluon_bwd.BLOCK_N), (gluon_bwd_d256.BLOCK_M, gluon_bwd_d256.BLOCK_N)]


@pytest.mark.parametrize("blocks", BLOCKS, ids=["d128", "d256"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_ordered_turns_cover_every_dq_block_without_gaps(causal, blocks):
    """Solver 129's turns (`_add_dq`, `_turn`) and those of 130's `ordered` config (64-key
    blocks): the key blocks that visit a dQ block (the kernel's [lo, m_end) per key block) are
    exactly 0..J with J from the same formula, so the turns J - j are 0..J once each (a gap
    would leave a counter short: a hang); and CTA pid 0 = n_kv - 1 - j waits only on lower
    pids (earlier CTAs of its head)."""
    BM, BN = blocks
    for Sq, Sk in ((1, 1), (64, 64), (300, 333), (333, 300), (1000, 129), (129, 1000), (4096, 4096), (64, 4000)):
        shift = Sk - Sq if causal == "bottom_right" else 0
        m_end = -(-Sq // BM) * BM
        n_kv = -(-Sk // BN)
        visits: dict[int, list[int]] = {}
        for j in range(n_kv):
            start_n = j * BN
            lo = (max(start_n - shift, 0) // BM) * BM if causal else 0
            for start_m in range(min(lo, m_end), m_end, BM):
                visits.setdefault(start_m, []).append(j)
        for start_m in range(0, m_end, BM):
            hi = min(Sk, start_m + BM + shift) if causal else Sk
            J = -(-hi // BN) - 1
            got = sorted(visits.get(start_m, []))
            assert got == list(range(J + 1)), (Sq, Sk, causal, start_m, got, J)
            turns = sorted(J - j for j in got)
            assert turns == list(range(len(got)))
            pids = [n_kv - 1 - j for j in sorted(got, reverse=True)]   # in turn order
            assert pids == sorted(pids)


@pytest.mark.parametrize("blocks", BLOCKS, ids=["d128", "d256"])
@pytest.mark.parametrize("sq,sk,group", [(4096, 4096, 1), (1024, 1024, 2), (300, 333, 4), (3001, 2999, 4),
                                         (640, 128, 1), (129, 128, 3), (8000, 1000, 1)])
def test_rotated_walk_turns_follow_the_arrival_order(sq, sk, group, blocks):
    """Solver 129 without causal masking (ROTATE, `_rotation` / `_turn`): key block j walks the
    query blocks of each head from block j s on, wrapping. The turn the kernel computes for
    each (dQ block, key block) is the rank of that key block's arrival there, so in lock-step
    no CTA waits: each turn arrives at least s steps after the one before it (DQ_DEFER passes
    a block on one step late, so s >= 1 is what it needs to not wait twice). The same for 130's
    `ordered` config (64-key blocks)."""
    BM, BN = blocks
    nb, n_kv = -(-sq // BM), -(-sk // BN)
    p = problem(Sq=sq, Sk=sk, Hq=group, Hkv=1)
    cfg = (gluon_bwd.tile_config(128, ordered=True) if BN == gluon_bwd.BLOCK_N
           else gluon_bwd_d256.tile_config(ordered=True))
    assert gluon_bwd.rotation(p, cfg, 132) == (n_kv <= nb)
    if n_kv > nb:
        return
    s = max(nb // n_kv, 1)
    arrivals: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for j in range(n_kv):
        rot = (j * s) % nb
        step = 0
        for g in range(group):
            for i in range(nb):
                m = (rot + i) % nb
                arrivals.setdefault((g, m), []).append((step, j))
                step += 1
    last = n_kv - 1
    for (g, m), visits in arrivals.items():
        a = min(m // s, last)
        turns = {j: (a - j + last + 1) % (last + 1) for _, j in visits}     # the kernel's `_turn`
        in_order = [j for _, j in sorted(visits)]
        assert [turns[j] for j in in_order] == list(range(n_kv)), (g, m, in_order)
        steps = sorted(st for st, _ in visits)
        assert all(b - a >= s for a, b in zip(steps, steps[1:]))


def test_rotated_walk_applies_only_where_it_cannot_hang():
    """127 rotates (at d128 by default) wherever there is no causal mask; 129 only where each key block of a head
    starts on its own query block and the head's CTAs fit the GPU at once (a CTA may wait on a
    key block launched after it)."""
    ordered, plain = gluon_bwd.tile_config(128, ordered=True), gluon_bwd.tile_config(128, rotate=True)
    assert not gluon_bwd.rotation(problem(Sq=4096, Sk=4096, causal="top_left"), ordered, 132)
    assert not gluon_bwd.rotation(problem(Sq=4096, Sk=4096, causal="top_left"), plain, 132)
    assert gluon_bwd.rotation(problem(Sq=16384, Sk=16384), ordered, 132)
    assert not gluon_bwd.rotation(problem(Sq=32768, Sk=32768), ordered, 132)    # 256 key blocks
    assert gluon_bwd.rotation(problem(Sq=32768, Sk=32768), plain, 132)
    assert not gluon_bwd.rotation(problem(Sq=64, Sk=4096), ordered, 132)         # fewer query blocks
    assert gluon_bwd.rotation(problem(Sq=4096, Sk=4096), gluon_bwd.tile_config(128), 132)   # 127's d128 default
    assert not gluon_bwd.rotation(problem(Sq=4096, Sk=4096, D=64, Dv=64), gluon_bwd.tile_config(64), 132)


def _emulate(p, q, k, v, do, o, lse, scale):
    """Solver 127's tile algorithm in float64 torch: per CTA (128 keys of one (b, kv head)),
    each 64-key warpgroup walks the query blocks of every query head of its group as the
    kernel does (`gluon_bwd_tiles`: with element masks on [lo, full), without on the rest)."""
    BM, BN, KEYS = gluon_bwd.BLOCK_M, gluon_bwd.BLOCK_N, gluon_bwd.KEYS_PER_WG
    t = padded(p, q, k, v, do, o, lse, BM, BN)
    dq = torch.zeros(p.B, p.Hq, t.m_end, p.D, dtype=torch.float64)
    dk, dv = (torch.zeros(p.B, p.Hkv, t.n_pad, p.D, dtype=torch.float64) for _ in range(2))
    cols = torch.arange(KEYS)[:, None]          # key - n0
    rws = torch.arange(BM)[None, :]
    for b in range(p.B):
        for hk in range(p.Hkv):
            for start_n in range(0, p.Sk, BN):
                lo, full = query_range(p, t, start_n, BM, BN)
                for wg in range(2):
                    n0 = start_n + wg * KEYS
                    kk, vv = t.k[b, hk, n0:n0 + KEYS], t.v[b, hk, n0:n0 + KEYS]
                    for masked, h, start_m in flat_steps(p, t, lo, full, hk, BM):
                        rows = slice(start_m, start_m + BM)
                        qq, dd = t.q[b, h, rows], t.do[b, h, rows]
                        st = (kk @ qq.T) * scale
                        if masked:
                            valid = cols < p.Sk - n0
                            if p.causal:
                                valid = valid & (cols <= rws + (start_m + t.shift - n0))
                            st = torch.where(valid, st, -torch.inf)
                        pt = torch.exp(st - t.lse2[b, h, rows][None, :])
                        dv[b, hk, n0:n0 + KEYS] += pt @ dd
                        dst = pt * ((vv @ dd.T) - t.delta[b, h, rows][None, :])
                        dk[b, hk, n0:n0 + KEYS] += dst @ qq * scale
                        dq[b, h, rows] += dst.T @ kk    # unscaled: the cast applies scale
    return dq[:, :, :p.Sq] * scale, dk[:, :, :p.Sk], dv[:, :, :p.Sk]


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (70, 200), (200, 70), (129, 257), (64, 128)])
def test_tile_algorithm_emulation_matches_reference(sq, sk, causal):
    from nnprim.args import AttnArgs
    from nnprim.attention.reference import reference_backward, reference_forward
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q, do = (torch.randn(1, 4, sq, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, sk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd")
    o, lse = reference_forward(p, AttnArgs(q, k, v))
    ref = reference_backward(p, AttnArgs(q, k, v, do=do))
    got = _emulate(p, q, k, v, do, torch.nan_to_num(o), lse, 16 ** -0.5)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        assert torch.allclose(x, r, atol=1e-9, rtol=1e-9), (name, (x - r).abs().max().item())


def test_without_the_tma_reduce_add(monkeypatch):
    """A Triton whose Gluon builder lacks the TMA reduce-add: 127 adds dQ with f32 atomics and
    129 (whose ordering relies on the reduce-add's completion) is not applicable."""
    monkeypatch.setattr(gluon_bwd, "tma_reduce_add", None)
    assert gluon_bwd.tile_config(128)["TMA_DQ"] == 0 and gluon_bwd.tile_config(64)["TMA_DQ"] == 0
    p = problem(device="cuda", B=1, Hq=4, Hkv=1, Sq=256, Sk=256)
    assert any("TMA reduce-add" in r for r in REGISTRY.get("gluon_flash_bwd_ordered").not_supported_reasons(p))
