"""Implicit-GEMM Triton convolution (solvers 20/21/22) against the float64 reference,
through TRITON_INTERPRET=1 (tests/conftest.py), with NaN-poisoned outputs."""
import inspect
import math

import pytest
import torch

from nnprim.args import ConvArgs
from nnprim.conv import configs
from nnprim.conv import implicit_gemm as ig
from nnprim.conv import implicit_gemm_bwd as igb
from nnprim.conv import reference as ref
from nnprim.post_ops import ELTWISE_KINDS, Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, empty_in_layout, to_layout
from nnprim.search.solver import REGISTRY

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
RUN = {"fwd": ig.conv_fwd, "bwd_data": ig.conv_bwd_data, "bwd_weights": igb.conv_bwd_weights}

# (x shape, w shape, options)
CASES = [
    ((2, 5, 7, 9), (6, 5, 3, 3), dict(padding=1)),
    ((2, 8, 7, 9), (6, 4, 3, 2), dict(stride=(2, 1), padding=((1, 0), (0, 2)), dilation=(1, 2), groups=2)),
    ((1, 40, 6, 5), (20, 40, 1, 1), {}),
    ((2, 34, 6, 5), (20, 34, 3, 3), dict(padding=1, stride=2)),
    ((2, 3, 5, 6, 7), (4, 3, 2, 3, 3), dict(padding=(1, (0, 2), 1), stride=(1, 2, 2))),
    ((2, 3, 17), (4, 3, 3), dict(padding=((2, 1),), stride=3)),
    ((2, 6, 6, 7), (6, 1, 3, 3), dict(padding=1, groups=6)),
    ((1, 33, 9, 4), (31, 33, 2, 3), dict(padding=((0, 1), (1, 0)), dilation=(2, 1))),
]


def _ids(c):
    return f"x{'x'.join(map(str, c[0]))}-w{'x'.join(map(str, c[1]))}-" + \
        "-".join(f"{k}{v}" for k, v in c[2].items()).replace(" ", "")


def tensors(p: ConvProblem, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda shape: to_layout(torch.randn(shape, generator=g).to(p.dtype), p.layout)  # noqa: E731
    return mk(p.x_shape), mk(p.w_shape), mk(p.y_shape)


def poisoned(shape, p: ConvProblem):
    return empty_in_layout(shape, p.layout, dtype=p.out_dtype).fill_(float("nan"))


def rel_err(out, exp):
    return ((out.double() - exp).norm() / exp.norm()).item()


def check(run, p: ConvProblem, tile=None, bias=None, post_ops=(), seed=0):
    x, w, dy = tensors(p, seed)
    kw = {} if tile is None else {"tile": tile}
    if p.direction == "fwd":
        out = run(p, ConvArgs(x=x, w=w, bias=bias, post_ops=post_ops), out=poisoned(p.y_shape, p), **kw)
        exp = ref.conv_fwd_f64(p, x, w, bias, post_ops)
    elif p.direction == "bwd_data":
        out = run(p, ConvArgs(dy=dy, w=w), out=poisoned(p.x_shape, p), **kw)
        exp = ref.conv_bwd_data_f64(p, dy, w)
    else:
        out = run(p, ConvArgs(dy=dy, x=x), out=poisoned(p.w_shape, p), **kw)
        exp = ref.conv_bwd_weights_f64(p, dy, x)
    assert not torch.isnan(out).any(), "unwritten (poisoned) elements remain"
    assert out.dtype == p.out_dtype
    err = rel_err(out, exp)
    assert err < TOL[p.dtype], err
    return out


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_f32_vs_reference(direction, case, layout):
    xs, ws, kw = case
    p = ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout=layout, **kw)
    check(RUN[direction], p)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half(direction, dtype):
    p = ConvProblem.create(direction, (2, 6, 7, 5), (10, 3, 3, 3), dtype=dtype, layout="nhwc",
                           padding=1, stride=(1, 2), groups=2)
    check(RUN[direction], p)


def test_bf16_to_f32_output():
    p = ConvProblem.create("fwd", (2, 16, 7, 5), (10, 16, 3, 3), dtype=torch.bfloat16,
                           out_dtype=torch.float32, layout="nhwc", padding=1)
    x, w, _ = tensors(p)
    out = ig.conv_fwd(p, ConvArgs(x=x, w=w), out=poisoned(p.y_shape, p))
    # f32 output keeps the f32 accumulator: only the bf16 inputs' rounding remains
    assert rel_err(out, ref.conv_fwd_f64(p, x, w)) < 1e-5


def test_split_k_bwd_weights():
    p = ConvProblem.create("bwd_weights", (3, 6, 15, 16), (5, 6, 3, 3), dtype=torch.float32,
                           layout="nhwc", padding=1)
    tile = configs.GemmTile(16, 16, 16, 4, 2)
    assert igb.plan_split(p, tile)[3] > 1
    check(igb.conv_bwd_weights, p, tile=tile)


@pytest.mark.parametrize("tile", [configs.GemmTile(16, 16, 16, 4, 2), configs.GemmTile(32, 64, 32, 4, 3)],
                         ids=str)
def test_tiles_tails(tile):
    for direction in RUN:
        p = ConvProblem.create(direction, (3, 35, 5, 7), (31, 35, 3, 3), dtype=torch.float32,
                               layout="nhwc", padding=(1, 2), stride=(1, 2))
        check(RUN[direction], p, tile=tile)


def _post_chain(p: ConvProblem, kind: str, bc: str, op: str, g: torch.Generator):
    y = p.y_shape
    shape = {"scalar": (1,) * len(y), "channel": (1, p.K) + (1,) * (len(y) - 2), "full": y}[bc]
    t = (torch.rand(shape, generator=g) + 0.5).to(p.dtype)
    if bc == "full":
        t = to_layout(t, p.layout)
    res = to_layout(torch.randn(y, generator=g).to(p.dtype), p.layout)
    chain = [Sum(res, 0.5), Binary(op, t)]
    if kind in ("sqrt", "log"):
        chain.append(Eltwise("abs"))
    chain.append(Eltwise(kind, alpha=0.3 if kind != "clip" else -0.5, beta=0.7))
    return tuple(chain)


@pytest.mark.parametrize("kind", ELTWISE_KINDS)
def test_post_ops_each_eltwise(kind):
    bcs = ["scalar", "channel", "full"]
    ops = ["add", "sub", "mul", "div", "max", "min"]
    i = ELTWISE_KINDS.index(kind)
    g = torch.Generator().manual_seed(i)
    layout = "nhwc" if i % 2 else "nchw"
    base = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.float32, layout=layout, padding=1)
    chain = _post_chain(base, kind, bcs[i % 3], ops[i % 6], g)
    p = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.float32, layout=layout,
                           padding=1, has_bias=True, post_ops=tuple(o.signature() for o in chain))
    bias = torch.randn(6, generator=g)
    check(ig.conv_fwd, p, bias=bias, post_ops=chain)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min"])
def test_post_ops_binary_broadcasts_bf16(op):
    g = torch.Generator().manual_seed(7)
    base = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.bfloat16, layout="nhwc", padding=1)
    chain = tuple(Binary(op, (torch.rand(s, generator=g) + 0.5).to(torch.bfloat16))
                  for s in [(1, 1, 1, 1), (1, 6, 1, 1), base.y_shape])
    p = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.bfloat16, layout="nhwc", padding=1,
                           post_ops=tuple(o.signature() for o in chain))
    check(ig.conv_fwd, p, post_ops=chain)


def test_registered_solvers_and_invokers():
    p = ConvProblem.create("fwd", (2, 5, 6, 7), (6, 5, 3, 3), dtype=torch.float32, layout="nhwc", padding=1)
    for sid, direction in ((20, "fwd"), (21, "bwd_data"), (22, "bwd_weights")):
        s = REGISTRY.get(sid)
        q = p.with_direction(direction)
        assert s.family == "implicit_gemm" and s.is_applicable(q), s.not_supported_reasons(q)
        assert not s.is_applicable(p.with_direction("fwd" if direction != "fwd" else "bwd_data"))
        assert s.estimate(q) > 0
        x, w, dy = tensors(q)
        out = s.prepare(q)(ConvArgs(x=x, w=w, dy=dy))
        shape = {"fwd": q.y_shape, "bwd_data": q.x_shape, "bwd_weights": q.w_shape}[direction]
        assert tuple(out.shape) == shape
        assert out.permute(0, 2, 3, 1).is_contiguous()   # nhwc kept


def test_not_supported_reasons():
    s = REGISTRY.get("implicit_gemm_fwd")
    sigs = tuple(Eltwise("relu").signature() for _ in range(5))
    p = ConvProblem.create("fwd", (1, 4, 5, 5), (4, 4, 3, 3), dtype=torch.float32, post_ops=sigs)
    assert any("post-ops" in r for r in s.not_supported_reasons(p))
    p = ConvProblem.create("fwd", (1, 4, 5, 5), (4, 4, 3, 3), dtype=torch.float32,
                           post_ops=(("binary", "add", (1, 4, 5, 1)),))
    assert any("Binary" in r for r in s.not_supported_reasons(p))
    assert math.isfinite(s.estimate(p))


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_gemm_tma(direction, dtype):
    """1x1 stride-1 NHWC runs as a TMA GEMM: 105 rows, C=24 and K=40 against 16/32
    blocks leave tails on every side (zero-filled out-of-bounds TMA reads)."""
    p = ConvProblem.create(direction, (3, 24, 5, 7), (40, 24, 1, 1), dtype=dtype, layout="nhwc")
    plan = {"fwd": ig.FwdPlan, "bwd_data": ig.BwdDataPlan}[direction](p, configs.GemmTile(32, 32, 16, 4, 2))
    assert plan.tma
    check(lambda p, a, out: plan(a, out), p)


def test_plain_gemm_tma_fused_epilogue():
    g = torch.Generator().manual_seed(5)
    base = ConvProblem.create("fwd", (2, 32, 3, 5), (48, 32, 1, 1), dtype=torch.bfloat16, layout="nhwc")
    chain = (Sum(to_layout(torch.randn(base.y_shape, generator=g).to(torch.bfloat16), "nhwc"), 0.5),
             Binary("mul", (torch.rand(1, 48, 1, 1, generator=g) + 0.5).to(torch.bfloat16)), Eltwise("relu"))
    p = ConvProblem.create("fwd", (2, 32, 3, 5), (48, 32, 1, 1), dtype=torch.bfloat16, layout="nhwc",
                           has_bias=True, post_ops=tuple(o.signature() for o in chain))
    plan = ig.FwdPlan(p, configs.GemmTile(16, 32, 16, 4, 2))
    assert plan.tma
    check(lambda p, a, out: plan(a, out), p, bias=torch.randn(48, generator=g), post_ops=chain)


@pytest.mark.parametrize("sid", [20, 21, 22])
def test_prepared_invoker_reuse_and_strides(sid):
    """A prepared invoker is called repeatedly (new inputs each time, the cached launch)
    and with inputs whose strides differ from the layout's (a plan for those strides)."""
    s = REGISTRY.get(sid)
    q = ConvProblem.create(next(iter(s.directions)), (2, 6, 5, 7), (4, 6, 3, 3), dtype=torch.float32,
                           layout="nhwc", padding=1, stride=(2, 1))
    inv = s.prepare(q)
    run = lambda p, a, out: inv(a, out)  # noqa: E731
    for seed in (0, 1):
        check(run, q, seed=seed)
    x, w, dy = tensors(q, 2)
    args = ConvArgs(x=x.contiguous(), w=w.contiguous(), dy=dy.contiguous())   # nchw-strided tensors
    out = inv(args)
    exp = {"fwd": lambda: ref.conv_fwd_f64(q, x, w), "bwd_data": lambda: ref.conv_bwd_data_f64(q, dy, w),
           "bwd_weights": lambda: ref.conv_bwd_weights_f64(q, dy, x)}[q.direction]()
    assert rel_err(out, exp) < 1e-5
    assert inv.variants


def test_launch_fast_path(monkeypatch):
    """After the first (JIT) launch, a Launch calls the compiled kernel directly with the
    grid, the current stream and the full argument list; a pointer with another 16-byte
    alignment goes back through the JIT."""
    from nnprim import launch

    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            calls.append(("fast", a))

    def signature_of(t, n, flag, C, D=11):  # the kernel's parameters: C, D constexprs
        pass

    class Kernel:
        arg_names = ["t", "n", "flag", "C", "D"]
        signature = inspect.signature(signature_of)

        def __getitem__(self, grid):
            return lambda *a, **o: calls.append(("jit", grid, a, o)) or Compiled()

    monkeypatch.setattr(launch, "_stream", lambda: 7)
    lc = launch.Launch(Kernel(), (3, 2), (5, True), num_warps=4, C=9)
    lc.fast = True
    t = torch.zeros(8)
    lc(t)
    lc(t)
    lc(t[1:])
    assert [c[0] for c in calls] == ["jit", "fast", "jit"]
    assert calls[0][1] == (3, 2, 1) and calls[0][2][1:] == (5, True) and calls[0][3] == {"num_warps": 4, "C": 9}
    assert calls[1][1][:9] == (3, 2, 1, 7, "fn", "meta", None, None, None)
    # the compiled launcher takes every parameter positionally: keyword constexprs and defaults too
    assert calls[1][1][9] is t and calls[1][1][10:] == (5, True, 9, 11)


TMA_CONV_CASES = [
    ((2, 24, 7, 9), (40, 24, 3, 3), dict(padding=1)),
    ((1, 16, 6, 5), (24, 16, 3, 2), dict(padding=((2, 0), (0, 1)), dilation=(2, 1))),
    ((2, 16, 19), (8, 16, 5), dict(padding=2)),
    ((1, 8, 3, 4, 5), (16, 8, 3, 3, 3), dict(padding=1)),
]


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
@pytest.mark.parametrize("case", TMA_CONV_CASES, ids=_ids)
def test_tma_conv(direction, case):
    """Stride-1 NHWC through the TMA convolution kernel: zero-filled out-of-bounds reads
    are the (asymmetric, dilated) padding; channel tails (24 vs BK/BN 16) read the next
    tap's weights into masked columns only."""
    xs, ws, kw = case
    p = ConvProblem.create(direction, xs, ws, dtype=torch.bfloat16, layout="nhwc", **kw)
    assert ig.is_tma_conv(p)
    plan = {"fwd": ig.FwdPlan, "bwd_data": ig.BwdDataPlan}[direction](p, configs.GemmTile(32, 16, 16, 4, 2),
                                                                        tma_conv=True)
    assert plan.tma
    check(lambda p, a, out: plan(a, out), p)


def test_tma_conv_fused_epilogue_f16():
    g = torch.Generator().manual_seed(9)
    base = ConvProblem.create("fwd", (2, 16, 5, 6), (24, 16, 3, 3), dtype=torch.float16, layout="nhwc", padding=1)
    chain = (Sum(to_layout(torch.randn(base.y_shape, generator=g).to(torch.float16), "nhwc"), 1.0), Eltwise("relu"))
    p = ConvProblem.create("fwd", (2, 16, 5, 6), (24, 16, 3, 3), dtype=torch.float16, layout="nhwc", padding=1,
                           has_bias=True, post_ops=tuple(o.signature() for o in chain))
    plan = ig.FwdPlan(p, configs.GemmTile(16, 16, 16, 4, 2), tma_conv=True)
    assert plan.tma
    check(lambda p, a, out: plan(a, out), p, bias=torch.randn(24, generator=g), post_ops=chain)


@pytest.mark.parametrize("case", TMA_CONV_CASES + [((2, 16, 5, 7), (24, 16, 1, 1), {})], ids=_ids)
@pytest.mark.parametrize("bp", [16, 64])
def test_tma_bwd_weights(case, bp):
    """Stride-1 NHWC backward weights with TMA reads, split over pixel tiles (bp pixels
    per step) or not: tile tails, padding and channel tails come from zero fill."""
    xs, ws, kw = case
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=torch.bfloat16, layout="nhwc", **kw)
    plan = igb.BwdWeightsPlan(p, configs.GemmTile(16, 16, bp, 4, 2), tma_conv=True)
    assert plan.tma
    check(lambda p, a, out: plan(a, out), p)


def test_default_plans_use_tma_when_eligible():
    """The solvers' own plans (prepare) pick the TMA kernels for stride-1 NHWC half
    problems (configs.TMA_CONV_DIRECTIONS) and stay exact."""
    for xs, ws in (((2, 16, 5, 6), (24, 16, 3, 3)), ((2, 16, 3, 5), (24, 16, 1, 1))):
        for sid in (20, 21, 22):
            s = REGISTRY.get(sid)
            p = ConvProblem.create(next(iter(s.directions)), xs, ws, dtype=torch.bfloat16, layout="nhwc",
                                   padding=ws[2] // 2)
            inv = s.prepare(p)
            assert inv.tma, (xs, sid)
            check(lambda p, a, out, inv=inv: inv(a, out), p)
            assert s.workspace_size(p) >= 0


def test_estimate_host_floor_and_nchw_gathers_in_every_direction():
    """A tiny CUDA layer costs at least the call's host work; NCHW is indexed natively with
    channel-strided gathers, forward too (a stride-2 NCHW conv1d measured 6-11x its old
    estimate on the H200, the NHWC twin ~1x)."""
    s = REGISTRY.get("implicit_gemm_fwd")
    tiny = ConvProblem.create("fwd", (1, 8, 8, 8), (8, 8, 3, 3), dtype=torch.bfloat16, padding=1, device="cuda",
                              layout="nhwc")
    assert s.estimate(tiny) == ig.HOST_FLOOR_MS
    cpu = ConvProblem.create("fwd", (1, 8, 8, 8), (8, 8, 3, 3), dtype=torch.float32, padding=1)
    assert s.estimate(cpu) < ig.HOST_FLOOR_MS
    kw = dict(dtype=torch.bfloat16, stride=2, padding=1, device="cuda")
    nchw = ConvProblem.create("fwd", (16, 384, 3000), (384, 384, 3), layout="nchw", **kw)
    nhwc = ConvProblem.create("fwd", (16, 384, 3000), (384, 384, 3), layout="nhwc", **kw)
    assert s.estimate(nchw) > 2.5 * s.estimate(nhwc)
    # the native NCHW backward never under NCHW_BWD_FLOOR_MS, however small; a 1x1 layer is a
    # plain GEMM over NCHW (no per-tap gathers): priced as its NHWC twin
    for d, name in (("bwd_data", "implicit_gemm_bwd_data"), ("bwd_weights", "implicit_gemm_bwd_weights")):
        small = ConvProblem.create(d, (1, 64, 16, 16), (64, 64, 3, 3), dtype=torch.bfloat16, padding=1,
                                   device="cuda", layout="nchw")
        assert REGISTRY.get(name).estimate(small) == ig.NCHW_BWD_FLOOR_MS > ig.HOST_FLOOR_MS
    one = {lay: s.estimate(ConvProblem.create("fwd", (32, 256, 56, 56), (64, 256, 1, 1), dtype=torch.bfloat16,
                                              device="cuda", layout=lay)) for lay in ("nchw", "nhwc")}
    assert one["nchw"] == one["nhwc"]
