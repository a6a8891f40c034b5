"""Native per-tap brgemm convolution (solvers 80-82) against the float64 reference: every
direction, strides (phases), dilation, asymmetric padding, groups, 1-3D, both layouts, bias
and post-ops; NaN-poisoned outputs, random never-zero inputs. bf16 errors are bounded by the
error of rounding the exact result to bf16 (one rounding: f32 accumulation); f32 to f32
rounding. Every kernel path runs: the own AMX kernel, torch's brgemm on VNNI blocks, and the
plain layout (oneDNN's GEMM)."""

from dataclasses import replace

import pytest
import torch

from nnprim.args import ConvArgs
from nnprim.conv import cpu_brgemm
from nnprim.conv.cpu_brgemm import CpuBrgemmBwdData, CpuBrgemmBwdWeights, CpuBrgemmFwd, runs_of
from nnprim.conv.reference import reference
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout

from . import solver_check

pytestmark = pytest.mark.skipif(cpu_brgemm.LIBRARY.ops() is None, reason="native CPU library unavailable")

SHAPES = {
    "2d_3x3_pad": ((2, 6, 9, 11), (4, 6, 3, 3), dict(padding=1)),
    "2d_asym_dil_g2": ((3, 8, 7, 9), (4, 4, 3, 2), dict(padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2)),
    "2d_no_pad_tail": ((1, 4, 6, 5), (6, 4, 2, 4), {}),
    "2d_1x1": ((2, 8, 5, 3), (6, 8, 1, 1), {}),
    "2d_pad_over_span": ((2, 4, 5, 6), (2, 4, 1, 1), dict(padding=(1, (0, 2)))),
    "1d": ((2, 4, 15), (6, 4, 3), dict(padding=((2, 1),), dilation=2)),
    "3d_g2": ((2, 4, 5, 6, 7), (6, 2, 3, 1, 2), dict(groups=2, padding=1)),
    "s2_3x3_pad1": ((2, 6, 9, 11), (4, 6, 3, 3), dict(stride=2, padding=1)),
    "s2_d2_asym": ((1, 4, 9, 8), (4, 4, 3, 2), dict(stride=(2, 3), dilation=2, padding=((2, 0), (1, 2)))),
    "s3_1x1_g2": ((2, 4, 10, 7), (6, 2, 1, 1), dict(stride=3, groups=2)),
    "3d_s2_tail": ((1, 4, 5, 6, 7), (4, 4, 3, 2, 3), dict(stride=(2, 1, 3), padding=(1, 0, 2))),
    "1d_long": ((1, 4, 1500), (6, 4, 5), dict(padding=2, stride=2)),    # lines cut into segments
    "g4_c16_merged": ((2, 64, 7, 6), (32, 16, 3, 3), dict(padding=1, groups=4)),   # AMX: pairs of groups
    "g2_c48": ((2, 96, 5, 6), (64, 48, 3, 1), dict(padding=(1, 0), groups=2, stride=(2, 1))),
    "amx_c64_k40": ((2, 64, 9, 11), (40, 64, 3, 3), dict(padding=1)),     # AMX forward, a 32-column tail
    "amx_c32_k96_s2": ((2, 32, 9, 8), (96, 32, 3, 3), dict(padding=1, stride=2)),   # AMX both ways, phases
    "wide_k70": ((2, 66, 6, 7), (70, 66, 3, 3), dict(padding=1)),       # K and C past one 64-column block
    # wider channel blocks per group: 48 = 32 + 16 columns (fwd Kg), 32 (bwd_data Cg), 16 only
    "f32_k48_g2": ((2, 64, 9, 11), (96, 32, 3, 3), dict(padding=1, groups=2)),
    "f32_k16_s2": ((2, 16, 13, 8), (16, 16, 3, 3), dict(stride=2, padding=(1, 2), dilation=(1, 2))),
    # x read in place (nhwc forward, stride-2 3-wide pad-1 last dim): a 40-column tail, lines of
    # 35 outputs (a 32-row step and a 3-row one) under dilated rows, 3-D with halo planes
    "s2_in_place": ((2, 32, 7, 10), (40, 32, 3, 3), dict(stride=2, padding=1)),
    "s2_in_place_wide": ((1, 64, 7, 70), (32, 64, 3, 3), dict(stride=(1, 2), padding=(0, 1), dilation=(2, 1))),
    "s2_in_place_3d": ((1, 32, 4, 5, 12), (16, 32, 2, 3, 3), dict(stride=(2, 1, 2), padding=1)),
    "1d_segments": ((1, 4, 5000), (6, 4, 3), dict(padding=1)),    # lines of 5 segments
    # stride-1 in place: odd H and W, K past one 64-column block with a tail; blocks of several
    # lines next to the top / bottom halo lines; W of 2, 3 (every column a border one; W = 1 is
    # staged); a right pad of 0; 3-D with strided, dilated leading dims; 1-D
    "s1_in_place": ((3, 32, 9, 9), (72, 32, 3, 3), dict(padding=1)),
    "s1_in_place_w1": ((2, 64, 5, 1), (40, 64, 3, 3), dict(padding=1)),
    "s1_in_place_w2": ((2, 32, 4, 2), (24, 32, 3, 3), dict(padding=1)),
    "s1_in_place_w3_pad0": ((2, 32, 7, 3), (48, 32, 3, 3), dict(padding=(1, (1, 0)))),
    "s1_in_place_wide": ((1, 32, 6, 37), (16, 32, 3, 3), dict(padding=(2, 1), dilation=(2, 1), stride=(2, 1))),
    "s1_in_place_3d": ((2, 32, 4, 5, 7), (16, 32, 2, 3, 3), dict(stride=(2, 1, 1), padding=1)),
    "s1_in_place_1d": ((2, 32, 45), (20, 32, 3), dict(padding=1)),
    "s1_in_place_75_rows": ((1, 4, 6, 16, 9), (6, 4, 5, 15, 3), dict(padding=(2, 7, 1))),   # > 64 filter rows
    "s1_pad2_staged": ((1, 32, 5, 6), (16, 32, 3, 3), dict(padding=(1, (1, 2)))),
    "s1_dil2_staged": ((1, 32, 5, 8), (16, 32, 3, 3), dict(padding=1, dilation=(1, 2))),
}
IN_PLACE = ["s2_in_place", "s2_in_place_wide", "s2_in_place_3d", "amx_c32_k96_s2", "s1_in_place", "s1_in_place_w2",
            "s1_in_place_w3_pad0", "s1_in_place_wide", "s1_in_place_3d", "s1_in_place_1d", "amx_c64_k40",
            "s1_in_place_75_rows"]
# forward shapes the in-place path does not cover (staged): bf16 channels off 32s, groups, a
# right pad of 2, a dilated or 2-wide last dim, a 1x1, one column
STAGED = {"2d_3x3_pad": torch.bfloat16, "wide_k70": torch.bfloat16, "g4_c16_merged": torch.bfloat16,
          "s1_pad2_staged": None, "s1_in_place_w1": None, "s1_dil2_staged": None, "2d_asym_dil_g2": None, "2d_1x1": None}
SOLVERS = {"fwd": CpuBrgemmFwd, "bwd_data": CpuBrgemmBwdData, "bwd_weights": CpuBrgemmBwdWeights}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    solver_check.poison_cpu(monkeypatch, cpu_brgemm)


@pytest.fixture(params=["amx", "vnni", "vnni_brgemm", "plain"])
def b_layout(request, monkeypatch):
    """amx: the own AMX forward kernel where it applies; vnni: torch's brgemm on VNNI blocks
    (what CPUs with avx512_bf16 and no AMX run; their backward weights: cpu_wgrad's kernel);
    vnni_brgemm: backward weights through torch's brgemm too; plain: the plain-layout brgemm
    (odd depths)."""
    if request.param == "amx" and not cpu_brgemm.cpu_has_amx():
        pytest.skip("no AMX: the AMX kernel does not run here")
    if request.param.startswith("vnni") and not cpu_brgemm.cpu_has_native_bf16():
        pytest.skip("no native bf16: the VNNI path does not run here")
    if request.param.startswith("vnni"):
        monkeypatch.setattr(cpu_brgemm, "USE_AMX_KERNEL", False)
    if request.param == "vnni_brgemm":
        if getattr(request.node, "callspec", None) is None or \
                request.node.callspec.params.get("direction") != "bwd_weights":
            pytest.skip("vnni_brgemm: backward weights only (the other directions run as vnni)")
        monkeypatch.setattr(cpu_brgemm, "USE_OWN_WGRAD", False)
    if request.param == "plain":
        monkeypatch.setattr(cpu_brgemm, "vnni", lambda p: False)
    return request.param


@pytest.fixture(params=["default", "whole"])
def x_path(request, monkeypatch):
    """How the forward reads x: default (in place where `reads_in_place`); whole: staged first."""
    if request.param == "whole":
        monkeypatch.setattr(cpu_brgemm, "reads_in_place", lambda p: False)
    return request.param


def make(direction, x_shape, w_shape, layout, dtype, **kw):
    return solver_check.random_case(direction, x_shape, w_shape, layout=layout, dtype=dtype, **kw)


def check(p, args, out, ref):
    shape = {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weights": p.w_shape}[p.direction]
    assert tuple(out.shape) == shape and out.dtype == p.out_dtype
    assert not out.isnan().any(), "unwritten (NaN) elements"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if p.out_dtype == torch.float32:
        assert err < 2e-6, err
    else:
        one_rounding = ((ref.to(p.out_dtype).double() - ref).norm() / ref.norm()).item()
        assert err <= 1.5 * one_rounding + 1e-6, (err, one_rounding)


@pytest.mark.parametrize("direction", list(SOLVERS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16(shape, layout, direction, b_layout, x_path):
    if x_path != "default" and direction != "fwd":
        pytest.skip("x staged whole: the forward's choice")
    xs, ws, kw = SHAPES[shape]
    p, args = make(direction, xs, ws, layout, torch.bfloat16, **kw)
    assert SOLVERS[direction]().is_applicable(p), SOLVERS[direction]().not_supported_reasons(p)
    check(p, args, SOLVERS[direction]().prepare(p)(args), reference(p, args))


@pytest.mark.parametrize("direction", list(SOLVERS))
@pytest.mark.parametrize("shape", ["2d_asym_dil_g2", "s2_d2_asym", "3d_s2_tail", "f32_k48_g2", "f32_k16_s2",
                                   "s2_in_place", "s2_in_place_3d", "1d_segments", "s1_in_place", "s1_in_place_w1",
                                   "s1_in_place_w3_pad0", "s1_in_place_wide", "s1_in_place_3d", "s1_in_place_1d"])
def test_f32(shape, direction, x_path):
    if x_path != "default" and direction != "fwd":
        pytest.skip("x staged whole: the forward's choice")
    xs, ws, kw = SHAPES[shape]
    p, args = make(direction, xs, ws, "nhwc", torch.float32, **kw)
    check(p, args, SOLVERS[direction]().prepare(p)(args), reference(p, args))


@pytest.mark.parametrize("direction", ["bwd_data", "bwd_weights"])
def test_f32_output_of_bf16(direction):
    xs, ws, kw = SHAPES["s2_3x3_pad1"]
    p, args = make(direction, xs, ws, "nchw", torch.bfloat16, out_dtype=torch.float32, **kw)
    out = SOLVERS[direction]().prepare(p)(args)
    ref = reference(p, args)
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bias_and_post_ops(layout, b_layout):
    xs, ws, kw = SHAPES["s2_3x3_pad1"]
    res = to_layout(torch.randn(2, 4, 5, 6).bfloat16(), layout)
    post = (Sum(res), Eltwise("relu"))
    p = ConvProblem.create("fwd", xs, ws, dtype=torch.bfloat16, layout=layout, has_bias=True, post_ops=post, **kw)
    _, args = make("fwd", xs, ws, layout, torch.bfloat16, **kw)
    args = ConvArgs(x=args.x, w=args.w, bias=torch.randn(4).bfloat16(), post_ops=post)
    check(p, args, CpuBrgemmFwd().prepare(p)(args), reference(p, args))


def _residual(shape, dtype, kind):
    """A y-shaped residual in NHWC memory: dense, or a strided slice of a wider buffer."""
    g = torch.Generator().manual_seed(9)
    if kind == "dense":
        return to_layout(torch.randn(shape, generator=g).to(dtype), "nhwc")
    n, k, h, w = shape
    wide = torch.randn(n, h, w + 3, k + 5, generator=g).to(dtype)     # (N, H, W', K') storage
    return wide[:, :, 1:w + 1, 2:k + 2].permute(0, 3, 1, 2)


CHAINS = {   # (post-ops builder, runs in the native row epilogue)
    "sum_bf16_scaled_leaky": (lambda r: (Sum(r, 0.5), Eltwise("relu", 0.1)), True),
    "binary_add_relu": (lambda r: (Binary("add", r), Eltwise("relu")), True),
    "sum_only": (lambda r: (Sum(r, -2.0),), True),
    "relu_only": (lambda r: (Eltwise("relu"),), True),
    "relu_then_sum": (lambda r: (Eltwise("relu"), Sum(r)), False),
    "sum_then_tanh": (lambda r: (Sum(r), Eltwise("tanh")), False),
}


@pytest.mark.parametrize("shape", ["s2_3x3_pad1", "g4_c16_merged", "amx_c64_k40"])
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("dtype,res_dtype,res_kind", [(torch.bfloat16, torch.bfloat16, "dense"),
                                                      (torch.bfloat16, torch.float32, "strided"),
                                                      (torch.float32, torch.float32, "dense"),
                                                      (torch.float32, torch.bfloat16, "strided")], ids=str)
def test_row_epilogue_post_ops(shape, chain, dtype, res_dtype, res_kind, b_layout):
    """Residual (Sum / Binary add, f32 or bf16, dense or strided NHWC) then relu in the native
    forward's row epilogue, groups included; other chains on the whole output afterwards."""
    if dtype == torch.float32 and b_layout != "plain":
        pytest.skip("f32 runs the plain path only")
    xs, ws, kw = SHAPES[shape]
    y_shape = ConvProblem.create("fwd", xs, ws, dtype=dtype, **kw).y_shape
    build, native = CHAINS[chain]
    post = build(_residual(y_shape, res_dtype, res_kind))
    p = ConvProblem.create("fwd", xs, ws, dtype=dtype, layout="nhwc", has_bias=True, post_ops=post, **kw)
    assert (cpu_brgemm.row_post_ops(p, post) is not None) == native
    _, args = make("fwd", xs, ws, "nhwc", dtype, **kw)
    args = ConvArgs(x=args.x, w=args.w, bias=torch.randn(p.K).to(dtype), post_ops=post)
    check(p, args, CpuBrgemmFwd().prepare(p)(args), reference(p, args))


def _in_place_expected(shape: str, dtype: torch.dtype) -> bool:
    """The IN_PLACE shapes in f32 and on the AMX kernel; bf16 without AMX (oneDNN's brgemm on VNNI
    blocks) also at channel counts off 32s (even: 6, 66)."""
    if dtype == torch.float32:
        return shape in IN_PLACE
    if cpu_brgemm.cpu_has_amx():        # the AMX kernel: channels in 32s (s1_in_place_75_rows has 4)
        return shape in IN_PLACE and SHAPES[shape][0][1] % 32 == 0
    return cpu_brgemm.cpu_has_native_bf16() and shape in IN_PLACE + ["2d_3x3_pad", "wide_k70"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", IN_PLACE)
def test_in_place_chosen(shape, dtype):
    """The in-place forward runs where it applies (bf16: on the AMX kernel, or VNNI blocks without
    AMX), and at nchw only for bf16 without AMX (x and y transposed whole)."""
    xs, ws, kw = SHAPES[shape]
    p = ConvProblem.create("fwd", xs, ws, dtype=dtype, layout="nhwc", **kw)
    assert cpu_brgemm._Plan(p).in_place == _in_place_expected(shape, dtype)
    nchw = dtype == torch.bfloat16 and not cpu_brgemm.cpu_has_amx() and _in_place_expected(shape, dtype)
    assert cpu_brgemm._Plan(replace(p, layout="nchw")).in_place == nchw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", IN_PLACE + ["2d_3x3_pad", "wide_k70", "s1_pad2_staged"])
@pytest.mark.parametrize("post", ["none", "sum_relu"])
@pytest.mark.parametrize("own_tile", [True, False], ids=["own_tile", "brgemm"])
def test_nchw_forward(shape, dtype, post, own_tile, monkeypatch):
    """nchw forward (bf16 without AMX: in place between two whole-image transposes; else staged)
    against float64: outputs poisoned, x sliced (non-contiguous), bias, Sum + ReLU on the f32 block;
    bf16 in place through our own vdpbf16ps tile or torch's brgemm."""
    monkeypatch.setattr(cpu_brgemm, "USE_OWN_FWD_TILE", own_tile)
    xs, ws, kw = SHAPES[shape]
    y_shape = ConvProblem.create("fwd", xs, ws, dtype=dtype, **kw).y_shape
    ops = (Sum(torch.randn(y_shape).to(dtype), 0.5), Eltwise("relu")) if post != "none" else ()
    p = ConvProblem.create("fwd", xs, ws, dtype=dtype, layout="nchw", has_bias=True, post_ops=ops, **kw)
    _, args = make("fwd", xs, ws, "nchw", dtype, **kw)
    wide = torch.randn(xs[0], xs[1] + 2, *xs[2:]).to(dtype)
    wide[:, 1:xs[1] + 1] = args.x
    args = ConvArgs(x=wide[:, 1:xs[1] + 1], w=args.w, bias=torch.randn(p.K).to(dtype), post_ops=ops)
    check(p, args, CpuBrgemmFwd().prepare(p)(args), reference(p, args))


class _Spy:
    """LIBRARY.ops() with its forward kernels' calls recorded."""

    def __init__(self, ops, calls: list[str]) -> None:
        self._ops, self._calls = ops, calls

    def __getattr__(self, name: str):
        if name in ("conv_fwd", "conv_fwd_in_place"):
            self._calls.append(name)
        return getattr(self._ops, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", IN_PLACE + list(STAGED))
@pytest.mark.parametrize("x_kind", ["dense", "strided"])
@pytest.mark.parametrize("own_tile", [True, False], ids=["own_tile", "brgemm"])
def test_in_place_dispatch(shape, dtype, x_kind, own_tile, monkeypatch):
    """The kernel that runs: in place exactly where `_Plan.in_place` (and x's positions are C
    apart), staged otherwise (the shapes in STAGED, and x sliced from a wider buffer); the
    result against the float64 reference with bias and a Sum + ReLU row epilogue either way."""
    if STAGED.get(shape, dtype) != dtype:
        pytest.skip("in place at this dtype")
    monkeypatch.setattr(cpu_brgemm, "USE_OWN_FWD_TILE", own_tile)
    xs, ws, kw = SHAPES[shape]
    y_shape = ConvProblem.create("fwd", xs, ws, dtype=dtype, **kw).y_shape
    post = (Sum(_residual(y_shape, dtype, "dense"), 0.5), Eltwise("relu"))
    p = ConvProblem.create("fwd", xs, ws, dtype=dtype, layout="nhwc", has_bias=True, post_ops=post, **kw)
    _, args = make("fwd", xs, ws, "nhwc", dtype, **kw)
    x = args.x
    if x_kind == "strided":       # channels of a wider NHWC buffer: positions C + 3 apart
        wide = torch.full((xs[0], *xs[2:], xs[1] + 3), float("nan"), dtype=dtype)
        wide[..., 1:xs[1] + 1] = x.movedim(1, -1)
        x = wide[..., 1:xs[1] + 1].movedim(-1, 1)
    args = ConvArgs(x=x, w=args.w, bias=torch.randn(p.K).to(dtype), post_ops=post)
    calls: list[str] = []
    ops = cpu_brgemm.LIBRARY.ops()
    monkeypatch.setattr(cpu_brgemm.LIBRARY, "ops", lambda: _Spy(ops, calls))
    out = CpuBrgemmFwd().prepare(p)(args)
    in_place = cpu_brgemm._Plan(p).in_place
    assert in_place == _in_place_expected(shape, dtype)
    assert calls == ["conv_fwd_in_place" if in_place and x_kind == "dense" else "conv_fwd"]
    check(p, args, out, reference(p, args))


@pytest.mark.parametrize("stride", [1, 2])
def test_in_place_estimate(stride, monkeypatch):
    """Reading x in place, the estimate counts no x staging and no junk grid positions."""
    p = ConvProblem.create("fwd", (16, 128, 56, 56), (256, 128, 3, 3), dtype=torch.float32, stride=stride,
                           padding=1, layout="nhwc")
    assert cpu_brgemm.reads_in_place(p)
    s = CpuBrgemmFwd()
    in_place = s.estimate(p)
    monkeypatch.setattr(cpu_brgemm, "reads_in_place", lambda p: False)
    assert in_place < 0.95 * s.estimate(p)


def test_runs():
    """Taps of one phase at consecutive offsets form one run, whatever their order."""
    taps = [(0, 5, 0), (0, 0, 1), (1, 0, 2), (0, 1, 3), (0, 6, 4), (0, 2, 5)]
    assert runs_of(taps) == [[(0, 0, 1), (0, 1, 3), (0, 2, 5)], [(0, 5, 0), (0, 6, 4)], [(1, 0, 2)]]


def test_merge_factor():
    """Narrow groups on AMX merge into tile-deep block-diagonal groups."""
    p = ConvProblem.create("fwd", (8, 128, 28, 28), (128, 16, 3, 3), padding=1, groups=8, dtype=torch.bfloat16)
    assert cpu_brgemm.merge_factor(p) == (2 if cpu_brgemm.amx(p) else 1)
    q = ConvProblem.create("fwd", (8, 128, 28, 28), (128, 64, 3, 3), padding=1, groups=2, dtype=torch.bfloat16)
    assert cpu_brgemm.merge_factor(q) == 1


def test_not_applicable():
    f16 = ConvProblem.create("fwd", (1, 6, 8, 8), (4, 6, 3, 3), dtype=torch.float16)
    assert not CpuBrgemmFwd().is_applicable(f16)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
def test_bf16_without_amx_ranks(direction, monkeypatch):
    """avx512_bf16 without AMX: even GEMM depths take VNNI blocks (oneDNN's vdpbf16ps brgemm, no
    AMX kernel, no group merging) and rank ahead of the im2col GEMM; an odd depth would run torch's
    plain-layout scalar loop and ranks behind it."""
    from nnprim.conv.cpu_gemm import CpuGemmBwdData, CpuGemmBwdWeights, CpuGemmFwd
    monkeypatch.setattr(cpu_brgemm, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(cpu_brgemm, "cpu_has_native_bf16", lambda: True)
    gemm = {"fwd": CpuGemmFwd, "bwd_data": CpuGemmBwdData, "bwd_weights": CpuGemmBwdWeights}[direction]()
    ours = SOLVERS[direction]()
    even = ConvProblem.create(direction, (8, 64, 56, 56), (64, 64, 3, 3), padding=1, dtype=torch.bfloat16,
                              layout="nhwc")
    assert cpu_brgemm.vnni(even) and not cpu_brgemm.amx(even)
    assert not cpu_brgemm._Plan(even).amx and cpu_brgemm._Plan(even).vnni
    assert ours.estimate(even) < gemm.estimate(even)
    grouped = ConvProblem.create(direction, (8, 128, 28, 28), (128, 16, 3, 3), padding=1, groups=8,
                                 dtype=torch.bfloat16)
    assert cpu_brgemm.merge_factor(grouped) == 1
    if direction != "bwd_weights":     # backward weights' depth is positions (padded to even)
        odd = ConvProblem.create(direction, (8, 63, 56, 56), (65, 63, 3, 3), padding=1, dtype=torch.bfloat16,
                                 layout="nhwc")
        assert not cpu_brgemm.vnni(odd)
        assert ours.estimate(odd) > gemm.estimate(odd)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape", ["s1_in_place", "s1_in_place_3d", "s1_in_place_1d", "s1_in_place_w2", "wide_k70",
                                   "2d_3x3_pad", "amx_c64_k40", "s1_pad2_staged", "s2_in_place"])
def test_bwd_data_forward_twin(shape, layout):
    """Stride-1 backward data as the in-place forward of dy with the transposed, rotated filter
    (bf16 without AMX): taken exactly where that forward reads in place, and against float64
    (dx poisoned, dy sliced from a wider buffer)."""
    xs, ws, kw = SHAPES[shape]
    p = ConvProblem.create("bwd_data", xs, ws, dtype=torch.bfloat16, layout=layout, **kw)
    twin = cpu_brgemm.fwd_twin(p)
    s1 = all(s == 1 for s in p.stride) and all(d == 1 for d in p.dilation)
    expect = s1 and cpu_brgemm.cpu_has_native_bf16() and not cpu_brgemm.cpu_has_amx()   # pad (1, 2): twin pad (1, 0)
    assert (twin is not None) == expect
    _, args = make("bwd_data", xs, ws, layout, torch.bfloat16, **kw)
    dy = args.dy
    wide = torch.randn(dy.shape[0], dy.shape[1] + 2, *dy.shape[2:]).bfloat16()
    wide[:, 1:dy.shape[1] + 1] = dy
    args = ConvArgs(x=args.x, w=args.w, dy=wide[:, 1:dy.shape[1] + 1])
    check(p, args, CpuBrgemmBwdData().prepare(p)(args), reference(p, args))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("kcf", [(70, 66, (3, 3)), (6, 4, (3,)), (64, 8, (2, 3, 3))])
def test_pack_taps(kcf, twin, layout):
    """pack_taps (one pass from any layout) = pack_b_pairs of the rows (f, c) (forward) or of the
    forward twin's filter (twin_weights: W transposed, rotated by 180 degrees)."""
    K, C, filt = kcf
    w = to_layout(torch.randn(K, C, *filt).bfloat16(), layout)
    ops = cpu_brgemm.LIBRARY.ops()
    got = ops.pack_taps(w.flatten(2), twin)
    src = w
    if twin:
        p = ConvProblem.create("bwd_data", (1, C, *(5,) * len(filt)), tuple(w.shape), dtype=torch.bfloat16)
        src = cpu_brgemm.twin_weights(p, w)
    rows = src.movedim(1, -1).contiguous()            # (K', filt.., C'): rows (f, c) per output channel
    want = ops.pack_b_pairs(rows.view(rows.shape[0], -1), 1)
    assert torch.equal(got, want)
