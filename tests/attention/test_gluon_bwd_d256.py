"""Solver 130 `gluon_flash_bwd_d256` on CPU: never applicable here (no Hopper GPU, and
TRITON_INTERPRET=1 from tests/conftest.py), with reasons naming why, the options it leaves to
solvers 127 / 123, its tile configs against Hopper's shared memory, and its tile algorithm
(64-key CTAs, S / dP split by keys and dK / dV / dQ by head-dim columns between the two
consumer warpgroups) emulated in float64. Its kernel is compiled for sm_90 by
tests/test_compile_sm90.py and run by tests/gpu/test_gluon_bwd_d256_gpu.py."""
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
    fields = dict(direction="bwd", B=1, Hq=4, Hkv=1, Sq=70, Sk=90, D=256, Dv=256, dtype=BF16, device="cpu",
                  return_lse=True)
    return AttentionProblem(**(fields | kw))


def test_registered_as_nondeterministic_flash_backward():
    s = REGISTRY.get(130)
    assert s is REGISTRY.get("gluon_flash_bwd_d256")
    assert s.family == "flash" and not s.deterministic and s.directions == frozenset({"bwd"})
    assert s.dtypes == frozenset({torch.bfloat16, torch.float16})


def test_not_applicable_on_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("NNPRIM_GLUON", "1")   # past the off switch: the device reasons
    s = REGISTRY.get("gluon_flash_bwd_d256")
    reasons = " | ".join(s.not_supported_reasons(problem()))
    assert "not applicable" in reasons and "TRITON_INTERPRET" in reasons
    assert "not applicable" in " | ".join(s.not_supported_reasons(problem(device="cuda")))
    monkeypatch.setenv("NNPRIM_GLUON", "0")
    assert "NNPRIM_GLUON=0" in " | ".join(s.not_supported_reasons(problem(device="cuda")))


def test_options_left_to_other_solvers_are_named():
    s = REGISTRY.get("gluon_flash_bwd_d256")
    cases = {
        "mask=bool": dict(mask="bool", mask_shape=(1, 1, 70, 90)),
        "dropout_p=0.1": dict(dropout_p=0.1),
        "kv_lens": dict(has_kv_lens=True),
        "tensor scale": dict(scale="tensor"),
        "D=128": dict(D=128, Dv=128),
        "D=64": dict(D=64, Dv=64),
        "D=192": dict(D=192, Dv=192),
        "Dv=128": dict(Dv=128),
        "dtype torch.float32": dict(dtype=torch.float32),
    }
    for needle, kw in cases.items():
        reasons = " | ".join(s.not_supported_reasons(problem(device="cuda", **kw)))
        assert needle in reasons, (needle, reasons)
    fwd = " | ".join(s.not_supported_reasons(problem(device="cuda", direction="fwd")))
    assert "fwd" in fwd
    # and 127 still leaves d256 to others (this solver, 111, 123)
    assert "D=256" in " | ".join(REGISTRY.get("gluon_flash_bwd").not_supported_reasons(problem(device="cuda")))


def test_registry_keeps_choosing_triton_solvers_on_cpu():
    p = problem(causal="bottom_right")
    names = [sol.solver for sol in get_solutions(p)]
    assert names and "gluon_flash_bwd_d256" not in names
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 20, 256, generator=g).to(BF16)
    k = torch.randn(1, 1, 23, 256, generator=g).to(BF16)
    v = torch.randn(1, 1, 23, 256, generator=g).to(BF16)
    o, lse = nnprim.sdpa(q, k, v, return_lse=True)
    do = torch.randn(o.shape, generator=g).to(BF16)
    with pytest.raises(nnprim.NotSupportedError, match="gluon_flash_bwd_d256|not applicable"):
        nnprim.sdpa_backward(do, q, k, v, o, lse, solver="gluon_flash_bwd_d256")


def test_tile_configs_fit_hopper_shared_memory_workspace_and_estimate():
    c = gluon_bwd_d256.tile_config()
    assert c == gluon_bwd_d256.CONFIGS["default"]()
    assert c["BLOCK_M"] == c["BLOCK_N"] == 64 and c["STAGES"] == 2 and c["maxnreg"] * 384 <= 65536
    # the default: two full ring stages, dQ by reduce-adds through one 8 KB box per warpgroup
    assert c["TMA_DQ"] == 1 and c["DQ_RED"] == 32 and c["DQ_SLOTS"] == 1
    assert gluon_bwd_d256.smem_bytes(c) == 2 * (2 * 64 * 256 + 4 * 64 * 256 + 2 * 64 * 64) + 2 * 64 * 32 * 4
    for name, make in gluon_bwd_d256.CONFIGS.items():   # every config the benchmark can time fits
        cfg = make()
        assert gluon_bwd_d256.smem_bytes(cfg) <= gluon_bwd_d256.SMEM_BYTES - 1024, name   # barriers' margin
        cols = 256 // 2
        assert cols % cfg["DQ_RED"] == 0 and (cols // cfg["DQ_RED"]) % cfg["DQ_SLOTS"] == 0, name
    assert c["PS_SWIZZLE"] == 128
    # the fallback with no shared-memory view starting inside a 128-byte swizzle row
    al = gluon_bwd_d256.CONFIGS["aligned"]()
    assert al["PS_SWIZZLE"] == 64 and al["DQ_RED"] % 64 == 0 and al["TMA_DQ"] == 0
    # deterministic: the ordered adds through the writer warp, one staging box per warpgroup,
    # the rotated walk where it applies (gluon_bwd.rotation)
    od = gluon_bwd_d256.CONFIGS["ordered"]()
    assert od["TMA_DQ"] == 2 and od["DQ_SLOTS"] == 1 and od["ROTATE"] and not c["ROTATE"]
    with pytest.raises(ValueError):
        gluon_bwd_d256.tile_config(ordered=True, slots=2)
    # dK's product after the last dQ box with the ordered adds, after the first otherwise
    assert od["DK_AFTER"] == 128 // od["DQ_RED"] - 1 and c["DK_AFTER"] == 0 and od["TURNS"] and not c["TURNS"]
    assert not gluon_bwd_d256.CONFIGS["writer"]()["TURNS"]
    with pytest.raises(ValueError):
        gluon_bwd_d256.tile_config(dk_after=4)
    # a full [64, 256] f32 dQ staging tile does not fit next to a 2-stage ring (why dQ is streamed)
    assert gluon_bwd_d256.smem_bytes(dict(c, DQ_RED=128, DQ_SLOTS=1)) > gluon_bwd_d256.SMEM_BYTES
    s = REGISTRY.get("gluon_flash_bwd_d256")
    p = problem(device="cuda", B=2, Hq=8, Hkv=2, Sq=1000, Sk=1000)
    assert s.workspace_size(p) == 4 * 2 * 8 * 1000 * 257
    big = problem(device="cuda", B=4, Hq=8, Hkv=8, Sq=4096, Sk=4096)
    tflops = big.flops() / s.estimate(big) / 1e9
    assert 280 < tflops < 330    # EFF 0.42 of the models' bf16 peak (750), wave fill 0.99
    assert s.estimate(problem(device="cuda", Sq=16, Sk=16)) == gluon_bwd_d256.HOST_FLOOR_MS


def test_without_the_tma_reduce_add(monkeypatch):
    monkeypatch.setattr(gluon_bwd_d256, "tma_reduce_add", None)
    c = gluon_bwd_d256.tile_config()
    assert c["TMA_DQ"] == 0 and gluon_bwd_d256.smem_bytes(c) == 2 * (2 * 64 * 256 + 4 * 64 * 256 + 2 * 64 * 64)


def test_plan_uses_its_kernel_and_one_kv_box():
    assert gluon_bwd_d256.GluonBwdD256Plan.KV_BOXES == 1 and gluon_bwd.GluonBwdPlan.KV_BOXES == 2
    assert gluon_bwd_d256.GluonBwdD256Plan._kernel() is gluon_bwd_d256._gluon_bwd_d256_kernel
    assert gluon_bwd.GluonBwdPlan._kernel() is gluon_bwd._gluon_bwd_kernel
    assert gluon_bwd_d256.GluonBwdD256Plan._default_config(256) == gluon_bwd_d256.tile_config()


def _emulate(p, q, k, v, do, o, lse, scale, red: int):
    """Solver 130's tile algorithm in float64 torch: per CTA (BLOCK_N keys of one (b, kv
    head)) the consumers' two flat loops as in 127 (`gluon_bwd_tiles`): warpgroup w forms S,
    dP, P and dS of its BLOCK_N / 2 keys (key0 = start_n + w BLOCK_N / 2, with the kernel's
    masks), the P and dS tiles assembled from both halves, then w's head-dim columns of dV,
    dK and (in `red`-column boxes) dQ."""
    BM, BN = gluon_bwd_d256.BLOCK_M, gluon_bwd_d256.BLOCK_N
    KEYS, COLS = BN // 2, p.D // 2
    t = padded(p, q, k, v, do, o, lse, BM, BN)
    dq = torch.zeros(p.B, p.Hq, t.m_end, p.D, dtype=torch.float64)
    dk, dv = (torch.zeros(p.B, p.Hkv, t.n_pad, p.D, dtype=torch.float64) for _ in range(2))
    cols = torch.arange(KEYS)[None, :]          # key - key0
    rws = torch.arange(BM)[:, None]
    for b in range(p.B):
        for hk in range(p.Hkv):
            for start_n in range(0, p.Sk, BN):
                lo, full = query_range(p, t, start_n, BM, BN)
                kk, vv = t.k[b, hk, start_n:start_n + BN], t.v[b, hk, start_n:start_n + BN]
                for masked, h, start_m in flat_steps(p, t, lo, full, hk, BM):
                    rows = slice(start_m, start_m + BM)
                    qq, dd = t.q[b, h, rows], t.do[b, h, rows]
                    ps, dss = [], []
                    for w in range(2):                   # S / dP split by keys
                        key0 = start_n + w * KEYS
                        kw_, vw = kk[w * KEYS:(w + 1) * KEYS], vv[w * KEYS:(w + 1) * KEYS]
                        st = (qq @ kw_.T) * scale
                        if masked:
                            valid = cols < p.Sk - key0
                            if p.causal:
                                valid = valid & (cols <= rws + (start_m + t.shift - key0))
                            st = torch.where(valid, st, -torch.inf)
                        pw = torch.exp(st - t.lse2[b, h, rows][:, None])
                        ps.append(pw)
                        dss.append(pw * ((dd @ vw.T) - t.delta[b, h, rows][:, None]))
                    pm, dsm = torch.cat(ps, 1), torch.cat(dss, 1)   # the shared P, dS tiles
                    for w in range(2):                   # dK / dV / dQ split by columns
                        c = slice(w * COLS, (w + 1) * COLS)
                        dv[b, hk, start_n:start_n + BN, c] += pm.T @ dd[:, c]
                        dk[b, hk, start_n:start_n + BN, c] += dsm.T @ qq[:, c] * scale
                        for c0 in range(w * COLS, (w + 1) * COLS, red):
                            dq[b, h, rows, c0:c0 + red] += dsm @ kk[:, c0:c0 + red]   # unscaled
    return dq[:, :, :p.Sq] * scale, dk[:, :, :p.Sk], dv[:, :, :p.Sk]


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (70, 200), (200, 70), (129, 257), (64, 64), (100, 65)])
def test_tile_algorithm_emulation_matches_reference(sq, sk, causal):
    from nnprim.args import AttnArgs
    from nnprim.attention.reference import reference_backward, reference_forward
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    d = 16   # the column split and dQ boxes at a small head dim (the kernel's: 256, 128 / 32)
    q, do = (torch.randn(1, 4, sq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, sk, d, generator=g, dtype=torch.float64) for _ in range(2))
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd")
    o, lse = reference_forward(p, AttnArgs(q, k, v))
    ref = reference_backward(p, AttnArgs(q, k, v, do=do))
    got = _emulate(p, q, k, v, do, torch.nan_to_num(o), lse, d ** -0.5, red=4)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        assert torch.allclose(x, r, atol=1e-9, rtol=1e-9), (name, (x - r).abs().max().item())
