"""Solver 127 `gluon_flash_bwd` (Gluon, warp-specialised, Hopper only) on the GPU: random
inputs, NaN-poisoned outputs, dq/dk/dv against the float64 reference; odd Sq/Sk tails, GQA
4:1 and MQA, both causal alignments, d64/d128, Sq != Sk (rows that see no key), more CTAs
than SMs, f16, negative and inverted scales, strided and unaligned inputs, the public API.
Both ways of forming dQ_partial: `split_dq` (all 128 keys, each warpgroup half the
columns; the default at d128; d64 reads K's column halves from a second copy) and `wg_dq`
(each warpgroup its 64 keys, all columns), dQ added by TMA reduce-adds (the default), by f32
atomics (`_atomic`), by reduce-adds in a fixed order (`_ordered`, solver 129: bit-identical
run to run) and with the query blocks walked from a per-key-block start (`_rotate`, and
`_ordered` without causal masking).

A wrong barrier phase shows as a hang, not an error: the smoke test runs small problems in
a subprocess with a timeout (per dQ variant) and a variant's tests are skipped when it hangs or fails
(run the module under `timeout` too). Error bound: FACTOR x the same-dtype error of torch's
SDPA backward (of solver 123 where torch's is not finite: rows that see no key) + a floor
(gpu_helpers.assert_close)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import GLUON_MODULE_MARKS, assert_bit_identical, assert_close

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import gluon_bwd
from nnprim.attention.reference import reference_backward
from nnprim.problems.attention import AttentionProblem
from nnprim.search.solver import REGISTRY

DEV = "cuda"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = GLUON_MODULE_MARKS

SMOKE = """
import sys, torch, nnprim
from nnprim.args import AttnArgs
from nnprim.attention import gluon_bwd
from nnprim.problems.attention import AttentionProblem

for D, Sq, Sk in ((64, 130, 200), (128, 300, 77), (128, 64, 128)):
    g = torch.Generator(device="cuda").manual_seed(D)
    q, do = (torch.randn(1, 2, Sq, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 1, Sk, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    for causal in (None, "bottom_right"):
        o, lse = nnprim.sdpa(q, k, v, causal=causal, return_lse=True, solver="flash_fwd")
        p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd")
        mode = int(sys.argv[2])
        cfg = gluon_bwd.tile_config(D, sys.argv[1] == "1", tma_dq=mode != 0, ordered=mode in (2, 5),
                                    rotate=mode in (2, 3, 4, 5), writer=mode in (4, 5))
        dq, dk, dv = gluon_bwd.GluonBwdPlan(p, cfg)(AttnArgs(q, k, v, do=do, o=o, lse=lse))
        torch.cuda.synchronize()
        ref = nnprim.sdpa_backward(do, q, k, v, o, lse, causal=causal, solver="flash_bwd_atomic")
        for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
            err = ((x.float() - r.float()).norm() / r.float().norm().clamp_min(1e-6)).item()
            assert err < 5e-2, f"wrong result: D={D} Sq={Sq} Sk={Sk} {causal} {name} rel err {err}"
print("SMOKE-OK")
"""
_smoke: dict[tuple[bool, int], str] = {}
# (SPLIT_DQ, mode): mode = TMA_DQ (0 atomics, 1 reduce-adds, 2 ordered); 3: TMA_DQ 1 with the rotated
# walk of the query blocks; 4 / 5: 1 / 2 with the dQ writer warp (DQ_WRITER, split dQ only) and the
# rotated walk
VARIANTS = [(True, 1), (False, 1), (True, 0), (True, 2), (False, 2), (True, 3), (False, 3), (True, 4), (True, 5)]
IDS = ["split_dq", "wg_dq", "split_dq_atomic", "split_dq_ordered", "wg_dq_ordered", "split_dq_rotate", "wg_dq_rotate",
       "split_dq_writer", "split_dq_ordered_writer"]


def config(D: int, variant: tuple[bool, int]) -> dict:
    split, mode = variant
    return gluon_bwd.tile_config(D, split, tma_dq=mode != 0, ordered=mode in (2, 5), rotate=mode in (2, 3, 4, 5),
                                 writer=mode in (4, 5))


def smoke_failure(variant: tuple[bool, int]) -> str | None:
    """None when small launches of the dQ variant finish correctly in a subprocess within
    120 s, else why (a hang is killed with its process)."""
    if variant not in _smoke:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TRITON_INTERPRET", None)
        try:
            r = subprocess.run([sys.executable, "-c", SMOKE, str(int(variant[0])), str(variant[1])], env=env,
                               capture_output=True, text=True, timeout=120)
            _smoke[variant] = "" if "SMOKE-OK" in r.stdout else f"smoke run failed: {(r.stdout + r.stderr)[-3000:]}"
        except subprocess.TimeoutExpired:
            _smoke[variant] = "smoke run hung for 120 s (deadlock: barrier phases?)"
    return _smoke[variant] or None


@pytest.fixture(params=VARIANTS, ids=IDS)
def split(request) -> tuple[bool, int]:
    """(SPLIT_DQ, TMA_DQ) of a variant whose smoke run passed."""
    why = smoke_failure(request.param)
    if why:
        pytest.skip(why[:500])
    return request.param


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_smoke_in_subprocess(variant):
    why = smoke_failure(variant)
    assert why is None, why


def setup(B, Hq, Hkv, Sq, Sk, D, causal=None, dtype=torch.bfloat16, scale=None, invert=False, seed=0):
    """Inputs, the forward's o and lse (solver 110), the problem and args of the backward."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, do = (torch.randn(B, Hq, Sq, D, generator=g, device=DEV).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g, device=DEV).to(dtype) for _ in range(2))
    o, lse = nnprim.sdpa(q, k, v, causal=causal, scale=scale, invert_scale=invert, return_lse=True,
                         solver="flash_fwd")
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, scale=scale, invert_scale=invert, direction="bwd")
    return p, AttnArgs(q, k, v, scale=scale, do=do, o=o, lse=lse)


def theirs(p, a):
    """The same-dtype baseline: torch's SDPA backward (GQA by repeat), or solver 123's when
    torch's is not finite (causal rows that see no key give NaN in torch)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (a.q, a.k, a.v))
    g = p.group
    mask = None
    if p.causal is not None:
        shift = p.Sk - p.Sq if p.causal == "bottom_right" else 0
        mask = torch.ones(p.Sq, p.Sk, dtype=torch.bool, device=DEV).tril(shift)
    scale = float(a.effective_scale(p.invert_scale))
    F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask,
                                   scale=scale).backward(a.do)
    grads = (q.grad, k.grad, v.grad)
    if all(torch.isfinite(x).all() for x in grads):
        return grads
    return nnprim.sdpa_backward(a.do, a.q, a.k, a.v, a.o, a.lse, causal=p.causal, scale=a.scale,
                                invert_scale=p.invert_scale, solver="flash_bwd_atomic")


def check(p, a, split, name=""):
    s = REGISTRY.get("gluon_flash_bwd")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    out = tuple(torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV) for t in (a.q, a.k, a.v))
    got = gluon_bwd.GluonBwdPlan(p, config(p.D, split))(a, out=out)
    torch.cuda.synchronize()
    assert all(x is y for x, y in zip(got, out))
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), out, theirs(p, a), ref):
        assert_close(f"{name} {gname}", x, t, r)
    return out


SHAPES = [  # (B, Hq, Hkv, Sq, Sk, D)
    (1, 4, 1, 1, 1, 64),           # one row, one key
    (2, 4, 1, 197, 333, 64),       # GQA 4:1, odd tails
    (1, 8, 2, 250, 129, 128),      # Sk one past a key block
    (2, 8, 2, 1000, 1000, 128),    # tails in both, GQA 4:1
    (1, 4, 4, 333, 100, 128),      # Sq > Sk: bottom-right rows that see no key
    (4, 16, 4, 2048, 2048, 64),    # 256 CTAs > 132 SMs, several ring wraps
    (1, 8, 8, 2048, 1536, 128),    # Sq != Sk, no tails
]


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_reference(shape, causal, split):
    p, a = setup(*shape, causal=causal)
    check(p, a, split, f"{shape} {causal}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_f16_and_scales(dtype, split):
    for scale, invert in ((0.05, False), (-0.08, False), (12.0, True)):
        p, a = setup(2, 4, 1, 333, 517, 128, causal="top_left", dtype=dtype, scale=scale, invert=invert, seed=3)
        check(p, a, split, f"{dtype} scale={scale} invert={invert}")


def test_strided_and_unaligned_inputs(split):
    # (B, S, H, D) storage viewed as (B, H, S, D): TMA-able strides, read in place
    g = torch.Generator(device=DEV).manual_seed(11)
    q, do = (torch.randn(2, 301, 8, 128, generator=g, device=DEV).bfloat16().transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(2, 333, 2, 128, generator=g, device=DEV).bfloat16().transpose(1, 2) for _ in range(2))
    o, lse = nnprim.sdpa(q, k, v, causal="bottom_right", return_lse=True, solver="flash_fwd")
    p = AttentionProblem.from_tensors(q, k, v, causal="bottom_right", direction="bwd")
    check(p, AttnArgs(q, k, v, do=do, o=o, lse=lse), split, "bshd")
    # an odd storage offset (not 16-byte aligned): copied contiguous first
    base = torch.randn(2 * 4 * 100 * 64 + 3, generator=g, device=DEV).bfloat16()
    q2 = base[3:].view(2, 4, 100, 64)
    k2, v2, do2 = (torch.randn(*s, generator=g, device=DEV).bfloat16()
                   for s in ((2, 1, 120, 64), (2, 1, 120, 64), (2, 4, 100, 64)))
    o2, lse2 = nnprim.sdpa(q2, k2, v2, return_lse=True, solver="flash_fwd")
    p2 = AttentionProblem.from_tensors(q2, k2, v2, direction="bwd")
    check(p2, AttnArgs(q2, k2, v2, do=do2, o=o2, lse=lse2), (False, split[1]) if split[1] < 4 else split, "unaligned")


def test_public_api_forced_solver():
    cfg = gluon_bwd.tile_config(128)
    why = smoke_failure((cfg["SPLIT_DQ"], cfg["TMA_DQ"]))   # the solver's own variant
    if why:
        pytest.skip(why[:500])
    p, a = setup(2, 8, 2, 513, 700, 128, causal="bottom_right", seed=9)
    runs = [nnprim.sdpa_backward(a.do, a.q, a.k, a.v, a.o, a.lse, causal="bottom_right", solver="gluon_flash_bwd")
            for _ in range(2)]
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), runs[0], theirs(p, a), ref):
        assert_close(f"api {gname}", x, t, r)
    # dK and dV have one writer per element (bit-identical); dQ's atomic adds may differ in order
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    diff = (runs[0][0].float() - runs[1][0].float()).abs().max().item()
    print(f"gluon_flash_bwd dq run-to-run max |diff| {diff:.3g}")


@pytest.mark.parametrize("writer", [False, True], ids=["", "writer"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_ordered_is_bit_identical_run_to_run(D, causal, writer):
    """Solver 129 (and its dQ writer warp variant): many CTAs per head (more than SMs), GQA,
    tails; three runs bit-equal, and close to the reference."""
    variant = (True, 5) if writer else (D == 128, 2)
    why = smoke_failure(variant)
    if why:
        pytest.skip(why[:500])
    p, a = setup(2, 16, 4, 3001, 2999, D, causal=causal, seed=5)
    plan = gluon_bwd.GluonBwdPlan(p, config(D, variant))
    runs = [plan(a) for _ in range(3)]
    torch.cuda.synchronize()
    assert_bit_identical(runs)
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), runs[0], theirs(p, a), ref):
        assert_close(f"ordered {gname}", x, t, r)


def test_deterministic_mode_chooses_a_deterministic_solver():
    why = smoke_failure((True, 5))   # 129's own variant: ordered, the dQ writer warp
    if why:
        pytest.skip(why[:500])
    p, a = setup(1, 8, 2, 1024, 1024, 128, causal="top_left", seed=2)
    torch.use_deterministic_algorithms(True)
    try:
        assert REGISTRY.get("gluon_flash_bwd_ordered").deterministic
        runs = [nnprim.sdpa_backward(a.do, a.q, a.k, a.v, a.o, a.lse, causal="top_left") for _ in range(2)]
        forced = [nnprim.sdpa_backward(a.do, a.q, a.k, a.v, a.o, a.lse, causal="top_left",
                                       solver="gluon_flash_bwd_ordered") for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert_bit_identical(runs)
    assert_bit_identical(forced)
