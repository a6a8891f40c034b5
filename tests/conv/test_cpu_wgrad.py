"""bf16 backward weights on avx512_bf16 without AMX (nnprim/conv/cpu_wgrad.py, solver 82's
native path there) against the float64 reference: groups with 1-70 channels (tile row and
column tails), strides, dilation, padding, 1-3D, both layouts, tiny chunks (lines cut into
segments, many passes over the output), f32 output; the segment cover and the channel-major
staging checked on their own."""

import itertools
import math

import pytest
import torch

from nnprim.conv import cpu_brgemm, cpu_wgrad
from nnprim.conv.cpu_brgemm import CpuBrgemmBwdWeights
from nnprim.conv.cpu_tap import tap_grid
from nnprim.conv.reference import reference
from nnprim.problems.conv import ConvProblem

from . import solver_check

NATIVE = cpu_brgemm.LIBRARY.ops() is not None
RUNS = NATIVE and "avx512_bf16" in cpu_wgrad.cpu_flags()

CASES = {
    "3x3_pad": ((2, 6, 9, 11), (4, 6, 3, 3), dict(padding=1)),
    "odd_w_g2_dil": ((3, 8, 7, 9), (70, 4, 3, 2), dict(padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2)),
    "1x1_no_junk": ((2, 18, 5, 3), (24, 18, 1, 1), {}),      # lines touch: pairs across lines
    "s2_asym": ((1, 20, 9, 8), (40, 20, 3, 2), dict(stride=(2, 3), dilation=2, padding=((2, 0), (1, 2)))),
    "3d_g4": ((2, 16, 5, 6, 7), (8, 4, 3, 1, 2), dict(groups=4, padding=1)),
    "1d_long": ((1, 6, 1501), (10, 6, 5), dict(padding=2, stride=2)),
    "g8_c16": ((2, 128, 10, 9), (128, 16, 3, 3), dict(padding=1, groups=8)),
    "c1_k1": ((2, 1, 6, 7), (1, 1, 3, 3), dict(padding=1)),
}


def _check(p, args, out):
    ref = reference(p, args)
    assert tuple(out.shape) == tuple(p.w_shape) and out.dtype == p.out_dtype and not out.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if p.out_dtype == torch.float32:
        assert err < 1e-5, err
    else:
        one_rounding = ((ref.to(p.out_dtype).double() - ref).norm() / ref.norm()).item()
        assert err <= 1.5 * one_rounding + 1e-6, (err, one_rounding)


@pytest.mark.skipif(not RUNS, reason="needs the native library and avx512_bf16")
@pytest.mark.parametrize("chunk", [None, 8, 30])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(case, layout, chunk, monkeypatch):
    solver_check.poison_cpu(monkeypatch, cpu_brgemm)
    monkeypatch.setattr(cpu_wgrad, "own_kernel", lambda p: p.dtype == torch.bfloat16)   # AMX CPUs too
    if chunk:
        monkeypatch.setattr(cpu_wgrad, "chunk_positions", lambda p: chunk)
    xs, ws, kw = CASES[case]
    p, args = solver_check.random_case("bwd_weights", xs, ws, layout=layout, dtype=torch.bfloat16, **kw)
    assert cpu_brgemm._Plan(p).own_wgrad
    _check(p, args, CpuBrgemmBwdWeights().prepare(p)(args))


@pytest.mark.skipif(not RUNS, reason="needs the native library and avx512_bf16")
@pytest.mark.parametrize("threads", [1, 3, 5])
@pytest.mark.parametrize("case", ["3d_g4", "c1_k1", "odd_w_g2_dil"])
def test_threads_split_by_rows(case, threads, monkeypatch):
    """Each thread's run of (group, column block, row block, tap) items, cut by rows: any
    thread count, including more threads than row blocks (c1_k1: one row a tap)."""
    solver_check.poison_cpu(monkeypatch, cpu_brgemm)
    monkeypatch.setattr(cpu_wgrad, "own_kernel", lambda p: p.dtype == torch.bfloat16)
    xs, ws, kw = CASES[case]
    p, args = solver_check.random_case("bwd_weights", xs, ws, dtype=torch.bfloat16, **kw)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = CpuBrgemmBwdWeights().prepare(p)(args)
    finally:
        torch.set_num_threads(before)
    _check(p, args, out)


@pytest.mark.skipif(not RUNS, reason="needs the native library and avx512_bf16")
def test_f32_output():
    xs, ws, kw = CASES["odd_w_g2_dil"]
    p, args = solver_check.random_case("bwd_weights", xs, ws, dtype=torch.bfloat16, out_dtype=torch.float32, **kw)
    _check(p, args, CpuBrgemmBwdWeights().prepare(p)(args))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [2, 8, 64, 2048])
def test_segments_cover_valid_positions_once(case, chunk):
    xs, ws, kw = CASES[case]
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=torch.bfloat16, **kw)
    chunks, segs = cpu_wgrad.wgrad_segments(p, chunk)
    U, _, ut = tap_grid(p)
    O = list(p.out_size)
    valid = set()
    for n in range(p.N):
        for o in itertools.product(*(range(v) for v in O)):
            valid.add(n * ut + sum(v * math.prod(U[i + 1:]) for i, v in enumerate(o)))
    covered: list[int] = []
    last = -1
    for s, ln in segs.tolist():
        assert s % 2 == 0 and ln % 2 == 0 and ln > 0 and s >= last      # even, sorted, disjoint
        covered += range(s, s + ln)
        last = s + ln
    assert valid <= set(covered) and len(covered) == len(set(covered))
    assert (set(covered) - valid) == {q for q in covered if q not in valid}     # extras are junk
    assert max(covered) < p.N * ut + 2
    for start, span, a, b in chunks.tolist():
        assert start % 2 == 0 and span % 2 == 0 and span <= max(chunk, 2)
        assert segs[a, 0] == start and segs[b - 1].sum() == start + span
    assert chunks[0, 2] == 0 and chunks[-1, 3] == len(segs) and (chunks[1:, 2] == chunks[:-1, 3]).all()


@pytest.mark.skipif(not NATIVE, reason="native CPU library unavailable")
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "strided"])
@pytest.mark.parametrize("case", ["3x3_pad", "s2_asym", "3d_g4", "1d_long", "c1_k1"])
def test_stage_channel_major(case, layout):
    """stage_cm is the position-major staging (cpu_brgemm's `stage`) transposed."""
    xs, ws, kw = CASES[case]
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=torch.bfloat16, **kw)
    x = torch.randn(xs).bfloat16()
    if layout == "nhwc":
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    elif layout == "strided":
        x = torch.randn(*xs[:-1], 2 * xs[-1]).bfloat16()[..., ::2]
    plan, ops = cpu_brgemm._Plan(p), cpu_brgemm.LIBRARY.ops()
    st = plan.x_stage
    nb = st.nbytes(p.C, torch.bfloat16)
    pm = st(ops, x, p.C, torch.bfloat16, torch.full((nb,), 255, dtype=torch.uint8))
    cm = st.channel_major(ops, x, p.C, torch.full((nb,), 255, dtype=torch.uint8))
    assert torch.equal(cm, pm.transpose(1, 2))


def test_own_kernel_gating(monkeypatch):
    p = ConvProblem.create("bwd_weights", (2, 8, 9, 9), (8, 8, 3, 3), padding=1, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_wgrad, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert cpu_wgrad.own_kernel(p)
    assert not cpu_wgrad.own_kernel(ConvProblem.create("bwd_weights", (2, 8, 9, 9), (8, 8, 3, 3), padding=1,
                                                       dtype=torch.float32))
    assert not cpu_wgrad.own_kernel(ConvProblem.create("bwd_data", (2, 8, 9, 9), (8, 8, 3, 3), padding=1,
                                                       dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_wgrad, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert not cpu_wgrad.own_kernel(p)
    monkeypatch.setattr(cpu_wgrad, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert not cpu_wgrad.own_kernel(p)


def test_chunk_positions():
    small = ConvProblem.create("bwd_weights", (8, 64, 56, 56), (64, 64, 3, 3), padding=1, dtype=torch.bfloat16)
    big = ConvProblem.create("bwd_weights", (8, 256, 14, 14), (256, 256, 3, 3), padding=1, dtype=torch.bfloat16)
    assert cpu_wgrad.chunk_positions(small) == cpu_wgrad.CHUNK
    assert cpu_wgrad.chunk_positions(big) == cpu_wgrad.CHUNK_BIG_OUT
