"""Solver 126 `gluon_flash_fwd` on CPU: never applicable here (no Hopper GPU, and
TRITON_INTERPRET=1 from tests/conftest.py), with reasons naming why, and the options it
leaves to solver 110. Its kernel is compiled for sm_90 by tests/test_compile_sm90.py and run
by tests/gpu/test_gluon_fwd_gpu.py."""
from __future__ import annotations

import pytest
import torch

import nnprim
from nnprim.attention import gluon_fwd
from nnprim.problems.attention import AttentionProblem
from nnprim.search.context import get_solutions
from nnprim.search.solver import REGISTRY

BF16 = torch.bfloat16


def problem(**kw) -> AttentionProblem:
    fields = dict(direction="fwd", B=1, Hq=4, Hkv=1, Sq=70, Sk=90, D=128, Dv=128, dtype=BF16, device="cpu")
    return AttentionProblem(**(fields | kw))


def test_registered_as_deterministic_flash_forward():
    s = REGISTRY.get(126)
    assert s is REGISTRY.get("gluon_flash_fwd")
    assert s.family == "flash" and s.deterministic and s.directions == frozenset({"fwd"})


def test_not_applicable_on_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("NNPRIM_GLUON", "1")   # past the off switch: the device reasons
    s = REGISTRY.get("gluon_flash_fwd")
    reasons = " | ".join(s.not_supported_reasons(problem()))
    assert "not applicable" in reasons and "TRITON_INTERPRET" in reasons
    # a CUDA problem under the interpreter (or without a GPU) is not applicable either
    cuda_reasons = " | ".join(s.not_supported_reasons(problem(device="cuda")))
    assert "not applicable" in cuda_reasons


def test_options_left_to_solver_110_are_named():
    s = REGISTRY.get("gluon_flash_fwd")
    cases = {
        "mask=bool": dict(mask="bool", mask_shape=(1, 1, 70, 90)),
        "dropout_p=0.1": dict(dropout_p=0.1),
        "kv_lens": dict(has_kv_lens=True),
        "tensor scale": dict(scale="tensor"),
        "D=96": dict(D=96, Dv=96),
        "Dv=64": dict(Dv=64),
        "dtype torch.float32": dict(dtype=torch.float32),
    }
    for needle, kw in cases.items():
        reasons = " | ".join(s.not_supported_reasons(problem(device="cuda", **kw)))
        assert needle in reasons, (needle, reasons)
    paged = " | ".join(s.not_supported_reasons(problem(device="cuda", page_size=16)))
    assert "paged" in paged


def test_registry_keeps_choosing_other_solvers_on_cpu():
    p = problem(causal="bottom_right", return_lse=True)
    names = [sol.solver for sol in get_solutions(p)]
    assert names and "gluon_flash_fwd" not in names
    assert REGISTRY.get("flash_fwd").is_applicable(p)
    q = torch.randn(1, 4, 20, 64).to(BF16)
    k = torch.randn(1, 1, 23, 64).to(BF16)
    with pytest.raises(nnprim.NotSupportedError, match="gluon_flash_fwd|not applicable"):
        nnprim.sdpa(q, k, k, solver="gluon_flash_fwd")
    o = nnprim.sdpa(q, k, k, solver="flash_fwd")
    assert o.shape == (1, 4, 20, 64) and torch.isfinite(o.float()).all()


def test_tile_configs_fit_hopper_shared_memory():
    for d in gluon_fwd.HEAD_DIMS:
        for pp, consumers in ((None, None), (False, None), (True, None), (True, 3)):
            if consumers == 3 and d > 64:
                with pytest.raises(ValueError, match="consumers=3"):
                    gluon_fwd.tile_config(d, pp, consumers=consumers)
                continue
            for persistent in (None, False, True):
                c = gluon_fwd.tile_config(d, pp, persistent, consumers=consumers)
                smem = 2 * ((2 if c["SEPARATE_O"] else 1) * c["BLOCK_M"] * d + 2 * c["STAGES"] * c["BLOCK_N"] * d)
                assert smem == gluon_fwd.smem_bytes(d, c) <= 227 * 1024
                # an O buffer of its own only for persistent launches, wherever it fits (d <= 128)
                assert c["SEPARATE_O"] == (c["PERSISTENT"] and d <= 128)
                # consumers: two or three 4-warp partitions of 64 rows (ping-pong) or one of 8
                # warps and 128 rows; + 1 producer warp (padded to a warpgroup). The register
                # file holds maxnreg for every warpgroup at launch and, after setmaxnreg, the
                # consumers' CONSUMER_REGS next to the producer's 24
                n = c["CONSUMERS"]
                assert n == (consumers or (1 if pp is False else 2))   # ping-pong by default at every d
                assert c["BLOCK_M"] == (64 * n if n > 1 else 128) and c["num_warps"] == (4 if n > 1 else 8)
                groups = n + 1 if n > 1 else 3
                assert c["maxnreg"] * 128 * groups <= 65536
                assert n == 1 or (n * c["CONSUMER_REGS"] + 24) * 128 <= 65536


def test_persistent_choice_workspace_and_estimate():
    s = REGISTRY.get("gluon_flash_fwd")
    short = problem(device="cuda", B=16, Hq=16, Hkv=16, Sq=1024, Sk=1024, causal="top_left")
    long_causal = problem(device="cuda", B=1, Hq=16, Hkv=16, Sq=16384, Sk=16384, causal="top_left")
    long_plain = problem(device="cuda", B=1, Hq=16, Hkv=16, Sq=16384, Sk=16384)
    assert gluon_fwd.tile_config(128, problem=short)["PERSISTENT"]
    assert gluon_fwd.tile_config(128, problem=long_plain)["PERSISTENT"]
    assert not gluon_fwd.tile_config(128, problem=long_causal)["PERSISTENT"]
    assert s.workspace_size(short) == 0          # host descriptors: no in-kernel descriptor scratch

    def tflops(p):
        return p.flops() / s.estimate(p) / 1e9
    # the fit of the H200 runs (persistent d128: s16k 709, s4k 702, s1k 605 TFLOP/s measured,
    # the model a little below with its launch cost); d64 about 0.65x d128
    d128 = {sq: problem(device="cuda", B=16384 // sq, Hq=16, Hkv=16, Sq=sq, Sk=sq) for sq in (1024, 4096, 16384)}
    t = {sq: tflops(p) for sq, p in d128.items()}
    assert 640 < t[16384] < 740 and 620 < t[4096] < 720 and 540 < t[1024] < 640
    d64 = problem(device="cuda", B=1, Hq=32, Hkv=32, Sq=16384, Sk=16384, D=64, Dv=64)
    assert 420 < tflops(d64) < 470
    assert 600 < tflops(long_causal) < 700 and tflops(short) < t[1024]


def test_three_consumers_where_measured_ahead():
    """d64 takes three ping-pong consumers (192-row tiles, persistent) on long sequences
    (causal from s16k), two elsewhere; an explicit `consumers` or `pingpong` wins."""
    def cfg(**kw):
        return gluon_fwd.tile_config(kw.get("D", 64), problem=problem(device="cuda", **kw))
    long64 = cfg(B=1, Hq=8, Hkv=8, Sq=4096, Sk=4096, D=64, Dv=64)
    assert long64["CONSUMERS"] == 3 and long64["BLOCK_M"] == 192 and long64["PERSISTENT"]
    assert cfg(B=1, Hq=8, Hkv=8, Sq=16384, Sk=16384, D=64, Dv=64, causal="top_left")["CONSUMERS"] == 3
    assert cfg(B=1, Hq=8, Hkv=8, Sq=4096, Sk=4096, D=64, Dv=64, causal="top_left")["CONSUMERS"] == 2
    assert cfg(B=1, Hq=8, Hkv=8, Sq=1024, Sk=1024, D=64, Dv=64)["CONSUMERS"] == 2
    assert cfg(B=1, Hq=8, Hkv=8, Sq=4096, Sk=4096, D=128, Dv=128)["CONSUMERS"] == 2
    assert gluon_fwd.tile_config(64, True, consumers=2)["BLOCK_M"] == 128
    assert gluon_fwd.tile_config(64, False)["CONSUMERS"] == 1
    # the plan's TMA box follows the consumers' rows
    p = problem(device="cuda", B=1, Hq=8, Hkv=8, Sq=4096, Sk=4096, D=64, Dv=64)
    assert gluon_fwd.GluonFwdPlan(p).rows == 64


def test_model_counts_kv_rereads():
    """126's estimate: every tile streams all its visible keys through L2 (GQA decodes measured
    2.2-4.5x the HBM bound, at this one), and a long training problem stays compute-bound (the
    L2 term does not move it)."""
    dec = problem(device="cuda", B=64, Hq=32, Hkv=8, Sq=1, Sk=8192, D=128)
    cfg = gluon_fwd.tile_config(128, problem=dec)
    kv = 64 * 32 * 8192 * 256 * 2
    assert gluon_fwd.model_ms(dec, cfg) >= kv / (gluon_fwd.L2_TBS * 1e12) * 1e3
    train = problem(device="cuda", B=1, Hq=16, Hkv=16, Sq=16384, Sk=16384, D=128)
    tcfg = gluon_fwd.tile_config(128, problem=train)
    t_c = train.flops() / (750e12 * gluon_fwd.EFF_BY_D[128])
    fill = 2048 / (16 * 132)   # 16 heads x 128 tiles over 132 SMs
    assert gluon_fwd.model_ms(train, tcfg) == pytest.approx((t_c * (128 + 1) / 128 / fill) * 1e3 + 0.01, rel=0.01)
