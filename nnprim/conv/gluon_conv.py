"""Persistent, warp-specialised implicit-GEMM convolution forward for Hopper in Gluon
(solver 27 `gluon_implicit_gemm_fwd`, family `implicit_gemm`, issue 13), and backward data
on the same kernel (solver 28 `gluon_implicit_gemm_bwd_data`: the forward of dy with the
flipped filter, `forward_view`; the filter is read in place, TRANS_W; stride 2: PHASED).

Same GEMM as solver 20's TMA convolution (implicit_gemm.py `_conv_tma_kernel`): NHWC,
groups 1, stride 1; an output tile is a BH x BW rectangle of one image (BM = BH*BW rows)
times BN output channels; the reduction walks (tap, channel block): for tap (r, s) the
x tile is the output rectangle shifted by (r*dh - ph, s*dw - pw), one [1, BH, BW, BK] TMA
box of a 4-D descriptor over x [N, H, W, C] whose out-of-bounds zero fill is the padding;
the weights are w as [K, R*S*C] (channels-last filter), read in [BN, BK] boxes at
(k, tap*C + c). Channel blocks past C load zeros from x, so BK need not divide C.

Structure (Gluon's explicit Hopper ops):
  - a persistent grid of min(#SMs, tiles) CTAs walking the output tiles with a stride of
    the grid (grouped-M order: GROUP_M row tiles share their weight column tiles in L2);
  - `gl.warp_specialize`: a 1-warp producer partition issues the TMA loads of KSUB
    (x box, w box) pairs per ring stage into a STAGES-deep ring (ready barrier with the
    transaction count, empty barrier released by the consumer). The ring runs across tile
    boundaries, so the producer loads tile i+1 while the consumer runs tile i's epilogue;
  - the default partition (one or two warpgroups) issues async wgmma (both operands in
    shared memory, at most one stage in flight behind the one being issued) and runs the
    epilogue: bias + post-op chain (triton_epilogue.epilogue, traced as Gluon), cast,
    registers -> shared memory -> TMA store over y [N, OH, OW, K] (which clips the tile's
    rows past OH/OW and channels past K). The store of tile i drains under tile i+1's
    MMAs (store_wait just before the buffer is reused).
KSUB > 1 (small C) makes one ring stage span several taps: fewer barrier round trips per
wgmma; sub-steps past the last tap read weight columns past R*S*C, which TMA fills with
zeros, so they add nothing. tile_config only takes it when it still leaves MIN_STAGES.

Performance notes (first H200 run, 2026-12-01: correct, but 0.29x cuDNN against solver
20's 0.77x). Offline analysis of the sm_90 TTGIR/PTX/SASS (compile_check's path) shows a
sound main loop: one mbarrier wait (all consumer threads), KSUB wgmma groups, one
`wgmma.wait_group 1`, one single-thread arrive on the released slot; no local memory, no
convert_layout through shared memory (the 4-D -> 2-D `_reinterpret` of the x box gives a
plain 128-byte-swizzle K-major descriptor), no ptxas wgmma serialisation warning, a
STSM epilogue and one TMA store per 64-column chunk. What the numbers point at instead:
  1. host cost: every measured time was ~0.16 or ~0.33 ms whatever the work (3.3 to 60
     GFLOP), and the benchmark's sample is max(event time, host enqueue time). Each call
     built three TensorDescriptors (validation, layouts), took Triton's JIT launch path
     (binder over ~50 arguments) and re-encoded three CUtensorMaps. Now: layouts, shapes,
     grid and argument tail planned once, descriptors built unvalidated, the launch through
     nnprim.launch.Launch (compiled kernel called directly, CUtensorMaps cached by address),
     as solver 20 does. `GluonConvPlan(planned=False)` keeps the old path for probes.
  2. ring depth: KSUB 3 at C=64 left STAGES=2, i.e. no load in flight ahead of the stage
     being multiplied (a TMA round trip per 3 taps); BN=256 tiles have 3 stages.
  3. padded work: BN 256 for K=320/640 computed 512/768 columns (pick_bn).
benchmarks/gluon_conv_probe.py separates these on the device (JIT vs planned launch,
host us per call, CUDA-graph time without host cost, variants, epilogue off).

Stride 2 (forward): the x box of a tap is read from the stride phase view x[:, a::2, b::2]
(a, b = parities of the tap's input offset; one descriptor per phase, `_load_x`), in which
the strided window is a unit-stride box again, so no gather and no copy.

Stride 2 (backward data, PHASED): dx splits into its stride phases dx[:, a::2, b::2], each
a stride-1 correlation of dy with the taps that reach it (gluon_phases.py, solver 21's
decomposition; a 3x3 pad-1 layer: phases of 4, 2, 2 and 1 taps). One launch covers the
tiles of all phases (heaviest phase first); per tile both partitions read the phase's row
of a small int32 table (`_phase_tile`): its tile grid, its dy offsets, filter taps and step
count; the tile is stored through the phase's own TMA descriptor over the strided view
(its extent clips exactly the rows of the phase). A phase no tap reaches (1x1 stride 2:
three of four) has no steps, so its tiles store zeros. KSUB is 1 (phases differ in length).

3-D (DEPTH): the kernel's images are the N*OD output planes, x is described as [N*D, H, W, C],
and each depth tap reads its x plane (`_x_plane`); a tap in the depth padding loads a box at
plane -1, wholly outside x, which TMA fills with zeros. Depth stride, padding and dilation
are free; 3-D backward data is stride 1 (the phased launch is 2-D).

Grouped (DIAG, blockdiag.py): a tile of BN output channels of whole groups reduces over the
CB input channels of those groups, its filter block packed per call into [K, taps * CB] (zeros
outside the groups); the x boxes start at the tile's first input channel. Groups of 4+
channels (narrower ones: the depthwise / direct solvers); grouped backward data stride 1.

Covers 2-D and 3-D NHWC bf16/f16 forward and backward data, groups as above, stride 1 or 2
over rows and columns, any dilation, any filter and padding (asymmetric too; stride-1 backward
data: at most dilation*(filter-1)), C and K multiples of 16 (TMA row alignment), bias and up to
MAX_POST_OPS post-ops (forward), y in the input dtype, standard (contiguous channels-last)
x, w and y; other strides are copied (x, w) or the result copied out (y). Needs a CUDA device of
capability 9.x and Gluon; never applicable under TRITON_INTERPRET=1 (Gluon kernels do not
run in the interpreter) nor with NNPRIM_GLUON=0 (the off switch, nnprim/gluon_support.py).
Deterministic: each output element is reduced by one CTA in a fixed order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from .. import alloc, workspace
from ..args import ConvArgs
from ..gluon_support import (
    TensorDescriptor,
    async_copy,
    contiguous_aligned,
    fence_async_shared,
    gl,
    gluon,
    gluon_reasons,
    host_descriptor,
    mbarrier,
    sm_count,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..launch import Launch
from ..problems.conv import ConvProblem
from ..search.solver import register
from . import gluon_phases as gp
from .blockdiag import DiagGeometry, diag_geometry, pack_args
from .blockdiag import _pack_kernel as _blockdiag_pack_kernel
from .implicit_gemm import _IGemmBase, flipped_padding_reasons, geom, layout_strides, roofline_ms, same_memory
from .triton_epilogue import epilogue, plan_epilogue

SMEM_BYTES = 227 * 1024
GLUON_VS_SOLVER20 = 0.65   # measured time ratio to solver 20 (see GluonImplicitGemmFwd.estimate)
# host time per call that bounds small problems, on find's clock, by direction: the smallest
# forced calls through the API in the held-out runs since the Gluon host path was cut
# (results/regret_2026-12-02_s17*.json, _s8): 27 0.0315 ms (Triton 20 0.030 on the same layer),
# 28 0.028-0.030 (Triton 21 0.031-0.033), 29 0.031-0.032 (Triton 22 0.023-0.032). The flat
# 0.038 before came from 2026-12-01 (0.051 ms through the API, 15 us over solver 20's)
HOST_FLOOR_MS = {"fwd": 0.038, "bwd_data": 0.028, "bwd_weights": 0.031}
# grouped (DIAG) tiles: 64-channel blocks run as rn50_r2_3x3's C = K = 64 layer does; measured
# resnext_g32 forward / backward data 0.152 ms for 59 GFLOP of dense tile work (390 TFLOP/s, 0.52
# of the bf16 peak; results/conv_grouped_2026-12-02_s20.json)
DIAG_EFF = 0.5


# ---- tiles -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GluonTile:
    """One kernel variant: the output rectangle BH x BW (BM = BH*BW rows), BN output
    channels, BK channels per wgmma step, KSUB steps per ring stage, STAGES ring stages,
    `warps` consumer warps. `epilogue=False` is a debug variant for probes: the tile's
    result is dropped (no epilogue, no store; y is left unwritten), so its time is the
    main loop's."""
    BH: int
    BW: int
    BN: int
    BK: int
    KSUB: int      # (x box, w box) pairs per ring stage
    STAGES: int
    warps: int     # default (consumer) partition: 4 = one warpgroup, 8 = two
    group_m: int = 8
    epilogue: bool = True
    epi_bufs: int = 1   # output staging buffers: 2 lets tile i's TMA store drain under tile i+1's epilogue
    res_prefetch: bool = True   # a leading Sum copied in before the tile's wgmmas (False: read after them)

    @property
    def BM(self) -> int:
        return self.BH * self.BW

    def stage_bytes(self, elem: int = 2) -> int:
        return self.KSUB * (self.BM + self.BN) * self.BK * elem

    def smem_bytes(self, elem: int = 2) -> int:
        return self.STAGES * self.stage_bytes(elem) + self.epi_bufs * self.BM * self.BN * elem + 1024   # + barriers


def rect(BM: int, OH: int, OW: int) -> tuple[int, int]:
    """(BH, BW): whole power-of-two rows of the output rectangle, BW >= 8 (TMA boxes of
    8+ rows keep the 128-byte swizzle atom whole), BH*BW == BM."""
    BW = max(8, min(triton.next_power_of_2(OW), BM))
    return BM // BW, BW


def pick_bn(K: int, BM: int) -> int:
    """Output channels per tile: the power of two in 64..256 (256 only with BM 128, two
    consumer warpgroups) with the least padded work, cdiv(K, BN)*BN, weighted by
    (1 + 32/BN) for the x tile each column tile re-reads; ties go to the wider tile.
    K=320 -> 128 (256 would compute 512 columns), K=640 -> 128, K=256/512/.. -> 256."""
    cands = [bn for bn in (256, 128, 64) if bn != 256 or BM == 128]
    return min(cands, key=lambda bn: (triton.cdiv(K, bn) * bn * (1 + 32 / bn), -bn))


# 256-row tiles (two consumer warpgroups, one weight box) for reductions of this many K steps
# or more: 1.06-1.24x on the H200 where a tile had one warpgroup (unet_320_64x64 forward 45
# steps 0.130 -> 0.105 ms, c3d_3x3x3 backward data 54 steps 0.471 -> 0.443, c3d forward 27
# steps 1.01x); 0.95x at 9 steps (rn50_r2_3x3), where the larger tile's fill and epilogue
# are not amortised (results/conv_tiles_probe_2026-12-02_s20.json, unet_probe_*)
LONG_STEPS = 27
MIN_STAGES = 3       # a ring of 2 holds the stage being multiplied and the one being released:
MAX_STAGES = 8       # no load is in flight ahead of the consumer (each stage pays a TMA round trip)
RING_BYTES = 96 * 1024   # aim: this much of loads in flight (~1.5 us of TMA latency at H200 L2 rates)


def tile_config(p: ConvProblem) -> GluonTile:
    """Tiles per problem class: BM 128 (64 when a 128-row rectangle would be mostly past a
    small image's rows: 7x7 and below), BN by `pick_bn` (256 with two consumer warpgroups:
    128 f32 accumulator registers per thread), BK 64 (128-byte rows), then the ring: as
    many stages as fit next to the epilogue buffer (at most MAX_STAGES), with KSUB taps per
    stage for C <= 64 only when that still leaves MIN_STAGES stages (KSUB 3 at C=64 left 2
    stages: no load in flight ahead of the wgmmas, the first device run's 172 TFLOP/s)."""
    gm = geom(p)
    d = diag_geometry(p) if p.groups > 1 else None
    if d is not None:   # grouped: BN output channels of whole groups, reduced over their CB inputs
        return tile_for(gm.out[1], gm.out[2], d.CB, gm.K, gm.taps, bn=d.BN, images=gm.N * gm.out[0])
    return tile_for(gm.out[1], gm.out[2], gm.C, gm.K, gm.taps, images=gm.N * gm.out[0])


def wave_efficiency(tiles: int, sms: int = 132) -> float:
    """The share of the persistent grid's tile slots that hold a tile (the last wave's idle
    SMs count against it); an H200's 132 SMs unless given."""
    return tiles / max(1, -(-tiles // sms) * sms)


def tile_for(OH: int, OW: int, C: int, K: int, taps: int, max_ksub: int = 3, bn: int | None = None,
             images: int = 0) -> GluonTile:
    """`tile_config` of `images` outputs OH x OW x K reduced over taps x C (KSUB <= max_ksub;
    BN `bn` when given). 256-row tiles (given `images`) only for long reductions (LONG_STEPS) where they fill
    the SMs' waves as well as 128-row ones (unet_640_32x32: 160 tiles of 256 rows, 1.2 waves,
    0.126 ms against 0.100 at 128 rows, 2.4 waves)."""
    BM = 64 if OH * OW <= 64 else 128
    BH, BW = rect(BM, OH, OW)
    BN = bn or pick_bn(K, BM)
    BK = 64 if C >= 64 else (32 if C >= 32 else 16)
    steps = taps * math.ceil(C / BK)
    if images > 0 and BM == 128 and BN <= 128 and steps >= LONG_STEPS and OH * OW >= 4 * 256:
        n_n = -(-K // BN)
        BH2, BW2 = rect(256, OH, OW)
        t256 = images * -(-OH // BH2) * -(-OW // BW2) * n_n
        t128 = images * -(-OH // BH) * -(-OW // BW) * n_n
        if wave_efficiency(t256) >= wave_efficiency(t128) - 0.02:
            BM, BH, BW = 256, BH2, BW2    # two consumer warpgroups share each weight box (LONG_STEPS)
    warps = 8 if BM * BN > 128 * 128 or BM == 256 else 4
    for ksub in (3, 2, 1):
        if ksub > 1 and (C > 64 or steps % ksub or ksub > max_ksub):
            continue
        t = GluonTile(BH, BW, BN, BK, ksub, MAX_STAGES, warps)
        stages = min(MAX_STAGES, (SMEM_BYTES - t.smem_bytes() + MAX_STAGES * t.stage_bytes()) // t.stage_bytes())
        # KSUB > 1 only for small stages: it must leave MIN_STAGES and still reach RING_BYTES
        if ksub == 1 or (stages >= MIN_STAGES and stages * t.stage_bytes() >= RING_BYTES):
            # a second output buffer where the ring keeps MIN_STAGES and RING_BYTES without it
            # (short reductions, e.g. 1x1 at C=64: one K step per tile, the epilogue dominates)
            t2 = GluonTile(BH, BW, BN, BK, ksub, MAX_STAGES, warps, epi_bufs=2)
            s2 = min(MAX_STAGES, (SMEM_BYTES - t2.smem_bytes() + MAX_STAGES * t2.stage_bytes()) // t2.stage_bytes())
            if s2 >= MIN_STAGES and s2 * t2.stage_bytes() >= RING_BYTES:
                return GluonTile(BH, BW, BN, BK, ksub, s2, warps, epi_bufs=2)
            return GluonTile(BH, BW, BN, BK, ksub, max(2, stages), warps)
    raise AssertionError("unreachable: KSUB 1 always returns")


# ---- Gluon kernel ------------------------------------------------------------------------
if gluon is not None:

    @gluon.jit
    def _tile_coords(t, n_th, n_tw, num_m, num_n, BH: gl.constexpr, BW: gl.constexpr,
                     BN: gl.constexpr, GROUP_M: gl.constexpr):
        """(n, oh0, ow0, off_n) of linear tile t in grouped-M order."""
        width = GROUP_M * num_n
        first_m = (t // width) * GROUP_M
        gsize = gl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (t % width) % gsize
        pid_n = (t % width) // gsize
        tw = pid_m % n_tw
        tmp = pid_m // n_tw
        th = tmp % n_th
        n = tmp // n_th
        return n, th * BH, tw * BW, pid_n * BN

    # phase table layout (gluon_phases.py) as kernel constants
    _PF = gl.constexpr(gp.PHASE_FIELDS)
    _PROWS = gl.constexpr(gp.PHASE_ROWS)
    _F_START = gl.constexpr(gp.F_START)
    _F_NTH = gl.constexpr(gp.F_NTH)
    _F_NTW = gl.constexpr(gp.F_NTW)
    _F_NUM_M = gl.constexpr(gp.F_NUM_M)
    _F_NTAPS = gl.constexpr(gp.F_NTAPS)
    _F_NRW = gl.constexpr(gp.F_NRW)
    _F_OFFH = gl.constexpr(gp.F_OFFH)
    _F_OFFW = gl.constexpr(gp.F_OFFW)
    _F_DYH = gl.constexpr(gp.F_DYH)
    _F_DYW = gl.constexpr(gp.F_DYW)
    _F_W0 = gl.constexpr(gp.F_W0)
    _F_WH = gl.constexpr(gp.F_WH)
    _F_WW = gl.constexpr(gp.F_WW)
    _F_QH = gl.constexpr(gp.F_QH)
    _F_QW = gl.constexpr(gp.F_QW)

    @gluon.jit
    def _phase_starts(tab):
        """First tiles of phase rows 1..3 (the rows are in tile order)."""
        return (gl.load(tab + _PF + _F_START), gl.load(tab + 2 * _PF + _F_START),
                gl.load(tab + 3 * _PF + _F_START))

    @gluon.jit
    def _phase_tile(t, tab, s1, s2, s3, num_n, BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr,
                    GROUP_M: gl.constexpr):
        """(phase row index, row pointer, n, oh0, ow0, off_n) of linear tile t of a phased
        launch (stride-2 backward data): its phase's row, then `_tile_coords` within it."""
        i = (t >= s1).to(gl.int32) + (t >= s2).to(gl.int32) + (t >= s3).to(gl.int32)
        row = tab + i * _PF
        n, oh0, ow0, off_n = _tile_coords(t - gl.load(row + _F_START), gl.load(row + _F_NTH), gl.load(row + _F_NTW),
                                          gl.load(row + _F_NUM_M), num_n, BH, BW, BN, GROUP_M)
        return i, row, n, oh0, ow0, off_n

    @gluon.jit
    def _x_plane(n, td, OD, D, sd, pd, dd, DEPTH: gl.constexpr):
        """3-D (DEPTH): the plane of x ([N*D, H, W, C]) that output plane n (of N*OD) reads at
        depth tap td, or -1 where the tap falls into the depth padding: a box wholly outside
        x, which TMA fills with zeros. 2-D: n itself."""
        if DEPTH:
            img = n // OD
            iz = (n - img * OD) * sd - pd + td * dd
            xn = img * D + iz
            if (iz < 0) | (iz >= D):
                xn = -1
        else:
            xn = n
        return xn

    @gluon.jit
    def _tap_rq(tap, RS, S, DEPTH: gl.constexpr):
        """(depth tap, filter row, filter column) of linear tap index `tap` (T x R x S order)."""
        if DEPTH:
            td = tap // RS
            rs = tap - td * RS
        else:
            td = 0
            rs = tap
        r = rs // S
        return td, r, rs - r * S

    @gluon.jit
    def _load_x(x_desc, x01_desc, x10_desc, x11_desc, n, oh0, ow0, oy, ox, c0, bar, buf,
                SH: gl.constexpr, SW: gl.constexpr):
        """The x box of output rows oh0.., columns ow0.. shifted by the tap's input offset
        (oy, ox) = (r*dh - ph, q*dw - pw). Stride 2 reads the phase view x[:, a::2, b::2]
        (a, b = the offset's parities) at (oh0 + (oy - a)/2, ..): a unit-stride box again."""
        if SH == 1 and SW == 1:
            tma.async_copy_global_to_shared(x_desc, [n, oh0 + oy, ow0 + ox, c0], bar, buf)
        else:
            a = oy & (SH - 1)
            b = ox & (SW - 1)
            iy = oh0 + (oy - a) // SH
            ix = ow0 + (ox - b) // SW
            if a == 0:
                if b == 0:
                    tma.async_copy_global_to_shared(x_desc, [n, iy, ix, c0], bar, buf)
                else:
                    tma.async_copy_global_to_shared(x01_desc, [n, iy, ix, c0], bar, buf)
            else:
                if b == 0:
                    tma.async_copy_global_to_shared(x10_desc, [n, iy, ix, c0], bar, buf)
                else:
                    tma.async_copy_global_to_shared(x11_desc, [n, iy, ix, c0], bar, buf)

    @gluon.jit
    def _producer(x_desc, x01_desc, x10_desc, x11_desc, w_desc, a_bufs, b_bufs, ready, empty, n_tiles,
                  n_th, n_tw, num_m, num_n, n_steps, nk, S, C, K, n_taps, ph, pw, dh, dw, tab,
                  RS, OD, D, sd, pd, dd, Kg, Cg,
                  BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                  KSUB: gl.constexpr, GROUP_M: gl.constexpr, TRANS_W: gl.constexpr,
                  SH: gl.constexpr, SW: gl.constexpr, PHASED: gl.constexpr, DEPTH: gl.constexpr,
                  DIAG: gl.constexpr):
        """1 warp: for every tile of this CTA and every stage of its reduction, wait for the
        slot to be released, then KSUB (x box, w box) loads onto its ready barrier. Empty
        barriers start 'phase 1 complete', so the first pass waits on parity 1.
        TRANS_W (backward data): w is [C, taps*K] (the forward filter [K', R, S, C'] seen
        with the reduction channels as rows), boxes [BK, BN] at (c0, flipped tap*K + n).
        PHASED: stride-2 backward data, see `_produce_phased`. DEPTH (3-D): taps are T x R x S,
        tiles are rectangles of output planes, each tap reads its x plane (`_x_plane`).
        DIAG (grouped, blockdiag.py): w is the packed [K, taps * C] block-diagonal filter (C
        the tile's input channels) and the x boxes start at the tile's first input channel,
        (off_n // Kg) * Cg."""
        STAGES: gl.constexpr = ready.type.shape[0]
        nbytes: gl.constexpr = KSUB * (x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        if PHASED:
            _produce_phased(x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_tiles, num_n, nk, K, tab,
                            BH, BW, BN, BK, GROUP_M, nbytes)
        else:
            cnt = 0
            for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
                n, oh0, ow0, off_n = _tile_coords(t, n_th, n_tw, num_m, num_n, BH, BW, BN, GROUP_M)
                for st in range(n_steps):
                    s = cnt % STAGES
                    mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), nbytes)
                    for u in gl.static_range(KSUB):
                        it = st * KSUB + u
                        tap = it // nk
                        c0 = (it - tap * nk) * BK
                        td, r, q = _tap_rq(tap, RS, S, DEPTH)
                        if DIAG:
                            xc = (off_n // Kg) * Cg + c0
                        else:
                            xc = c0
                        _load_x(x_desc, x01_desc, x10_desc, x11_desc, _x_plane(n, td, OD, D, sd, pd, dd, DEPTH),
                                oh0, ow0, r * dh - ph, q * dw - pw, xc, ready.index(s), a_bufs.index(s * KSUB + u),
                                SH, SW)
                        if TRANS_W:
                            tma.async_copy_global_to_shared(w_desc, [c0, (n_taps - 1 - tap) * K + off_n],
                                                            ready.index(s), b_bufs.index(s * KSUB + u))
                        else:
                            tma.async_copy_global_to_shared(w_desc, [off_n, tap * C + c0], ready.index(s),
                                                            b_bufs.index(s * KSUB + u))
                    cnt += 1

    @gluon.jit
    def _produce_phased(x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_tiles, num_n, nk, K, tab,
                        BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        GROUP_M: gl.constexpr, nbytes: gl.constexpr):
        """The producer of a phased launch (KSUB 1): x is dy, read at unit stride; sub-tap
        (jr, jq) of the tile's phase reads dy at the output rectangle + (off + jr*dy) per
        dim and the filter tap w0 + jr*wh + jq*ww (w as [dy channels, taps * dx channels]).
        A phase without taps loads nothing."""
        STAGES: gl.constexpr = ready.type.shape[0]
        s1, s2, s3 = _phase_starts(tab)
        cnt = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            i, row, n, oh0, ow0, off_n = _phase_tile(t, tab, s1, s2, s3, num_n, BH, BW, BN, GROUP_M)
            nrw = gl.load(row + _F_NRW)
            y0 = oh0 + gl.load(row + _F_OFFH)
            x0 = ow0 + gl.load(row + _F_OFFW)
            dyh = gl.load(row + _F_DYH)
            dyw = gl.load(row + _F_DYW)
            w0 = gl.load(row + _F_W0)
            wh = gl.load(row + _F_WH)
            ww = gl.load(row + _F_WW)
            for st in range(gl.load(row + _F_NTAPS) * nk):
                s = cnt % STAGES
                mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tap = st // nk
                c0 = (st - tap * nk) * BK
                jr = tap // nrw
                jq = tap - jr * nrw
                tma.async_copy_global_to_shared(x_desc, [n, y0 + jr * dyh, x0 + jq * dyw, c0], ready.index(s),
                                                a_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [c0, (w0 + jr * wh + jq * ww) * K + off_n], ready.index(s),
                                                b_bufs.index(s))
                cnt += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, c_smem, ready, empty, y_desc, y1_desc, y2_desc, y3_desc,
                  bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, tab,
                  n_tiles, n_th, n_tw, num_m, num_n, n_steps, nk, OH, OW, K, syn, syh, syw,
                  p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                  HAS_BIAS: gl.constexpr,
                  P0_KIND: gl.constexpr, P0_SUB: gl.constexpr, P0_BC: gl.constexpr,
                  P1_KIND: gl.constexpr, P1_SUB: gl.constexpr, P1_BC: gl.constexpr,
                  P2_KIND: gl.constexpr, P2_SUB: gl.constexpr, P2_BC: gl.constexpr,
                  P3_KIND: gl.constexpr, P3_SUB: gl.constexpr, P3_BC: gl.constexpr,
                  BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                  KSUB: gl.constexpr, GROUP_M: gl.constexpr, WARPS: gl.constexpr, EPILOGUE: gl.constexpr,
                  TRANS_W: gl.constexpr, PHASED: gl.constexpr, RES_PREFETCH: gl.constexpr):
        """Default partition: async wgmma over the ring (a stage is released once the
        wgmmas of the stage after it have been issued and the older ones retired), then the
        fused epilogue and a TMA store of the tile. PHASED: each tile's phase row gives its
        coordinates, its steps (ntaps * nk; none for a phase no tap reaches: zeros are
        stored) and its output view (y_desc, y1_desc, .. in row order). RES_PREFETCH: a
        leading Sum in y's dtype is copied into the tile's output buffer while its wgmmas
        run (`_residual_prefetch`)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        BM: gl.constexpr = BH * BW
        dtype: gl.constexpr = a_bufs.dtype
        # a leading Sum in y's (16-bit) dtype goes through the tile's output buffer
        RES_SMEM: gl.constexpr = (P0_KIND == 1 and not PHASED and p0_ptr.dtype.element_ty == dtype
                                  and dtype.primitive_bitwidth == 16)
        RES_PF: gl.constexpr = RES_PREFETCH and EPILOGUE and RES_SMEM
        c2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BN, 16])
        a2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        EPI_BUFS: gl.constexpr = c_smem.type.shape[0]
        if PHASED:
            s1, s2, s3 = _phase_starts(tab)
        cnt = 0
        tcount = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            if PHASED:
                yi, row, n, oh0, ow0, off_n = _phase_tile(t, tab, s1, s2, s3, num_n, BH, BW, BN, GROUP_M)
                steps = gl.load(row + _F_NTAPS) * nk
                OHt = gl.load(row + _F_QH)
                OWt = gl.load(row + _F_QW)
            else:
                n, oh0, ow0, off_n = _tile_coords(t, n_th, n_tw, num_m, num_n, BH, BW, BN, GROUP_M)
                steps = n_steps
                yi = 0
                OHt = OH
                OWt = OW
            if RES_PF:
                # before the tile's wgmmas: inside the K loop, the copy's registers made ptxas
                # serialise every wgmma (one WARPGROUP.DEPBAR each). The wait is the last store
                # of this buffer reading it out, which that tile's epilogue has just issued.
                tma.store_wait(EPI_BUFS - 1)
                _residual_prefetch(p0_ptr, c_smem.index(tcount % EPI_BUFS)._reinterpret(dtype, [BM, BN], c2_layout),
                                   n, oh0, ow0, off_n, OHt, OWt, K, syn, syh, syw, BW, WARPS)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            for st in range(steps):
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                for u in gl.static_range(KSUB):
                    a = a_bufs.index(s * KSUB + u)._reinterpret(dtype, [BM, BK], a2_layout)
                    if TRANS_W:   # [BK, BN] with BN contiguous: an MN-major B operand
                        b = b_bufs.index(s * KSUB + u)
                    else:
                        b = b_bufs.index(s * KSUB + u).permute((1, 0))
                    acc = warpgroup_mma(a, b, acc, is_async=True)
                # the previous stage's wgmmas have retired: release its slot
                acc = warpgroup_mma_wait(KSUB, deps=(acc,))
                if st > 0:
                    mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
                cnt += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if PHASED:
                if steps > 0:   # a tile without steps acquired no slot
                    mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
            else:
                mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
            if EPILOGUE:
                _store_tile(acc, c_smem.index(tcount % EPI_BUFS), y_desc, y1_desc, y2_desc, y3_desc, yi,
                            n, oh0, ow0, off_n, OHt, OWt, K,
                            syn, syh, syw, bias_ptr,
                            p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                            HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                            P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC, BW, EPI_BUFS, PHASED, WARPS, RES_SMEM, RES_PF)
            tcount += 1
        tma.store_wait(0)

    @gluon.jit
    def _residual_at(ptr, c_smem, n, oh0, ow0, off_n, OH, OW, K, syn, syh, syw,
                     BW: gl.constexpr, WARPS: gl.constexpr):
        """Addresses and mask of the tile's Sum operand (y's shape and strides) in a layout
        of 16-byte pieces (8 channels a thread): the accumulator's own layout gives each
        thread 2 channels a row, 8 rows a warp load (a fused ResNet 3x3 layer ran 25-35 us
        over the same conv without post-ops, H200). K, syn, syh, syw are multiples of 8
        (y's TMA descriptor requires it)."""
        BM: gl.constexpr = c_smem.type.shape[0]
        BN: gl.constexpr = c_smem.type.shape[1]
        TN: gl.constexpr = BN // 8
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [WARPS, 1], [1, 0])
        ri = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
        rn = gl.max_contiguous(gl.multiple_of(off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, blk)), BN), BN)
        oh = oh0 + ri // BW
        ow = ow0 + ri % BW
        base = gl.multiple_of(n.to(gl.int64) * syn + oh * syh + ow * syw, 8)
        k8 = (K // 8) * 8
        mask = ((oh < OH) & (ow < OW))[:, None] & (rn < k8)[None, :]
        return ptr + (base[:, None] + rn[None, :]), mask

    @gluon.jit
    def _residual(ptr, c_smem, n, oh0, ow0, off_n, OH, OW, K, syn, syh, syw,
                  BW: gl.constexpr, WARPS: gl.constexpr, acc_layout: gl.constexpr):
        """The tile's Sum operand (c_smem's dtype) in the accumulator's layout, read with
        16-byte loads after the tile's last wgmma and passed through c_smem."""
        ptrs, mask = _residual_at(ptr, c_smem, n, oh0, ow0, off_n, OH, OW, K, syn, syh, syw, BW, WARPS)
        c_smem.store(gl.load(ptrs, mask=mask, other=0.0))
        return c_smem.load(acc_layout).to(gl.float32)

    @gluon.jit
    def _residual_prefetch(ptr, c_smem, n, oh0, ow0, off_n, OH, OW, K, syn, syh, syw,
                           BW: gl.constexpr, WARPS: gl.constexpr):
        """Start the tile's Sum operand on its way into c_smem (cp.async, 16-byte pieces,
        zeros where masked) while the tile's wgmmas run: the epilogue then waits for the
        group (`async_copy.wait_group`) instead of a global load's full latency. c_smem
        must be free: the store that last read it waited for."""
        ptrs, mask = _residual_at(ptr, c_smem, n, oh0, ow0, off_n, OH, OW, K, syn, syh, syw, BW, WARPS)
        async_copy.async_copy_global_to_shared(c_smem, ptrs, mask=mask)
        async_copy.commit_group()

    @gluon.jit
    def _store_tile(acc, c_smem, y_desc, y1_desc, y2_desc, y3_desc, yi, n, oh0, ow0, off_n, OH, OW, K,
                    syn, syh, syw, bias_ptr,
                    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                    HAS_BIAS: gl.constexpr,
                    P0_KIND: gl.constexpr, P0_SUB: gl.constexpr, P0_BC: gl.constexpr,
                    P1_KIND: gl.constexpr, P1_SUB: gl.constexpr, P1_BC: gl.constexpr,
                    P2_KIND: gl.constexpr, P2_SUB: gl.constexpr, P2_BC: gl.constexpr,
                    P3_KIND: gl.constexpr, P3_SUB: gl.constexpr, P3_BC: gl.constexpr, BW: gl.constexpr,
                    EPI_BUFS: gl.constexpr, PHASED: gl.constexpr, WARPS: gl.constexpr, RES_SMEM: gl.constexpr,
                    RES_PF: gl.constexpr):
        """Epilogue of one tile: bias + post-ops on the f32 accumulator, cast, registers ->
        c_smem (once the store that last read it has: with EPI_BUFS buffers in turn, at most
        EPI_BUFS - 1 stores may still be in flight) -> TMA store (PHASED: into phase row
        yi's output view). RES_SMEM (the consumer's): a leading Sum in y's dtype is read
        through c_smem: RES_PF, the copy `_residual_prefetch` started before the tile's
        wgmmas, else `_residual`."""
        acc_layout: gl.constexpr = acc.type.layout
        BM: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        dtype: gl.constexpr = c_smem.dtype
        c2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
        ri = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        oh = oh0 + ri // BW
        ow = ow0 + ri % BW
        rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        mask_n = rn < K
        mask = ((oh < OH) & (ow < OW))[:, None] & mask_n[None, :]
        y_off = (n.to(gl.int64) * syn + oh * syh + ow * syw)[:, None] + rn[None, :]
        cs = c_smem._reinterpret(dtype, [BM, BN], c2_layout)
        if RES_SMEM:
            if HAS_BIAS:
                acc = acc + gl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(gl.float32)[None, :]
            if RES_PF:
                async_copy.wait_group(0)
                res = cs.load(acc_layout).to(gl.float32)
            else:
                tma.store_wait(EPI_BUFS - 1)     # the store that last read this buffer is done
                res = _residual(p0_ptr, cs, n, oh0, ow0, off_n, OH, OW, K, syn, syh, syw, BW, WARPS, acc_layout)
            acc = acc + p0_a * res
            acc = epilogue(acc, y_off, rn, mask_n, mask, bias_ptr,
                           p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                           False, 0, 0, 0, P1_KIND, P1_SUB, P1_BC,
                           P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
        else:
            acc = epilogue(acc, y_off, rn, mask_n, mask, bias_ptr,
                           p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                           HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                           P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
            tma.store_wait(EPI_BUFS - 1)     # the store that last read this buffer is done
        cs.store(acc.to(dtype))
        fence_async_shared()
        if PHASED:
            if yi == 0:
                tma.async_copy_shared_to_global(y_desc, [n, oh0, ow0, off_n], c_smem)
            elif yi == 1:
                tma.async_copy_shared_to_global(y1_desc, [n, oh0, ow0, off_n], c_smem)
            elif yi == 2:
                tma.async_copy_shared_to_global(y2_desc, [n, oh0, ow0, off_n], c_smem)
            else:
                tma.async_copy_shared_to_global(y3_desc, [n, oh0, ow0, off_n], c_smem)
        else:
            tma.async_copy_shared_to_global(y_desc, [n, oh0, ow0, off_n], c_smem)

    @gluon.jit(do_not_specialize=["N", "OH", "OW", "S", "C", "K", "ph", "pw", "dh", "dw", "syn", "syh", "syw",
                                  "T", "OD", "D", "sd", "pd", "dd", "Kg", "Cg"])
    def _gluon_conv_kernel(
            x_desc, x01_desc, x10_desc, x11_desc, w_desc, y_desc, y1_desc, y2_desc, y3_desc,
            bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, tab,
            N, OH, OW, R, S, C, K, ph, pw, dh, dw, syn, syh, syw, T, OD, D, sd, pd, dd, Kg, Cg,
            p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
            HAS_BIAS: gl.constexpr,
            P0_KIND: gl.constexpr, P0_SUB: gl.constexpr, P0_BC: gl.constexpr,
            P1_KIND: gl.constexpr, P1_SUB: gl.constexpr, P1_BC: gl.constexpr,
            P2_KIND: gl.constexpr, P2_SUB: gl.constexpr, P2_BC: gl.constexpr,
            P3_KIND: gl.constexpr, P3_SUB: gl.constexpr, P3_BC: gl.constexpr,
            BH: gl.constexpr, BW: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
            KSUB: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, EPILOGUE: gl.constexpr,
            TRANS_W: gl.constexpr, EPI_BUFS: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr,
            PHASED: gl.constexpr, DEPTH: gl.constexpr, DIAG: gl.constexpr, RES_PREFETCH: gl.constexpr,
            num_warps: gl.constexpr):
        """Persistent: CTA i runs tiles i, i + grid, ... (see the module docstring). PHASED
        (stride-2 backward data): `tab` is the phase table (gluon_phases.phase_table), the
        tiles those of all phases; else `tab` is unused. DEPTH (3-D): N counts output planes
        (N*OD), x is [N*D, H, W, C], the filter T x R x S (depth stride sd, padding pd,
        dilation dd); 2-D: T = OD = D = 1 and these go unused. DIAG (grouped): C is a tile's
        input channels, Kg / Cg the channels per group (see `_producer`)."""
        dtype: gl.constexpr = x_desc.dtype
        n_th = gl.cdiv(OH, BH)
        n_tw = gl.cdiv(OW, BW)
        num_m = N * n_th * n_tw
        num_n = gl.cdiv(K, BN)
        if PHASED:
            gl.static_assert(KSUB == 1, "phased launches take one (x box, w box) pair per stage")
            n_tiles = gl.load(tab + _PROWS * _PF + _F_START)   # the sentinel row's start: all tiles
        else:
            n_tiles = num_m * num_n
        nk = gl.cdiv(C, BK)
        n_steps = gl.cdiv(T * R * S * nk, KSUB)

        a_bufs = gl.allocate_shared_memory(dtype, [STAGES * KSUB] + x_desc.block_type.shape, x_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES * KSUB] + w_desc.block_type.shape, w_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, [EPI_BUFS] + y_desc.block_type.shape, y_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, c_smem, ready, empty, y_desc, y1_desc, y2_desc, y3_desc,
                         bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, tab,
                         n_tiles, n_th, n_tw, num_m, num_n, n_steps, nk, OH, OW, K, syn, syh, syw,
                         p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                         HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                         P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC,
                         BH, BW, BN, BK, KSUB, GROUP_M, num_warps, EPILOGUE, TRANS_W, PHASED, RES_PREFETCH)),
            (_producer, (x_desc, x01_desc, x10_desc, x11_desc, w_desc, a_bufs, b_bufs, ready, empty, n_tiles,
                         n_th, n_tw, num_m, num_n, n_steps, nk, S, C, K, T * R * S, ph, pw, dh, dw, tab,
                         R * S, OD, D, sd, pd, dd, Kg, Cg, BH, BW, BN, BK, KSUB, GROUP_M, TRANS_W, SH, SW, PHASED,
                         DEPTH, DIAG)),
        ], [1], [24])

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


# ---- launcher ------------------------------------------------------------------------------
def _nvmma(block: list[int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(block, getattr(gl, str(dtype).split(".")[-1]))


def forward_view(p: ConvProblem) -> ConvProblem:
    """The forward convolution the kernel runs for p. Forward: p. Stride-1 backward data:
    dx = conv(dy, w flipped, channels swapped) with padding dil*(R-1) - pad per side (>= 0,
    `shape_reasons`), so dy plays x (channels K), dx plays y (channels C) and the output size
    is p's input size; the kernel reads w in place (TRANS_W) instead of a flipped copy."""
    if p.direction == "fwd":
        return p
    pads = tuple((d * (r - 1) - a, d * (r - 1) - b)
                 for d, r, a, b in zip(p.dilation, p.filter, p.pad_before, p.pad_after))
    return ConvProblem.create("fwd", (p.N, p.K, *p.out_size), (p.C, p.K // p.groups, *p.filter), dtype=p.dtype,
                              layout=p.layout, device=p.device, padding=pads, dilation=p.dilation, groups=p.groups)


def flat_view(p: ConvProblem) -> ConvProblem | None:
    """A 2-D 1x1, stride-1, unpadded convolution as one image of 1 x N*H*W pixels (None for
    others): the same GEMM over the same channels-last memory, tiled as flat 128-row
    blocks instead of rectangles of each image (a 7x7 image fills 49 of a 64-row
    rectangle; the flat rows waste nothing but the last tile's tail)."""
    if p.ndim != 2 or p.filter != (1, 1) or any(s != 1 for s in p.stride) \
            or any(p.pad_before) or any(p.pad_after):
        return None
    return ConvProblem.create(p.direction, (1, p.C, 1, p.N * math.prod(p.in_size)), (p.K, p.C // p.groups, 1, 1),
                              dtype=p.dtype, layout=p.layout, device=p.device, groups=p.groups)


class GluonConvPlan:
    """Launch of `_gluon_conv_kernel` for one problem (forward; stride-1 backward data run
    as its `forward_view`; stride-2 backward data as one phased launch, `phase_table`);
    x, w, y as standard channels-last tensors (others are copied).
    Everything but the data pointers is fixed here: the descriptors' shapes, strides, boxes
    and layouts, the grid and the argument tail; calls go through nnprim.launch.Launch
    (compiled-kernel fast path, CUtensorMaps encoded once per address triple).
    `planned=False` takes Triton's JIT launch path on every call instead (the first device
    run's path, kept for probes: ~100+ us of host work per call there)."""

    def __init__(self, p: ConvProblem, tile: GluonTile | None = None, planned: bool = True):
        self.p = p
        self.out_shape = p.x_shape if p.direction == "bwd_data" else p.y_shape
        self.out_strides = layout_strides(self.out_shape, "nhwc")
        self.fast_keys: dict = {}
        self.bwd = p.direction == "bwd_data"
        self.phased = self.bwd and any(s != 1 for s in p.stride)
        self.planned = planned
        self.table = None      # phased: the phase table (int32, on the device it runs on)
        self.launch = None     # the grid needs the device's SM count: planned on the first call
        if self.phased:
            self._plan_phased(p, tile)
            return
        fp = forward_view(p)
        self.epi = plan_epilogue(fp if self.bwd else p)   # the epilogue by the real shapes
        flat = flat_view(fp)
        self.flat = flat is not None
        if self.flat:
            fp = flat
        self.gm = gm = geom(fp)
        # grouped: tiles of whole groups over a packed block-diagonal filter (blockdiag.py)
        self.diag: DiagGeometry | None = diag_geometry(fp) if fp.groups > 1 else None
        ch = self.diag.CB if self.diag else gm.C     # input channels a tile reduces over per tap
        self.tile = t = tile or tile_config(fp)
        H, W = gm.inp[1], gm.inp[2]
        OH, OW = gm.out[1], gm.out[2]
        # 3-D: the kernel's images are the N*OD output planes, x is [N*D, H, W, C] (`_x_plane`)
        self.depth = fp.ndim == 3
        planes = gm.N * gm.out[0]
        self.n_tiles = planes * triton.cdiv(OH, t.BH) * triton.cdiv(OW, t.BW) * triton.cdiv(gm.K, t.BN)
        self.scalars = (planes, OH, OW, gm.filt[1], gm.filt[2], ch, gm.K, gm.pad[1], gm.pad[2],
                        gm.dil[1], gm.dil[2], OH * OW * gm.K, OW * gm.K, gm.K,
                        gm.filt[0], gm.out[0], gm.inp[0], gm.stride[0], gm.pad[0], gm.dil[0],
                        *((self.diag.Kg, self.diag.Cg) if self.diag else (1, 1)))
        self.y_shape = (planes, OH, OW, gm.K)
        # x per stride phase (a, b): the view x[:, a::sh, b::sw] (one phase at stride 1)
        self.sh, self.sw = sh, sw = gm.stride[1], gm.stride[2]
        box = [1, t.BH, t.BW, t.BK]
        self.x_shape = (gm.N * gm.inp[0], H, W, gm.C)
        self.dx = {ab: (*gp.view_geometry(self.x_shape, *ab, sh, sw), box, _nvmma(box, p.dtype))
                   for ab in gp.phases_of(sh, sw)}
        self.trans_w = self.bwd and self.diag is None
        self.pack = None      # grouped: the launch that packs the block-diagonal filter
        if self.diag:   # the packed [K, taps * CB] (backward data: its forward view's, taps flipped)
            self.dw = ([gm.K, gm.taps * ch], [gm.taps * ch, 1], [t.BN, t.BK], _nvmma([t.BN, t.BK], p.dtype))
            self.pack_tail = pack_args(fp, self.diag, self.bwd)
        elif self.bwd:   # p's w [K=gm.C, R, S, C=gm.K] as [gm.C, taps * gm.K]: rows are the reduction
            self.dw = ([gm.C, gm.taps * gm.K], [gm.taps * gm.K, 1], [t.BK, t.BN], _nvmma([t.BK, t.BN], p.dtype))
        else:
            self.dw = ([gm.K, gm.taps * gm.C], [gm.taps * gm.C, 1], [t.BN, t.BK], _nvmma([t.BN, t.BK], p.dtype))
        self.dy = ([planes, OH, OW, gm.K], [OH * OW * gm.K, OW * gm.K, gm.K, 1], [1, t.BH, t.BW, t.BN],
                   _nvmma([1, t.BH, t.BW, t.BN], p.dtype))
        self.tail = (*self.scalars, *self.epi.scalars(), *self.epi.constexprs(),
                     t.BH, t.BW, t.BN, t.BK, t.KSUB, t.STAGES, t.group_m, t.epilogue, self.trans_w, t.epi_bufs, sh,
                     sw, False, self.depth, self.diag is not None, t.res_prefetch)

    def _plan_phased(self, p: ConvProblem, tile: GluonTile | None) -> None:
        """Stride-2 backward data: dy (channels p.K) is the unit-stride x, dx (channels p.C)
        is written per phase view dx[:, a::sh, b::sw] (one y descriptor per phase row), the
        filter read in place as for stride 1 (TRANS_W), the tiles of all phases in one
        launch (`gluon_phases.phase_table`). The tile is planned for the largest phase."""
        self.epi = plan_epilogue(p)
        assert not self.epi.needs_tensors and not p.has_bias, "backward data has no epilogue"
        self.flat = self.depth = False
        self.diag = None
        N, (H, W), (OH, OW), (R, S) = p.N, p.in_size, p.out_size, p.filter
        phases = gp.data_phases(p)
        QH, QW = max(d.h.Q for d in phases), max(d.w.Q for d in phases)
        self.tile = t = tile or tile_for(QH, QW, p.K, p.C, max(d.ntaps for d in phases), max_ksub=1)
        if t.KSUB != 1:
            raise ValueError(f"phased launches take KSUB 1, not {t.KSUB}")
        self.phases, self.rows, self.n_tiles = gp.phase_table(p, t.BH, t.BW, t.BN)
        if p.device == "cuda" and torch.cuda.is_available():   # now, not in a first call under graph capture
            self.table = torch.tensor(self.rows, dtype=torch.int32, device="cuda")
        self.sh, self.sw = sh, sw = p.stride
        self.y_shape = (N, H, W, p.C)
        self.dx = {(0, 0): ([N, OH, OW, p.K], [OH * OW * p.K, OW * p.K, p.K, 1], [1, t.BH, t.BW, t.BK],
                            _nvmma([1, t.BH, t.BW, t.BK], p.dtype))}
        self.dw = ([p.K, R * S * p.C], [R * S * p.C, 1], [t.BK, t.BN], _nvmma([t.BK, t.BN], p.dtype))
        box = [1, t.BH, t.BW, t.BN]
        self.dys = [(*gp.view_geometry(self.y_shape, *d.ab, sh, sw), box, _nvmma(box, p.dtype)) for d in phases]
        # scalars: the kernel's OH, OW, R, S, pads and dilations are the phase rows' in this mode
        self.tail = (N, QH, QW, R, S, p.K, p.C, 0, 0, 1, 1, H * W * p.C, sh * W * p.C, sw * p.C, 1, 1, 1, 1, 0, 1,
                     1, 1, *self.epi.scalars(), *self.epi.constexprs(),
                     t.BH, t.BW, t.BN, t.BK, t.KSUB, t.STAGES, t.group_m, t.epilogue, True, t.epi_bufs, 1, 1, True,
                     False, False, False)

    def _launch(self, device: torch.device) -> Launch:
        if self.launch is None:
            grid = (max(1, min(sm_count(device.index), self.n_tiles)),)
            self.launch = Launch(_gluon_conv_kernel, grid, self.tail, num_warps=self.tile.warps)
        return self.launch

    def _table(self, device: torch.device) -> torch.Tensor:
        if self.table is None or self.table.device != device:
            self.table = torch.tensor(self.rows, dtype=torch.int32, device=device)
        return self.table

    def _x_descs(self, x: torch.Tensor, make) -> tuple:
        """The kernel's four x descriptors (phases (0,0), (0,1), (1,0), (1,1)); a phase the
        strides do not have repeats phase (0,0)'s. Phased: dy's one, four times."""
        if self.phased:
            return (make(x, *self.dx[(0, 0)]),) * 4
        return gp.four_phase_descs(x, self.dx, self.sh, self.sw, make)

    def _y_descs(self, y: torch.Tensor, make) -> tuple:
        """The kernel's four y descriptors: y's, four times; phased: the phase rows' views
        of dx in row order (an absent row repeats row 0's)."""
        if not self.phased:
            return (make(y, *self.dy),) * 4
        d = [make(y[:, ph.h.ph::self.sh, ph.w.ph::self.sw], *spec) for ph, spec in zip(self.phases, self.dys)]
        return (*d, *d[:1] * (4 - len(d)))

    def _fast_inputs(self, key: tuple) -> bool:
        """Inputs with strides `key` (x or dy, w) address the standard channels-last memory
        the descriptors describe (size-1 dims may be strided otherwise)."""
        ok = self.fast_keys.get(key)
        if ok is None:
            p = self.p
            shapes = (p.y_shape if self.bwd else p.x_shape, p.w_shape)
            ok = same_memory(shapes, key, tuple(layout_strides(sh, "nhwc") for sh in shapes))
            if len(self.fast_keys) < 64:
                self.fast_keys[key] = ok
        return ok

    def _descs(self, xl: torch.Tensor, w: torch.Tensor, yl: torch.Tensor) -> tuple:
        """Host descriptors of standard channels-last logical x (dy) and y, and of w: the
        memory the w descriptor reads (the layer's filter, or the packed one when grouped)."""
        x, y = channels_last(xl), channels_last(yl)
        if self.flat or self.depth:
            x, y = x.reshape(self.x_shape), y.reshape(self.y_shape)
        return (*self._x_descs(x, host_descriptor), host_descriptor(w, *self.dw), *self._y_descs(y, host_descriptor))

    def _packed(self, w: torch.Tensor) -> torch.Tensor:
        """Grouped: the block-diagonal filter [K, taps * CB] packed from the channels-last
        filter memory w (contiguous) into a workspace buffer, one launch."""
        wb = workspace.empty(self.dw[0], w.dtype, w.device)
        if self.pack is None:
            self.pack = Launch(_blockdiag_pack_kernel, (triton.cdiv(self.pack_tail[0], self.pack_tail[-1]),),
                               self.pack_tail)
        self.pack(w, wb)
        return wb

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        launch = self.launch
        if out is None and launch is not None and launch.ready():
            # the planned path: standard aligned inputs, a fresh output, addresses not tensors
            xl, wl = (args.dy if self.bwd else args.x), args.w
            xp, wp = xl.data_ptr(), wl.data_ptr()
            if not (xp | wp) & 15 and self._fast_inputs((xl.stride(), wl.stride())):
                yl = alloc.empty(self.out_shape, p.dtype, xl.device, self.out_strides)
                yp = yl.data_ptr()
                ptrs = self.epi.pointers(args.bias, args.post_ops, yl)
                addr = self.epi.addresses(ptrs, yp)
                if addr is not None:
                    last = self._table(xl.device).data_ptr() if self.phased else yp
                    # the filter's address is wl's (its channels-last view is a permute,
                    # built only when the descriptors are)
                    wd = self._packed(wl) if self.diag else wl
                    launch.run_keyed_addresses((xp, wd.data_ptr(), yp),
                                               lambda: self._descs(xl, wd if self.diag else channels_last(wl), yl),
                                               *addr, last)
                    return yl
        # physical NHWC views (the logical tensors are (N, C, H, W) in channels-last memory)
        x = channels_last(args.dy if self.bwd else args.x)
        w = channels_last(args.w)
        x, w = contiguous_aligned(x), contiguous_aligned(w)
        if self.diag:
            w = self._packed(w)
        direct = (out is not None and out.dtype == p.dtype and out.data_ptr() % 16 == 0
                  and channels_last(out).is_contiguous())
        y_phys = channels_last(out) if direct else None
        if self.flat or self.depth:   # flat: the same memory as one row of N*H*W pixels; 3-D: N*D planes
            x = x.reshape(self.x_shape)
            y = y_phys.reshape(self.y_shape) if direct else alloc.empty(self.y_shape, p.dtype, x.device)
            y_nchw = logical(y.view(out_phys_shape(p)))
        else:
            y = y_phys if direct else alloc.empty(self.y_shape, p.dtype, x.device)
            y_nchw = y.permute(0, 3, 1, 2)
        ptrs = (*self.epi.pointers(args.bias, args.post_ops, y_nchw), self._table(x.device) if self.phased else y)
        if self.planned:   # the descriptors' encoded form is reused per (x, w, y) address
            self._launch(x.device).run_keyed(
                (x.data_ptr(), w.data_ptr(), y.data_ptr()),
                lambda: (*self._x_descs(x, host_descriptor), host_descriptor(w, *self.dw),
                         *self._y_descs(y, host_descriptor)),
                *ptrs)
        else:
            descs = (*self._x_descs(x, TensorDescriptor), TensorDescriptor(w, *self.dw),
                     *self._y_descs(y, TensorDescriptor))
            grid = (max(1, min(sm_count(x.device.index), self.n_tiles)),)
            _gluon_conv_kernel[grid](*descs, *ptrs, *self.tail, num_warps=self.tile.warps)
        if out is not None and not direct:
            return out.copy_(y_nchw)
        return y_nchw


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """The physical (N, *spatial, C) view of a logical (N, C, *spatial) channels-last tensor."""
    return t.permute(0, *range(2, t.dim()), 1)


def logical(t: torch.Tensor) -> torch.Tensor:
    """The logical (N, C, *spatial) view of a physical (N, *spatial, C) tensor."""
    return t.permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def out_phys_shape(p: ConvProblem) -> tuple[int, ...]:
    """The channels-last (N, H, W, C) shape of what the plan writes: y (forward), dx (backward data)."""
    n, c, *sp = p.y_shape if p.direction == "fwd" else p.x_shape
    return (n, *sp, c)


# ---- solver ------------------------------------------------------------------------------
def shape_reasons(p: ConvProblem) -> list[str]:
    """Options the kernel does not cover (each names the option and its value)."""
    reasons = []
    if p.ndim not in (2, 3):
        reasons.append(f"ndim={p.ndim}: only 2-D and 3-D convolutions")
    elif p.ndim == 3 and p.direction == "bwd_data" and any(s != 1 for s in p.stride):
        reasons.append(f"stride={tuple(p.stride)}: 3-D backward data needs stride 1 (the phased launch is 2-D)")
    if p.layout != "nhwc":
        reasons.append(f"layout={p.layout}: needs nhwc")
    if p.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"dtype {p.dtype}: needs bfloat16 or float16")
    if p.out_dtype != p.dtype:
        reasons.append(f"out_dtype {p.out_dtype}: the output must be in the input dtype {p.dtype}")
    if p.groups != 1 and p.direction != "bwd_weights":
        if p.direction == "bwd_data" and any(s != 1 for s in p.stride):
            reasons.append(f"groups={p.groups} with stride={tuple(p.stride)}: grouped backward data needs stride 1")
        elif p.direction == "bwd_data" and flipped_padding_reasons(p):
            pass    # named below; its forward view does not exist
        elif diag_geometry(forward_view(p)) is None:
            reasons.append(f"groups={p.groups} with {p.K // p.groups} filters and {p.C // p.groups} channels per "
                           "group: no tile of whole groups (64-256 filters, 16-128 channels, groups of 4+)")
    # rows and columns: stride 1 or 2 (phase views); 3-D depth: any (each tap picks its plane)
    if any(s not in (1, 2) for s in p.stride[-2:]):
        reasons.append(f"stride={tuple(p.stride)}: needs stride 1 or 2 over rows and columns")
    elif any(s == 2 and n < 2 for s, n in zip(p.stride[-2:], p.in_size[-2:])):
        reasons.append(f"stride 2 over an input size {tuple(p.in_size)} < 2: an empty stride phase")
    if p.C % 16 or p.K % 16:
        reasons.append(f"C={p.C}, K={p.K}: both must be multiples of 16 (TMA row alignment)")
    if p.direction == "bwd_data" and all(s == 1 for s in p.stride):   # stride 2: phased, any padding
        reasons += flipped_padding_reasons(p)
    return reasons


class GluonConvSolver(_IGemmBase):
    """What the Gluon conv solvers 27/28/29 share: Hopper + Gluon, bf16/f16, a fixed
    reduction order, long compiles, `shape_reasons`, and the price of a Gluon kernel."""
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    deterministic = True    # one CTA (or one ordered reduce) sums each output element in a fixed order
    long_compile = True
    launch_per_phase = False  # stride 2: the phases in one launch (gluon_phases)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + shape_reasons(problem) + gluon_reasons(problem.device)

    def workspace_size(self, problem) -> int:
        """Grouped forward / backward data: the packed block-diagonal filter."""
        if problem.groups == 1 or problem.direction == "bwd_weights" or shape_reasons(problem):
            return 0
        fp = forward_view(problem) if problem.direction == "bwd_data" else problem
        d = diag_geometry(fp)
        return 0 if d is None else fp.K * math.prod(fp.filter) * d.CB * fp.dtype.itemsize

    def diag_estimate(self, fp: ConvProblem, direction: str) -> float | None:
        """Grouped: the dense work of the block-diagonal tiles (CB / Cg times the grouped
        FLOPs) at DIAG_EFF of the dense roofline, and at least the host time of a call in
        `direction` (fp may be a backward's forward view)."""
        d = diag_geometry(fp)
        if d is None:
            return None
        return max(roofline_ms(fp.flops() * d.CB / d.Cg, fp.bytes(), fp.dtype, DIAG_EFF), HOST_FLOOR_MS[direction])

    @staticmethod
    def gluon_price(est: float | None, direction: str) -> float | None:
        """An implicit-GEMM estimate as the Gluon kernels run it: 0.57-0.62x solver 20's time
        on ResNet-50 1x1/3x3 and UNet 3x3 layers in the H200 probe of 2026-12-01
        (benchmarks/gluon_conv_probe.py), and at least the host time of a call in `direction`."""
        return None if est is None else max(est * GLUON_VS_SOLVER20, HOST_FLOOR_MS[direction])

    def prepare(self, problem):
        return GluonConvPlan(problem)


@register
class GluonImplicitGemmFwd(GluonConvSolver):
    """Persistent warp-specialised Hopper forward in Gluon: TMA producer warp, wgmma consumers."""
    id = 27
    name = "gluon_implicit_gemm_fwd"
    directions = frozenset({"fwd"})

    def estimate(self, problem) -> float | None:
        if problem.groups > 1:
            return self.diag_estimate(problem, "fwd")
        return self.gluon_price(super().estimate(problem), "fwd")


@register
class GluonImplicitGemmBwdData(GluonConvSolver):
    """Backward data on solver 27's kernel: dy convolved with the flipped filter, the filter
    read in place as an MN-major wgmma operand (`forward_view`, TRANS_W); stride 2 as the
    stride-1 convolutions of its dx phases in one phased launch (`gluon_phases`)."""
    id = 28
    name = "gluon_implicit_gemm_bwd_data"
    directions = frozenset({"bwd_data"})

    def estimate(self, problem) -> float | None:
        # the forward it runs, priced as solver 27 prices a forward; stride 2: the phases do
        # the same FLOPs over the same dx pixels (as 27 prices its stride 2: the problem's own)
        if shape_reasons(problem):
            return None
        if problem.groups > 1:
            return self.diag_estimate(forward_view(problem), "bwd_data")
        if any(s != 1 for s in problem.stride):
            return self.gluon_price(super().estimate(problem), "bwd_data")
        return self.gluon_price(super().estimate(forward_view(problem)), "bwd_data")
