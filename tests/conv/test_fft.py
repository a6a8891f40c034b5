"""FFT convolution (solvers 60-62 through TRITON_INTERPRET=1, 63-65 in torch) against the
float64 reference, with NaN-poisoned outputs and work buffers; chunking; the workspace
ledger against workspace_size; not-applicable reasons; the public API."""
import pytest
import torch

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv import fft
from nnprim.conv import reference as ref
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, empty_in_layout, to_layout
from nnprim.search import ranking
from nnprim.search.solver import REGISTRY

from . import solver_check

ENGINES = ("triton", "torch")
CASES = [
    ((2, 3, 40), (3, 1, 40), dict(padding=[(39, 0)], groups=3)),             # causal depthwise, filter = L
    ((2, 4, 31), (4, 2, 17), dict(padding="same", groups=2)),                # 'same', grouped
    ((1, 2, 23), (6, 2, 16), dict(padding=((3, 5),))),                       # dense, asymmetric, odd
    ((2, 3, 9, 11), (3, 1, 7, 7), dict(padding=3, groups=3)),                # 2-D depthwise
    ((2, 2, 8, 9), (4, 1, 7, 8), dict(padding=((6, 0), (2, 3)), groups=2)),  # multiplier 2, asymmetric
    ((1, 2, 5, 6, 5), (2, 1, 5, 5, 5), dict(padding=2, groups=2)),           # 3-D
]


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every work buffer starts as NaN: an element the plan forgets to write shows."""
    def buf(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(fft, "new_buffer", buf)


def runner(engine: str, cap: int | None = None) -> dict:
    go = lambda p, a, out: fft.conv(p, a, out, engine=engine, cap=cap)  # noqa: E731
    return {"fwd": go, "bwd_data": go, "bwd_weights": go}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_f32_vs_reference(engine, direction, case):
    xs, ws, kw = case
    layout = "nhwc" if len(xs) == 4 else "nchw"
    solver_check.check(runner(engine), ConvProblem.create(direction, xs, ws, dtype=torch.float32,
                                                          layout=layout, **kw), seed=3)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
def test_half_and_layouts(engine, direction):
    for dtype, layout in ((torch.bfloat16, "nhwc"), (torch.float16, "nchw")):
        p = ConvProblem.create(direction, (2, 4, 7, 9), (4, 1, 7, 7), dtype=dtype, layout=layout,
                               padding=3, groups=4)
        solver_check.check(runner(engine), p, seed=4)
    p = ConvProblem.create(direction, (2, 2, 33), (2, 1, 33), dtype=torch.bfloat16, padding=[(32, 0)],
                           groups=2, out_dtype=torch.float32)
    solver_check.check(runner(engine), p, seed=5)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
@pytest.mark.parametrize("cap", [1, 3000])
def test_chunks(engine, direction, cap):
    """Caps of one (n, g) pair per chunk (slices of a group's images) and of a few groups
    (whole groups): same results; bwd_weights accumulates across a group's chunks."""
    p = ConvProblem.create(direction, (3, 4, 20), (4, 2, 16), dtype=torch.float32, padding=((15, 0),), groups=2)
    chunks = fft.plan_chunks(p, cap)
    assert len(chunks) > 1 and sum(c.pairs for c in chunks) == p.N * p.groups
    if cap == 1:
        assert all(c.pairs == 1 for c in chunks)
    solver_check.check(runner(engine, cap), p, seed=6)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_fused_epilogue(engine, layout):
    g = torch.Generator().manual_seed(7)
    y = (2, 6, 8, 7)
    res = to_layout(torch.randn(y, generator=g), layout).to(torch.bfloat16)
    chain = (Sum(res, 0.5), Binary("mul", torch.rand(1, 6, 1, 1, generator=g).to(torch.bfloat16) + 0.5),
             Eltwise("gelu_erf"), Binary("add", torch.randn(y, generator=g).to(torch.bfloat16)))
    p = ConvProblem.create("fwd", (2, 3, 8, 7), (6, 1, 7, 7), dtype=torch.bfloat16, out_dtype=torch.float32,
                           layout=layout, padding=3, groups=3, has_bias=True,
                           post_ops=tuple(o.signature() for o in chain))
    solver_check.check(runner(engine, 9000), p, bias=torch.randn(6, generator=g), post_ops=chain)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weights"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=solver_check.case_id)
@pytest.mark.parametrize("cap", [None, 5000])
def test_workspace_is_what_is_held(engine, direction, case, cap, monkeypatch):
    """The ledger of an invocation (every buffer the plan holds, step by step) peaks at
    exactly workspace_size."""
    ledgers = []

    def new():
        ledgers.append(fft.Ledger())
        return ledgers[-1]
    monkeypatch.setattr(fft, "new_ledger", new)
    xs, ws, kw = case
    p = ConvProblem.create(direction, xs, ws, dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(8)
    args = ConvArgs(x=torch.randn(p.x_shape, generator=g), w=torch.randn(p.w_shape, generator=g),
                    dy=torch.randn(p.y_shape, generator=g))
    fft.conv(p, args, engine=engine, cap=cap)
    assert ledgers[0].live == 0
    assert ledgers[0].peak == fft.workspace_bytes(p, cap) > 0
    if cap is None:
        assert REGISTRY.get({"fwd": 63, "bwd_data": 64, "bwd_weights": 65}[direction]).workspace_size(p) \
            == ledgers[0].peak


def test_fast_len():
    for n in (1, 2, 7, 11, 13, 97, 1000, 4097, 8191, 16383, 12287, 65537):
        m = fft.fast_len(n)
        assert m >= n
        r = m
        for f in (2, 3, 5, 7):
            while r % f == 0:
                r //= f
        assert r == 1
        assert all(fft.fast_len(k) != k for k in range(n, m)), (n, m)
    assert fft.fast_len(16383) == 16384 and fft.fast_len(12287) == 12288


def test_transform_sizes():
    """Nf = fast length of max(L + pb, L + pa, F, Lo): 2L for a causal filter as long as
    the input, about 1.5 L for 'same'."""
    p = ConvProblem.create("fwd", (8, 768, 8192), (768, 1, 8192), dtype=torch.bfloat16, device="cuda",
                           padding=[(8191, 0)], groups=768)
    assert fft.fft_geom(p).fft_sizes == (16384,)
    assert not fft.fft_reasons(p)
    p = ConvProblem.create("fwd", (8, 768, 8192), (768, 1, 8192), dtype=torch.bfloat16, padding="same", groups=768)
    assert fft.fft_geom(p).fft_sizes == (12288,)
    p = ConvProblem.create("fwd", (32, 384, 56, 56), (384, 1, 31, 31), dtype=torch.bfloat16, padding=15,
                           groups=384)
    assert fft.fft_geom(p).fft_sizes == (72, 72) and not fft.fft_reasons(p)


def test_not_applicable_reasons():
    mk = lambda **kw: ConvProblem.create("fwd", **{"x_shape": (2, 4, 40, 40), "w_shape": (4, 1, 9, 9),  # noqa: E731
                                                   "dtype": torch.float32, "groups": 4, **kw})
    s = REGISTRY.get("fft_cpu_fwd")
    assert s.is_applicable(mk())
    assert any("stride 1" in r for r in s.not_supported_reasons(mk(stride=2)))
    assert any("dilation 1" in r for r in s.not_supported_reasons(mk(dilation=2)))
    small = mk(w_shape=(4, 1, 3, 3))
    assert any("taps" in r for r in s.not_supported_reasons(small))
    assert any("taps" in r for r in REGISTRY.get("fft_fwd").not_supported_reasons(small))
    dense = ConvProblem.create("fwd", (1, 1024, 56, 56), (1024, 1024, 31, 31), dtype=torch.float32)
    assert any("weight spectrum" in r for r in s.not_supported_reasons(dense))
    huge = ConvProblem.create("fwd", (1, 1, (1 << 24) + 1), (1, 1, 64), dtype=torch.float32)
    assert any("points per row" in r for r in s.not_supported_reasons(huge))
    cuda_only = mk().__class__.create("fwd", (2, 4, 40, 40), (4, 1, 9, 9), dtype=torch.float32, groups=4,
                                      device="cuda")
    assert any("device" in r for r in s.not_supported_reasons(cuda_only))
    assert REGISTRY.get("fft_fwd").is_applicable(cuda_only)
    for sid, d in ((60, "fwd"), (61, "bwd_data"), (62, "bwd_weights"), (63, "fwd"), (64, "bwd_data"),
                   (65, "bwd_weights")):
        q = cuda_only.with_direction(d) if sid < 63 else mk().with_direction(d)
        sv = REGISTRY.get(sid)
        assert sv.family == "fft" and sv.is_applicable(q) and sv.estimate(q) > 0 and sv.workspace_size(q) > 0


def test_public_api_forced_and_disabled(monkeypatch):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 50, generator=g)
    w = torch.randn(3, 1, 50, generator=g)
    kw = dict(padding=[(49, 0)], groups=3)
    y = nnprim.conv_forward(x, w, solver="fft_cpu_fwd", **kw)
    p = ConvProblem.from_tensors(x, w, **kw)
    exp = ref.conv_fwd_f64(p, x, w)
    assert ((y.double() - exp).norm() / exp.norm()).item() < 1e-5
    dy = torch.randn(y.shape, generator=g)
    dx = nnprim.conv_backward_data(dy, w, x.shape, solver="fft_cpu_bwd_data", **kw)
    dw = nnprim.conv_backward_weights(dy, x, w.shape, solver="fft_cpu_bwd_weights", **kw)
    assert ((dx.double() - ref.conv_bwd_data_f64(p, dy, w)).norm() / dx.double().norm()).item() < 1e-5
    assert ((dw.double() - ref.conv_bwd_weights_f64(p, dy, x)).norm() / dw.double().norm()).item() < 1e-5
    names = [s.name for s in ranking.heuristic_order(p)]
    assert "fft_cpu_fwd" in names
    nnprim.disable_families("fft")
    try:
        assert "fft_cpu_fwd" not in [s.name for s in ranking.heuristic_order(p)]
    finally:
        nnprim.enable_families("fft")


def test_long_depthwise_prefers_fft_on_cpu():
    """A long causal depthwise conv1d: the FFT solver's estimate is far below the GEMM's."""
    p = ConvProblem.create("fwd", (2, 16, 4096), (16, 1, 4096), dtype=torch.float32, padding=[(4095, 0)], groups=16)
    order = ranking.heuristic_order(p)
    assert order[0].family == "fft", [s.name for s in order]


def test_out_with_other_strides():
    """An output view with non-standard strides gets the result copied in."""
    p = ConvProblem.create("fwd", (2, 2, 20), (2, 1, 16), dtype=torch.float32, padding=((15, 0),), groups=2)
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(p.x_shape, generator=g), torch.randn(p.w_shape, generator=g)
    big = torch.full((2, 4, 20), float("nan"))
    out = big[:, ::2]
    fft.conv(p, ConvArgs(x=x, w=w), out=out, engine="triton")
    exp = ref.conv_fwd_f64(p, x, w)
    assert ((out.double() - exp).norm() / exp.norm()).item() < 1e-5
    y = fft.conv(p, ConvArgs(x=x[:, :, :], w=w), engine="triton")
    assert tuple(y.shape) == p.y_shape and empty_in_layout(p.y_shape, "nchw").stride() == y.stride()
