"""CPU Winograd forward (solver 14) against the float64 reference: NaN-poisoned workspace
and output, random never-zero inputs, odd sizes (partial last tiles), padding 0/1/2 and
asymmetric, both layouts, F(2x2) and F(4x4), blocks of images and of tile rows, bias +
post-op chain, out_dtype; the explicit transform programs against winograd_math."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv import cpu_winograd as cw
from nnprim.conv import reference as ref
from nnprim.conv.winograd_math import VARIANTS
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search.ranking import heuristic_order

from . import solver_check

# every test on both transform paths (tests/conv/conftest.py)
pytestmark = pytest.mark.usefixtures("winograd_transforms")


SOLVER = cw.CpuWinogradFwd()
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    return solver_check.poison_cpu(monkeypatch, cw)


def rnd(shape, dtype, layout, g):
    t = torch.randn(shape, generator=g)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.3), t)
    return to_layout(t.to(dtype), layout)


def run(x_shape, K, layout, padding=1, m=None, dtype=torch.float32, block_bytes=None, bias=False,
        post=None, out_dtype=None):
    g = torch.Generator().manual_seed(sum(x_shape) + K)
    N, C, H, W = x_shape
    x, w = rnd(x_shape, dtype, layout, g), rnd((K, C, 3, 3), dtype, layout, g)
    p0 = ConvProblem.create("fwd", x.shape, w.shape, dtype=dtype, layout=layout, padding=padding)
    b = torch.randn(K, generator=g) if bias else None
    ops = post(p0, g) if post else ()
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=dtype, layout=layout, padding=padding,
                           out_dtype=out_dtype, has_bias=bias, post_ops=tuple(o.signature() for o in ops))
    assert SOLVER.is_applicable(p), SOLVER.not_supported_reasons(p)
    inv = cw.prepare_with(p, m, block_bytes)
    y = inv(ConvArgs(x=x, w=w, bias=b, post_ops=ops))
    exp = ref.conv_fwd_f64(p, x, w, b, ops)
    assert y.shape == exp.shape and y.dtype == p.out_dtype
    assert not torch.isnan(y).any(), "unwritten (poisoned) elements remain"
    err = ((y.double() - exp).norm() / exp.norm()).item()
    assert err < TOL[dtype if p.out_dtype == torch.float32 else p.out_dtype], err
    return y, inv.plan


CASES = {   # x shape, K, padding
    "odd_tails_pad1": ((2, 3, 7, 9), 5, 1),
    "no_pad": ((1, 4, 6, 11), 3, 0),
    "pad2_tiny": ((1, 2, 3, 3), 4, 2),
    "asym": ((2, 5, 9, 10), 6, ((2, 0), (1, 2))),
    "exact_tiles": ((3, 8, 10, 10), 8, 1),
    # more than one 16-wide run of channels, columns and filters, each with a tail: the
    # native nchw staging and output transposes' full and masked 16 x 16 blocks
    "wide_tails": ((2, 19, 7, 37), 21, 1),
}


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward(case, layout, m):
    xs, K, pad = CASES[case]
    _, plan = run(xs, K, layout, pad, m)
    assert plan.m == m


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_row_blocks_and_image_blocks(layout, poison, monkeypatch):
    """Tiny blocks: tile rows of one image per block, then pairs of images."""
    monkeypatch.setattr(cw, "MIN_TILES", 1)
    _, plan = run((3, 5, 13, 7), 4, layout, 1, 4, block_bytes=1)
    assert len(plan.blocks) == 3 * plan.TH and plan.nb == 1
    _, plan = run((4, 5, 9, 7), 4, layout, ((0, 2), (1, 0)), 2, block_bytes=2 * 4 * 5 * 300 * 4)
    assert 1 < len(plan.blocks) < 4 * plan.TH
    assert poison[-1] == plan.workspace_bytes()


def _chain(p, g):
    res = to_layout(torch.randn(p.y_shape, generator=g), p.layout)
    return (Sum(res, 0.5), Eltwise("relu", 0.1), Binary("mul", torch.rand(1, p.K, 1, 1, generator=g) + 0.5),
            Binary("add", torch.randn(1, 1, 1, p.y_shape[3], generator=g)), Eltwise("tanh"))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("m", [2, 4])
def test_bias_and_post_ops(layout, m):
    run((2, 4, 9, 6), 5, layout, 1, m, bias=True, post=_chain)
    run((1, 3, 5, 7), 4, layout, 1, m, bias=True, post=lambda p, g: (Eltwise("relu"),), block_bytes=1)
    run((2, 3, 6, 9), 4, layout, 2, m, post=lambda p, g: (Binary("add", torch.randn(1, p.K, 1, 1, generator=g)),
                                                       Sum(torch.randn(p.y_shape, generator=g), 2.0)))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_dtypes(layout):
    run((2, 5, 7, 9), 6, layout, 1, 4, dtype=torch.bfloat16)
    run((2, 5, 7, 9), 6, layout, 1, 4, dtype=torch.bfloat16, out_dtype=torch.float32, bias=True, post=_chain)
    run((1, 4, 6, 5), 3, layout, 1, 2, dtype=torch.float16, bias=True, post=_chain, block_bytes=1)


FUSED_CASES = {   # x shape, K (a multiple of 16), padding, block_bytes
    "tails": ((2, 19, 7, 37), 32, 1, None),
    "asym_k16": ((1, 5, 9, 10), 16, ((2, 0), (1, 2)), None),
    "row_blocks": ((3, 5, 13, 7), 48, 1, 1),
}


@pytest.mark.parametrize("group_bytes", [1, None])
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_pass(case, layout, m, group_bytes, winograd_transforms, monkeypatch):
    """K a multiple of 16 and a small U: the fused native pass (input transform, GEMMs and
    output transform per group of tile rows; group_bytes 1: one tile row a group) with bias and
    the post-op chain, against float64; on the torch-op path the same plan runs the blocked
    passes."""
    monkeypatch.setattr(cw, "MIN_TILES", 1)
    if group_bytes is not None:
        monkeypatch.setattr(cw, "FUSED_GROUP_BYTES", group_bytes)
    xs, K, pad, bb = FUSED_CASES[case]
    calls = []
    fused = cw._fused_block
    monkeypatch.setattr(cw, "_fused_block", lambda *a: calls.append(1) or fused(*a))
    _, plan = run(xs, K, layout, pad, m, bias=True, post=_chain, block_bytes=bb)
    assert plan.fused
    assert bool(calls) == (winograd_transforms == "native")
    run(xs, K, layout, pad, m, dtype=torch.bfloat16, block_bytes=bb)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_blocked_gemms_on_the_register_tile(layout, m, monkeypatch):
    """K a multiple of 16 without the fused pass: the blocked alpha^2 GEMMs on the native
    register tile (wino_gemm; torch.bmm on the torch-op path), tails, row blocks, bias + chain."""
    monkeypatch.setattr(cw, "USE_FUSED", False)
    monkeypatch.setattr(cw, "MIN_TILES", 1)
    calls = []
    if cw.native.ops() is not None:
        nat = cw.native.ops()

        class Spy:
            def __getattr__(self, name):
                return getattr(nat, name)

            def wino_gemm(self, *a):
                calls.append(1)
                return nat.wino_gemm(*a)
        monkeypatch.setattr(cw.native, "ops", lambda: Spy())
    _, plan = run((2, 19, 7, 37), 32, layout, 1, m, bias=True, post=_chain)
    assert not plan.fused
    _, plan = run((3, 5, 13, 7), 48, layout, ((0, 2), (1, 0)), m, block_bytes=1)
    assert len(plan.blocks) > 1
    assert bool(calls) == (cw.native.ops() is not None and isinstance(cw.native.ops(), Spy))


@pytest.mark.parametrize("threads,tile_rows,row_bytes,want", [
    (2, 56, 229376, 4),       # rn50_r4 F(2x2) at 1 MiB: 14 groups of 4
    (2, 63, 1 << 20, 1),      # one row fills the budget
    (2, 9, 100, 5),           # all rows fit: split in two for the two threads
    (2, 7, 300 << 10, 2),     # 3 rows fit: 3 groups -> 4 groups of 2
    (1, 7, 300 << 10, 3),
    (4, 10, 1 << 18, 3),      # 4 rows fit: 3 groups -> 4 groups of 3
])
def test_group_rows_fill_the_threads(threads, tile_rows, row_bytes, want, monkeypatch):
    monkeypatch.setattr(cw, "FUSED_GROUP_BYTES", 1 << 20)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert cw._group_rows(tile_rows, row_bytes) == want


def _u_f64(w: torch.Tensor, m: int, flipped: bool) -> torch.Tensor:
    g = torch.tensor(VARIANTS[m].G, dtype=torch.float64)
    wf = w.double().flip(2, 3) if flipped else w.double()
    return torch.einsum("ar,bs,kcrs->abck", g, g, wf).reshape((m + 2) ** 2, w.shape[1], w.shape[0])


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("view", ["nchw", "nhwc", "transposed"])
def test_native_filter_transform(view, dtype, m):
    """wino_filter: U (alpha^2, C, K) = G w G^T of any-strided filters (the backward data's
    transposed view, flipped), K with a 16-lane tail, against float64 on a poisoned U."""
    nat = cw.native.ops()
    if nat is None:
        pytest.skip("no C++ compiler: the native transforms are not built")
    g = torch.Generator().manual_seed(m)
    K, C = 37, 70
    base = torch.randn(C, K, 3, 3, generator=g) if view == "transposed" else torch.randn(K, C, 3, 3, generator=g)
    w = base.transpose(0, 1) if view == "transposed" else to_layout(base, view)
    w = w.to(dtype)
    for flipped in (False, True):
        U = torch.full(((m + 2) ** 2, C, K), float("nan"))
        nat.wino_filter(w, cw._g_matrix(m), U, flipped)
        exp = _u_f64(w, m, flipped)
        assert not torch.isnan(U).any()
        assert ((U.double() - exp).norm() / exp.norm()).item() < 1e-6


def test_native_gemm_on_row_slices():
    """wino_gemm on V / Mp slices along the tile dimension (the 3-D depth taps), with add."""
    nat = cw.native.ops()
    if nat is None:
        pytest.skip("no C++ compiler: the native transforms are not built")
    g = torch.Generator().manual_seed(5)
    V = torch.randn(16, 150, 37, generator=g)
    U = torch.randn(16, 37, 48, generator=g)
    Mp = torch.full((16, 130, 48), float("nan"))
    nat.wino_gemm(V[:, 3:103], U, Mp[:, 10:110], False)
    nat.wino_gemm(V[:, 50:150], U, Mp[:, 10:110], True)
    exp = torch.bmm(V[:, 3:103].double(), U.double()) + torch.bmm(V[:, 50:150].double(), U.double())
    got = Mp[:, 10:110].double()
    assert ((got - exp).norm() / exp.norm()).item() < 1e-6
    assert torch.isnan(Mp[:, :10]).all() and torch.isnan(Mp[:, 110:]).all()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        nat.wino_gemm(V, torch.randn(16, 37, 40), torch.empty(16, 150, 40), False)


def test_fused_only_for_small_filters():
    def fuses(x, w):
        return cw.fuses(ConvProblem.create("fwd", x, w, dtype=torch.float32), 4)
    assert fuses((1, 64, 8, 8), (64, 64, 3, 3)) == cw.native.expected()
    assert not fuses((1, 64, 8, 8), (40, 64, 3, 3))        # K % 16
    assert not fuses((1, 256, 8, 8), (256, 256, 3, 3))     # U 9.4 MB


@pytest.mark.parametrize("planned_native", [True, False])
def test_nchw_output_block_either_way(planned_native, poison, monkeypatch):
    """A plan made without the native transforms keeps an f32 block for nchw outputs
    (the torch ops write it channels-last, then one copy with the residual fused); made with
    them, it has none and the native output transform writes y in place. Either plan runs on
    either transform path (the library can fail to build or appear after planning)."""
    make_plan = cw.make_plan
    monkeypatch.setattr(cw, "make_plan", lambda *a, **k: replace(make_plan(*a, **k), native=planned_native))
    _, plan = run((2, 19, 9, 21), 17, "nchw", 1, 4, bias=True, post=_chain)
    assert plan.native == planned_native and ("y" in plan.buffers()) != planned_native
    assert poison[-1] == plan.workspace_bytes()


def test_workers_pool():
    """The optional pool: each worker runs its share of the blocks on one thread."""
    g = torch.Generator().manual_seed(3)
    x, w = rnd((3, 4, 9, 9), torch.float32, "nhwc", g), rnd((5, 4, 3, 3), torch.float32, "nhwc", g)
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=torch.float32, layout="nhwc", padding=1)
    inv = cw.prepare_with(p, 4, 1, workers=2)
    assert inv.plan.workers == 2
    threads = torch.get_num_threads()
    y = inv(ConvArgs(x=x, w=w))
    assert torch.get_num_threads() == threads
    exp = ref.conv_fwd_f64(p, x, w, None, ())
    assert ((y.double() - exp).norm() / exp.norm()).item() < 1e-5


@pytest.mark.parametrize("m", [2, 4])
def test_programs_match_matrices(m):
    """The explicit add/sub programs compute B^T and A^T of winograd_math."""
    tr = VARIANTS[m]
    bt, at, nt_in, nt_out = cw.PROGRAMS[m]
    a = tr.alpha
    for prog, mat, nout, nt in ((bt, tr.BT, a, nt_in), (at, tr.AT, m, nt_out)):
        d = list(torch.eye(a, dtype=torch.float64))           # d[k] = e_k: outputs are columns
        o = [torch.full((a,), float("nan"), dtype=torch.float64) for _ in range(nout)]
        prog(d, o, [torch.empty(a, dtype=torch.float64) for _ in range(nt)])
        assert torch.equal(torch.stack(o), torch.tensor(mat, dtype=torch.float64))


def test_filter_matrix():
    """Gk (alpha^2 x 9) is G (x) G: U = G w G^T."""
    w = torch.randn(3, 3, dtype=torch.float64)
    for tr in VARIANTS.values():
        g = torch.tensor(tr.G, dtype=torch.float64)
        u = (cw.filter_matrix(tr).double() @ w.reshape(9)).view(tr.alpha, tr.alpha)
        torch.testing.assert_close(u, g @ w @ g.T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw,why", [
    (dict(w=(4, 3, 3, 3), stride=2), "stride"),
    (dict(w=(4, 3, 3, 3), dilation=2), "dilation"),
    (dict(w=(4, 3, 5, 5)), "filter"),
    (dict(w=(4, 3, 3, 1)), "filter"),
    (dict(w=(6, 1, 3, 3), groups=3), "groups"),
    (dict(w=(4, 3, 3, 3), padding=3), "padding"),
    (dict(w=(4, 3, 3, 3), padding=((0, 3), (1, 1))), "padding"),
    (dict(x=(2, 3, 10), w=(4, 3, 3)), "2-D"),
    (dict(x=(2, 3, 6, 6, 6), w=(4, 3, 3, 1, 3)), "filter"),
    (dict(w=(4, 3, 3, 3), direction="bwd_data"), "direction"),
    (dict(x=(1, 8192, 4, 4), w=(4096, 8192, 3, 3)), "filter transform"),
])
def test_not_applicable(kw, why):
    kw = dict(kw)
    x, w, d = kw.pop("x", (2, 3, 10, 10)), kw.pop("w"), kw.pop("direction", "fwd")
    p = ConvProblem.create(d, x, w, dtype=torch.float32, **kw)
    reasons = SOLVER.not_supported_reasons(p)
    assert any(why in r for r in reasons), reasons


def test_public_api_forced_and_deterministic():
    g = torch.Generator().manual_seed(5)
    x, w = rnd((2, 3, 8, 7), torch.float32, "nchw", g), rnd((4, 3, 3, 3), torch.float32, "nchw", g)
    b = torch.randn(4, generator=g)
    y = nnprim.conv_forward(x, w, b, padding=1, solver="cpu_winograd_fwd", post_ops=(Eltwise("relu"),))
    y2 = nnprim.conv_forward(x, w, b, padding=1, solver=14, post_ops=(Eltwise("relu"),))
    assert torch.equal(y, y2) and SOLVER.deterministic and SOLVER.family == "winograd"
    exp = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), b.double(), padding=1))
    assert ((y.double() - exp).norm() / exp.norm()).item() < 1e-5


def test_heuristic_ranks_it_first_on_the_suite_3x3():
    """The suite's 3x3 stride-1 ungrouped f32 problems run Winograd by default (measured faster)."""
    suite = json.loads((Path(nnprim.__file__).parent / "data" / "suites" / "conv_cpu.json").read_text())
    n = 0
    for s in suite["problems"]:
        p = ConvProblem.create("fwd", (s["N"], s["C"], *s["spatial"]), (s["K"], s["C"] // s["groups"], *s["filter"]),
                               stride=s["stride"], padding=s["padding"], dilation=s["dilation"],
                               groups=s["groups"], layout=s["layout"], dtype=torch.float32)
        first = heuristic_order(p)[0]
        if SOLVER.is_applicable(p):
            n += 1
            assert first.id == 14, (s["name"], first)
        else:
            assert first.id != 14
    assert n == 4      # the three 2-D 3x3 problems and c3d_small
