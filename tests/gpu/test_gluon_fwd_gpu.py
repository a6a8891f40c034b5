"""Solver 126 `gluon_flash_fwd` (Gluon, warp-specialised, Hopper only) on the GPU: random
inputs, NaN-poisoned outputs, against the float64 reference; odd Sq/Sk tails, GQA 4:1 and
8:1, both causal alignments, d64/d128/d256, B*H above and below the SM count, lse,
bit-identical output run to run, strided inputs (copied for TMA), the public API. Every
kernel variant: ping-pong (two 4-warp consumers taking turns; three for d64, 192-row tiles,
whose causal tiles align to the last row) or one 8-warp consumer, each launched one tile per
CTA (`single`) or persistent (grid <= #SMs walking the tiles; a test shrinks the grid to 7
CTAs so each runs many tiles, causal snake rounds included). The three-consumer variants run
the d64 cases only.

A wrong barrier phase shows as a hang, not an error: the smoke tests run small problems of
each variant in a subprocess with a timeout, and a variant's other tests are skipped when
its smoke run hangs or fails (run the module under `timeout` too). Error bound: FACTOR x torch's same-dtype SDPA error + a
floor (gpu_helpers.assert_close)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import GLUON_MODULE_MARKS, assert_close

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import gluon_fwd
from nnprim.attention.reference import reference_forward
from nnprim.problems.attention import AttentionProblem
from nnprim.search.solver import REGISTRY

DEV = "cuda"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = GLUON_MODULE_MARKS


SMOKE = """
import sys, torch
from nnprim.args import AttnArgs
from nnprim.attention import gluon_fwd
from nnprim.problems.attention import AttentionProblem

pp, persistent, consumers = sys.argv[1] == "1", sys.argv[2] == "1", int(sys.argv[3])
for D, Sq, Sk in ((64, 130, 200), (64, 450, 301), (128, 300, 77), (256, 200, 333)):
    if consumers == 3 and D != 64:
        continue
    q = torch.randn(1, 2, Sq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, Sk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 1, Sk, D, device="cuda", dtype=torch.bfloat16)
    for causal in (None, "bottom_right"):
        p = AttentionProblem.from_tensors(q, k, v, causal=causal, return_lse=True)
        cfg = gluon_fwd.tile_config(D, pp, persistent, consumers=consumers if pp else None)
        o, lse = gluon_fwd.gluon_forward(p, AttnArgs(q, k, v), cfg=cfg)
        torch.cuda.synchronize()
        if causal is None:
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().expand(1, 2, Sk, D),
                                                                   v.float().expand(1, 2, Sk, D))
            err = (o.float() - ref).abs().max().item()
            assert err < 5e-2, f"wrong result: D={D} max abs err {err}"
print("SMOKE-OK")
"""

VARIANTS = {  # name: (ping-pong, persistent, consumers)
    "pingpong-persistent": (True, True, 2),
    "pingpong-single": (True, False, 2),
    "pingpong3-persistent": (True, True, 3),
    "pingpong3-single": (True, False, 3),
    "one_consumer-persistent": (False, True, 1),
    "one_consumer-single": (False, False, 1),
}
Variant = tuple[bool, bool, int]
_smoke: dict[Variant, str] = {}


def tile_cfg(D: int, variant: Variant) -> dict:
    """The variant's tile config for head dim D; skips the test where the variant has no
    config (three consumers past d64)."""
    pp, persistent, consumers = variant
    if consumers == 3 and D > 64:
        pytest.skip("three consumers: d64 only")
    return gluon_fwd.tile_config(D, pp, persistent, consumers=consumers if pp else None)


def smoke_failure(variant: Variant) -> str | None:
    """None when small launches of the variant (ping-pong, persistent, consumers) finish
    correctly in a subprocess within 120 s, else why (a hang is killed with its process)."""
    if variant not in _smoke:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TRITON_INTERPRET", None)
        try:
            r = subprocess.run([sys.executable, "-c", SMOKE, *("1" if x else "0" for x in variant[:2]),
                                str(variant[2])], env=env, capture_output=True, text=True, timeout=120)
            _smoke[variant] = "" if "SMOKE-OK" in r.stdout else f"smoke run failed: {(r.stdout + r.stderr)[-3000:]}"
        except subprocess.TimeoutExpired:
            _smoke[variant] = "smoke run hung for 120 s (deadlock: barrier phases?)"
    return _smoke[variant] or None


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant(request) -> Variant:
    """(ping-pong, persistent, consumers) of a variant whose smoke run passed."""
    v = VARIANTS[request.param]
    why = smoke_failure(v)
    if why:
        pytest.skip(f"{request.param}: {why[:500]}")
    return v


@pytest.mark.parametrize("name", list(VARIANTS))
def test_smoke_in_subprocess(name):
    why = smoke_failure(VARIANTS[name])
    assert why is None, why


def case(B, Hq, Hkv, Sq, Sk, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, device=DEV).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g, device=DEV).to(dtype)
    return q, k, v


def torch_same_dtype(q, k, v, causal):
    """torch's SDPA in q's dtype (math backend semantics for bottom-right via an explicit mask)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    Sq, Sk = q.shape[2], k.shape[2]
    if causal is None:
        return F.scaled_dot_product_attention(q, k, v)
    i = torch.arange(Sq, device=DEV)[:, None]
    j = torch.arange(Sk, device=DEV)[None, :]
    vis = j <= i + (Sk - Sq if causal == "bottom_right" else 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis)


def run_checked(q, k, v, variant, causal=None, scale=None, inf_as_zero=False):
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, scale=scale, return_lse=True,
                                      softmax_inf_as_zero=inf_as_zero)
    s = REGISTRY.get("gluon_flash_fwd")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    args = AttnArgs(q, k, v, scale=scale)
    B, Hq, Sq, D = q.shape
    o = torch.full((B, Hq, Sq, D), float("nan"), dtype=q.dtype, device=DEV)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32, device=DEV)
    gluon_fwd.gluon_forward(p, args, out=o, lse_out=lse, cfg=tile_cfg(D, variant))
    torch.cuda.synchronize()
    ro, rl = reference_forward(p, args)
    return p, args, o, lse, ro, rl


SHAPES = [  # (B, Hq, Hkv, Sq, Sk, D)
    (1, 4, 1, 1, 1, 64),           # one row, one key
    (2, 4, 1, 197, 333, 64),       # GQA 4:1, odd tails
    (1, 8, 1, 250, 129, 128),      # GQA 8:1, Sk one past a block
    (2, 8, 2, 1000, 1000, 128),    # tails in both, GQA 4:1
    (1, 2, 2, 77, 300, 256),       # d256
    (4, 48, 6, 1024, 1024, 128),   # B*H = 192 > 132 SMs, GQA 8:1: several tiles per persistent CTA
    (2, 16, 16, 2048, 2048, 64),   # several K/V ring wraps
    (1, 4, 2, 400, 150, 64),       # Sk < Sq: bottom-right rows with no key; 3 tiles of 192 rows, the first partial
    (2, 8, 2, 1100, 900, 256),     # d256, 144 tiles: persistent CTAs reload Q after O left through it
]


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_reference(shape, causal, variant):
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v = case(B, Hq, Hkv, Sq, Sk, D)
    p, args, o, lse, ro, rl = run_checked(q, k, v, variant, causal=causal)
    hidden = torch.isneginf(rl)               # bottom-right with Sk < Sq: rows that see no key
    assert torch.isnan(o[hidden]).all() and torch.equal(torch.isneginf(lse), hidden)
    theirs = torch_same_dtype(q, k, v, causal)
    rows = ~hidden
    assert_close(f"o {shape} {causal}", o[rows], theirs[rows], ro[rows])
    assert (lse[rows].double() - rl[rows]).abs().max().item() < 1e-3 * max(1.0, rl[rows].abs().max().item())


def test_fully_masked_rows_inf_as_zero(variant):
    q, k, v = case(1, 4, 1, 300, 100, 128)
    p, args, o, lse, ro, rl = run_checked(q, k, v, variant, causal="bottom_right", inf_as_zero=True)
    hidden = torch.isneginf(rl)
    assert hidden.any() and (o[hidden] == 0).all() and torch.isneginf(lse[hidden]).all()
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_f16_and_scales(dtype, variant):
    q, k, v = case(2, 4, 2, 333, 517, 128, dtype=dtype, seed=3)
    for scale in (0.05, -0.08):               # negative: the general (unfused) softmax path
        p, args, o, lse, ro, rl = run_checked(q, k, v, variant, causal="top_left", scale=scale)
        rep = 2
        theirs = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                is_causal=True, scale=scale)
        assert_close(f"o {dtype} scale={scale}", o, theirs, ro)


def test_bit_identical_run_to_run(variant):
    D = 64 if variant[2] == 3 else 128
    q, k, v = case(2, 32, 4, 1531, 1531, D, seed=7)
    p = AttentionProblem.from_tensors(q, k, v, causal="bottom_right", return_lse=True)
    cfg = tile_cfg(D, variant)
    outs = [gluon_fwd.gluon_forward(p, AttnArgs(q, k, v), cfg=cfg) for _ in range(3)]
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_strided_inputs_bshd_and_unaligned(variant):
    # (B, S, H, D) storage viewed as (B, H, S, D): TMA-able strides, read in place; Sk > Sq
    # (bottom-right causal with Sk < Sq leaves rows with no key: NaN by the contract)
    g = torch.Generator(device=DEV).manual_seed(11)
    q = torch.randn(2, 301, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 333, 2, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 333, 2, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    p, args, o, lse, ro, rl = run_checked(q, k, v, variant, causal="bottom_right")
    assert_close("o bshd", o, torch_same_dtype(q, k, v, "bottom_right"), ro)
    # an odd storage offset (not 16-byte aligned): copied contiguous first
    base = torch.randn(2 * 4 * 100 * 64 + 3, device=DEV, dtype=torch.bfloat16)
    q2 = base[3:].view(2, 4, 100, 64)
    k2, v2 = case(2, 1, 1, 1, 120, 64, seed=5)[1:]
    p, args, o, lse, ro, rl = run_checked(q2, k2, v2, variant)
    assert_close("o unaligned", o, torch_same_dtype(q2, k2, v2, None), ro)


def test_public_api_forced_solver():
    q, k, v = case(2, 8, 2, 513, 700, 128, seed=9)
    p = AttentionProblem.from_tensors(q, k, v, causal="bottom_right", return_lse=True)
    cfg = gluon_fwd.tile_config(128, problem=p)
    why = smoke_failure((cfg["CONSUMERS"] > 1, cfg["PERSISTENT"], cfg["CONSUMERS"]))   # the solver's own variant
    if why:
        pytest.skip(why[:500])
    o, lse = nnprim.sdpa(q, k, v, causal="bottom_right", return_lse=True, solver="gluon_flash_fwd")
    ref_o, ref_lse = nnprim.sdpa(q, k, v, causal="bottom_right", return_lse=True, solver="flash_fwd")
    ro, rl = reference_forward(p, AttnArgs(q, k, v))
    assert_close("o api", o, ref_o, ro)
    assert (lse.double() - rl).abs().max().item() < 1e-3 * max(1.0, rl.abs().max().item())


def test_public_api_default_three_consumers():
    """The solver's own choice at d64 on a long sequence: three consumers, persistent; Sq one
    slab and 4 rows past a multiple of 192, so the last tile has a busy, a partial and an idle
    slab, and lse of every row."""
    q, k, v = case(1, 4, 2, 4100, 4111, 64, seed=31)
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True)
    cfg = gluon_fwd.tile_config(64, problem=p)
    assert cfg["CONSUMERS"] == 3
    why = smoke_failure((True, cfg["PERSISTENT"], 3))
    if why:
        pytest.skip(why[:500])
    o, lse = nnprim.sdpa(q, k, v, return_lse=True, solver="gluon_flash_fwd")
    ro, rl = reference_forward(p, AttnArgs(q, k, v))
    assert_close("o default d64", o, torch_same_dtype(q, k, v, None), ro)
    assert (lse.double() - rl).abs().max().item() < 1e-3 * max(1.0, rl.abs().max().item())


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_public_api_default_d256_pingpong(causal):
    """d256 through the public call on the solver's own choice: two ping-pong warpgroups (the
    default at every head dim since 2026-12-03), no separate O buffer; tails and GQA."""
    q, k, v = case(2, 6, 2, 1111, 1234, 256, seed=37)
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, return_lse=True)
    cfg = gluon_fwd.tile_config(256, problem=p)
    assert cfg["CONSUMERS"] == 2 and not cfg["SEPARATE_O"]
    why = smoke_failure((True, cfg["PERSISTENT"], 2))
    if why:
        pytest.skip(why[:500])
    o, lse = nnprim.sdpa(q, k, v, causal=causal, return_lse=True, solver="gluon_flash_fwd")
    ro, rl = reference_forward(p, AttnArgs(q, k, v))
    assert_close(f"o default d256 {causal}", o, torch_same_dtype(q, k, v, causal), ro)
    assert (lse.double() - rl).abs().max().item() < 1e-3 * max(1.0, rl.abs().max().item())


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("consumers", [2, 3, 1], ids=["pingpong", "pingpong3", "one_consumer"])
def test_persistent_many_tiles_per_cta(monkeypatch, causal, consumers):
    """A grid of 7 CTAs over 2 * 4 * 9 = 72 tiles: ten full rounds and a partial one (snake
    order when causal), the ring and the Q/O buffers cycling through many tiles."""
    variant = (consumers > 1, True, consumers)
    why = smoke_failure(variant)
    if why:
        pytest.skip(why[:500])
    monkeypatch.setattr(gluon_fwd, "sm_count", lambda index: 7)
    for D in (64,) if consumers == 3 else (64, 128, 256):
        q, k, v = case(2, 4, 2, 1100, 1000 if D != 256 else 700, D, seed=D)
        p, args, o, lse, ro, rl = run_checked(q, k, v, variant, causal=causal)
        rows = ~torch.isneginf(rl)
        assert_close(f"o D={D} {causal}", o[rows], torch_same_dtype(q, k, v, causal)[rows], ro[rows])
        assert (lse[rows].double() - rl[rows]).abs().max().item() < 1e-3 * max(1.0, rl[rows].abs().max().item())


def test_size_one_dims_with_any_stride_need_no_copy(variant):
    """A size-1 batch dim's stride is never stepped over: TMA describes the tensor as it is."""
    g = torch.Generator(device=DEV).manual_seed(13)
    base = torch.randn(4 * 100 * 64 * 3, generator=g, device=DEV).to(torch.bfloat16)
    q = base.as_strided((1, 4, 100, 64), (12345, 6400, 64, 1))
    k = base.as_strided((1, 1, 150, 64), (7, 64, 64, 1), 4 * 100 * 64)
    v = base.as_strided((1, 1, 150, 64), (7, 64, 64, 1), 2 * 4 * 100 * 64)
    assert gluon_fwd._tma_strides(q) is not None and gluon_fwd._tma_strides(k) is not None
    p, args, o, lse, ro, rl = run_checked(q, k, v, variant, causal="top_left")
    assert_close("o size-1 dims", o, torch_same_dtype(q, k, v, "top_left"), ro)


def test_one_plan_many_calls():
    """A plan reused as the solver reuses it: the encoded descriptors are keyed by address
    and strides, so new values at the same addresses, new tensors, other strides (BSHD
    views) and an unaligned copy each give the right result."""
    q, k, v = case(2, 8, 2, 300, 333, 128, seed=21)
    p = AttentionProblem.from_tensors(q, k, v, causal="bottom_right", return_lse=True)
    plan = gluon_fwd.GluonFwdPlan(p)

    def check(qq, kk, vv, name):
        o, _ = plan(AttnArgs(qq, kk, vv))
        ro, _ = reference_forward(p, AttnArgs(qq, kk, vv))
        assert_close(name, o, torch_same_dtype(qq, kk, vv, "bottom_right"), ro)
        return o

    o1 = check(q, k, v, "first")
    assert torch.equal(check(q, k, v, "again"), o1)
    q.copy_(torch.randn_like(q))                       # same address, new values
    assert not torch.equal(check(q, k, v, "new values"), o1)
    q2, k2, v2 = case(2, 8, 2, 300, 333, 128, seed=22)   # new tensors
    check(q2, k2, v2, "new tensors")
    g = torch.Generator(device=DEV).manual_seed(23)  # (B, S, H, D) storage: other strides
    qb = torch.randn(2, 300, 8, 128, generator=g, device=DEV).to(torch.bfloat16).transpose(1, 2)
    check(qb, k2, v2, "bshd q")
    base = torch.randn(q.numel() + 1, device=DEV).to(torch.bfloat16)
    qo = base[1:].view(q.shape)
    qo.copy_(q2)
    check(qo, k2, v2, "unaligned q")
