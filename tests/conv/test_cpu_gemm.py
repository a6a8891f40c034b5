"""CPU GEMM convolution solvers (ids 10-12) against the float64 reference.

Outputs and the workspace are poisoned with NaN (unwritten or uninitialised
elements show), inputs are random and never zero. Tolerances (relative norm):
f32 1e-5, f16/bf16 1e-2."""
import dataclasses
import math
import threading

import pytest
import torch

import nnprim
from nnprim.conv import cpu_gemm
from nnprim.conv.cpu_gemm import CpuGemmConfig, conv_bias_grad, make_plan, prepare_with
from nnprim.conv.cpu_im2col import balance211, plan_blocks
from nnprim.conv.reference import reference
from nnprim.post_ops import ELTWISE_KINDS, Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout

from . import solver_check

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
TINY = CpuGemmConfig(block_bytes=2000)                 # many blocks, level > 0 blocking
CONFIGS = {
    "default": CpuGemmConfig(),
    "tiny": TINY,
    "tiny_pool2": CpuGemmConfig(block_bytes=2000, threads="pool", nthr=2),
    "tiny_pool3_mkl": CpuGemmConfig(block_bytes=700, threads="pool", nthr=3, gemm="matmul"),
    "tiny_native_bf16": CpuGemmConfig(block_bytes=2000, threads="pool", nthr=2, bf16_gemm="native"),
    "col2im_native_bf16": CpuGemmConfig(bwd_data_as_fwd=False, bf16_gemm="native"),
    "tiny_col2im_mkl": CpuGemmConfig(block_bytes=2000, bwd_data_as_fwd=False, gemm="matmul"),
    "f32_gemm": CpuGemmConfig(bf16_gemm="f32"),
}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """NaN-filled outputs and workspace; records workspace sizes."""
    return solver_check.poison_cpu(monkeypatch, cpu_gemm)


make = solver_check.random_case


def check(p, args, cfg=CpuGemmConfig()):
    out = prepare_with(p, cfg)(args)
    ref = reference(p, args)
    shape = {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weights": p.w_shape}[p.direction]
    assert tuple(out.shape) == shape
    assert out.dtype == p.out_dtype
    if p.layout == "nhwc":
        assert out.permute(0, *range(2, out.dim()), 1).is_contiguous()
    else:
        assert out.is_contiguous()
    assert not out.isnan().any(), "unwritten (NaN) elements"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    # bf16/f16 outputs round the result; bf16 inputs to an f32 output keep f32 accuracy
    tol = min(TOL[p.dtype], TOL[p.out_dtype]) if p.out_dtype == torch.float32 else TOL[p.out_dtype]
    assert err < tol, err
    return out


# x shape, w shape, options: 1D/2D/3D, stride, asymmetric padding, dilation, groups,
# depthwise, 1x1 (direct), odd sizes
SHAPES = {
    "2d_3x3_pad": ((2, 5, 9, 11), (4, 5, 3, 3), dict(padding=1)),
    "2d_asym_stride_dil_g3": ((3, 6, 7, 9), (6, 2, 3, 2),
                              dict(padding=((1, 0), (2, 1)), stride=(2, 1), dilation=(1, 2), groups=3)),
    "2d_depthwise": ((2, 6, 5, 7), (6, 1, 3, 3), dict(groups=6, padding=1, stride=2)),
    "2d_1x1": ((2, 8, 5, 3), (6, 8, 1, 1), {}),
    "2d_1x1_s2": ((2, 8, 5, 7), (6, 8, 1, 1), dict(stride=2)),
    "2d_big_stride": ((1, 3, 9, 9), (2, 3, 2, 2), dict(stride=3, padding=((0, 2), (1, 0)))),
    "1d": ((2, 4, 15), (5, 4, 3), dict(padding=(((2, 1),)), dilation=2)),
    "1d_1x1_g2": ((3, 4, 15), (6, 2, 1), dict(groups=2)),
    "3d": ((2, 4, 5, 6, 7), (6, 2, 3, 1, 2), dict(groups=2, stride=(1, 2, 1), padding=1)),
    "3d_pad_only_d": ((1, 3, 3, 4, 5), (2, 3, 3, 3, 3), dict(padding=(2, 0, 1))),
    "2d_1x1_pad": ((2, 4, 5, 6), (3, 4, 1, 1), dict(padding=(1, (0, 2)))),   # pad > span: col2im
}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
def test_grid_f32_bf16(direction, shape, layout, cfg, monkeypatch):
    xs, ws, kw = SHAPES[shape]
    if "native" in cfg:   # exercise the bf16-GEMM path on any CPU
        monkeypatch.setattr(cpu_gemm, "cpu_has_native_bf16", lambda: True)
    for dtype in (torch.float32, torch.bfloat16):
        p, args = make(direction, xs, ws, layout=layout, dtype=dtype, **kw)
        check(p, args, CONFIGS[cfg])


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
def test_f16_and_f32_output(direction):
    xs, ws, kw = SHAPES["2d_asym_stride_dil_g3"]
    for layout in ("nchw", "nhwc"):
        check(*make(direction, xs, ws, layout=layout, dtype=torch.float16, **kw), TINY)
        check(*make(direction, xs, ws, layout=layout, dtype=torch.bfloat16, out_dtype=torch.float32, **kw), TINY)


def test_blocking_boundaries():
    """Tiny caps force every blocking level: images, outer spatial dims, inner dims."""
    xs, ws, kw = SHAPES["3d"]
    seen_levels = set()
    for cap in (100, 300, 1200, 5000, 40000):
        cfg = CpuGemmConfig(block_bytes=cap, threads="pool", nthr=1 if cap > 10000 else 2)
        for direction in ("fwd", "bwd_data", "bwd_weights"):
            for layout in ("nchw", "nhwc"):
                p, args = make(direction, xs, ws, layout=layout, **kw)
                plan = make_plan(p, cfg)
                plan = plan.via or plan     # relayout twin (_relayout_twin): its blocks
                blocks = [b for w in plan.work for b in w]
                for b in blocks:   # column buffer under the cap unless a single position exceeds it
                    assert b.positions * p.C * math.prod(p.filter) * 4 <= max(cap, p.C * math.prod(p.filter) * 4)
                seen_levels.add(max(b.nb for b in blocks) > 1)
                check(p, args, cfg)
    assert seen_levels == {True, False}


def test_plan_blocks_cover_once():
    out = (5, 6, 7)
    for cap in (1, 10, 50, 300, 10 ** 6):
        blocks = plan_blocks(1, 4, out, 1, cap, min_blocks=2)
        seen = torch.zeros(4, *out, dtype=torch.int32)
        for b in blocks:
            seen[b.n0:b.n1, b.lo[0]:b.hi[0], b.lo[1]:b.hi[1], b.lo[2]:b.hi[2]] += 1
        assert (seen[1:] == 1).all() and (seen[0] == 0).all()
        assert all(b.positions <= max(cap, 1) for b in blocks)


def test_balance211():
    for n in range(0, 12):
        for nthr in range(1, 5):
            parts = [balance211(n, nthr, t) for t in range(nthr)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(parts[i][1] == parts[i + 1][0] for i in range(nthr - 1))
            sizes = [b - a for a, b in parts]
            assert max(sizes) - min(sizes) <= 1


def _post_ops(K, y_shape, dtype, kind):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(y_shape, generator=g).to(dtype)
    chan = (torch.rand(K, generator=g) + 0.5).reshape(1, K, 1, 1)
    scal = torch.tensor(1.7).reshape(1, 1, 1, 1)
    if kind == "sum":
        return (Sum(full, scale=0.5), Eltwise("relu"))
    if kind.startswith("binary_"):
        op = kind.split("_")[1]
        return (Binary(op, chan), Binary(op, full.abs() + 0.5), Binary(op, scal))
    pre = (Eltwise("abs"), Eltwise("linear", 1.0, 0.1)) if kind in ("sqrt", "log") else ()
    alpha, beta = {"relu": (0.1, 0.0), "elu": (0.7, 0.0), "clip": (-0.5, 0.8),
                   "linear": (0.5, -0.25)}.get(kind, (0.0, 0.0))
    return pre + (Eltwise(kind, alpha, beta),)


@pytest.mark.parametrize("kind", ["sum", *[f"binary_{o}" for o in ("add", "sub", "mul", "div", "max", "min")],
                                  *ELTWISE_KINDS])
def test_post_ops(kind):
    xs, ws, kw = (2, 4, 7, 9), (6, 2, 3, 3), dict(padding=1, groups=2)
    p0 = ConvProblem.create("fwd", xs, ws, dtype=torch.float32, **kw)
    for layout, dtype, out_dtype in (("nchw", torch.float32, None), ("nhwc", torch.bfloat16, None),
                                     ("nhwc", torch.float32, None), ("nchw", torch.bfloat16, torch.float32)):
        ops = _post_ops(p0.K, p0.y_shape, dtype, kind)
        if layout == "nhwc":   # residual tensors in the layout of y
            ops = tuple(Sum(to_layout(o.tensor, "nhwc"), o.scale) if isinstance(o, Sum) else o for o in ops)
        p, args = make("fwd", xs, ws, layout=layout, dtype=dtype, out_dtype=out_dtype, bias=True,
                       post_ops=ops, **kw)
        check(p, args, TINY)


@pytest.mark.parametrize("threads", ["torch", "pool"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
def test_threads_1_vs_2(direction, groups, threads):
    xs, ws, kw = (5, 6, 9, 8), (4, 6 // groups, 3, 3), dict(padding=1, groups=groups)
    outs = []
    old = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for layout in ("nchw", "nhwc"):
                p, args = make(direction, xs, ws, layout=layout, **kw)
                outs.append(check(p, args, CpuGemmConfig(block_bytes=3000, threads=threads)))
    finally:
        torch.set_num_threads(old)
    for a, b in ((outs[0], outs[2]), (outs[1], outs[3])):   # up to f32 summation order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
def test_workspace_exact(direction, poison):
    for layout in ("nchw", "nhwc"):
        for dtype in (torch.float32, torch.bfloat16):
            for name in ("2d_asym_stride_dil_g3", "2d_1x1", "3d"):
                xs, ws, kw = SHAPES[name]
                p, args = make(direction, xs, ws, layout=layout, dtype=dtype, **kw)
                solver = nnprim.REGISTRY.get({"fwd": 10, "bwd_data": 11, "bwd_weights": 12}[direction])
                expect = solver.workspace_size(p)
                poison.clear()
                solver.prepare(p)(args)
                assert poison and poison[-1] == expect


def test_workspace_capped():
    """A large problem keeps the column buffer of each thread under the 32 MiB cap."""
    p = ConvProblem.create("fwd", (64, 256, 112, 112), (256, 256, 3, 3), dtype=torch.bfloat16, padding=1)
    for cfg in (CpuGemmConfig(block_bytes=1 << 40), CpuGemmConfig(block_bytes=1 << 40, threads="pool", nthr=4)):
        plan = make_plan(p, cfg)
        plan = plan.via or plan     # nchw bf16 on AMX: the nhwc twin's blocks
        n, dt = plan.per_thread["col"]
        assert n * dt.itemsize <= cpu_gemm.COL_CAP_BYTES
        assert cpu_gemm.CpuGemmFwd().workspace_size(p) < 4 * cpu_gemm.COL_CAP_BYTES


def test_registered_and_api():
    for sid, d in ((10, "fwd"), (11, "bwd_data"), (12, "bwd_weights")):
        s = nnprim.REGISTRY.get(sid)
        assert s.family == "gemm" and s.primitive == "conv" and s.directions == {d}
        p, _ = make(d, (1, 2, 5, 5), (2, 2, 3, 3))
        assert s.is_applicable(p) and s.estimate(p) > 0
        assert s.not_supported_reasons(ConvProblem.create(d, (1, 2, 5, 5), (2, 2, 3, 3),
                                                          dtype=torch.float32, device="cuda"))
    x = torch.randn(2, 4, 7, 7).to(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)
    b = torch.randn(6)
    y = nnprim.conv_forward(x, w, b, padding=1, solver="CpuGemmFwd", post_ops=(Eltwise("relu"),))
    torch.testing.assert_close(y, torch.relu(torch.nn.functional.conv2d(x, w, b, 1, 1)), rtol=1e-4, atol=1e-4)
    assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(y)
    dx = nnprim.conv_backward_data(dy, w, x.shape, padding=1, solver=11)
    torch.testing.assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w, dy, 1, 1), rtol=1e-4, atol=1e-4)
    dw = nnprim.conv_backward_weights(dy, x, w.shape, padding=1, solver=12)
    torch.testing.assert_close(dw, torch.nn.grad.conv2d_weight(x, w.shape, dy, 1, 1), rtol=1e-4, atol=1e-4)


def test_bias_grad():
    for layout in ("nchw", "nhwc"):
        for dtype in (torch.float32, torch.bfloat16):
            dy = to_layout(torch.randn(3, 5, 4, 7).to(dtype), layout)
            ref = dy.double().sum(dim=(0, 2, 3))
            db = conv_bias_grad(dy, torch.float32)
            assert ((db.double() - ref).norm() / ref.norm()) < 1e-5
            assert conv_bias_grad(dy).dtype == dtype


def test_gemm_dtype_choice(monkeypatch):
    """bf16 uses the native bf16 GEMM only where its rounded output is the result
    ("auto"), or also in backward ("native", rounding each block before the f32
    accumulation); never without CPU support."""
    mk = lambda d, **kw: ConvProblem.create(d, (1, 4, 5, 5), (4, 4, 3, 3), dtype=torch.bfloat16, **kw)  # noqa: E731
    monkeypatch.setattr(cpu_gemm, "cpu_has_native_bf16", lambda: True)
    auto, native = CpuGemmConfig(), CpuGemmConfig(bf16_gemm="native")
    assert auto.gemm_dtype(mk("fwd")) == torch.bfloat16
    assert auto.gemm_dtype(mk("fwd", has_bias=True)) == torch.float32
    assert auto.gemm_dtype(mk("fwd", out_dtype=torch.float32)) == torch.float32
    assert auto.gemm_dtype(mk("bwd_weights")) == torch.float32  # f32 accumulation across blocks
    assert auto.gemm_dtype(mk("bwd_data")) == torch.float32
    assert native.gemm_dtype(mk("bwd_data")) == torch.bfloat16
    assert auto.gemm_dtype(mk("bwd_weights", out_dtype=torch.float32)) == torch.float32
    assert native.gemm_dtype(mk("bwd_weights")) == torch.bfloat16
    assert native.gemm_dtype(mk("fwd", post_ops=(("eltwise", "relu", 0.0, 0.0),))) == torch.float32
    assert CpuGemmConfig(bf16_gemm="f32").gemm_dtype(mk("fwd")) == torch.float32
    monkeypatch.setattr(cpu_gemm, "cpu_has_native_bf16", lambda: False)
    assert native.gemm_dtype(mk("bwd_data")) == torch.float32


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("chain", ["sum_relu", "binary_add_sum", "sum_scaled", "relu_only", "none"])
def test_onednn_fused_epilogue(layout, chain):
    """f32 forward through oneDNN: bias fused (nhwc), a leading residual add fused as a
    binary post-op, the trailing ReLU fused into the copy to y; checked with and without
    the fused paths (residual in the other layout, f32 vs bf16 output)."""
    if not cpu_gemm.onednn_linear_available():
        pytest.skip("no oneDNN linear in this torch build")
    xs, ws, kw = (3, 5, 9, 7), (6, 5, 3, 3), dict(padding=1)
    p0 = ConvProblem.create("fwd", xs, ws, dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(5)
    res = to_layout(torch.randn(p0.y_shape, generator=g), layout)
    other = to_layout(res, "nhwc" if layout == "nchw" else "nchw")     # not fusable: other layout
    ops = {"sum_relu": (Sum(res), Eltwise("relu")),
           "binary_add_sum": (Binary("add", res), Sum(other, 0.5), Eltwise("relu", 0.1)),
           "sum_scaled": (Sum(res, 2.0), Eltwise("tanh")),
           "relu_only": (Eltwise("relu"),),
           "none": ()}[chain]
    for bias in (False, True):
        for out_dtype in (None, torch.bfloat16):
            p, args = make("fwd", xs, ws, layout=layout, bias=bias, post_ops=ops, out_dtype=out_dtype, **kw)
            for cfg in (CpuGemmConfig(), TINY):
                assert make_plan(p, cfg).onednn
                assert cpu_gemm._fusable_residual(p, ops) == (chain in ("sum_relu", "binary_add_sum"))
                check(p, args, cfg)


def test_bwd_data_as_fwd_choice():
    """Stride-1 backward data runs as a forward convolution of dy unless the padding
    exceeds the filter span (then col2im), or the problem is strided or 1x1 direct."""
    mk = lambda **kw: ConvProblem.create("bwd_data", (1, 4, 9, 9), kw.pop("w", (4, 4, 3, 3)),  # noqa: E731
                                         dtype=torch.float32, **kw)
    assert make_plan(mk(padding=1)).as_fwd is not None
    assert make_plan(mk(padding=((2, 0), (1, 1)))).as_fwd is not None
    assert make_plan(mk(padding=3)).as_fwd is None
    assert make_plan(mk(padding=1, stride=2)).as_fwd is None
    assert make_plan(mk(w=(4, 4, 1, 1))).as_fwd is None
    assert make_plan(mk(padding=1), CpuGemmConfig(bwd_data_as_fwd=False)).as_fwd is None
    pf = make_plan(mk(padding=((2, 0), (1, 1)), dilation=(1, 2))).as_fwd
    assert pf.direction == "fwd" and pf.pad_before == (0, 3) and pf.pad_after == (2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [((2, 6, 5, 7), (4, 3, 3, 3), dict(padding=1, groups=2)),
                                   ((2, 4, 3, 4, 5), (6, 2, 3, 2, 3), dict(padding=(1, (0, 1), 2), groups=2,
                                                                           stride=(2, 1, 1), dilation=(1, 1, 2))),
                                   ((1, 3, 9, 6), (5, 3, 3, 3), dict(padding=((2, 0), (1, 2))))])
def test_wide_forward(shape, dtype, monkeypatch):
    """The padded-width forward (junk columns computed and dropped, stage slack read),
    with block splits inside an image, post-ops, through backward data, and backward
    weights (junk columns of dy zeroed; NaN-poisoned workspace would show otherwise)."""
    monkeypatch.setattr(cpu_gemm, "cpu_has_native_bf16", lambda: True)
    xs, ws, kw = shape
    ops = (Eltwise("relu", 0.1),)
    for cfg in (CpuGemmConfig(wide=1.0, relayout="off"), CpuGemmConfig(block_bytes=2000, wide=1.0, relayout="off"),
                CpuGemmConfig(block_bytes=2000, relayout="off")):
        p, args = make("fwd", xs, ws, dtype=dtype, **kw)
        wide = make_plan(p, cfg).wide
        grouped = kw.get("groups", 1) > 1            # grouped f32 forward is wide too
        assert (wide > 0) == (cfg.wide == 1.0 and (dtype == torch.bfloat16 or grouped))
        check(p, args, cfg)
        check(*make("fwd", xs, ws, dtype=dtype, bias=True, post_ops=ops, **kw), cfg)
        check(*make("bwd_data", xs, ws, dtype=dtype, **kw), cfg)
        pw, argw = make("bwd_weights", xs, ws, dtype=dtype, **kw)    # dy widened with zeros
        native = dataclasses.replace(cfg, bf16_gemm="native")         # backward's bf16 GEMM
        assert (make_plan(pw, native).wide > 0) == (wide > 0 and dtype == torch.bfloat16)
        check(pw, argw, cfg)
        check(pw, argw, native)


def test_workspace_arena_reused(monkeypatch):
    """Without the poisoning hook the workspace is one buffer reused between calls
    (stale contents from another problem must not leak into results), and a call made
    while the arena is leased gets a fresh buffer."""
    monkeypatch.setattr(cpu_gemm, "workspace", cpu_gemm._Arena().lease)
    allocs = []
    monkeypatch.setattr(cpu_gemm, "alloc_workspace", lambda n: allocs.append(n) or torch.full((n,), 255, dtype=torch.uint8))
    big = make("fwd", (2, 6, 9, 11), (4, 6, 3, 3), padding=1, bias=True)
    small = make("bwd_weights", (1, 3, 5, 4), (2, 3, 3, 3), padding=(1, 0))
    for _ in range(2):
        for p, args in (big, small, make("bwd_data", (2, 4, 7, 5), (3, 4, 3, 3), padding=1,
                                         dtype=torch.bfloat16)):
            check(p, args)
    assert len(allocs) <= 3      # grown at most once per size increase, then reused
    arena = cpu_gemm._Arena()
    with arena.lease(100) as a:
        done = []
        t = threading.Thread(target=lambda: done.append(arena.lease(100).__enter__()))
        t.start()
        t.join()
        assert done[0].data_ptr() != a.data_ptr()


@pytest.mark.parametrize("layout,shape,dtype", [
    ("nchw", ((2, 5, 4, 6, 5), (7, 5, 3, 3, 3), dict(padding=(1, (0, 1), 1))), torch.bfloat16),
    ("nchw", ((2, 6, 9), (4, 6, 3), dict(padding=2, dilation=2)), torch.bfloat16),
    ("nhwc", ((2, 6, 7, 5), (6, 2, 3, 3), dict(padding=((1, 0), (0, 2)), groups=3, stride=(1, 2))), torch.float32),
    ("nhwc", ((2, 8, 6, 7), (4, 4, 3, 3), dict(padding=1, groups=2)), torch.bfloat16),
])
def test_relayout_twin(layout, shape, dtype, monkeypatch):
    """Plain forward (and backward data as forward) of narrow-K nchw bf16 and of grouped nhwc
    problems runs the other layout's plan, converting x in and y out; bias / post-ops and
    relayout="off" keep the layout."""
    monkeypatch.setattr(cpu_gemm, "cpu_has_native_bf16", lambda: True)
    xs, ws, kw = shape
    for direction in ("fwd", "bwd_data"):
        p, args = make(direction, xs, ws, layout=layout, dtype=dtype, **kw)
        plan = make_plan(p)
        if direction == "fwd" or plan.as_fwd is not None:
            assert plan.via is not None and plan.via.p.layout != layout
        check(p, args)
        assert make_plan(p, CpuGemmConfig(relayout="off")).via is None
        check(p, args, CpuGemmConfig(relayout="off"))
    p, args = make("fwd", xs, ws, layout=layout, dtype=dtype, bias=True, **kw)
    assert make_plan(p).via is None
    check(p, args)


@pytest.mark.parametrize("shape", [
    ((2, 5, 7, 9), (40, 5, 3, 3), dict(padding=1)),                 # staged: the copy changes layout
    ((1, 6, 6, 7), (36, 6, 2, 3), dict(dilation=(2, 1))),           # unpadded: x converted first
    ((2, 3, 4, 5, 6), (34, 3, 3, 1, 3), dict(padding=(1, 0, (2, 0)))),
])
def test_relayout_amx_any_k(shape, monkeypatch):
    """On AMX CPUs a plain nchw bf16 forward (and backward data as forward) of any K runs as
    its nhwc twin, y written in nchw by the block copies; without AMX K > 32 keeps nchw."""
    monkeypatch.setattr(cpu_gemm, "cpu_has_native_bf16", lambda: True)
    xs, ws, kw = shape
    for amx in (True, False):
        monkeypatch.setattr(cpu_gemm, "cpu_has_amx", lambda amx=amx: amx)
        p, args = make("fwd", xs, ws, layout="nchw", dtype=torch.bfloat16, **kw)
        assert (make_plan(p).via is not None) == amx
        check(p, args)
    monkeypatch.setattr(cpu_gemm, "cpu_has_amx", lambda: True)
    p, args = make("bwd_data", (2, 36, 6, 7), (5, 36, 3, 3), layout="nchw", dtype=torch.bfloat16, padding=1)
    assert make_plan(p).via is not None
    check(p, args)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape,K", [((3, 40, 7, 5), 24), ((2, 17, 9), 33), ((2, 8, 3, 5, 4), 12)])
def test_pointwise_one_gemm(poison, layout, bias, x_shape, K):
    """1x1 stride-1 unpadded ungrouped forward as one GEMM straight into y (planned, no
    workspace): NaN-poisoned y fully written; f32 with bias and a post-op chain, native bf16 plain."""
    w_shape = (K, x_shape[1], *([1] * (len(x_shape) - 2)))
    y_shape = (x_shape[0], K, *x_shape[2:])
    res = to_layout(torch.randn(y_shape, generator=torch.Generator().manual_seed(5)), layout)
    chain = (Sum(res, 0.5), Binary("mul", torch.rand(1, K, *([1] * (len(x_shape) - 2))) + 0.5), Eltwise("relu"))
    # a leading residual add in y's layout starts y (the GEMM accumulates into it); in the
    # other layout it is added afterwards
    other = to_layout(res.contiguous(), "nchw" if layout == "nhwc" else "nhwc")
    for ops in ((), chain, (Binary("add", res), Eltwise("relu")), (Sum(other, 2.0),)):
        p, args = make("fwd", x_shape, w_shape, layout=layout, bias=bias, post_ops=ops)
        assert make_plan(p).pointwise and make_plan(p).workspace_bytes() == 0
        check(p, args)
    if not bias:
        p, args = make("fwd", x_shape, w_shape, layout=layout, dtype=torch.bfloat16)
        cfg = CpuGemmConfig(bf16_gemm="native")
        assert make_plan(p, cfg).pointwise == cpu_gemm.cpu_has_native_bf16()
        check(p, args, cfg)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("x_shape,K", [((3, 40, 7, 5), 24), ((2, 17, 9), 33), ((2, 8, 3, 5, 4), 12)])
def test_pointwise_backward_one_gemm(layout, x_shape, K):
    """1x1 backward data (f32, native bf16) and weights (f32) as GEMMs straight into the
    NaN-poisoned output; bf16 backward weights keeps the blocked path (f32 reduction)."""
    w_shape = (K, x_shape[1], *([1] * (len(x_shape) - 2)))
    for d in ("bwd_data", "bwd_weights"):
        p, args = make(d, x_shape, w_shape, layout=layout)
        assert make_plan(p).pointwise
        check(p, args)
    check(*make("bwd_data", x_shape, w_shape, layout=layout, dtype=torch.bfloat16))
    p, args = make("bwd_weights", x_shape, w_shape, layout=layout, dtype=torch.bfloat16)
    cfg = CpuGemmConfig(bf16_gemm="native")
    assert not make_plan(p, cfg).pointwise
    check(p, args, cfg)
