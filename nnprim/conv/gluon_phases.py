"""Stride phases of the Gluon conv solvers (gluon_conv.py, gluon_conv_wgrad.py), host side
and pure Python, so the index maps are tested on CPU (tests/conv/test_gluon_phases.py).

A stride-2 window of an NHWC tensor t is a unit-stride box of a phase view t[:, a::sh,
b::sw] (a < sh, b < sw): one TMA descriptor per phase. Its extent ceil((H - a) / sh) ends
exactly at the last row of t that the phase holds, so TMA's bounds (zero fill on loads,
clipping on stores) are t's own. Solver 27 (forward) and 29 (backward weights) read x per
phase, solver 28 (backward data) writes dx per phase.

Backward data at stride 2 (solver 28): dx splits into the phases of its rows and columns;
phase (a, b) is a stride-1 correlation of dy with the taps that reach it (implicit_gemm.
dim_phases, solver 21's decomposition, per dim: dx index a + st*q gets taps r0 + j*rs,
j < nr, from dy index q + bs - j*dc). `phase_table` lays the phases out for one persistent
launch: the tiles of every phase in one linear tile space, heaviest phases first, one
int32 row of PHASE_FIELDS per phase that the kernel reads per tile (a phase no tap reaches
has ntaps 0: its tiles store zeros)."""
from __future__ import annotations

from dataclasses import dataclass

from ..problems.conv import ConvProblem
from .implicit_gemm import Phase, dim_phases

PHASE_ROWS = 4       # at most 2 x 2 phases; absent rows start at the total (never reached)
PHASE_FIELDS = 16
# field offsets of a phase row (the kernel's `_phase_tile` reads these)
F_START, F_NTH, F_NTW, F_NUM_M, F_NTAPS, F_NRW, F_OFFH, F_OFFW, F_DYH, F_DYW, F_W0, F_WH, F_WW, F_QH, F_QW = range(15)


def view_geometry(shape: tuple[int, int, int, int], a: int, b: int, sh: int, sw: int) -> tuple[list[int], list[int]]:
    """(shape, element strides) of the view t[:, a::sh, b::sw] of a contiguous NHWC tensor t."""
    N, H, W, C = shape
    return [N, -(-(H - a) // sh), -(-(W - b) // sw), C], [H * W * C, sh * W * C, sw * C, 1]


def phases_of(sh: int, sw: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(sh) for b in range(sw)]


def four_phase_descs(t, specs: dict, sh: int, sw: int, make) -> tuple:
    """The kernels' four descriptors of t's phase views (order (0,0), (0,1), (1,0), (1,1)),
    each made by make(view, *specs[(a, b)]); a phase the strides do not have repeats (0,0)'s."""
    d = {ab: make(t[:, ab[0]::sh, ab[1]::sw], *specs[ab]) for ab in phases_of(sh, sw)}
    return tuple(d.get(ab, d[(0, 0)]) for ab in ((0, 0), (0, 1), (1, 0), (1, 1)))


@dataclass(frozen=True)
class DataPhase:
    """Phase (a, b) of a stride-2 backward data: dx[:, a::sh, b::sw] from the taps of
    h (rows) and w (columns)."""
    h: Phase
    w: Phase

    @property
    def ab(self) -> tuple[int, int]:
        return self.h.ph, self.w.ph

    @property
    def ntaps(self) -> int:
        return self.h.nr * self.w.nr


def data_phases(p: ConvProblem) -> list[DataPhase]:
    """The phases of 2-D backward data problem p, most taps first (ties in (a, b) order):
    the persistent grid takes the long tiles first and fills the tail with short ones."""
    (H, W), (R, S) = p.in_size, p.filter
    hs = dim_phases(H, R, p.stride[0], p.pad_before[0], p.dilation[0])
    ws = dim_phases(W, S, p.stride[1], p.pad_before[1], p.dilation[1])
    return sorted((DataPhase(h, w) for h in hs for w in ws), key=lambda d: -d.ntaps)


def phase_row(d: DataPhase, start: int, N: int, S: int, BH: int, BW: int) -> list[int]:
    """One phase's row: tile j of the phase (start <= j < start + N*n_th*n_tw*num_n) and
    sub-tap (jr, jq) < (nr_h, nr_w) read dy at (q + off + jr*dy) per dim and the filter
    tap w0 + jr*wh + jq*ww (r*S + s of the forward filter)."""
    h, w = d.h, d.w
    n_th, n_tw = -(-h.Q // BH), -(-w.Q // BW)
    row = [0] * PHASE_FIELDS
    row[F_START], row[F_NTH], row[F_NTW], row[F_NUM_M] = start, n_th, n_tw, N * n_th * n_tw
    row[F_NTAPS], row[F_NRW] = d.ntaps, w.nr
    row[F_OFFH], row[F_OFFW], row[F_DYH], row[F_DYW] = h.bs, w.bs, -h.dc, -w.dc
    row[F_W0], row[F_WH], row[F_WW] = h.r0 * S + w.r0, h.rs * S, w.rs
    row[F_QH], row[F_QW] = h.Q, w.Q
    return row


def phase_table(p: ConvProblem, BH: int, BW: int, BN: int) -> tuple[list[DataPhase], list[list[int]], int]:
    """(phases, table, total tiles) of one launch of stride-2 backward data p with output
    tiles BH x BW pixels x BN channels: PHASE_ROWS + 1 rows (a sentinel whose start is the
    total), in `data_phases` order; absent phases start at the total."""
    phases = data_phases(p)
    num_n = -(-p.C // BN)
    rows, start = [], 0
    for d in phases:
        rows.append(phase_row(d, start, p.N, p.filter[1], BH, BW))
        start += rows[-1][F_NUM_M] * num_n
    while len(rows) <= PHASE_ROWS:
        rows.append([start] + [0] * (PHASE_FIELDS - 1))
    return phases, rows, start
