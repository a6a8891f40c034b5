"""Solver 27 `gluon_implicit_gemm_fwd` on CPU: never applicable here (no Hopper GPU, and
TRITON_INTERPRET=1 from tests/conftest.py), with reasons naming why and naming each option
it does not cover; the tiles fit Hopper's shared memory. Its kernel is compiled for sm_90
by tests/test_compile_sm90.py and run by tests/gpu/test_gluon_conv_gpu.py."""
from __future__ import annotations

import pytest
import torch

import nnprim
from nnprim.conv import gluon_conv
from nnprim.problems.conv import ConvProblem
from nnprim.search.context import get_solutions
from nnprim.search.solver import REGISTRY

BF16 = torch.bfloat16


def problem(x=(2, 64, 9, 11), w=(64, 64, 3, 3), **kw) -> ConvProblem:
    fields = dict(dtype=BF16, layout="nhwc", device="cpu", padding=1) | kw
    return ConvProblem.create("fwd", x, w, **fields)


def test_registered_as_deterministic_implicit_gemm_forward():
    s = REGISTRY.get(27)
    assert s is REGISTRY.get("gluon_implicit_gemm_fwd")
    assert s.family == "implicit_gemm" and s.deterministic and s.directions == frozenset({"fwd"})


def test_not_applicable_on_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("NNPRIM_GLUON", "1")   # past the off switch: the device reasons
    s = REGISTRY.get("gluon_implicit_gemm_fwd")
    reasons = " | ".join(s.not_supported_reasons(problem()))
    assert "not applicable" in reasons
    cuda = " | ".join(s.not_supported_reasons(problem(device="cuda")))
    assert "TRITON_INTERPRET" in cuda or "not applicable on device" in cuda


@pytest.mark.parametrize("needle,x,w,kw", [
    ("stride=(2, 2)", (1, 64, 9, 9), (64, 64, 3, 3), dict(stride=2)),
    ("groups=2", (1, 64, 9, 9), (64, 32, 3, 3), dict(groups=2)),
    ("layout=nchw", (1, 64, 9, 9), (64, 64, 3, 3), dict(layout="nchw")),
    ("dtype torch.float32", (1, 64, 9, 9), (64, 64, 3, 3), dict(dtype=torch.float32)),
    ("out_dtype torch.float32", (1, 64, 9, 9), (64, 64, 3, 3), dict(out_dtype=torch.float32)),
    ("C=24", (1, 24, 9, 9), (64, 24, 3, 3), {}),
    ("K=40", (1, 64, 9, 9), (40, 64, 3, 3), {}),
    ("ndim=3", (1, 64, 4, 9, 9), (64, 64, 3, 3, 3), {}),
    ("ndim=1", (1, 64, 9), (64, 64, 3), {}),
])
def test_each_unsupported_option_is_named(needle, x, w, kw):
    s = REGISTRY.get("gluon_implicit_gemm_fwd")
    reasons = " | ".join(s.not_supported_reasons(problem(x, w, device="cuda", **kw)))
    assert needle in reasons, (needle, reasons)


def test_registry_keeps_choosing_other_solvers_on_cpu():
    p = problem()
    names = [sol.solver for sol in get_solutions(p)]
    assert names and "gluon_implicit_gemm_fwd" not in names
    x = torch.randn(1, 32, 6, 7).to(BF16).to(memory_format=torch.channels_last)
    w = torch.randn(32, 32, 3, 3).to(BF16).to(memory_format=torch.channels_last)
    with pytest.raises(nnprim.NotSupportedError, match="gluon_implicit_gemm_fwd|not applicable"):
        nnprim.conv_forward(x, w, padding=1, solver="gluon_implicit_gemm_fwd")


@pytest.mark.parametrize("x,w", [
    ((32, 64, 56, 56), (64, 64, 3, 3)), ((32, 128, 28, 28), (128, 128, 3, 3)),
    ((32, 256, 14, 14), (256, 256, 3, 3)), ((32, 512, 7, 7), (512, 512, 3, 3)),
    ((32, 64, 56, 56), (256, 64, 1, 1)), ((8, 16, 33, 35), (48, 16, 7, 7)), ((4, 32, 3, 5), (16, 32, 5, 5)),
])
def test_tiles_fit_hopper(x, w):
    t = gluon_conv.tile_config(problem(x, w))
    assert t.smem_bytes() <= gluon_conv.SMEM_BYTES and t.STAGES >= 2
    assert t.BM in (64, 128) and t.BW >= 8 and t.warps in (4, 8)
    # accumulator: at most 128 f32 registers per consumer thread
    assert t.BM * t.BN // (t.warps * 32) <= 128
    assert t.BK <= w[1] or t.BK == 16
