"""Solver 130 `gluon_flash_bwd_d256` (Gluon, warp-specialised, Hopper only, head dim 256) on the
GPU: random inputs, NaN-poisoned outputs, dq/dk/dv against the float64 reference; odd Sq/Sk
tails, GQA 4:1 and MQA, both causal alignments and none, Sq != Sk (rows that see no key),
more CTAs than SMs, f16, negative and inverted scales, strided and unaligned inputs, the
public API. Each variant of gluon_bwd_d256.CONFIGS: `default` (dQ in 32-column boxes by TMA
reduce-adds through one staging tile per warpgroup), `atomic` (f32 atomics), `red16`
(16-column boxes, two staging tiles per warpgroup), `aligned` (atomics in 64-column boxes and
64-byte-swizzled P / dS: no shared-memory view starting inside a 128-byte swizzle row; if only
it passes, a sliced view is what is wrong), `ordered` (deterministic: the boxes added in a fixed
key-block order by a writer warp; bit-identical run to run).

As in tests/gpu/test_gluon_bwd_gpu.py (whose setup and same-dtype baseline this module uses):
a wrong barrier phase shows as a hang, so a smoke run of small problems per variant runs in
a subprocess with a timeout first and a variant's tests are skipped when it hangs or fails
(run the module under `timeout` too). Error bound: FACTOR x the same-dtype error of torch's
SDPA backward + a floor (gpu_helpers.assert_close)."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from gpu_helpers import GLUON_MODULE_MARKS, assert_bit_identical, assert_close
from test_gluon_bwd_gpu import setup, theirs

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import gluon_bwd_d256
from nnprim.attention.reference import reference_backward
from nnprim.problems.attention import AttentionProblem
from nnprim.search.solver import REGISTRY

DEV = "cuda"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = GLUON_MODULE_MARKS
VARIANTS = list(gluon_bwd_d256.CONFIGS)   # default, atomic, red16, aligned

SMOKE = """
import sys, torch, nnprim
from nnprim.args import AttnArgs
from nnprim.attention import gluon_bwd_d256
from nnprim.attention.reference import reference_backward
from nnprim.problems.attention import AttentionProblem

cfg = gluon_bwd_d256.CONFIGS[sys.argv[1]]()
for Sq, Sk in ((130, 200), (300, 77), (64, 64)):
    g = torch.Generator(device="cuda").manual_seed(Sq)
    q, do = (torch.randn(1, 2, Sq, 256, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 1, Sk, 256, device="cuda", generator=g).bfloat16() for _ in range(2))
    for causal in (None, "bottom_right"):
        o, lse = nnprim.sdpa(q, k, v, causal=causal, return_lse=True, solver="flash_fwd")
        p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd")
        a = AttnArgs(q, k, v, do=do, o=o, lse=lse)
        dq, dk, dv = gluon_bwd_d256.GluonBwdD256Plan(p, cfg)(a)
        torch.cuda.synchronize()
        for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), reference_backward(p, a)):
            err = ((x.double() - r.double()).norm() / r.double().norm().clamp_min(1e-6)).item()
            assert err < 5e-2, f"wrong result: Sq={Sq} Sk={Sk} {causal} {name} rel err {err}"
print("SMOKE-OK")
"""
_smoke: dict[str, str] = {}


def _smoke_run(variant: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    try:
        r = subprocess.run([sys.executable, "-c", SMOKE, variant], env=env, capture_output=True, text=True,
                           timeout=150)
        return "" if "SMOKE-OK" in r.stdout else f"smoke run failed: {(r.stdout + r.stderr)[-3000:]}"
    except subprocess.TimeoutExpired:
        return "smoke run hung for 150 s (deadlock: barrier phases?)"


def smoke_failure(variant: str) -> str | None:
    """None when small launches of the variant finish correctly in a subprocess within 150 s,
    else why (a hang is killed with its process). The first call runs every variant's
    subprocess at once (they compile their kernels in parallel)."""
    if not _smoke:
        with ThreadPoolExecutor(len(VARIANTS)) as pool:
            _smoke.update(zip(VARIANTS, pool.map(_smoke_run, VARIANTS)))
    return _smoke[variant] or None


def passed_smoke(variant: str) -> str:
    """variant, or a skip when its smoke run failed or hung."""
    why = smoke_failure(variant)
    if why:
        pytest.skip(why[:500])
    return variant


def check(p, a, variant, name=""):
    s = REGISTRY.get("gluon_flash_bwd_d256")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    out = tuple(torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV) for t in (a.q, a.k, a.v))
    got = gluon_bwd_d256.GluonBwdD256Plan(p, gluon_bwd_d256.CONFIGS[variant]())(a, out=out)
    torch.cuda.synchronize()
    assert all(x is y for x, y in zip(got, out))
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), out, theirs(p, a), ref):
        assert_close(f"{name} {variant} {gname}", x, t, r)
    return out


SHAPES = [  # (B, Hq, Hkv, Sq, Sk)
    (1, 2, 1, 1, 1),              # one row, one key
    (2, 8, 2, 1000, 1037),        # GQA 4:1, tails in both
    (1, 4, 4, 333, 100),          # Sq > Sk: bottom-right rows that see no key
    (1, 4, 1, 250, 65),           # MQA, Sk one past a key block
    (2, 8, 2, 4096, 4096),        # 256 CTAs > 132 SMs, many ring wraps
]


# every shape with the solver's config; the other variants (each a kernel to compile per
# causal mode and specialisation) on the GQA-with-tails shape
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_reference(shape, causal):
    p, a = setup(*shape, 256, causal=causal)
    check(p, a, passed_smoke("default"), f"{shape} {causal}")


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "default"])
def test_other_variants_against_reference(name, causal):
    p, a = setup(2, 8, 2, 1000, 1037, 256, causal=causal, seed=1)
    check(p, a, passed_smoke(name), f"{causal}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_f16_and_scales(dtype):
    for scale, invert in ((0.05, False), (-0.03, False), (16.0, True)):
        p, a = setup(2, 4, 1, 333, 517, 256, causal="top_left", dtype=dtype, scale=scale, invert=invert, seed=3)
        check(p, a, passed_smoke("default"), f"{dtype} scale={scale} invert={invert}")


def test_strided_and_unaligned_inputs():
    variant = passed_smoke("default")
    # (B, S, H, D) storage viewed as (B, H, S, D): TMA-able strides, read in place
    g = torch.Generator(device=DEV).manual_seed(11)
    q, do = (torch.randn(2, 301, 8, 256, generator=g, device=DEV).bfloat16().transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(2, 333, 2, 256, generator=g, device=DEV).bfloat16().transpose(1, 2) for _ in range(2))
    o, lse = nnprim.sdpa(q, k, v, causal="bottom_right", return_lse=True, solver="flash_fwd")
    p = AttentionProblem.from_tensors(q, k, v, causal="bottom_right", direction="bwd")
    check(p, AttnArgs(q, k, v, do=do, o=o, lse=lse), variant, "bshd")
    # an odd storage offset (not 16-byte aligned): copied contiguous first
    base = torch.randn(2 * 4 * 100 * 256 + 3, generator=g, device=DEV).bfloat16()
    q2 = base[3:].view(2, 4, 100, 256)
    k2, v2, do2 = (torch.randn(*s, generator=g, device=DEV).bfloat16()
                   for s in ((2, 1, 120, 256), (2, 1, 120, 256), (2, 4, 100, 256)))
    o2, lse2 = nnprim.sdpa(q2, k2, v2, return_lse=True, solver="flash_fwd")
    p2 = AttentionProblem.from_tensors(q2, k2, v2, direction="bwd")
    check(p2, AttnArgs(q2, k2, v2, do=do2, o=o2, lse=lse2), variant, "unaligned")


def test_public_api_forced_solver():
    why = smoke_failure("default")   # the solver's own variant
    if why:
        pytest.skip(why[:500])
    p, a = setup(2, 8, 2, 513, 700, 256, causal="bottom_right", seed=9)
    runs = [nnprim.sdpa_backward(a.do, a.q, a.k, a.v, a.o, a.lse, causal="bottom_right",
                                 solver="gluon_flash_bwd_d256") for _ in range(2)]
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), runs[0], theirs(p, a), ref):
        assert_close(f"api {gname}", x, t, r)
    # dK and dV have one writer per element (bit-identical); dQ's adds may differ in order
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    diff = (runs[0][0].float() - runs[1][0].float()).abs().max().item()
    print(f"gluon_flash_bwd_d256 dq run-to-run max |diff| {diff:.3g}")


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [(2, 16, 4, 3001, 3100), (1, 4, 1, 2048, 2048)], ids=["gqa_tails", "rotated"])
def test_ordered_is_bit_identical_run_to_run(shape, causal):
    """The `ordered` config (dQ boxes added in a fixed key-block order by the writer warp):
    three runs bit-equal and close to the reference; more CTAs than SMs with GQA and tails (more
    key blocks than query blocks: every key block from query block 0), and a head whose key
    blocks walk the query blocks from staggered starts (no causal mask: 32 key blocks of 64 keys
    on 32 query blocks)."""
    variant = passed_smoke("ordered")
    p, a = setup(*shape, 256, causal=causal, seed=5)
    plan = gluon_bwd_d256.GluonBwdD256Plan(p, gluon_bwd_d256.CONFIGS[variant]())
    assert plan.cfg["ROTATE"] == (causal is None and shape[4] <= shape[3])
    runs = [plan(a) for _ in range(3)]
    torch.cuda.synchronize()
    assert_bit_identical(runs)
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), runs[0], theirs(p, a), ref):
        assert_close(f"ordered {gname}", x, t, r)


def test_deterministic_solver_through_autograd():
    """Solver 132 (the `ordered` config as a solver): under torch's deterministic mode autograd
    chooses a deterministic solver and repeats its gradients bit for bit; 132 forced at the op
    agrees with the reference and with itself."""
    passed_smoke("ordered")
    p, a = setup(2, 8, 2, 777, 1500, 256, causal="bottom_right", seed=13)
    solver = REGISTRY.get("gluon_flash_bwd_d256_ordered")
    assert solver.deterministic and not solver.not_supported_reasons(p)
    forced = [nnprim.sdpa_backward(a.do, a.q, a.k, a.v, a.o, a.lse, causal="bottom_right",
                                   solver="gluon_flash_bwd_d256_ordered") for _ in range(2)]
    ref = reference_backward(p, a)
    for gname, x, t, r in zip(("dq", "dk", "dv"), forced[0], theirs(p, a), ref):
        assert_close(f"132 {gname}", x, t, r)
    assert_bit_identical(forced)
    q, k, v = (t.detach().clone().requires_grad_() for t in (a.q, a.k, a.v))
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            o = nnprim.sdpa(q, k, v, causal="bottom_right")
            grads.append(torch.autograd.grad(o, (q, k, v), a.do))
    finally:
        torch.use_deterministic_algorithms(False)
    assert_bit_identical(grads)
    for gname, x, t, r in zip(("dq", "dk", "dv"), grads[0], theirs(p, a), ref):
        assert_close(f"autograd det {gname}", x, t, r)


@pytest.mark.parametrize("name", VARIANTS)
def test_smoke_in_subprocess(name):
    """Last in the module: under -x a variant that fails its smoke run does not stop the
    default config's tests (which skip the variants whose smoke run failed)."""
    why = smoke_failure(name)
    assert why is None, why
