"""Small-channel stem convolution (solvers 70/71/72) against the float64 reference,
through TRITON_INTERPRET=1, with NaN-poisoned outputs."""
import pytest
import torch

import nnprim
from nnprim.conv import stem
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search.solver import REGISTRY

from . import solver_check

RUN = {"fwd": stem.conv_fwd, "bwd_data": stem.conv_bwd_data, "bwd_weights": stem.conv_bwd_weights}
CASES = [
    ((2, 3, 11, 13), (16, 3, 7, 7), dict(padding=3, stride=2)),              # the ResNet stem, small
    ((1, 3, 9, 10), (24, 3, 5, 5), dict(padding=2)),
    ((2, 1, 7, 9), (16, 1, 3, 3), dict(padding=((0, 1), (2, 0)), stride=(2, 1))),
    ((1, 4, 10, 7), (40, 4, 3, 3), dict(padding=1, stride=2)),               # K tiled (BN 16 below)
    ((2, 3, 8, 9), (16, 3, 4, 4), dict(stride=4)),                           # patchify: no padding, no overlap
    ((2, 3, 15), (16, 3, 7), dict(padding=3, stride=2)),                     # 1D
]
SMALL = stem.StemTile(16, 16, 4, 1)


def check(p, bias=None, post_ops=(), tile=None):
    run = {d: (lambda p, a, out, f=f: f(p, a, tile, out)) for d, f in RUN.items()}
    solver_check.check(run, p, bias, post_ops, seed=3)


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_f32_vs_reference(direction, case):
    xs, ws, kw = case
    check(ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout="nhwc", **kw), tile=SMALL)


@pytest.mark.parametrize("direction", list(RUN))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_default_tiles(direction, dtype):
    check(ConvProblem.create(direction, *CASES[0][:2], dtype=dtype, layout="nhwc", **CASES[0][2]))


@pytest.mark.parametrize("direction", ["fwd", "bwd_weights"])
@pytest.mark.parametrize("case", CASES[:3], ids=solver_check.case_id)
def test_padded_channels(direction, case):
    """x read from a copy with C padded to a power of two (aligned rows)."""
    xs, ws, kw = case
    p = ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout="nhwc", **kw)
    check(p, tile=stem.StemTile(16, 16, 4, 1, cpad=True))


@pytest.mark.parametrize("direction", list(RUN))
def test_nchw(direction):
    xs, ws, kw = CASES[0]
    check(ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout="nchw", **kw), tile=SMALL)


def test_bwd_weights_many_slices(monkeypatch):
    """Pixel slices shorter than the image (several partials per image, a tail slice)."""
    monkeypatch.setattr(stem, "MIN_STEPS", 1)
    p = ConvProblem.create("bwd_weights", (3, 3, 13, 11), (16, 3, 7, 7), dtype=torch.float32, layout="nhwc",
                           padding=3, stride=2)
    tile = stem.StemTile(16, 16, 4, 1, waves=64)
    assert stem.StemBwdWeightsPlan(p, tile).ws_shape[0] > 3
    check(p, tile=tile)


def test_bwd_weights_row_blocks():
    """Filter rows in blocks of 2 (acc_cols 64 of a 32-column run): 4 programs per channel
    block, the last one half past the filter."""
    p = ConvProblem.create("bwd_weights", (2, 3, 11, 13), (24, 3, 7, 7), dtype=torch.float32, layout="nhwc",
                           padding=3, stride=2)
    check(p, tile=stem.StemTile(16, 16, 4, 1, acc_cols=64))


def test_fused_epilogue():
    g = torch.Generator().manual_seed(4)
    y = (2, 16, 6, 7)
    chain = (Sum(to_layout(torch.randn(y, generator=g), "nhwc"), 0.5),
             Binary("mul", torch.randn(1, 16, 1, 1, generator=g)), Eltwise("relu", 0.1))
    p = ConvProblem.create("fwd", (2, 3, 11, 13), (16, 3, 7, 7), dtype=torch.float32, layout="nhwc",
                           padding=3, stride=2, has_bias=True, post_ops=tuple(o.signature() for o in chain))
    check(p, bias=torch.randn(16, generator=g), post_ops=chain, tile=SMALL)


def test_strided_views():
    """Inputs that are views (a channel slice of a wider tensor) take a strided plan."""
    g = torch.Generator().manual_seed(5)
    wide = to_layout(torch.randn(2, 5, 11, 13, generator=g), "nhwc")
    x = wide[:, 1:4]
    w = to_layout(torch.randn(16, 3, 7, 7, generator=g), "nhwc")
    y = nnprim.conv_forward(x, w, stride=2, padding=3, solver="stem_fwd")
    ref = torch.nn.functional.conv2d(x.double(), w.double(), stride=2, padding=3)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
    dy = to_layout(torch.randn(ref.shape, generator=g), "nhwc")
    dw = nnprim.conv_backward_weights(dy, x, tuple(w.shape), stride=2, padding=3, solver="stem_bwd_weights")
    ref_dw = torch.ops.aten.convolution_backward(dy.double(), x.double(), w.double(), None, [2, 2], [3, 3], [1, 1],
                                                 False, [0, 0], 1, [False, True, False])[1]
    assert ((dw.double() - ref_dw).norm() / ref_dw.norm()).item() < 1e-5


def test_dy_window():
    """Stem: per 2x2 dx block, dy rows qh-1..qh+2 (4 rows; 3 taps for phase 0, 4 for phase 1)."""
    assert stem.dy_window(7, 2, 3) == (-1, 4)
    assert stem.dy_window(3, 1, 1) == (-1, 3)
    assert stem.dy_window(4, 4, 0) == (0, 1)


def test_applicability():
    p = ConvProblem.create("fwd", (128, 3, 224, 224), (64, 3, 7, 7), dtype=torch.bfloat16, layout="nhwc",
                           padding=3, stride=2, device="cpu")
    for sid, d in ((70, "fwd"), (71, "bwd_data"), (72, "bwd_weights")):
        s = REGISTRY.get(sid)
        q = p.with_direction(d)
        assert s.family == "implicit_gemm" and s.is_applicable(q), s.not_supported_reasons(q)
        ig = REGISTRY.get({"fwd": 20, "bwd_data": 21, "bwd_weights": 22}[d])
        assert s.estimate(q) < ig.estimate(q)     # immediate mode prefers it for the stem
    wide = ConvProblem.create("fwd", (1, 64, 8, 8), (64, 64, 3, 3), dtype=torch.float32)
    assert any("S*C" in r for r in REGISTRY.get(70).not_supported_reasons(wide))
    for kw, word in ((dict(groups=3), "groups"), (dict(dilation=2), "dilation")):
        q = ConvProblem.create("fwd", (1, 3, 8, 8), (3, 3 // kw.get("groups", 1), 3, 3), dtype=torch.float32, **kw)
        assert any(word in r for r in REGISTRY.get(70).not_supported_reasons(q))
    d3 = ConvProblem.create("fwd", (1, 3, 4, 8, 8), (8, 3, 3, 3, 3), dtype=torch.float32)
    assert any("3D" in r for r in REGISTRY.get(70).not_supported_reasons(d3))
    fold = ConvProblem.create("bwd_data", (1, 8, 16, 16), (8, 8, 4, 4), dtype=torch.float32, stride=4)
    assert any("phase-folded" in r for r in REGISTRY.get(71).not_supported_reasons(fold))


def test_gemm_estimate_prices_short_column_runs():
    """The im2col copy of an RGB stem moves 6-byte runs: gemm_* must not look 4x faster
    than it runs (H200: backward weights 2.0 ms measured, 0.45 estimated at full bandwidth)."""
    p = ConvProblem.create("bwd_weights", (128, 3, 224, 224), (64, 3, 7, 7), dtype=torch.bfloat16,
                           layout="nhwc", padding=3, stride=2, device="cuda")
    assert 1.5 < REGISTRY.get("gemm_bwd_weights").estimate(p) > REGISTRY.get(72).estimate(p)


def test_flat_walk_caps_only_the_tensor_core_rate():
    """Solver 20's flat walk over RGB channels caps its tensor-core rate, not its bytes: a
    patchify stem (convnext 4x4 / 4, 0.46 GFLOP in 14 MB) ran 0.047 ms on the H200 against
    stem_fwd's 0.077 (2026-12-02), while the 7x7 / 2 ResNet stem stays stem_fwd's (0.47 against
    2.1 ms)."""
    patchify = ConvProblem.create("fwd", (16, 3, 224, 224), (96, 3, 4, 4), dtype=torch.bfloat16,
                                  layout="nhwc", stride=4, device="cuda")
    rn50 = ConvProblem.create("fwd", (128, 3, 224, 224), (64, 3, 7, 7), dtype=torch.bfloat16,
                              layout="nhwc", padding=3, stride=2, device="cuda")
    ig, st = REGISTRY.get("implicit_gemm_fwd"), REGISTRY.get("stem_fwd")
    assert ig.estimate(patchify) < 0.06 and ig.estimate(patchify) < st.estimate(patchify)
    assert ig.estimate(rn50) > 3 * st.estimate(rn50)
    # NCHW's channel-strided gathers keep their price on the capped rate
    nchw = ConvProblem.create("fwd", (128, 3, 224, 224), (64, 3, 7, 7), dtype=torch.bfloat16,
                              layout="nchw", padding=3, stride=2, device="cuda")
    assert ig.estimate(nchw) >= ig.estimate(rn50)
