"""The stride-phase index maps of the Gluon conv solvers (nnprim/conv/gluon_phases.py) on CPU,
in float64 against the reference, before any kernel runs them:
  - backward data (solver 28, PHASED): a torch emulation of exactly what the kernel does
    with the phase table (per tile: its phase row, its coordinates, per sub-tap the dy
    offsets and the filter tap; per phase its strided dx view), NaN-poisoned dx, odd and
    even sizes, pad 0/1/2 and asymmetric, 1x1/3x3/5x5, dilation 1-3, stride (2,2), (2,1),
    (1,2); the tiles of all phases cover every dx element once;
  - x read per stride phase (solvers 27 and 29, `_load_x`): the phase view's box at the
    tap offset is exactly the strided window, its extent clipping exactly the missing rows;
    backward weights emulated through it."""
from __future__ import annotations

import itertools

import pytest
import torch

from nnprim.conv import gluon_conv
from nnprim.conv import gluon_phases as gp
from nnprim.conv.reference import conv_bwd_data_f64, conv_bwd_weights_f64
from nnprim.problems.conv import ConvProblem

F64 = torch.float64

CASES = [  # (x, w, options) of backward data / weights problems
    ((2, 3, 9, 11), (4, 3, 3, 3), dict(stride=2, padding=1)),
    ((1, 2, 8, 8), (3, 2, 3, 3), dict(stride=2, padding=1)),          # even sizes (rn50_r3_3x3s2's kind)
    ((2, 3, 7, 10), (2, 3, 3, 3), dict(stride=2, padding=0)),
    ((1, 2, 10, 9), (3, 2, 5, 5), dict(stride=2, padding=2)),
    ((1, 2, 11, 12), (3, 2, 5, 5), dict(stride=2, padding=1)),
    ((2, 4, 9, 8), (3, 4, 1, 1), dict(stride=2)),                     # 1x1 downsample: 3 zero phases
    ((1, 4, 7, 7), (3, 4, 1, 1), dict(stride=2, padding=1)),          # padding past the filter span
    ((1, 2, 13, 12), (3, 2, 3, 3), dict(stride=2, padding=2, dilation=2)),   # even dilation: zero phases
    ((1, 2, 13, 11), (3, 2, 3, 3), dict(stride=2, padding=3, dilation=3)),
    ((2, 3, 9, 10), (4, 3, 3, 3), dict(stride=(2, 1), padding=1)),
    ((2, 3, 10, 9), (4, 3, 3, 5), dict(stride=(1, 2), padding=(1, 2))),
    ((1, 2, 9, 11), (3, 2, 5, 3), dict(stride=2, padding=((2, 1), (0, 2)))),   # asymmetric
    ((1, 2, 2, 3), (3, 2, 3, 3), dict(stride=2, padding=1)),          # one row per phase
]
IDS = [f"{c[0][2]}x{c[0][3]}-{c[1][2]}x{c[1][3]}-{c[2]}" for c in CASES]


def make(direction, x, w, kw) -> ConvProblem:
    return ConvProblem.create(direction, x, w, dtype=torch.bfloat16, layout="nhwc", device="cuda", **kw)


def tile_coords(t, n_th, n_tw, num_m, num_n, BH, BW, BN, group_m=8):
    """The kernel's `_tile_coords`, in Python."""
    width = group_m * num_n
    first_m = (t // width) * group_m
    gsize = min(num_m - first_m, group_m)
    pid_m = first_m + (t % width) % gsize
    pid_n = (t % width) // gsize
    tw, tmp = pid_m % n_tw, pid_m // n_tw
    return tmp // n_th, (tmp % n_th) * BH, tw * BW, pid_n * BN


def shifted(t: torch.Tensor, oy: int, ox: int, rows: int, cols: int) -> torch.Tensor:
    """t[:, :, q + oy, u + ox] for q < rows, u < cols, zero outside t (TMA's zero fill)."""
    out = torch.zeros(*t.shape[:2], rows, cols, dtype=t.dtype)
    H, W = t.shape[2:]
    q0, q1 = max(0, -oy), min(rows, H - oy)
    u0, u1 = max(0, -ox), min(cols, W - ox)
    if q0 < q1 and u0 < u1:
        out[:, :, q0:q1, u0:u1] = t[:, :, q0 + oy:q1 + oy, u0 + ox:u1 + ox]
    return out


def emulate_phased(p: ConvProblem, dy: torch.Tensor, w: torch.Tensor, BH: int, BW: int, BN: int) -> torch.Tensor:
    """dx as the phased kernel computes it from the phase table: tile by tile (`_phase_tile`),
    sub-tap by sub-tap (`_produce_phased`), stored into the phase's view of dx."""
    phases, rows, total = gp.phase_table(p, BH, BW, BN)
    S = p.filter[1]
    sh, sw = p.stride
    dx = torch.full(p.x_shape, float("nan"), dtype=F64)
    starts = [rows[i][gp.F_START] for i in (1, 2, 3)]
    num_n = -(-p.C // BN)
    written = torch.zeros(p.x_shape, dtype=torch.int32)
    for t in range(total):
        i = sum(t >= s for s in starts)
        row = rows[i]
        n, oh0, ow0, off_n = tile_coords(t - row[gp.F_START], row[gp.F_NTH], row[gp.F_NTW], row[gp.F_NUM_M],
                                         num_n, BH, BW, BN)
        acc = torch.zeros(BN, BH, BW, dtype=F64)
        cs = slice(off_n, min(off_n + BN, p.C))
        for tap in range(row[gp.F_NTAPS]):
            jr, jq = divmod(tap, row[gp.F_NRW])
            oy = oh0 + row[gp.F_OFFH] + jr * row[gp.F_DYH]
            ox = ow0 + row[gp.F_OFFW] + jq * row[gp.F_DYW]
            r, s = divmod(row[gp.F_W0] + jr * row[gp.F_WH] + jq * row[gp.F_WW], S)
            box = shifted(dy[n:n + 1], oy, ox, BH, BW)[0]                 # [K, BH, BW]
            acc[:cs.stop - off_n] += torch.einsum("khw,kc->chw", box, w[:, cs, r, s])
        a, b = phases[i].ab
        view = dx[n, cs, a::sh, b::sw]                                  # the TMA store clips to the view
        assert list(view.shape[1:]) == [row[gp.F_QH], row[gp.F_QW]]
        hh, ww = min(BH, view.shape[1] - oh0), min(BW, view.shape[2] - ow0)
        view[:, oh0:oh0 + hh, ow0:ow0 + ww] = acc[:cs.stop - off_n, :hh, :ww]
        written[n, cs, a::sh, b::sw][:, oh0:oh0 + hh, ow0:ow0 + ww] += 1
    assert torch.equal(written, torch.ones_like(written)), "every dx element stored exactly once"
    return dx


@pytest.mark.parametrize("x,w,kw", CASES, ids=IDS)
@pytest.mark.parametrize("tile", [(2, 8, 16), (4, 8, 32)])
def test_phased_backward_data_matches_reference(x, w, kw, tile):
    p = make("bwd_data", x, w, kw)
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(p.y_shape, generator=g, dtype=F64)
    wt = torch.randn(p.w_shape, generator=g, dtype=F64)
    dx = emulate_phased(p, dy, wt, *tile)
    torch.testing.assert_close(dx, conv_bwd_data_f64(p, dy, wt))
    if all(a == b for a, b in p.padding):   # torch's own transposed convolution agrees
        theirs = torch.nn.grad.conv2d_input(p.x_shape, wt, dy, stride=p.stride, padding=p.pad_before,
                                            dilation=p.dilation)
        torch.testing.assert_close(dx, theirs)


@pytest.mark.parametrize("x,w,kw", CASES, ids=IDS)
def test_phase_table_layout(x, w, kw):
    """Rows in tile order, heaviest first, tap counts per phase summing to the filter (each
    tap reaches one phase per dim), absent rows and the sentinel at the total."""
    p = make("bwd_data", x, w, kw)
    phases, rows, total = gp.phase_table(p, 4, 8, 16)
    assert len(rows) == gp.PHASE_ROWS + 1 and len(phases) == p.stride[0] * p.stride[1]
    assert sorted(d.ab for d in phases) == gp.phases_of(*p.stride)
    assert [d.ntaps for d in phases] == sorted((d.ntaps for d in phases), reverse=True)
    starts = [r[gp.F_START] for r in rows]
    assert starts == sorted(starts) and starts[0] == 0 and rows[-1][gp.F_START] == total
    assert all(r[gp.F_START] == total for r in rows[len(phases):])
    assert sum(d.ntaps for d in phases) == p.filter[0] * p.filter[1]   # each tap reaches one phase
    for d, r in zip(phases, rows):
        assert [r[gp.F_QH], r[gp.F_QW]] == gp.view_geometry((p.N, *p.in_size, p.C), *d.ab, *p.stride)[0][1:3]


@pytest.mark.parametrize("x,w,kw", CASES, ids=IDS)
def test_plan_of_phased_backward_data(x, w, kw):
    """GluonConvPlan's phased mode (planned on CPU, run on the GPU): KSUB 1, one store view
    per phase row in row order, the table the kernel reads; solver 28 names no stride reason."""
    p = ConvProblem.create("bwd_data", (x[0], 16 * x[1], *x[2:]), (16 * w[0], 16 * w[1], *w[2:]), dtype=torch.bfloat16,
                           layout="nhwc", device="cuda", **kw)
    plan = gluon_conv.GluonConvPlan(p)
    assert plan.phased and plan.tile.KSUB == 1 and plan.tile.smem_bytes() <= gluon_conv.SMEM_BYTES
    assert len(plan.dys) == len(plan.phases) and plan.n_tiles == plan.rows[-1][gp.F_START]
    for d, (shape, strides, box, _) in zip(plan.phases, plan.dys):
        assert (shape, strides) == gp.view_geometry(plan.y_shape, *d.ab, *p.stride)
        assert box == [1, plan.tile.BH, plan.tile.BW, plan.tile.BN]
        assert all(s * 2 % 16 == 0 for s in strides[:-1])     # TMA: 16-byte strides (bf16)
    assert not gluon_conv.shape_reasons(p)


@pytest.mark.parametrize("H", [2, 3, 7, 8, 11, 12])
@pytest.mark.parametrize("s", [1, 2])
def test_phase_view_box_is_the_strided_window(H, s):
    """`_load_x`: for output row o and tap offset oy, the phase view x[a::s] (a = oy mod s)
    holds x row o*s + oy at row o + (oy - a)/s, and that row is inside the view's extent
    exactly when the x row is inside x."""
    for oy in range(-5, 6):
        a = oy & (s - 1)
        extent = gp.view_geometry((1, H, 1, 1), a, 0, s, 1)[0][1]
        assert extent == len(range(a, H, s))
        for o in range(-2, H + 2):
            iy = o + (oy - a) // s
            xr = o * s + oy
            assert (0 <= iy < extent) == (0 <= xr < H)
            if 0 <= iy < extent:
                assert a + s * iy == xr


@pytest.mark.parametrize("x,w,kw", CASES, ids=IDS)
def test_backward_weights_through_phase_views(x, w, kw):
    """Solver 29's stride-2 reads emulated: dw[k, c, r, q] = sum of dy over the output
    pixels times the x box of tap (r, q), taken from the phase view (zero fill outside its
    extent), against the reference."""
    p = make("bwd_weights", x, w, kw)
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(p.x_shape, generator=g, dtype=F64)
    dy = torch.randn(p.y_shape, generator=g, dtype=F64)
    (sh, sw), (ph, pw), (dh, dw) = p.stride, p.pad_before, p.dilation
    OH, OW = p.out_size
    dwt = torch.full(p.w_shape, float("nan"), dtype=F64)
    for r, q in itertools.product(range(p.filter[0]), range(p.filter[1])):
        oy, ox = r * dh - ph, q * dw - pw
        a, b = oy & (sh - 1), ox & (sw - 1)
        view = xt[:, :, a::sh, b::sw]
        box = shifted(view, (oy - a) // sh, (ox - b) // sw, OH, OW)
        dwt[:, :, r, q] = torch.einsum("nkhw,nchw->kc", dy, box)
    torch.testing.assert_close(dwt, conv_bwd_weights_f64(p, dy, xt))
