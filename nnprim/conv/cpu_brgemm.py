"""CPU convolution as per-tap accumulating GEMMs in native code around oneDNN's batch-reduce
GEMM micro-kernel (family `implicit_gemm`, ids 80 `cpu_brgemm_fwd`, 81 `cpu_brgemm_bwd_data`,
82 `cpu_brgemm_bwd_weights`), issue 16: no im2col, bf16 on AMX tiles with f32 accumulation.

The C++ (cpu_brgemm_src.cpp, built once per machine by nnprim/native.py) calls
`at::native::cpublas::brgemm`, the micro-kernel torch's own CPU flash attention uses: on CPUs
with AMX its bf16 path takes B in VNNI blocks (pairs of K rows interleaved, 64 columns) and
runs on the tile unit; elsewhere, and for f32, it is oneDNN's GEMM.

Positions live on cpu_tap's phase grid: x is staged once, zero-padded and split into its
stride phases (`X_rho[n*prod(U) + u] = x_pad[n, u*s + rho]`, position-major: a row of C
channels per position), so tap f reads phase rho_f at a flat offset off_f (cpu_tap.tap_offsets).
The forward with a stride-2 last dim splits only the leading dims into phases and stages whole
rows (`FwdGeometry`, ps = 2): grid position w reads staged column 2w + tap, A rows 2C apart,
so a filter row's taps stay one GEMM. ResNet's 3x3s (a 3-wide, pad-1 last dim of stride 1 or 2,
NHWC) skip all of this and read x in place (`reads_in_place`, `conv_fwd_in_place`).

fwd          For a block of MB grid positions and a group, the f32 accumulator (MB x Kg, in
             cache) takes one brgemm per RUN of taps: taps of one phase at consecutive flat
             offsets (a filter row at stride 1 and dilation 1, or d == s) read overlapping
             A rows (row stride C, L*Cg columns), so the run is ONE GEMM of depth L*Cg against
             the taps' weight rows stacked (a 3x3 at C = 64: three GEMMs of depth 192, not nine
             of depth 64: 25-35 % faster on AMX). Junk rows at a block's ends are trimmed;
             bias is added to the accumulator and each valid row converted once into y.
bwd_data     A transposed convolution, phase by phase of dx: dx_pad[u*s + rho] = sum over the taps
             f with f*d = rho (mod s) of dy[u - a_f] . W_f^T, a_f = (f*d - rho) / s; dy staged with
             A = max a_f leading zeros, so each phase is the forward kernel with offsets A - a_f,
             writing the phase's strided view of dx (stride 1: one phase, the 180-degree rotated
             filter). Phases without taps are zero.
bwd_weights  dW_f[g] (Cg x Kg) = X_{rho_f}[g]^T (Cg x positions) . dy_grid[g] (positions x Kg):
             x transposed once (fbgemm's SIMD transpose), dy on the grid packed once in VNNI
             blocks; work items are (chunk of positions, tap, group), their f32 partials summed.

Numerics: f32 accumulation over all taps and channels, one rounding to the output dtype (the
contract's); post-ops run on an f32 copy of the result before that rounding.
Covers bf16 (B in VNNI blocks where the GEMM depth is even: oneDNN's brgemm on AMX tiles, or
avx512_bf16's vdpbf16ps without AMX; odd depths: torch's plain-layout loop, ranked last) and
f32, 1-3D, any stride, dilation, padding, groups, nchw and nhwc (nchw is staged/written through
one transposing copy each way), bias and post-ops.
Needs the native library (nnprim/native.py); without it not applicable.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import torch

from ..args import ConvArgs
from ..native import NATIVE_HELPERS, NativeLibrary
from ..post_ops import Binary, Eltwise, Sum
from ..problems.conv import ConvProblem, empty_in_layout, to_layout
from ..search.solver import Solver, register
from . import cpu_wgrad  # own_kernel read through the module (tests patch it there)
from .cpu_gemm import apply_post_ops_block, cpu_has_amx, cpu_has_native_bf16, workspace
from .cpu_im2col import F32, Block, logical, physical
from .cpu_tap import phase_list, tap_grid, tap_offsets
from .cpu_wgrad import cm_rows, wgrad_own, wgrad_segments

_HERE = Path(__file__).parent
LIBRARY = NativeLibrary("nnprim_cpu_conv", NATIVE_HELPERS + (_HERE / "cpu_brgemm_src.cpp").read_text()
                        + (_HERE / "cpu_wgrad_src.cpp").read_text(), "native CPU convolution")
BF16 = torch.bfloat16
NB = 64                   # columns of a VNNI block
MAX_STAGE_BYTES = 1 << 31
WGRAD_CHUNK = 512         # positions per backward-weights work item
USE_AMX_KERNEL = True     # the forward kernels' own AMX micro-kernel where it applies (tests turn it off)
USE_OWN_WGRAD = True      # cpu_wgrad's bf16 backward-weights kernel where it applies (tests, A/B turn it off)
USE_OWN_FWD_TILE = True   # the in-place forward's own vdpbf16ps tile on bf16 without AMX (tests, A/B turn it off)
_SLACK = 32               # positions past the last tap's reach (the AMX kernel's 32-row blocks)


def vnni(p: ConvProblem) -> bool:
    """bf16 with B operands in VNNI blocks: oneDNN's brgemm micro-kernel, on AMX tiles or (without
    AMX) avx512_bf16's vdpbf16ps; its plain-layout bf16 path is torch's scalar reference loop
    (2-3 GFLOP/s on a 2-core AMD EPYC without AMX, 2026-12-03: 0.03-0.08x torch). The GEMM depth
    comes in pairs: forward's runs are multiples of C/G deep, backward data's of K/G (backward
    weights' are positions, padded to even); odd ones take the plain path."""
    depth = {"fwd": p.C // p.groups, "bwd_data": p.K // p.groups}.get(p.direction, 2)
    return p.dtype == BF16 and cpu_has_native_bf16() and depth % 2 == 0


def amx(p: ConvProblem) -> bool:
    """VNNI blocks on an AMX CPU: the own tile kernels (USE_AMX_KERNEL), AMX-sized group merging
    and the in-place bf16 forward apply."""
    return vnni(p) and cpu_has_amx()


# ---------------------------------------------------------------------------- geometry
def runs_of(taps: list[tuple[int, int, int]], merge: bool = True) -> list[list[tuple[int, int, int]]]:
    """Group (phase, offset, weight index) taps into runs: one phase, consecutive offsets. Only
    ungrouped problems merge (merge=True): a position's channels of one group are not
    contiguous with the next position's."""
    out: list[list[tuple[int, int, int]]] = []
    for t in sorted(taps):
        if merge and out and out[-1][-1][0] == t[0] and out[-1][-1][1] + 1 == t[1]:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def _kernel_runs(taps: list[tuple[int, int, int]], merge: bool) -> list[list[tuple[int, int, int]]]:
    """The forward's runs_of in the order of their first weight index: the runs of a stride-2
    last dim (FwdGeometry, ordered by phase: filter rows 0, 2, 1) then stack the weights in filter
    order. (Backward data keeps runs_of's order.)"""
    return sorted(runs_of(taps, merge), key=lambda run: run[0][2])


def run_table(runs: list[list[tuple[int, int, int]]], depth: int) -> torch.Tensor:
    """(nr, 4) int64 per run: phase, first offset, GEMM depth L*depth, first weight row (the
    runs' taps stacked in order, `depth` rows each)."""
    table, r0 = [], 0
    for run in runs:
        table.append((run[0][0], run[0][1], len(run) * depth, r0))
        r0 += len(run) * depth
    return torch.tensor(table, dtype=torch.int64).view(-1, 4)


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


def _stage_rows(p: ConvProblem, grid_positions: int) -> int:
    return grid_positions + max(o for _, o in tap_offsets(p)) + _SLACK


def column_stride(p: ConvProblem) -> int:
    """Staged positions per grid position of the forward (`FwdGeometry`): 2 for a stride-2
    last dim, else 1."""
    return 2 if p.direction == "fwd" and p.stride[-1] == 2 else 1


class FwdGeometry:
    """Where the forward's staged x and grid live. ps == 1: cpu_tap's phase grid (x split into
    all its stride phases). ps == 2 (a stride-2 last dim): x is split by the stride phases of
    the leading dims only and its rows are staged whole (an even number of columns), so grid
    position (.., w) reads staged column 2w + tap: the taps of a filter row stay consecutive
    offsets, one GEMM of depth S*C with A rows 2C apart, where the phase split made two
    (the even taps and the odd one; rn50_r3_3x3s2: 6 GEMMs of depth 128-256 -> 3 of 384)."""

    def __init__(self, p: ConvProblem) -> None:
        self.ps = ps = column_stride(p)
        if ps == 1:
            self.U_stage, _, ut = tap_grid(p)
            self.U_grid, self.stride, self.phases = self.U_stage, p.stride, phase_list(p)
            self.taps = tap_offsets(p)
            self.rows = _stage_rows(p, p.N * ut)
            return
        lead = p.ndim - 1
        wp = p.in_size[-1] + p.pad_before[-1] + p.pad_after[-1]
        self.U_stage = tuple(-(-(i + a + b) // s) for i, a, b, s in
                             zip(p.in_size[:lead], p.pad_before[:lead], p.pad_after[:lead], p.stride[:lead])) \
            + (wp + wp % 2,)
        self.U_grid = self.U_stage[:-1] + (self.U_stage[-1] // 2,)
        self.stride = tuple(p.stride[:lead]) + (1,)
        self.phases = [ph + (0,) for ph in itertools.product(*(range(s) for s in p.stride[:lead]))]
        us = [math.prod(self.U_stage[i + 1:]) for i in range(p.ndim)]
        index = {ph: i for i, ph in enumerate(self.phases)}
        self.taps = []
        for fi in itertools.product(*(range(f) for f in p.filter)):
            fd = [f * d for f, d in zip(fi, p.dilation)]
            ph = tuple(v % s for v, s in zip(fd[:lead], p.stride[:lead])) + (0,)
            off = sum((v // s) * u for v, s, u in zip(fd[:lead], p.stride[:lead], us[:lead])) + fd[-1]
            self.taps.append((index[ph], off))
        # the AMX kernel reads 32-position blocks past a block's end: ps staged rows each
        self.rows = p.N * math.prod(self.U_stage) + max(o for _, o in self.taps) + _SLACK * ps


def _pad3(t: tuple[int, ...], fill: int) -> list[int]:
    return [fill] * (3 - len(t)) + list(t)


def _five(t: torch.Tensor) -> torch.Tensor:
    """(N, sp.., K) -> (N, 1.., sp.., K), 5-D."""
    while t.dim() < 5:
        t = t.unsqueeze(1)
    return t


def _logical5(t: torch.Tensor) -> torch.Tensor:
    """Logical (N, C, sp..) -> (N, C, 1.., sp..), 5-D."""
    while t.dim() < 5:
        t = t.unsqueeze(2)
    return t


def _grid9(U: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> list[int]:
    return _pad3(U, 1) + _pad3(lo, 0) + _pad3(hi, 1)


def _block_m(cols: int) -> int:
    """Grid positions per block. Measured at 1 thread (AMX kernel, rn50 layers, 2026-12-01): 64
    columns 2.5 ms at 64-128, 2.1 at 256; 256 columns 1.43 ms at 128, 1.5-1.57 at 64 and 256+."""
    return 256 if cols <= 64 else 128


def reads_in_place(p: ConvProblem) -> bool:
    """The forward at a 3-wide, pad-1 last dim of stride 1 or 2 (ResNet's 3x3s, NHWC) reads x in
    place (`conv_fwd_in_place`: no staging; split into GEMMs whose A rows are all inside x).
    Stride 2: x's columns 2j, 2j + 1 against taps 1, 2 and 2j + 1 against tap 0 of column j + 1;
    no right border (2 O <= W). Stride 1: a block of lines is one run of x's positions, the
    staged kernel's depth-3C GEMM on it, its border columns (first, last of each line) apart;
    at least 2 columns, a right pad of 0 or 1. One group; bf16 on the AMX kernel (channels in
    32s) or, without AMX, oneDNN's brgemm on VNNI blocks (even channel counts), or f32. Without
    AMX, bf16 nchw too: x and y through whole-image SIMD transposes (`transpose_images`), which
    beats the staged kernel's junk grid positions (rn50_r4: 14 x 14 outputs on a 16 x 16 grid)."""
    amx_kernel = amx(p) and USE_AMX_KERNEL and p.C % 32 == 0
    vnni_brgemm = vnni(p) and not cpu_has_amx()
    layout = p.layout == "nhwc" or (p.layout == "nchw" and vnni_brgemm)
    s, w, o = p.stride[-1], p.in_size[-1], p.out_size[-1]
    fits = 2 * o <= w if s == 2 else s == 1 and w >= 2 and p.pad_after[-1] in (0, 1)
    return (p.direction == "fwd" and (amx_kernel or vnni_brgemm or p.dtype == F32) and p.groups == 1 and layout
            and p.filter[-1] == 3 and p.dilation[-1] == 1 and p.pad_before[-1] == 1 and fits)


def _lead(p: ConvProblem) -> list[int]:
    """conv_fwd_in_place's leading dims (s0, s1, d0, d1, p0, p1, F0, F1), padded to two."""
    def two(t: tuple[int, ...], fill: int) -> list[int]:
        return [fill] * (3 - p.ndim) + list(t[:-1])
    s, d, pb, f = two(p.stride, 1), two(p.dilation, 1), two(p.pad_before, 0), two(p.filter, 1)
    return s + d + pb + f


class _Stage:
    """Geometry of one staged operand: grid U, stride, leading pad, phases, rows."""

    def __init__(self, U: tuple[int, ...], stride: tuple[int, ...], pad: tuple[int, ...],
                 phases: list[tuple[int, ...]], rows: int) -> None:
        self.U, self.stride, self.pad, self.rows = U, stride, pad, rows
        self.phases = torch.tensor([_pad3(ph, 0) for ph in phases], dtype=torch.int64).view(-1, 3)

    def nbytes(self, channels: int, dtype: torch.dtype) -> int:
        return _aligned(len(self.phases) * self.rows * channels * dtype.itemsize)

    def __call__(self, ops, t: torch.Tensor, channels: int, dtype: torch.dtype, ws: torch.Tensor) -> torch.Tensor:
        """Stage t into the workspace ws (at least nbytes), returning the (phases, rows, C) view."""
        shape = (len(self.phases), self.rows, channels)
        out = ws[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        ops.stage(_logical5(t.to(dtype)), out, _pad3(self.U, 1), _pad3(self.stride, 1), _pad3(self.pad, 0),
                  self.phases)
        return out

    def channel_major(self, ops, t: torch.Tensor, channels: int, ws: torch.Tensor) -> torch.Tensor:
        """bf16 t staged channel-major into ws: the (phases, C, rows) view (cpu_wgrad)."""
        shape = (len(self.phases), channels, self.rows)
        out = ws[:math.prod(shape) * 2].view(BF16).view(shape)
        ops.stage_cm(_logical5(t.to(BF16)), out, _pad3(self.U, 1), _pad3(self.stride, 1), _pad3(self.pad, 0),
                     self.phases)
        return out


def _weight_source(p: ConvProblem, w: torch.Tensor, rows_fc: bool) -> tuple[torch.Tensor, bool]:
    """(src3, transpose) for pack_b from the weights' physical layout (_row_id numbers its rows).
    rows_fc: forward's rows (f, c) of W_f^T (Cg x Kg), else backward data's (f, k) of W_f."""
    G, Kg, Cg, F = p.groups, p.K // p.groups, p.C // p.groups, math.prod(p.filter)
    phys = physical(w.to(p.dtype), p.layout)       # (K, Cg, filt..) | (K, filt.., Cg)
    if not phys.is_contiguous():
        phys = phys.contiguous()
    if rows_fc:                                    # transposed: rows (f, c) | (c, f)
        return phys.view(G, Kg, Cg * F), True
    if p.layout == "nhwc":                         # rows (k, f) of (K*F, Cg)
        return phys.view(G, Kg * F, Cg), False
    return phys.view(p.K, Cg, F), True             # per k: (F, Cg)


def _row_id(p: ConvProblem, rows_fc: bool):
    """(g, f, j) -> the flattened row of _weight_source's logical rows holding tap f and channel j
    (c for rows_fc, else k) of group g."""
    Kg, Cg, F = p.K // p.groups, p.C // p.groups, math.prod(p.filter)
    if rows_fc:
        if p.layout == "nhwc":
            return lambda g, f, j: (g * F + f) * Cg + j
        return lambda g, f, j: (g * Cg + j) * F + f
    return lambda g, f, j: (g * Kg + j) * F + f


class _Plan:
    """Everything of a problem that does not depend on the tensors, built in prepare: staging
    geometry and workspace layout at once (solvers' workspace_size asks for those), run tables,
    weight gathers and work items on the first call (cached)."""

    def __init__(self, p: ConvProblem) -> None:
        self.p = p
        self.vnni = vnni(p)
        self.amx = amx(p) and USE_AMX_KERNEL
        U, _, ut = tap_grid(p)
        self.U = U
        self.ps, self.in_place = 1, False
        if p.direction == "fwd":
            geo = self.fwd_geometry = FwdGeometry(p)
            self.U, self.ps = geo.U_grid, geo.ps
            self.x_stage = _Stage(geo.U_stage, geo.stride, p.pad_before, geo.phases, geo.rows)
            self.in_place = reads_in_place(p) and self.natural_rows and p.out_dtype in (p.dtype, F32)
            self.lead = _lead(p)
        else:
            rows = _stage_rows(p, p.N * ut)
            cm = cpu_wgrad.own_kernel(p)
            self.x_stage = _Stage(U, p.stride, p.pad_before, phase_list(p), cm_rows(rows) if cm else rows)
        if p.direction == "bwd_data":
            A, self.V, self.phases = _bwd_data_geometry(p)
            reach = max((off for taps, *_ in self.phases for off, _ in taps), default=0)
            self.dy_stage = _Stage(self.V, (1,) * p.ndim, A, [(0,) * p.ndim],
                                   p.N * math.prod(self.V) + reach + _SLACK)
        elif p.direction == "bwd_weights":
            self.dy_stage = _Stage(U, (1,) * p.ndim, (0,) * p.ndim, [(0,) * p.ndim], p.N * ut + _SLACK)
        # workspace: the staged operands, then (fwd / bwd_data) a position-major output where the
        # result is not written in place (nchw, post-ops, another output dtype)
        staged = self.x_stage.nbytes(p.C, p.dtype) if p.direction != "bwd_data" else 0
        if p.direction != "fwd":
            staged += self.dy_stage.nbytes(p.K, p.dtype)
        self.staged_bytes = staged
        n_out = {"fwd": p.N * math.prod(p.out_size) * p.K, "bwd_data": p.N * math.prod(p.in_size) * p.C}
        self.out_bytes = _aligned(n_out.get(p.direction, 0) * 4)
        self.workspace_bytes = self.staged_bytes + self.out_bytes

    def out_buffer(self, ws: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        return ws[self.staged_bytes:self.staged_bytes + n].view(dtype).view(shape)

    @cached_property
    def calls(self) -> list[tuple]:
        """Per kernel call (run table, pack_b's row gather (G, rows), lo, hi, first output
        index); a phase of dx that no tap reaches has (None, None, ...)."""
        p = self.p
        if p.direction == "fwd":
            return [self._call(self._fwd_taps, p.C // p.groups, True, (0,) * p.ndim, p.out_size, None)]
        return [self._call([(0, off, f) for off, f in taps], p.K // p.groups, False, lo, hi, i0) if taps else
                (None, None, lo, hi, i0) for taps, lo, hi, i0 in self.phases]

    @cached_property
    def _fwd_taps(self) -> list[tuple[int, int, int]]:
        return [(ph, off, f) for f, (ph, off) in enumerate(self.fwd_geometry.taps)]

    @cached_property
    def natural_rows(self) -> bool:
        """The forward's runs stack the taps in filter order (stride 1, a stride-2 last dim, or
        one run per tap): then pack_b_pairs packs the weights without a gather (rn50_r3_3x3s2:
        0.01 ms, against pack_b's 0.1)."""
        order = [f for run in _kernel_runs(self._fwd_taps, self.p.groups == 1) for _, _, f in run]
        return order == sorted(order)

    @cached_property
    def taps(self) -> torch.Tensor:
        return torch.tensor(tap_offsets(self.p), dtype=torch.int64)

    @cached_property
    def chunks(self) -> torch.Tensor:
        return wgrad_chunks(self.p)

    @property
    def own_wgrad(self) -> bool:       # read per call: the A/B benchmark switches USE_OWN_WGRAD
        return USE_OWN_WGRAD and self.vnni and cpu_wgrad.own_kernel(self.p)

    @cached_property
    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        return wgrad_segments(self.p)

    def _call(self, taps, depth: int, rows_fc: bool, lo, hi, i0):
        p = self.p
        runs = _kernel_runs(taps, p.groups == 1) if rows_fc else runs_of(taps, p.groups == 1)
        rid = _row_id(p, rows_fc)
        gather = torch.tensor([[rid(g, f, j) for run in runs for _, _, f in run for j in range(depth)]
                               for g in range(p.groups)], dtype=torch.int64)
        # pack_b reads these rows unchecked: the source holds (C or K) * F of them
        bound = (p.C if rows_fc else p.K) * math.prod(p.filter)
        if gather.numel() and not (gather.min() >= 0 and gather.max() < bound):
            raise AssertionError(f"weight gather outside 0..{bound}")
        return run_table(runs, depth), gather, tuple(lo), tuple(hi), i0


def _bwd_data_geometry(p: ConvProblem):
    """(A per dim, grid V, per phase of dx: (taps [(offset, weight index)], lo, hi, first dx index))."""
    A = tuple(((f - 1) * d) // s for f, d, s in zip(p.filter, p.dilation, p.stride))
    per_dim = []      # per dim, per rho: (taps [(tap index, a)], lo, hi, i0)
    for f_, d, s, pb, n in zip(p.filter, p.dilation, p.stride, p.pad_before, p.in_size):
        phases = []
        for rho in range(s):
            tl = [(t, (t * d - rho) // s) for t in range(f_) if (t * d - rho) % s == 0]
            lo = max(0, -(-(pb - rho) // s))
            hi = (n - 1 + pb - rho) // s + 1
            phases.append((tl, lo, max(lo, hi), lo * s + rho - pb))
        per_dim.append(phases)
    V = tuple(a + max(o, max(ph[2] for ph in phs)) for a, o, phs in zip(A, p.out_size, per_dim))
    vs = [1] * len(V)
    for i in range(len(V) - 2, -1, -1):
        vs[i] = vs[i + 1] * V[i + 1]
    out = []
    for combo in itertools.product(*per_dim):
        taps = []
        for tap in itertools.product(*(c[0] for c in combo)):
            f = 0
            for (t, _), fsz in zip(tap, p.filter):
                f = f * fsz + t
            taps.append((sum((a - at) * u for (_, at), a, u in zip(tap, A, vs)), f))
        out.append((taps, tuple(c[1] for c in combo), tuple(c[2] for c in combo), tuple(c[3] for c in combo)))
    return A, V, out


# ---------------------------------------------------------------------------- narrow groups
def merge_factor(p: ConvProblem) -> int:
    """Groups merged into one (block-diagonal weights) so that AMX tiles are filled: the smallest
    m dividing G with m * C/G a multiple of 32 (the tile's depth), at most 4 (m-fold flops). A
    16-channel group fills half a tile's depth and a quarter of its 64 columns; merged in pairs
    it runs on the AMX kernel at twice the flops."""
    G, Cg = p.groups, p.C // p.groups
    if G == 1 or not amx(p) or Cg % 32 == 0:
        return 1
    for m in (2, 4):
        if G % m == 0 and (m * Cg) % 32 == 0:
            return m
    return 1


def merged(p: ConvProblem) -> tuple[ConvProblem, int]:
    m = merge_factor(p)
    return (replace(p, groups=p.groups // m), m) if m > 1 else (p, 1)


def block_diagonal(p: ConvProblem, w: torch.Tensor, m: int) -> torch.Tensor:
    """Weights of G groups -> G/m groups of m-times the channels, zero off the diagonal blocks."""
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    F = math.prod(p.filter)
    src = w.reshape(G // m, m, Kg, Cg, F)
    out = torch.zeros(G // m, m, Kg, m, Cg, F, dtype=w.dtype)
    for i in range(m):
        out[:, i, :, i].copy_(src[:, i])
    return to_layout(out.view(p.K, m * Cg, *p.filter), p.layout)


def diagonal_blocks(p: ConvProblem, dw: torch.Tensor, m: int) -> torch.Tensor:
    """The merged problem's weight gradient (K, m*Cg, filt..) -> the problem's (K, Cg, filt..)."""
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    src = dw.reshape(G // m, m, Kg, m, Cg, *p.filter)
    blocks = torch.stack([src[:, i, :, i] for i in range(m)], dim=1)         # (G/m, m, Kg, Cg, filt..)
    out = empty_in_layout(p.w_shape, p.layout, dtype=dw.dtype)
    out.copy_(blocks.reshape(p.K, Cg, *p.filter))
    return out


# ---------------------------------------------------------------------------- directions
def row_post_ops(p: ConvProblem, post_ops) -> dict | None:
    """The post-op chain as the native forward's row epilogue (res, res_scale, relu,
    relu_slope): a y-shaped residual (Sum, or Binary add) of f32 / bf16 with contiguous
    channels, then relu, either optional and in that order; None for any other chain (it
    then runs on the whole f32 output afterwards)."""
    ops = list(post_ops)
    out: dict = dict(res=None, res_scale=1.0, relu=False, relu_slope=0.0)
    if ops and isinstance(ops[0], (Sum, Binary)):
        op = ops.pop(0)
        t = op.tensor
        if (isinstance(op, Binary) and op.op != "add") or tuple(t.shape) != tuple(p.y_shape) \
                or t.dtype not in (F32, BF16) or t.device.type != "cpu":
            return None
        t5 = _five(physical(t, "nhwc"))
        if t5.stride(4) != 1:
            return None
        out.update(res=t5, res_scale=float(op.scale) if isinstance(op, Sum) else 1.0)
    if ops and isinstance(ops[0], Eltwise) and ops[0].kind == "relu":
        out.update(relu=True, relu_slope=float(ops.pop(0).alpha))
    return None if ops else out


def _fwd_weights(plan: _Plan, w: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """The forward's B operand: VNNI blocks (bf16) or plain rows, in the run table's row order."""
    p, ops = plan.p, LIBRARY.required()
    if plan.vnni and plan.natural_rows and p.groups == 1 and not physical(w, "nhwc").is_contiguous():
        return ops.pack_taps(w.to(p.dtype).flatten(2), False)     # nchw weights: no permuted copy first
    if plan.vnni and plan.natural_rows:     # rows (f, c) in order: channel pairs are 32-bit words
        return ops.pack_b_pairs(physical(w.to(p.dtype), "nhwc").contiguous().view(p.K, -1), p.groups)
    src, tr = _weight_source(p, w, True)
    return ops.pack_b(src, tr, gather, plan.vnni)


def brgemm_fwd(plan: _Plan, args: ConvArgs, ws: torch.Tensor, wp: torch.Tensor | None = None) -> torch.Tensor:
    """The forward; wp: the weights already in VNNI blocks (the backward data's twin)."""
    p, ops = plan.p, LIBRARY.required()
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    table, gather, lo, hi, _ = plan.calls[0]
    # y first: allocated after the packed weights it lands past the hole the last call's y left
    # and page-faults ~1 MB of fresh heap every call (235 faults, rn50_r2_3x3_nhwc bf16)
    y = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    if wp is None:
        wp = _fwd_weights(plan, args.w, gather)
    bias = args.bias.to(F32).contiguous() if args.bias is not None else None
    # y written directly, its post-ops (if any) in the row epilogue; else an output buffer
    rows = row_post_ops(p, args.post_ops) if p.layout == "nhwc" and p.out_dtype in (p.dtype, F32) else None
    if rows is not None:
        out = physical(y, "nhwc")
    else:
        odt = F32 if args.post_ops or p.out_dtype not in (p.dtype, F32) else p.out_dtype
        out = plan.out_buffer(ws, (p.N, *p.out_size, p.K), odt)
    x5 = _five(physical(args.x.to(p.dtype), "nhwc")) if plan.in_place else None
    if x5 is not None and p.layout == "nchw":      # x as dense nhwc images in the staging space
        S = math.prod(p.in_size)
        xs = ws[:p.N * S * p.C * p.dtype.itemsize].view(p.dtype).view(p.N, S, p.C)
        ops.transpose_images(args.x.to(p.dtype).contiguous().view(p.N, p.C, S), xs)
        x5 = _five(xs.view(p.N, *p.in_size, p.C))
    if x5 is not None and x5.stride(4) == 1 and x5.stride(3) == p.C:
        ops.conv_fwd_in_place(x5, wp, _five(out), bias, plan.lead, p.stride[-1], **(rows or {}), use_amx=plan.amx,
                              own_tile=USE_OWN_FWD_TILE)
    else:
        ops.conv_fwd(plan.x_stage(ops, args.x, p.C, p.dtype, ws), wp, table, _five(out), bias,
                     _grid9(plan.U, lo, hi), G, Cg, Kg, _block_m(Kg), plan.vnni, plan.amx, plan.ps, **(rows or {}))
    if rows is not None:
        return y
    if args.post_ops:
        acc = logical(out, "nhwc").unsqueeze(1)           # (N, 1, K, out..)
        apply_post_ops_block(acc, Block(0, p.N, (0,) * p.ndim, tuple(p.out_size)), 1, None, args.post_ops)
    if p.layout == "nchw" and out.dtype == y.dtype and y.is_contiguous():
        S = math.prod(p.out_size)
        ops.transpose_images(out.view(p.N, S, p.K), y.view(p.N, p.K, S))
    else:
        y.copy_(logical(out, "nhwc"))
    return y


def brgemm_bwd_data(plan: _Plan, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    p, ops = plan.p, LIBRARY.required()
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    dys = plan.dy_stage(ops, args.dy, p.K, p.dtype, ws)
    src, tr = _weight_source(p, args.w, False)
    dx = empty_in_layout(p.x_shape, p.layout, dtype=p.out_dtype)
    odt = p.out_dtype if p.out_dtype in (p.dtype, F32) else F32
    nhwc = p.layout == "nhwc" and odt == p.out_dtype
    out = physical(dx, "nhwc") if nhwc else plan.out_buffer(ws, (p.N, *p.in_size, p.C), odt)
    for table, gather, lo, hi, i0 in plan.calls:
        view = out[(slice(None), *(slice(a, None, s) for a, s in zip(i0, p.stride)))]
        view = view[(slice(None), *(slice(0, h - l) for l, h in zip(lo, hi)))]
        if view.numel() == 0:
            continue
        if table is None:          # no tap reaches this phase of dx
            view.zero_()
            continue
        wp = ops.pack_b(src, tr, gather, plan.vnni)
        ops.conv_fwd(dys, wp, table, _five(view), None, _grid9(plan.V, lo, hi), G, Kg, Cg, _block_m(Cg), plan.vnni,
                     plan.amx, 1)
    if not nhwc:
        dx.copy_(logical(out, "nhwc"))
    return dx


def wgrad_chunks(p: ConvProblem) -> torch.Tensor:
    """(nch, 2) int64 (start, length) ranges of grid positions for backward weights' work items:
    the valid lines of each (n, outer dims) plane only (junk lines: dy = 0, skipped), widened to
    whole blocks of 32 positions (a GEMM depth off AMX's 32 takes oneDNN's K-tail path: 1.5-3x
    slower); ranges meeting in a block merge, so no position is counted twice, and a widened
    position is junk (dy = 0) or past the grid (zero rows of the staged dy). Then cut to
    WGRAD_CHUNK positions: a work item's transposed x block stays in L2."""
    U, _, ut = tap_grid(p)
    U3, O3 = _pad3(U, 1), _pad3(p.out_size, 1)
    ranges: list[list[int]] = []
    for n in range(p.N):
        for u0 in range(O3[0]):
            a = ((n * U3[0] + u0) * U3[1]) * U3[2]
            b = a + (O3[1] - 1) * U3[2] + O3[2]
            a, b = a // 32 * 32, -(-b // 32) * 32
            if ranges and a <= ranges[-1][1]:
                ranges[-1][1] = max(ranges[-1][1], b)
            else:
                ranges.append([a, b])
    kc = WGRAD_CHUNK
    out = [(s, min(kc, b - s)) for a, b in ranges for s in range(a, b, kc)]
    return torch.tensor(out, dtype=torch.int64).view(-1, 2)


def brgemm_bwd_weights(plan: _Plan, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    p, ops = plan.p, LIBRARY.required()
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    odt = p.out_dtype if p.out_dtype in (p.dtype, F32) else F32
    if plan.own_wgrad:     # avx512_bf16 without AMX: cpu_wgrad's kernel; x channel-major, dy packed as it is
        xt = plan.x_stage.channel_major(ops, args.x, p.C, ws)
        dw = empty_in_layout(p.w_shape, p.layout, dtype=odt)
        wgrad_own(ops, xt, _logical5(args.dy.to(BF16)), _pad3(plan.U, 1), plan.taps, *plan.segments, dw, p)
        return dw if odt == p.out_dtype else dw.to(p.out_dtype)
    dyg = plan.dy_stage(ops, args.dy, p.K, p.dtype, ws[plan.x_stage.nbytes(p.C, p.dtype):])[0]
    xs = plan.x_stage(ops, args.x, p.C, p.dtype, ws)
    F = len(plan.taps)
    out = torch.empty(F, G, Cg, Kg, dtype=odt)
    ops.conv_wgrad(xs, dyg, plan.taps, plan.chunks, out, G, Cg, Kg, plan.vnni)
    dw = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
    nd = p.ndim
    src = out.view(*p.filter, G, Cg, Kg).permute(nd, nd + 2, nd + 1, *range(nd))    # (G, Kg, Cg, filt)
    dw.copy_(src.reshape(p.K, Cg, *p.filter))
    return dw


# ---------------------------------------------------------------------------- solvers
_RUN = {"fwd": brgemm_fwd, "bwd_data": brgemm_bwd_data, "bwd_weights": brgemm_bwd_weights}
# rates (GFLOP/s per core) measured through the solvers on an AMX Xeon (2 cores, 2026-12-01,
# benchmarks/diag/cpu_brgemm_ab.py; the machine's speed varied 2-3x over the session, the ratios
# to torch less): bf16 AMX 450-700 forward / backward data (the AMX kernel), ~350 backward weights;
# f32 through oneDNN's GEMM per call ~60. bf16 without AMX (VNNI blocks, avx512_bf16; AMD EPYC,
# 2 threads, 2026-12-03, rn50 layers): 145-175 per core forward / backward data, 120-150 backward
# weights (with staging; c3d_small 5.1 ms, rn50_r2 nhwc 6.6-7.3, against solver 13's 8.0 / 9.0-10.2);
# plain-layout bf16 (odd depths) is torch's scalar loop: ~1 per core
_BF16_AMX_GFLOPS = {"fwd": 550.0, "bwd_data": 550.0, "bwd_weights": 350.0}
_BF16_VNNI_GFLOPS = {"fwd": 160.0, "bwd_data": 160.0, "bwd_weights": 150.0}
_BF16_PLAIN_GFLOPS = 1.0
# f32 per core by direction: the forward kernel (fwd, bwd_data) measured 77-85 GFLOP/s per core
# on the rn50 layers with 64-256 channels per group (2 threads, AMX Xeon, 2026-12-01,
# `benchmarks/diag/cpu_brgemm_ab.py --dtype f32`), scaled down for narrow groups in
# `estimate`; backward weights (per chunk of 512 positions: a deep reduction) ran 1.75 ms on
# grouped_g8 (16 per group), 1.35 at 32 per group, 8.25 on rn50_r2 (~110 per core with staging),
# but 18.2 ms at 8 per group and 12.3 at 4 (2 threads, 2026-12-01, BENCHMARKS.md twelfth session)
_F32_GFLOPS = {"fwd": 80.0, "bwd_data": 80.0, "bwd_weights": 110.0}


def _f32_narrow(direction: str, Kg: int, Cg: int) -> float:
    """f32 rate factor of narrow groups: short GEMM rows for the forward kernel (grouped_g8:
    ~35 per core); backward weights keeps its rate down to 16 channels and falls steeply below."""
    if direction == "bwd_weights":
        return min(1.0, min(Kg, Cg) / 16) ** 1.6
    return min(1.0, min(Kg, Cg) / 64) ** 0.5
_GBS_PER_CORE = 8.0       # staging copies
_CALL_US = 0.6            # per brgemm call


def fwd_twin(p: ConvProblem) -> ConvProblem | None:
    """Stride-1 backward data as the forward of dy with the filter transposed (K <-> C) and
    rotated by 180 degrees, padded by F - 1 - pad: where that forward reads its input in place
    (bf16 without AMX; a 3-wide, pad-1 last dim), it computes no junk grid positions, which the
    phase kernel does (rn50_r4: 16 x 16 per 14 x 14, c3d_small 1.43x); None elsewhere."""
    if (p.direction != "bwd_data" or p.groups != 1 or any(s != 1 for s in p.stride) or any(d != 1 for d in p.dilation)
            or not vnni(p) or cpu_has_amx() or p.post_ops):
        return None
    pad = [(f - 1 - a, f - 1 - b) for f, a, b in zip(p.filter, p.pad_before, p.pad_after)]
    if any(a < 0 or b < 0 for a, b in pad):
        return None
    q = ConvProblem.create("fwd", p.y_shape, (p.C, p.K, *p.filter), padding=pad, dtype=p.dtype, layout=p.layout,
                           out_dtype=p.out_dtype)
    return q if tuple(q.y_shape) == tuple(p.x_shape) and reads_in_place(q) and _Plan(q).in_place else None


def twin_weights(p: ConvProblem, w: torch.Tensor) -> torch.Tensor:
    """The forward twin's filter: W'[c, k] = W[k, c] rotated by 180 degrees, in p's layout (the
    kernels take it packed by pack_taps(twin=True); this is its reference)."""
    dims = tuple(range(2, 2 + p.ndim))
    return to_layout(w.to(p.dtype).transpose(0, 1).flip(dims), p.layout)


class _CpuBrgemmBase(Solver):
    family = "implicit_gemm"
    primitive = "conv"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.bfloat16, torch.float32})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        if p.dtype == BF16 and not cpu_has_native_bf16():
            reasons.append("bf16 on a CPU without avx512_bf16/amx_bf16: no native bf16 GEMM")
        if p.direction == "bwd_weights" and p.post_ops:
            reasons.append("post_ops apply to forward only")
        if self._stage_bytes(p) > MAX_STAGE_BYTES:
            reasons.append(f"staged operands {self._stage_bytes(p)} bytes > {MAX_STAGE_BYTES}")
        reasons += LIBRARY.missing_reasons()
        return reasons

    @staticmethod
    def _stage_bytes(p: ConvProblem) -> int:
        """Bytes the staging copies move: x's phase rows (none where the forward reads x in
        place) and the position-major output."""
        _, _, ut = tap_grid(p)
        if reads_in_place(p):     # nchw: x and y transposed once each
            return (p.N * math.prod(p.out_size) * p.K * (1 + (p.layout == "nchw"))
                    + (p.layout == "nchw") * p.N * math.prod(p.in_size) * p.C) * p.dtype.itemsize
        return (len(phase_list(p)) * _stage_rows(p, p.N * ut) * p.C + p.N * ut * p.K) * p.dtype.itemsize

    def estimate(self, p: ConvProblem) -> float:
        cores = max(1, torch.get_num_threads())
        _, _, ut = tap_grid(p)
        # positions of the tap grid computed per output (reading x in place: the outputs only)
        junk = 1.0 if reads_in_place(p) else p.N * ut / max(1, p.N * math.prod(p.out_size))
        if p.dtype == F32:
            gf = _F32_GFLOPS[p.direction]
        elif vnni(p):
            gf = (_BF16_AMX_GFLOPS if amx(p) else _BF16_VNNI_GFLOPS)[p.direction]
        else:
            gf = _BF16_PLAIN_GFLOPS
        m = merge_factor(p)            # merged narrow groups: m-fold flops on fuller tiles
        Kg, Cg = m * p.K // p.groups, m * p.C // p.groups
        if p.dtype == F32:
            gf *= _f32_narrow(p.direction, Kg, Cg)
        if amx(p):      # AMX tiles are 16 x 16 x 32: narrow groups waste the tile
            gf *= min(1.0, min(Kg if p.direction != "bwd_data" else Cg, 64) / 64) * min(1.0, Cg / 32)
        t = m * p.flops() * junk / (gf * 1e9 * cores) + self._stage_bytes(p) / (_GBS_PER_CORE * 1e9 * cores)
        # brgemm calls: per 128 positions, group and tap; backward weights per WGRAD_CHUNK positions
        calls = p.groups * math.prod(p.filter) * max(1, p.N * ut // (WGRAD_CHUNK if p.direction == "bwd_weights" else 128))
        if math.prod(p.filter) == 1 and math.prod(p.stride) == 1 and not any(p.pad_before + p.pad_after):
            # pointwise: solvers 10-12 run it as one GEMM straight into the output (no staging):
            # rn50_r3_1x1 bf16 1.6-1.9x torch there against 0.84-0.98x here; backward weights
            # 13's one GEMM per tap 1.2-1.4x against 0.7-0.96x here (2026-12-01)
            t *= 2.0 if p.direction != "bwd_weights" else 2.5
        return t * 1e3 + calls * _CALL_US * 1e-3 / cores

    def workspace_size(self, p: ConvProblem) -> int:
        twin = fwd_twin(p)
        return _Plan(twin if twin is not None else merged(p)[0]).workspace_bytes

    def prepare(self, p: ConvProblem):
        twin = fwd_twin(p)
        if twin is not None:
            tplan = _Plan(twin)

            def invoke_twin(args: ConvArgs) -> torch.Tensor:
                # the twin's weights (W transposed, rotated) packed in one pass (in place: rows in
                # filter order); brgemm_fwd then leaves args.w alone
                wp = LIBRARY.required().pack_taps(args.w.to(p.dtype).flatten(2), True)
                with workspace(tplan.workspace_bytes) as ws:
                    return brgemm_fwd(tplan, ConvArgs(x=args.dy, w=args.w), ws, wp)
            return invoke_twin
        pm, m = merged(p)
        fn, plan = _RUN[p.direction], _Plan(pm)

        def invoke(args: ConvArgs) -> torch.Tensor:
            if m > 1 and p.direction != "bwd_weights":
                args = replace(args, w=block_diagonal(p, args.w, m))
            with workspace(plan.workspace_bytes) as ws:
                out = fn(plan, args, ws)
            return diagonal_blocks(p, out, m) if m > 1 and p.direction == "bwd_weights" else out
        return invoke


@register
class CpuBrgemmFwd(_CpuBrgemmBase):
    id = 80
    name = "cpu_brgemm_fwd"
    directions = frozenset({"fwd"})


@register
class CpuBrgemmBwdData(_CpuBrgemmBase):
    id = 81
    name = "cpu_brgemm_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class CpuBrgemmBwdWeights(_CpuBrgemmBase):
    id = 82
    name = "cpu_brgemm_bwd_weights"
    directions = frozenset({"bwd_weights"})


__all__ = ["CpuBrgemmFwd", "CpuBrgemmBwdData", "CpuBrgemmBwdWeights", "brgemm_fwd", "brgemm_bwd_data",
           "brgemm_bwd_weights", "runs_of", "run_table"]
