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
    ("stride=(3, 3)", (1, 64, 9, 9), (64, 64, 3, 3), dict(stride=3)),
    ("no tile of whole groups", (1, 64, 9, 9), (64, 2, 3, 3), dict(groups=32)),
    ("layout=nchw", (1, 64, 9, 9), (64, 64, 3, 3), dict(layout="nchw")),
    ("dtype torch.float32", (1, 64, 9, 9), (64, 64, 3, 3), dict(dtype=torch.float32)),
    ("out_dtype torch.float32", (1, 64, 9, 9), (64, 64, 3, 3), dict(out_dtype=torch.float32)),
    ("C=24", (1, 24, 9, 9), (64, 24, 3, 3), {}),
    ("K=40", (1, 64, 9, 9), (40, 64, 3, 3), {}),
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
    ((8, 320, 64, 64), (320, 320, 3, 3)),   # 45 K steps: 256-row tiles, two warpgroups
])
def test_tiles_fit_hopper(x, w):
    t = gluon_conv.tile_config(problem(x, w))
    assert t.smem_bytes() <= gluon_conv.SMEM_BYTES and t.STAGES >= 2
    assert t.BM in (64, 128, 256) and t.BW >= 8 and t.warps in (4, 8)
    assert (t.BM == 256) == (x[1] == 320) and (t.BM < 256 or t.warps == 8)
    # accumulator: at most 128 f32 registers per consumer thread
    assert t.BM * t.BN // (t.warps * 32) <= 128
    assert t.BK <= w[1] or t.BK == 16


# ---- solvers 28 (backward data on the same kernel) and 29 (backward weights) ---------------
@pytest.mark.parametrize("x,w,kw", [
    ((2, 16, 9, 11), (32, 16, 3, 3), dict(padding=1)),
    ((1, 16, 8, 7), (16, 16, 5, 3), dict(padding=((2, 1), (0, 2)))),   # asymmetric
    ((2, 16, 12, 10), (32, 16, 3, 3), dict(padding=(2, 1), dilation=(2, 1))),
    ((2, 16, 6, 6), (16, 16, 3, 3), dict(padding=0)),
    ((2, 32, 5, 7), (48, 32, 1, 1), dict(padding=0)),
])
def test_backward_data_is_the_forward_view(x, w, kw):
    """Solver 28 runs the forward of dy with the flipped, channel-swapped filter on the
    padding forward_view computes: check that identity on CPU in float64."""
    from nnprim.conv.reference import conv_bwd_data_f64, conv_fwd_f64
    p = ConvProblem.create("bwd_data", x, w, dtype=torch.float64, layout="nhwc", device="cpu", **kw)
    fp = gluon_conv.forward_view(p)
    assert fp.direction == "fwd" and fp.x_shape == p.y_shape and fp.y_shape == p.x_shape
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(p.y_shape, generator=g, dtype=torch.float64)
    wt = torch.randn(p.w_shape, generator=g, dtype=torch.float64)
    flipped = wt.flip(-1, -2).transpose(0, 1)
    torch.testing.assert_close(conv_fwd_f64(fp, dy, flipped), conv_bwd_data_f64(p, dy, wt))


def test_backward_solvers_registered_and_name_what_they_do_not_cover():
    s28, s29 = REGISTRY.get(28), REGISTRY.get(29)
    assert s28.name == "gluon_implicit_gemm_bwd_data" and s28.directions == frozenset({"bwd_data"})
    assert s29.name == "gluon_implicit_gemm_bwd_weights" and s29.directions == frozenset({"bwd_weights"})
    assert s28.deterministic and s29.deterministic
    mk = lambda d, **kw: ConvProblem.create(d, (1, 64, 9, 9), (64, 64, 3, 3),  # noqa: E731
                                            **(dict(dtype=BF16, layout="nhwc", device="cuda") | kw))
    assert "stride=(3, 3)" in " | ".join(s28.not_supported_reasons(mk("bwd_data", padding=1, stride=3)))
    assert "negative padding" in " | ".join(s28.not_supported_reasons(mk("bwd_data", padding=3)))
    assert "stride=(3, 3)" in " | ".join(s29.not_supported_reasons(mk("bwd_weights", padding=1, stride=3)))
    # stride 2 (and (2, 1), (1, 2)): phased backward data, phase-view backward weights
    for st in (2, (2, 1), (1, 2)):
        assert not gluon_conv.shape_reasons(mk("bwd_data", padding=1, stride=st))
        assert not gluon_conv.shape_reasons(mk("bwd_weights", padding=1, stride=st))
        assert s28.estimate(mk("bwd_data", padding=1, stride=st)) is not None
        assert s29.estimate(mk("bwd_weights", padding=1, stride=st)) is not None
    assert not gluon_conv.shape_reasons(mk("bwd_data", padding=3, stride=2))   # phased: any padding
    tiny = ConvProblem.create("bwd_data", (1, 64, 1, 9), (64, 64, 1, 1), dtype=BF16, layout="nhwc", device="cuda",
                              stride=2)
    assert "empty stride phase" in " | ".join(s28.not_supported_reasons(tiny))
    assert "layout=nchw" in " | ".join(s29.not_supported_reasons(mk("bwd_weights", padding=1, layout="nchw")))


@pytest.mark.parametrize("x,w", [
    ((128, 64, 56, 56), (64, 64, 3, 3)), ((128, 64, 56, 56), (64, 64, 1, 1)), ((128, 256, 14, 14), (256, 256, 3, 3)),
    ((128, 512, 7, 7), (512, 512, 3, 3)), ((8, 640, 32, 32), (640, 640, 3, 3)), ((1, 16, 3, 5), (16, 16, 3, 3)),
    ((2048, 1024, 64, 64), (1024, 1024, 1, 1)),    # the workspace bound caps the split
])
def test_wgrad_plan_covers_every_pixel_once(x, w):
    from nnprim.conv import gluon_conv_wgrad as gw
    from nnprim.conv.implicit_gemm import geom
    from nnprim.conv.implicit_gemm_bwd import max_split
    p = ConvProblem.create("bwd_weights", x, w, dtype=BF16, layout="nhwc", device="cuda", padding=w[-1] // 2)
    t = gw.tile_config(p)
    assert t.STAGES >= 3 and t.STAGES * t.stage_bytes() + 2048 <= gluon_conv.SMEM_BYTES
    assert t.BM * t.BN // (t.warps * 32) <= 128
    split, tps, units = gw.plan_split(p, t, 132)
    gm = geom(p)
    nt = gm.N * -(-gm.out[1] // t.BH) * -(-gm.out[2] // t.BW)
    assert (split - 1) * tps < nt <= split * tps          # every slice non-empty, all pixels covered
    assert 1 <= split <= max_split(p)
    tiles = -(-gm.K // t.BM) * gm.taps * -(-gm.C // t.BN)
    assert units == tiles * split


@pytest.mark.parametrize("C,K,groups,want", [
    (128, 128, 32, (64, 64)), (144, 144, 144, (64, 64)), (256, 512, 32, (64, 32)), (128, 128, 2, (64, 64)),
    (256, 256, 2, (128, 128)), (96, 96, 32, None),     # Kg 3 divides neither 64 nor 128
])
def test_grouped_wgrad_tiles_hold_whole_groups(C, K, groups, want):
    from nnprim.conv import gluon_conv_wgrad as gw
    p = ConvProblem.create("bwd_weights", (2, C, 8, 8), (K, C // groups, 3, 3), dtype=BF16, layout="nhwc",
                           device="cuda", padding=1, groups=groups)
    assert gw.diag_tile(p) == want
    s = REGISTRY.get("gluon_implicit_gemm_bwd_weights")
    named = " | ".join(s.not_supported_reasons(p))
    assert ("no tile of whole groups" in named) == (want is None)


# ---- 3-D: output planes as the kernels' images, each depth tap reads its x plane -------------
@pytest.mark.parametrize("d,kw", [
    ("fwd", dict(padding=1)), ("fwd", dict(padding=1, stride=(3, 2, 2))), ("fwd", dict(padding=2, dilation=(2, 1, 1))),
    ("bwd_data", dict(padding=1)), ("bwd_weights", dict(padding=1)), ("bwd_weights", dict(padding=1, stride=2)),
])
def test_3d_problems_are_covered_and_planned_as_planes(d, kw):
    """3-D NDHWC: no shape reason (depth stride any, rows/columns stride 1 or 2); the plans
    describe x as [N*D, H, W, C] and y (dy) as [N*OD, OH, OW, K] and pass the depth geometry."""
    from nnprim.conv import gluon_conv_wgrad as gw
    p = ConvProblem.create(d, (2, 64, 7, 9, 10), (128, 64, 3, 3, 3), dtype=BF16, layout="nhwc", device="cuda", **kw)
    assert not gluon_conv.shape_reasons(p)
    (D, H, W), (OD, OH, OW) = p.in_size, p.out_size
    if d == "bwd_weights":
        plan = gw.GluonWgradPlan(p)
        assert plan.depth and plan.x_shape == (2 * D, H, W, 64) and plan.ddy[0] == [2 * OD, OH, OW, 128]
        assert plan.depth_args == (3, OD, D, p.stride[0], p.pad_before[0], p.dilation[0])
        t = plan.tile
        split, tps, units = gw.plan_split(p, t, 132)
        nt = 2 * OD * -(-OH // t.BH) * -(-OW // t.BW)      # rectangles of every output plane
        assert (split - 1) * tps < nt <= split * tps and units == -(-128 // t.BM) * 27 * -(-64 // t.BN) * split
        return
    plan = gluon_conv.GluonConvPlan(p)
    fp = gluon_conv.forward_view(p)
    (fD, fH, fW), (fOD, fOH, fOW) = fp.in_size, fp.out_size
    assert plan.depth and plan.x_shape == (2 * fD, fH, fW, fp.C) and plan.y_shape == (2 * fOD, fOH, fOW, fp.K)
    assert plan.scalars[0] == 2 * fOD and plan.scalars[-8:-2] == (3, fOD, fD, fp.stride[0], fp.pad_before[0],
                                                                fp.dilation[0])
    assert plan.n_tiles % (2 * fOD) == 0


def test_3d_options_the_kernels_do_not_cover_are_named():
    mk = lambda d, **kw: ConvProblem.create(d, (1, 64, 5, 9, 9), (64, 64, 3, 3, 3),  # noqa: E731
                                            **(dict(dtype=BF16, layout="nhwc", device="cuda", padding=1) | kw))
    assert "3-D backward data needs stride 1" in " | ".join(gluon_conv.shape_reasons(mk("bwd_data", stride=(2, 1, 1))))
    assert "stride 1 or 2 over rows and columns" in " | ".join(gluon_conv.shape_reasons(mk("fwd", stride=(1, 3, 1))))
    assert not gluon_conv.shape_reasons(mk("fwd", stride=(3, 1, 1)))


def test_3d_plane_arithmetic_matches_the_reference():
    """`_x_plane` in Python: the output plane n of image n // OD at depth tap td reads x plane
    img*D + od*sd - pd + td*dd, and only those inside 0..D-1 (the others are zeros); summing
    the per-tap 2-D products of those planes gives the reference 3-D convolution."""
    from nnprim.conv.reference import conv_fwd_f64
    g = torch.Generator().manual_seed(0)
    N, C, K, D, H, W, T = 2, 3, 4, 6, 5, 4, 3
    for sd, pd, dd in ((1, 1, 1), (2, 1, 1), (1, 2, 2), (3, 0, 1)):
        p = ConvProblem.create("fwd", (N, C, D, H, W), (K, C, T, 3, 3), dtype=torch.float64, device="cpu",
                               padding=(pd, 1, 1), stride=(sd, 1, 1), dilation=(dd, 1, 1))
        x = torch.randn(p.x_shape, generator=g, dtype=torch.float64)
        w = torch.randn(p.w_shape, generator=g, dtype=torch.float64)
        OD = p.out_size[0]
        planes = x.transpose(1, 2).reshape(N * D, C, H, W)
        y = torch.zeros(N * OD, K, H, W, dtype=torch.float64)
        for n in range(N * OD):
            img, od = divmod(n, OD)
            for td in range(T):
                iz = od * sd - pd + td * dd
                if 0 <= iz < D:
                    y[n] += torch.nn.functional.conv2d(planes[img * D + iz][None], w[:, :, td], padding=1)[0]
        torch.testing.assert_close(y.reshape(N, OD, K, H, W).transpose(1, 2), conv_fwd_f64(p, x, w))


def test_two_taps_a_unit_plan():
    """`taps2_tile`: TAPS 2, the ring refit to the larger stages, half the tap tiles (9 taps: 5),
    no stream-K (it runs one tap a tile)."""
    from nnprim.conv import gluon_conv_wgrad as gw
    p = ConvProblem.create("bwd_weights", (8, 64, 56, 56), (64, 64, 3, 3), dtype=BF16, layout="nhwc", device="cuda",
                           padding=1)
    t1, t2 = gw.tile_config(p), gw.taps2_tile(p)
    assert t2.TAPS == 2 and (t2.BM, t2.BN, t2.BP) == (t1.BM, t1.BN, t1.BP)
    assert t2.stage_bytes() == (t1.BM + 2 * t1.BN) * t1.BP * 2 and t2.STAGES * t2.stage_bytes() + 2048 <= gw.SMEM_BYTES
    split, tps, units = gw.plan_split(p, t2, 132)
    assert units == 5 * split
    assert "TAPS=2" in " | ".join(gw.stream_k_reasons(p, t2)) and not gw.use_stream_k(p, t2, 132)


def test_phased_backward_data_with_a_long_reduction_plans():
    """The phased launch plans its tile without an image count: a long reduction there keeps
    128-row tiles (the 256-row rule needs the tile count)."""
    p = ConvProblem.create("bwd_data", (2, 64, 128, 128), (512, 64, 3, 3), dtype=BF16, layout="nhwc", device="cuda",
                           padding=1, stride=2)
    plan = gluon_conv.GluonConvPlan(p)
    assert plan.phased and plan.tile.BM <= 128
    assert gluon_conv.wave_efficiency(0) == 0.0 and gluon_conv.wave_efficiency(133) == 133 / 264


def test_reasons_estimates_and_plans_never_raise():
    """Random conv problems (1-3 D, groups, strides, dilations, paddings, layouts, dtypes): the
    Gluon solvers name what they do not cover, estimate, size their workspace and plan (on
    CPU) without raising; a grouped backward data past the flipped padding once raised here."""
    import random

    from nnprim.conv import gluon_conv_wgrad
    from nnprim.errors import BadParameterError
    rng = random.Random(0)
    planned = 0
    for _ in range(600):
        nd, g = rng.choice([1, 2, 3]), rng.choice([1, 1, 2, 4, 8, 16, 32])
        cg, kg = rng.choice([4, 8, 16, 32, 48, 64]), rng.choice([4, 8, 16, 32, 48, 64])
        try:
            p = ConvProblem.create(rng.choice(["fwd", "bwd_data", "bwd_weights"]), (2, cg * g, *(rng.randint(1, 20)
                                   for _ in range(nd))), (kg * g, cg, *(rng.choice([1, 2, 3, 5]) for _ in range(nd))),
                                   dtype=rng.choice([BF16, torch.float16, torch.float32]),
                                   layout=rng.choice(["nhwc", "nchw"]), device="cuda", groups=g,
                                   stride=[rng.choice([1, 1, 2, 3]) for _ in range(nd)],
                                   dilation=[rng.choice([1, 1, 2]) for _ in range(nd)],
                                   padding=[rng.randint(0, 4) for _ in range(nd)])
        except BadParameterError:
            continue
        for sid in (27, 28, 29):
            s = REGISTRY.get(sid)
            if p.direction not in s.directions:
                continue
            s.not_supported_reasons(p)
            s.estimate(p)
            ok = not gluon_conv.shape_reasons(p) and not (
                sid == 29 and p.groups > 1 and gluon_conv_wgrad.diag_tile(p) is None)
            if ok:
                s.workspace_size(p)
                s.prepare(p)
                planned += 1
    assert planned >= 10
