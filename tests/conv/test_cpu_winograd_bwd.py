"""CPU Winograd backward data (solver 15) and backward weights (solver 16) against the float64 reference: NaN-poisoned
workspace and output, random never-zero inputs, odd sizes (partial tiles), padding 0/1/2
and asymmetric, both layouts, F(2x2) and F(4x4), f32/bf16 and out_dtype; applicability,
the public API and the suite ranking."""
import json
from pathlib import Path

import pytest
import torch

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv import cpu_winograd as cw
from nnprim.conv import reference as ref
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search.ranking import heuristic_order

from . import solver_check

# every test on both transform paths (tests/conv/conftest.py)
pytestmark = pytest.mark.usefixtures("winograd_transforms")


SOLVER = cw.CpuWinogradBwdData()
WSOLVER = cw.CpuWinogradBwdWeights()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    solver_check.poison_cpu(monkeypatch, cw)


def rnd(shape, dtype, layout, g):
    t = torch.randn(shape, generator=g)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.3), t)
    return to_layout(t.to(dtype), layout)


CASES = {   # x shape, K, padding
    "odd_pad1": ((2, 3, 7, 9), 5, 1),
    "no_pad": ((1, 4, 6, 11), 3, 0),
    "pad2": ((1, 2, 4, 3), 4, 2),
    "asym": ((2, 5, 9, 10), 6, ((2, 0), (1, 2))),
    "wide_tails": ((2, 18, 6, 35), 19, 1),    # > 16 channels, filters, columns: nchw transposes
}


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", list(CASES))
def test_bwd_data(case, layout, m):
    xs, K, pad = CASES[case]
    g = torch.Generator().manual_seed(sum(xs) + K + m)
    w = rnd((K, xs[1], 3, 3), torch.float32, layout, g)
    p = ConvProblem.create("bwd_data", xs, w.shape, dtype=torch.float32, layout=layout, padding=pad)
    assert SOLVER.is_applicable(p), SOLVER.not_supported_reasons(p)
    dy = rnd(p.y_shape, torch.float32, layout, g)
    dx = cw.prepare_bwd_data_with(p, m)(ConvArgs(dy=dy, w=w))
    exp = ref.conv_bwd_data_f64(p, dy, w)
    assert dx.shape == exp.shape and dx.dtype == torch.float32
    assert not torch.isnan(dx).any(), "unwritten (poisoned) elements remain"
    assert ((dx.double() - exp).norm() / exp.norm()).item() < TOL[torch.float32]


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None),
                                             (torch.bfloat16, torch.float32)])
def test_dtypes(dtype, out_dtype):
    g = torch.Generator().manual_seed(3)
    w = rnd((6, 4, 3, 3), dtype, "nhwc", g)
    p = ConvProblem.create("bwd_data", (2, 4, 8, 7), w.shape, dtype=dtype, out_dtype=out_dtype,
                           layout="nhwc", padding=1)
    dy = rnd(p.y_shape, dtype, "nhwc", g)
    dx = SOLVER.prepare(p)(ConvArgs(dy=dy, w=w))
    exp = ref.conv_bwd_data_f64(p, dy, w)
    assert dx.dtype == p.out_dtype and not torch.isnan(dx).any()
    tol = TOL[torch.bfloat16 if torch.bfloat16 in (dtype, p.out_dtype) else torch.float32]
    assert ((dx.double() - exp).norm() / exp.norm()).item() < tol


@pytest.mark.parametrize("kw,why", [
    (dict(stride=2), "stride"),
    (dict(dilation=2), "dilation"),
    (dict(w=(6, 1, 3, 3), groups=3), "groups"),
    (dict(padding=3), "padding"),
    (dict(w=(4, 3, 1, 1), padding=0), "filter"),
    (dict(w=(4, 3, 5, 5)), "filter"),
    (dict(x=(2, 3, 10), w=(4, 3, 3)), "2-D"),
    (dict(direction="fwd"), "direction"),
])
def test_not_applicable(kw, why):
    kw = dict(kw)
    x, w, d = kw.pop("x", (2, 3, 10, 10)), kw.pop("w", (4, 3, 3, 3)), kw.pop("direction", "bwd_data")
    p = ConvProblem.create(d, x, w, dtype=torch.float32, **kw)
    reasons = SOLVER.not_supported_reasons(p)
    assert reasons and any(why in r for r in reasons), reasons


def test_public_api_forced_and_deterministic():
    g = torch.Generator().manual_seed(5)
    w = rnd((4, 3, 3, 3), torch.float32, "nchw", g)
    dy = rnd((2, 4, 8, 7), torch.float32, "nchw", g)
    dx = nnprim.conv_backward_data(dy, w, (2, 3, 8, 7), padding=1, solver="cpu_winograd_bwd_data")
    dx2 = nnprim.conv_backward_data(dy, w, (2, 3, 8, 7), padding=1, solver=15)
    assert torch.equal(dx, dx2) and SOLVER.deterministic and SOLVER.family == "winograd"
    exp = torch.nn.grad.conv2d_input((2, 3, 8, 7), w.double(), dy.double(), padding=1)
    assert ((dx.double() - exp).norm() / exp.norm()).item() < 1e-5


def test_heuristic_ranks_it_first_on_the_suite_3x3_f32():
    suite = json.loads((Path(nnprim.__file__).parent / "data" / "suites" / "conv_cpu.json").read_text())
    n = 0
    for s in suite["problems"]:
        p = ConvProblem.create("bwd_data", (s["N"], s["C"], *s["spatial"]),
                               (s["K"], s["C"] // s["groups"], *s["filter"]), stride=s["stride"],
                               padding=s["padding"], dilation=s["dilation"], groups=s["groups"],
                               layout=s["layout"], dtype=torch.float32)
        first = heuristic_order(p)[0]
        if SOLVER.is_applicable(p):
            n += 1
            assert first.id == 15, (s["name"], first)
        else:
            assert first.id != 15
    assert n == 4      # the three 2-D 3x3 problems and c3d_small


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", list(CASES))
def test_bwd_weights(case, layout, m):
    xs, K, pad = CASES[case]
    g = torch.Generator().manual_seed(sum(xs) + K + m + 1)
    x = rnd(xs, torch.float32, layout, g)
    p = ConvProblem.create("bwd_weights", xs, (K, xs[1], 3, 3), dtype=torch.float32, layout=layout, padding=pad)
    assert WSOLVER.is_applicable(p), WSOLVER.not_supported_reasons(p)
    dy = rnd(p.y_shape, torch.float32, layout, g)
    dw = cw.prepare_bwd_weights_with(p, m)(ConvArgs(x=x, dy=dy))
    exp = ref.conv_bwd_weights_f64(p, dy, x)
    assert dw.shape == exp.shape and dw.dtype == torch.float32 and not torch.isnan(dw).any()
    assert ((dw.double() - exp).norm() / exp.norm()).item() < TOL[torch.float32]
    if layout == "nhwc":
        assert dw.is_contiguous(memory_format=torch.channels_last)


def test_bwd_weights_row_blocks_and_dtypes():
    """Blocks of tile rows (a tiny block budget) accumulate across blocks; bf16 in, f32 out."""
    g = torch.Generator().manual_seed(11)
    for dtype, out_dtype, bb in ((torch.float32, None, 1), (torch.bfloat16, torch.float32, None),
                                 (torch.bfloat16, None, None)):
        x = rnd((3, 4, 13, 10), dtype, "nchw", g)
        p = ConvProblem.create("bwd_weights", x.shape, (5, 4, 3, 3), dtype=dtype, out_dtype=out_dtype,
                               padding=((1, 2), (0, 1)))
        dy = rnd(p.y_shape, dtype, "nchw", g)
        inv = cw.prepare_bwd_weights_with(p, 2, bb)
        if bb:
            assert len(inv.plan.blocks) > p.N
        dw = inv(ConvArgs(x=x, dy=dy))
        exp = ref.conv_bwd_weights_f64(p, dy, x)
        assert dw.dtype == p.out_dtype and not torch.isnan(dw).any()
        tol = TOL[torch.bfloat16 if torch.bfloat16 == p.out_dtype else torch.float32]
        assert ((dw.double() - exp).norm() / exp.norm()).item() < tol


def test_bwd_weights_api_and_ranking():
    g = torch.Generator().manual_seed(6)
    x, dy = rnd((2, 3, 8, 7), torch.float32, "nhwc", g), rnd((2, 4, 8, 7), torch.float32, "nhwc", g)
    dw = nnprim.conv_backward_weights(dy, x, (4, 3, 3, 3), padding=1, solver="cpu_winograd_bwd_weights")
    exp = torch.nn.grad.conv2d_weight(x.double(), (4, 3, 3, 3), dy.double(), padding=1)
    assert ((dw.double() - exp).norm() / exp.norm()).item() < 1e-5 and WSOLVER.deterministic
    assert any("stride" in r for r in WSOLVER.not_supported_reasons(
        ConvProblem.create("bwd_weights", (2, 3, 8, 8), (4, 3, 3, 3), stride=2, dtype=torch.float32)))
    suite = json.loads((Path(nnprim.__file__).parent / "data" / "suites" / "conv_cpu.json").read_text())
    n = 0
    for s in suite["problems"]:
        p = ConvProblem.create("bwd_weights", (s["N"], s["C"], *s["spatial"]),
                               (s["K"], s["C"] // s["groups"], *s["filter"]), stride=s["stride"],
                               padding=s["padding"], dilation=s["dilation"], groups=s["groups"],
                               layout=s["layout"], dtype=torch.float32)
        if WSOLVER.is_applicable(p):
            n += 1
            assert heuristic_order(p)[0].id == 16, s["name"]
    assert n == 4      # the three 2-D 3x3 problems and c3d_small


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_keeps_the_native_gemm(threads, monkeypatch):
    """bf16 backward of the suite's 3x3 problems ranks a native-bf16 GEMM solver first: the
    im2col / per-tap GEMMs (10-13) or the native brgemm solvers (80-82), not Winograd (which
    computes in f32: measured 0.43x torch against 0.71 at 2 threads)."""
    monkeypatch.setattr(cw, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("nnprim.conv.cpu_gemm.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("nnprim.conv.cpu_tap.cpu_has_native_bf16", lambda: True)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for d, first in (("bwd_data", {11, 81}), ("bwd_weights", {13, 82}), ("fwd", {10, 80})):
            p = ConvProblem.create(d, (8, 64, 56, 56), (64, 64, 3, 3), padding=1, dtype=torch.bfloat16)
            assert heuristic_order(p)[0].id in first, (d, threads, heuristic_order(p)[0])
    finally:
        torch.set_num_threads(old)


CASES3 = {   # 3-D: x shape, K, padding (2-D Winograd over (H, W), depth taps as accumulating GEMMs)
    "odd_asym": ((2, 3, 4, 7, 9), 5, ((1, 0), (0, 2), (1, 1))),
    "pad2": ((1, 4, 3, 5, 6), 3, 2),
    "wide": ((1, 17, 3, 5, 18), 18, 1),
    # K (and for backward data C) multiples of 16: the fused pass sums the depth taps
    "fused_fwd": ((2, 3, 4, 7, 9), 16, ((1, 0), (0, 2), (1, 1))),
    "fused_both": ((1, 16, 3, 5, 18), 32, 1),
}


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", list(CASES3))
def test_3d_all_directions(case, layout, m):
    xs, K, pad = CASES3[case]
    g = torch.Generator().manual_seed(sum(xs) + K + m)
    x, w = rnd(xs, torch.float32, layout, g), rnd((K, xs[1], 3, 3, 3), torch.float32, layout, g)
    b = torch.randn(K, generator=g)
    p = ConvProblem.create("fwd", xs, w.shape, dtype=torch.float32, layout=layout, padding=pad, has_bias=True)
    pd, pw = p.with_direction("bwd_data"), p.with_direction("bwd_weights")
    dy = rnd(p.y_shape, torch.float32, layout, g)
    assert cw.CpuWinogradFwd().is_applicable(p) and SOLVER.is_applicable(pd) and WSOLVER.is_applicable(pw)
    y = cw.prepare_with(p, m, 1)(ConvArgs(x=x, w=w, bias=b))          # tiny blocks: one tile row each
    dx = cw.prepare_bwd_data_with(pd, m)(ConvArgs(dy=dy, w=w))
    dw = cw.prepare_bwd_weights_with(pw, m, 1)(ConvArgs(x=x, dy=dy))
    for out, exp in ((y, ref.conv_fwd_f64(p, x, w, b, ())), (dx, ref.conv_bwd_data_f64(pd, dy, w)),
                     (dw, ref.conv_bwd_weights_f64(pw, dy, x))):
        assert out.shape == exp.shape and not torch.isnan(out).any()
        assert ((out.double() - exp).norm() / exp.norm()).item() < TOL[torch.float32]
        if layout == "nhwc":
            assert out.is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("case", ["odd_asym", "fused_fwd"])
def test_3d_post_ops(layout, dtype, out_dtype, case):
    """The chain on each block of the 3-D forward: a full residual, per-channel, per-depth and
    per-tensor operands, eltwise ops; bias; tiny blocks (one tile row each); blocked and fused."""
    from nnprim.post_ops import Binary, Eltwise, Sum
    xs, K, pad = CASES3[case]
    g = torch.Generator().manual_seed(7)
    x, w = rnd(xs, dtype, layout, g), rnd((K, xs[1], 3, 3, 3), dtype, layout, g)
    b = torch.randn(K, generator=g)
    p0 = ConvProblem.create("fwd", xs, w.shape, dtype=dtype, layout=layout, padding=pad)
    ops = (Sum(to_layout(torch.randn(p0.y_shape, generator=g), layout).to(dtype), 0.5), Eltwise("relu", 0.1),
           Binary("mul", torch.rand(1, K, 1, 1, 1, generator=g) + 0.5),
           Binary("add", torch.randn(1, 1, p0.y_shape[2], 1, 1, generator=g)),
           Binary("max", torch.full((1, 1, 1, 1, 1), -0.2)), Eltwise("tanh"))
    p = ConvProblem.create("fwd", xs, w.shape, dtype=dtype, layout=layout, padding=pad, has_bias=True,
                           out_dtype=out_dtype, post_ops=tuple(o.signature() for o in ops))
    assert cw.CpuWinogradFwd().is_applicable(p), cw.CpuWinogradFwd().not_supported_reasons(p)
    for m in (2, 4):
        y = cw.prepare_with(p, m, 1)(ConvArgs(x=x, w=w, bias=b, post_ops=ops))
        exp = ref.conv_fwd_f64(p, x, w, b, ops)
        assert y.dtype == p.out_dtype and not torch.isnan(y).any()
        assert ((y.double() - exp).norm() / exp.norm()).item() < TOL[p.out_dtype]
