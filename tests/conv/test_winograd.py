"""Winograd convolution (solvers 50-55) against the float64 reference through
TRITON_INTERPRET=1, with NaN-poisoned outputs and work buffers; workspace accounting,
chunks, not-applicable reasons, registration."""
import pytest
import torch

import nnprim
from nnprim.conv import winograd as wg
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search import ranking
from nnprim.search.solver import REGISTRY

from . import solver_check

SOLVERS = {50: (2, True), 51: (4, True), 52: (2, True), 53: (4, True), 54: (4, False), 55: (4, False),
           56: (2, None), 57: (4, None)}
CASES = [   # odd sizes (tails of 2- and 4-output tiles), asymmetric padding, groups of 16
    ((2, 16, 7, 9), (16, 16, 3, 3), dict(padding=1)),
    ((1, 32, 6, 5), (32, 16, 3, 3), dict(padding=((2, 0), (1, 2)), groups=2)),
    ((2, 16, 11), (17, 16, 3), dict(padding=((0, 2),))),
]


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Work buffers start as NaN (an unwritten element shows); records their bytes."""
    sizes = []

    def buf(numel, dtype, device):
        sizes.append(numel * dtype.itemsize)
        return torch.full((numel,), float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(wg, "new_buffer", buf)
    return sizes


def runner(m: int, fused: bool | None) -> dict:
    go = lambda p, a, out: wg.conv(p, a, out, m=m, fused=fused)  # noqa: E731
    return {"fwd": go, "bwd_data": go, "bwd_weights": lambda p, a, out: wg.conv_bwd_weights(p, a, out, m=m)}


@pytest.mark.parametrize("sid", list(SOLVERS))
@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_f32_vs_reference(sid, case):
    s = REGISTRY.get(sid)
    direction = next(iter(s.directions))
    xs, ws, kw = case
    layout = "nhwc" if (sid + (sid > 55)) % 2 else "nchw"
    p = ConvProblem.create(direction, xs, ws, dtype=torch.float32, layout=layout, **kw)
    assert s.is_applicable(p), s.not_supported_reasons(p)
    solver_check.check(runner(*SOLVERS[sid]), p, seed=sid)


@pytest.mark.parametrize("sid", [50, 51, 53, 54, 57])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half(sid, dtype):
    direction = next(iter(REGISTRY.get(sid).directions))
    p = ConvProblem.create(direction, (2, 16, 6, 7), (16, 16, 3, 3), dtype=dtype, layout="nhwc", padding=1)
    solver_check.check(runner(*SOLVERS[sid]), p, seed=1)
    p = ConvProblem.create(direction, (2, 16, 10), (16, 16, 3), dtype=dtype, padding=1)
    solver_check.check(runner(*SOLVERS[sid]), p, seed=2)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_epilogue(fused):
    g = torch.Generator().manual_seed(3)
    y = (2, 16, 5, 6)
    chain = (Sum(to_layout(torch.randn(y, generator=g), "nhwc").to(torch.bfloat16), 0.5),
             Binary("mul", torch.rand(1, 16, 1, 1, generator=g).to(torch.bfloat16) + 0.5), Eltwise("silu"))
    p = ConvProblem.create("fwd", (2, 16, 5, 6), (16, 16, 3, 3), dtype=torch.bfloat16, out_dtype=torch.float32,
                           layout="nhwc", padding=1, has_bias=True, post_ops=tuple(o.signature() for o in chain))
    solver_check.check(runner(4, fused), p, bias=torch.randn(16, generator=g), post_ops=chain)
    p32 = ConvProblem.create("fwd", (1, 16, 5, 6), (16, 16, 3, 3), dtype=torch.float32, padding=1, has_bias=True,
                             post_ops=(Eltwise("relu", 0.1).signature(),))
    solver_check.check(runner(2, True), p32, bias=torch.randn(16, generator=g), post_ops=(Eltwise("relu", 0.1),))


@pytest.mark.parametrize("sid", [50, 51, 54])
def test_workspace_is_what_is_allocated(sid, poisoned_buffers, monkeypatch):
    """Every buffer the invoker allocates is counted by workspace_size; a small cap makes
    several chunks of images, with the same result."""
    m, fused = SOLVERS[sid]
    p = ConvProblem.create("fwd", (3, 16, 6, 7), (16, 16, 3, 3), dtype=torch.float32, padding=1)
    solver_check.check(runner(m, fused), p, seed=4)
    assert sum(poisoned_buffers) == REGISTRY.get(sid).workspace_size(p)
    poisoned_buffers.clear()
    plan = wg.WinogradPlan(p, m, fused)
    monkeypatch.setattr(wg, "WORKSPACE_CAP", plan.u_numel * 4 + 1)      # room for one image
    small = wg.WinogradPlan(p, m, fused)
    assert len(small.chunks) == p.N and small.workspace_bytes < plan.workspace_bytes
    solver_check.check(runner(m, fused), p, seed=4)
    assert sum(poisoned_buffers) == small.workspace_bytes


@pytest.mark.parametrize("m", [2, 4])
def test_bwd_weights_splits_and_chunks(m, poisoned_buffers, monkeypatch):
    """The tile reduction in several splits, and in several chunks of images (later ones
    adding to the first one's partial sums): the same weight gradient; the workspace is
    what is allocated."""
    p = ConvProblem.create("bwd_weights", (3, 16, 18, 17), (16, 16, 3, 3), dtype=torch.float32, layout="nhwc",
                           padding=((1, 0), (2, 1)))
    monkeypatch.setattr(wg, "NUM_SMS", 4096)                     # as many splits as the tiles allow
    monkeypatch.setattr(wg, "SPLIT_TILES", 32)
    plan = wg.WinogradBwdWeightsPlan(p, m)
    assert plan.slots > 1
    solver_check.check(runner(m, None), p, seed=5)
    assert sum(poisoned_buffers) == plan.workspace_bytes == REGISTRY.get(55 + m // 2).workspace_size(p)
    poisoned_buffers.clear()
    monkeypatch.setattr(wg, "WORKSPACE_CAP", 1)                 # one image per chunk
    small = wg.WinogradBwdWeightsPlan(p, m)
    assert len(small.chunks) == p.N
    solver_check.check(runner(m, None), p, seed=5)
    assert sum(poisoned_buffers) == small.workspace_bytes


def test_not_applicable_reasons():
    s = REGISTRY.get("winograd_f2_fwd")
    mk = lambda **kw: ConvProblem.create(**{"direction": "fwd", "x_shape": (1, 16, 8, 8),  # noqa: E731
                                            "w_shape": (16, 16, 3, 3), "dtype": torch.float32, **kw})
    assert s.is_applicable(mk())
    reasons = lambda q, sv=s: " ".join(sv.not_supported_reasons(q))  # noqa: E731
    assert "3-tap / 3x3" in reasons(mk(w_shape=(16, 16, 5, 5)))
    assert "stride 1" in reasons(mk(stride=2))
    assert "dilation 1" in reasons(mk(dilation=2))
    assert ">= 16" in reasons(mk(w_shape=(16, 1, 3, 3), groups=16))
    assert "1D and 2D" in reasons(mk(x_shape=(1, 16, 4, 4, 4), w_shape=(16, 16, 3, 3, 3)))
    bd = REGISTRY.get("winograd_f2_bwd_data")
    assert "padding <= 2" in reasons(mk(direction="bwd_data", padding=3), bd)
    assert bd.is_applicable(mk(direction="bwd_data", padding=2))
    assert "direction" in reasons(mk(direction="bwd_weights"))
    assert REGISTRY.get("winograd_f4_bwd_weights").is_applicable(mk(direction="bwd_weights", padding=3))
    for half in (torch.float16, torch.bfloat16):   # ~2e-2 off on half inputs (TF32 GEMM): f32 only
        assert "f32 only" in reasons(mk(direction="bwd_weights", dtype=half), REGISTRY.get("winograd_f4_bwd_weights"))
        assert REGISTRY.get("winograd_f2_bwd_weights").is_applicable(mk(direction="bwd_weights", dtype=half))
    cpu = ConvProblem.create("fwd", (1, 16, 8, 8), (16, 16, 3, 3), dtype=torch.float32)
    for sid in SOLVERS:
        sv = REGISTRY.get(sid)
        q = cpu if "fwd" in sv.directions else cpu.with_direction("bwd_data")
        assert sv.family == "winograd" and sv.estimate(q) > 0 and sv.workspace_size(q) > 0


def test_precision_follows_torch_matmul_setting():
    """f32: an exact GEMM by default; 3xTF32 (f32-accurate) when torch allows reduced
    float32 matmul precision; half inputs: f32 operands with a TF32 GEMM."""
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert wg.operand_dtype(4, torch.float32) == (torch.float32, "ieee")
        torch.set_float32_matmul_precision("high")
        assert wg.operand_dtype(4, torch.float32) == (torch.float32, "tf32x3")
    finally:
        torch.set_float32_matmul_precision(saved)
    assert wg.operand_dtype(2, torch.bfloat16) == (torch.float32, "tf32")


def test_registered_switchable_and_explained(capsys):
    p = ConvProblem.create("fwd", (1, 16, 8, 8), (16, 16, 3, 3), dtype=torch.float32, padding=1)
    names = [s.name for s in ranking.heuristic_order(p)]
    assert {"winograd_f2_fwd", "winograd_f4_fwd", "winograd_f4_nonfused_fwd"} <= set(names)
    nnprim.disable_families("winograd")
    try:
        assert not any(n.startswith("winograd") for n in (s.name for s in ranking.heuristic_order(p)))
    finally:
        nnprim.enable_families("winograd")
    nnprim.explain(p)
    out = capsys.readouterr().out
    assert "winograd_f4_nonfused_fwd" in out and "fft_fwd" in out


def test_estimate_host_floor_counts_launches():
    """On CUDA a tiny layer costs at least the host work of its launches: more unfused."""
    kw = dict(dtype=torch.bfloat16, padding=1, device="cuda", layout="nhwc")
    p = ConvProblem.create("bwd_data", (1, 16, 8, 8), (16, 16, 3, 3), **kw)
    fused, unfused = REGISTRY.get("winograd_f4_bwd_data"), REGISTRY.get("winograd_f4_nonfused_bwd_data")
    assert fused.estimate(p) == wg.host_floor_ms(p, 2) < unfused.estimate(p) == wg.host_floor_ms(p, 3)
