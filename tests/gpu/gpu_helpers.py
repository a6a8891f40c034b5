"""Shared checks of the GPU tests: errors bounded by a multiple of torch's own error in
the same dtype against float64 (FlashAttention's test pattern), and no reference
solver chosen on the GPU."""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnprim.search.context import context

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# the Gluon solvers' test modules: Hopper only, the solvers on (conftest.gluon_on)
GLUON_MODULE_MARKS = [pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU"),
                      pytest.mark.usefixtures("gluon_on")]
FACTOR = 3.0                         # ours may be this many times torch's same-dtype error
FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 6e-3}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(name: str, ours: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor) -> None:
    """`ours` is no further from the float64 `ref` than FACTOR x torch's same-dtype result
    (`theirs`), plus a floor for the dtype (the floor alone when torch's result is not finite);
    and has no NaN."""
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    e_ours, e_torch = rel(ours, ref), rel(theirs, ref)
    floor = FLOOR[ours.dtype if ours.dtype in FLOOR else torch.float32]
    # torch's own result can be non-finite (its f16 SDPA with a negative scale gives NaN):
    # then it is no baseline and the dtype's floor alone bounds ours
    bound = FACTOR * e_torch + floor if math.isfinite(e_torch) else floor
    assert e_ours <= bound, f"{name}: error {e_ours:.3g} > {bound:.3g} (torch's {e_torch:.3g})"


def assert_bit_identical(runs, name: str = "") -> None:
    """Every run's tensors equal the first run's, bit for bit (a deterministic path)."""
    for i, run in enumerate(runs[1:], 1):
        for j, (x, y) in enumerate(zip(runs[0], run)):
            assert torch.equal(x, y), f"{name} output {j}: run {i} differs from run 0"


def no_reference(device: torch.device | str = "cuda") -> None:
    """No problem on this device ended at the float64 reference (a defect on the GPU)."""
    ctx = context(torch.device(device))
    bad = [(b.problem.key(), b.solver.name) for b in list(ctx.chosen.values()) if b.solver.family == "reference"]
    assert not bad, f"reference solver chosen on the GPU: {bad}"


def chosen_solvers(device: torch.device | str = "cuda") -> dict[str, str]:
    ctx = context(torch.device(device))
    return {b.problem.key(): b.solver.name for b in list(ctx.chosen.values())}


def smoke_gate(code: str, timeout: int = 180, hang: str = "deadlock: barrier phases?"):
    """A cached check that `code` prints SMOKE-OK in a subprocess within `timeout` s: the
    returned function gives None, or why not (a kernel that hangs is killed with its process
    instead of hanging the test run). Modules gate their tests on it (`skip_unless`)."""
    root = Path(__file__).resolve().parents[2]

    @functools.cache
    def failure() -> str | None:
        env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TRITON_INTERPRET", None)
        try:
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"smoke run hung for {timeout} s ({hang})"
        return None if "SMOKE-OK" in r.stdout else f"smoke run failed: {(r.stdout + r.stderr)[-3000:]}"
    return failure


def skip_unless(failure) -> None:
    """Skip the calling test when the smoke gate `failure` (smoke_gate) failed."""
    why = failure()
    if why:
        pytest.skip(why[:500])


def smoke_fixture(failure):
    """A `smoked` fixture that skips its tests when the smoke gate `failure` failed."""
    @pytest.fixture
    def smoked():
        skip_unless(failure)
    return smoked


def smoke_test(failure):
    """The module's own test of its smoke gate (it fails, not skips, when the gate fails)."""
    def test_smoke_in_subprocess():
        assert failure() is None, failure()
    return test_smoke_in_subprocess


def dequant_reference(q: torch.Tensor, kq, vq, lens: torch.Tensor | None = None, causal=None):
    """(float64 attention of the dequantised K/V cache, torch's q-dtype SDPA on the same cache)
    for the quantized decode tests: GQA by repetition, ragged kv_lens, causal True or
    "bottom_right" (aligned to each entry's length) or "top_left"; rows that see no key are 0."""
    import torch.nn.functional as F
    dev = q.device
    kd, vd = kq.dequantize(torch.float64), vq.dequantize(torch.float64)
    G = q.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    Sq, Sk = q.shape[2], kd.shape[2]
    j = torch.arange(Sk, device=dev)
    L = torch.full((q.shape[0],), Sk, device=dev) if lens is None else lens.long()
    vis = j[None, None, :] < L[:, None, None]
    if causal:
        i = torch.arange(Sq, device=dev)
        shift = 0 if causal == "top_left" else (L[:, None, None] - Sq)
        vis = vis & (j[None, None, :] <= i[None, :, None] + shift)
    vis = vis[:, None].expand(-1, 1, Sq, Sk)
    empty = ~vis.any(-1, keepdim=True)
    ref = F.scaled_dot_product_attention(q.double(), kd, vd, attn_mask=vis | empty).masked_fill(empty, 0)
    theirs = F.scaled_dot_product_attention(q, kd.to(q.dtype), vd.to(q.dtype), attn_mask=vis | empty)
    return ref, theirs.masked_fill(empty, 0)

