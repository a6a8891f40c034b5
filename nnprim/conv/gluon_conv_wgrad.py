"""NHWC backward weights for Hopper in Gluon (solver 29
`gluon_implicit_gemm_bwd_weights`, family `implicit_gemm`, issue 13).

The GEMM of solver 22's TMA kernel (implicit_gemm_bwd.py `_conv_bwd_w_tma_kernel`):
  dw[k, tap, c] = sum over output pixels o of dy[o, k] * x[o*stride - pad + tap*dil, c]
an output tile is BM filter rows k times BN channels c of one tap; the reduction walks the
output pixels of every image in BH x BW rectangles (BP = BH*BW pixels per step): one
[1, BH, BW, BM] TMA box of dy and the same rectangle of x shifted by the tap, [1, BH, BW,
BN] (zero fill past the image is the padding; dy rows past OH/OW read as zeros, so tails
need no masks). Both boxes have channels contiguous, so both wgmma operands are MN-major
views of them (A = dy box^T [BM, BP], B = x box [BP, BN]); no transpose through registers.
Stride 2: the x rectangle of a tap is a unit-stride box of the phase view x[:, a::2, b::2]
(a, b = the parities of the tap's offset), read as solver 27 reads its x (`_load_x`, one
descriptor per phase, gluon_phases.py): the same steps and FLOPs as stride 1.

Structure (as solver 27, gluon_conv.py): a persistent grid walks work units (output tile,
reduction slice); `gl.warp_specialize` with a 1-warp TMA producer feeding a STAGES-deep ring
across unit boundaries and a consumer warpgroup issuing async wgmma and storing each unit's
f32 tile: into dw (cast) when there is one slice, else into a workspace [SPLIT, K, taps*C]
that `_split_reduce_kernel` (solver 22's) sums in slice order: deterministic.

Grouped (DIAG): a tile is BM filter rows of whole groups times the BN = BM/Kg*Cg input
channels of those groups (the block-diagonal tiles of the dense GEMM; ResNeXt g32: 16 groups of
4x4 per 64 x 64 tile, depthwise 64 groups of 1x1), only the entries within a group stored.

3-D: the output planes are the images and each depth tap reads its x plane, as solver 27
does (gluon_conv `_x_plane`).

Covers 2-D and 3-D NHWC bf16/f16, any groups with such a tile, stride 1 or 2 over rows and
columns (3-D depth: any), any dilation/padding/filter, C and K multiples of 16, dw in the
input dtype. Hopper + Gluon only (see gluon_support.gluon_reasons)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import alloc, workspace
from ..args import ConvArgs
from ..gluon_support import (
    contiguous_aligned,
    gl,
    gluon,
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
from .depthwise import dw_estimate
from .gluon_conv import SMEM_BYTES, GluonConvSolver, _nvmma, channels_last, flat_view, logical, rect
from .gluon_phases import four_phase_descs, phases_of, view_geometry
from .implicit_gemm import geom, layout_strides, roofline_ms, same_memory
from .implicit_gemm_bwd import REDUCE_SLICES, _split_reduce_kernel, max_split

MAX_STAGES = 6
SLICE_STEPS = 4    # fewest pixel rectangles per reduction slice (the ring's fill per unit)


@dataclass(frozen=True)
class WgradTile:
    """BM filter rows (k) x BN channels (c) of TAPS consecutive taps per unit, BP = BH*BW
    output pixels per step. TAPS 2 (ungrouped, split schedule): one dy box and two x boxes a
    step into two accumulators, the dy box read once for both taps (not yet measured on a GPU:
    `benchmarks/gluon_conv_bwd_probe.py` times it as the `taps2` variant)."""
    BH: int
    BW: int
    BM: int
    BN: int
    STAGES: int
    warps: int = 4
    TAPS: int = 1

    @property
    def BP(self) -> int:
        return self.BH * self.BW

    def stage_bytes(self, elem: int = 2) -> int:
        return (self.BM + self.TAPS * self.BN) * self.BP * elem


def diag_tile(p: ConvProblem) -> tuple[int, int] | None:
    """(BM, BN) of the grouped (block-diagonal) mode: BM filter rows holding whole groups
    and the BN = BM/Kg*Cg input channels of the same groups; None when no such tile is a
    valid wgmma/TMA shape (BN a power of two in 16..256)."""
    Kg, Cg = p.K // p.groups, p.C // p.groups
    for BM in (64, 128):
        if BM % Kg == 0 and BM // Kg * Cg in (16, 32, 64, 128, 256):
            return BM, BM // Kg * Cg
    return None


def tile_config(p: ConvProblem) -> WgradTile:
    """BM/BN 128 where 128 divides K/C (else 64: K = 320 in 128-row tiles computes 384 rows;
    measured unet_320_64x64 0.192 ms at 128 x 128, 0.208 / 0.227 at 128 x 64 / 64 x 128, 0.147
    at 64 x 64 with 128-pixel steps), BP 64 pixels (a 7x7 image fills 49 of 64), as many ring
    stages as fit (at most MAX_STAGES). Grouped: `diag_tile`.
    BP 128 where C or K is 64 (a 64-wide tile) on images of 256+ pixels, filters past 1x1:
    the 64 x 64 x 64 step is bound by its barrier round trip, not by the tensor cores. Measured
    on the H200 (results/wgrad_bp_probe_2026-12-02_s20.json, CUDA-graph time): rn50_r2_3x3
    0.131 -> 0.085 ms, c3d_3x3x3 (128 x 64) 0.479 -> 0.364; on 128 x 128 tiles 128-pixel steps
    were 0.96-1.04x (rn50_r3/r4, unet), so those keep 64."""
    gm = geom(p)
    if p.groups > 1:
        BM, BN = diag_tile(p)
    else:   # 128 only where it divides: unet_320's 320 channels in 64-wide tiles (0.192 -> 0.147 ms)
        BM = 128 if gm.K % 128 == 0 else 64
        BN = 128 if gm.C % 128 == 0 else 64
    wide = p.groups == 1 and min(BM, BN) == 64 and gm.taps > 1 and gm.out[1] * gm.out[2] >= 256
    BH, BW = rect(128 if wide else 64, gm.out[1], gm.out[2])
    t = WgradTile(BH, BW, BM, BN, 1)
    stages = min(MAX_STAGES, (SMEM_BYTES - 2048) // t.stage_bytes())
    return WgradTile(BH, BW, BM, BN, stages, 8 if BM * BN > 128 * 64 else 4)


def taps2_tile(p: ConvProblem) -> WgradTile:
    """`tile_config`'s tile with two taps a unit (the dy box shared; ungrouped), as many ring
    stages as then fit: a variant the probes time (`WgradTile`)."""
    t = tile_config(p)
    two = WgradTile(t.BH, t.BW, t.BM, t.BN, 1, t.warps, TAPS=2)
    return WgradTile(t.BH, t.BW, t.BM, t.BN, min(MAX_STAGES, (SMEM_BYTES - 2048) // two.stage_bytes()), t.warps, 2)


# cost model of plan_split (us, H200): a BM x BN x BP step at ~600 TFLOP/s over 132 SMs (at
# least STEP_FLOOR_US: small steps are latency-bound); the ordered reduce per REDUCE_SLICES
# slices, its launch, and the workspace traffic at ~3 TB/s
STEP_FLOOR_US = 0.25
REDUCE_STEP_US = 0.6
LAUNCH_US = 3.0


def plan_split(p: ConvProblem, t: WgradTile, sms: int) -> tuple[int, int, int]:
    """(split, steps per slice, units). The persistent grid runs `units` = tiles x split
    equal units on min(sms, units) CTAs; the split minimises the modelled time: the
    critical path (waves of units x steps per unit) plus the ordered reduction of the f32
    partials (per REDUCE_SLICES slices and bytes), within int32-indexable workspaces and
    slices of at least SLICE_STEPS pixel rectangles."""
    gm = geom(p)
    nt = gm.N * gm.out[0] * triton.cdiv(gm.out[1], t.BH) * triton.cdiv(gm.out[2], t.BW)
    tiles = triton.cdiv(gm.K, t.BM) * triton.cdiv(gm.taps, t.TAPS) * (1 if p.groups > 1 else triton.cdiv(gm.C, t.BN))
    step_us = max(STEP_FLOOR_US, 2 * t.BM * t.BN * t.TAPS * t.BP / (600e6 / 132))
    E = gm.K * gm.taps * gm.Cg
    hi = max(1, min(triton.cdiv(8 * sms, tiles), nt // SLICE_STEPS, max_split(p)))

    def cost(split: int) -> float:
        tps = triton.cdiv(nt, split)
        split = triton.cdiv(nt, tps)
        main = triton.cdiv(tiles * split, sms) * tps * step_us
        if split == 1:
            return main
        return main + LAUNCH_US + triton.cdiv(split, REDUCE_SLICES.value) * REDUCE_STEP_US + split * E * 4 / 3e6

    split = min(range(1, hi + 1), key=lambda s: (cost(s), s))
    tps = triton.cdiv(nt, split)
    split = triton.cdiv(nt, tps)
    return split, tps, tiles * split


def split_cost_us(p: ConvProblem, t: WgradTile, sms: int) -> float:
    """plan_split's modelled time (us) of its chosen split."""
    gm = geom(p)
    split, tps, units = plan_split(p, t, sms)
    step_us = max(STEP_FLOOR_US, 2 * t.BM * t.BN * t.TAPS * t.BP / (600e6 / 132))
    main = triton.cdiv(units, sms) * tps * step_us
    if split == 1:
        return main
    E = gm.K * gm.taps * gm.Cg
    return main + LAUNCH_US + triton.cdiv(split, REDUCE_SLICES.value) * REDUCE_STEP_US + split * E * 4 / 3e6


def sk_geometry(p: ConvProblem, t: WgradTile) -> tuple[int, int]:
    """(tiles, rectangles per tile) of the stream-K work list (ungrouped)."""
    gm = geom(p)
    nt = gm.N * gm.out[0] * triton.cdiv(gm.out[1], t.BH) * triton.cdiv(gm.out[2], t.BW)
    return triton.cdiv(gm.K, t.BM) * gm.taps * triton.cdiv(gm.C, t.BN), nt


def stream_k_reasons(p: ConvProblem, t: WgradTile) -> list[str]:
    """Why the stream-K schedule cannot run p: grouped tiles, taps sharing a tile, or a work
    list past int32."""
    reasons = []
    if p.groups > 1:
        reasons.append(f"groups={p.groups}: stream-K covers ungrouped tiles")
    if t.TAPS > 1:
        reasons.append(f"TAPS={t.TAPS}: stream-K runs one tap a tile")
    tiles, nt = sk_geometry(p, t)
    if tiles * nt >= 2 ** 31 // 2:
        reasons.append(f"{tiles * nt} steps: past the int32 step index")
    return reasons


def use_stream_k(p: ConvProblem, t: WgradTile, sms: int) -> bool:
    """Stream-K where one pixel rectangle is a whole image (7x7 layers) and its modelled time
    (equal runs of steps on every SM, the fix-up of the shared tiles) beats plan_split's.
    Measured on the H200 (results/wgrad_stream_2026-12-02_s14.json): rn50_r5_3x3 (144 tiles
    of 128 steps: split mode runs whole units in uneven waves) 0.084 ms against 0.108; on
    larger images the split mode's units, which run one pixel slice across all tiles at
    once, took 0.41-0.48 us a step where stream-K's scattered runs took 0.58-0.62 (unet_640
    0.107 against 0.127 ms, rn50_r3_3x3 0.062 against 0.076)."""
    gm = geom(p)
    if stream_k_reasons(p, t) or t.BH < gm.out[1] or t.BW < gm.out[2]:
        return False
    tiles, nt = sk_geometry(p, t)
    step_us = max(STEP_FLOOR_US, 2 * t.BM * t.BN * t.BP / (600e6 / 132))
    sk = triton.cdiv(tiles * nt, sms) * step_us + LAUNCH_US + 2 * sms * t.BM * t.BN * 4 / 3e6
    return sk < split_cost_us(p, t, sms)


# ---- Gluon kernel ------------------------------------------------------------------------
if gluon is not None:
    from .gluon_conv import _load_x, _tap_rq, _x_plane

    @gluon.jit
    def _unit_coords(u, tiles, nj, ncb, Kg, Cg, DIAG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                     TAPS: gl.constexpr = 1):
        """(slice, filter-row block, first tap, first channel) of work unit u: units of one
        slice are adjacent; DIAG (grouped): the channels of the groups of rows [pid_k*BM, +BM);
        TAPS taps a tile."""
        sp = u // tiles
        tile = u - sp * tiles
        pid_k = tile // nj
        pid_j = tile - pid_k * nj
        tg = pid_j // ncb
        if DIAG:
            c0 = (pid_k * BM // Kg) * Cg
        else:
            c0 = (pid_j - tg * ncb) * BN
        return sp, pid_k, tg * TAPS, c0

    @gluon.jit
    def _ring(dy_desc, x_desc, STAGES: gl.constexpr, TAPS: gl.constexpr = 1):
        """The STAGES-deep ring: dy and x box buffers (TAPS x boxes a stage) and their
        ready / empty barriers."""
        dtype: gl.constexpr = dy_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + dy_desc.block_type.shape, dy_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES * TAPS] + x_desc.block_type.shape, x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        return a_bufs, b_bufs, ready, empty

    @gluon.jit
    def _release(ready, empty):
        """Invalidate the ring's barriers (the kernel's end)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

    @gluon.jit
    def _mma_run(a_bufs, b_bufs, ready, empty, acc, acc1, steps, cnt, BP: gl.constexpr, BM: gl.constexpr,
                 BN: gl.constexpr, TAPS: gl.constexpr = 1):
        """`steps` ring slots from the `cnt`-th into acc (the boxes viewed as [BP, BM] and
        [BP, BN]): async wgmma, a slot released once the next step's wgmma is issued and the
        older ones retired, the last one at the end. TAPS 2: each slot's dy box against its
        two x boxes into acc / acc1 (TAPS 1 leaves acc1 as given). Returns (acc, acc1, cnt)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        dtype: gl.constexpr = a_bufs.dtype
        a2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BP, BM], dtype)
        b2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BP, BN], dtype)
        for st in range(steps):
            s = cnt % STAGES
            mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
            a = a_bufs.index(s)._reinterpret(dtype, [BP, BM], a2_layout).permute((1, 0))
            if TAPS == 2:
                acc = warpgroup_mma(a, b_bufs.index(2 * s)._reinterpret(dtype, [BP, BN], b2_layout), acc,
                                    is_async=True)
                acc1 = warpgroup_mma(a, b_bufs.index(2 * s + 1)._reinterpret(dtype, [BP, BN], b2_layout), acc1,
                                     is_async=True)
                acc, acc1 = warpgroup_mma_wait(2, deps=(acc, acc1))
            else:
                acc = warpgroup_mma(a, b_bufs.index(s)._reinterpret(dtype, [BP, BN], b2_layout), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))
            if st > 0:
                mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
            cnt += 1
        if TAPS == 2:
            acc, acc1 = warpgroup_mma_wait(0, deps=(acc, acc1))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
        return acc, acc1, cnt

    @gluon.jit
    def _rect_slot(dy_desc, a_bufs, ready, empty, t, cnt, n_th, n_tw, pid_k, nbytes: gl.constexpr,
                   BH: gl.constexpr, BW: gl.constexpr, BM: gl.constexpr):
        """Ring slot cnt % STAGES for pixel rectangle t, once the consumer has released it:
        `nbytes` expected on its ready barrier, the dy box loaded. Returns (image, row, column
        of the rectangle, slot)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        tw = t % n_tw
        tmp = t // n_tw
        th = tmp % n_th
        n = tmp // n_th
        s = cnt % STAGES
        mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(dy_desc, [n, th * BH, tw * BW, pid_k * BM], ready.index(s), a_bufs.index(s))
        return n, th * BH, tw * BW, s

    @gluon.jit
    def _load_rect2(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, t, cnt, n_th, n_tw,
                    pid_k, tap, n_taps, RS, S, ph, pw, dh, dw, c0, OD, D, sd, pd, dd, BH: gl.constexpr,
                    BW: gl.constexpr, BM: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr, DEPTH: gl.constexpr):
        """`_load_rect` for two taps a tile: the dy box once, the x boxes of taps `tap` and
        `tap` + 1 (past the last tap: a box wholly outside x, zeros) onto slot cnt % STAGES."""
        nbytes: gl.constexpr = dy_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes
        n, h0, w0, s = _rect_slot(dy_desc, a_bufs, ready, empty, t, cnt, n_th, n_tw, pid_k, nbytes, BH, BW, BM)
        for u in gl.static_range(2):
            tu = tap + u
            td, r, q = _tap_rq(gl.minimum(tu, n_taps - 1), RS, S, DEPTH)
            xn = _x_plane(n, td, OD, D, sd, pd, dd, DEPTH)
            if tu >= n_taps:
                xn = -1
            _load_x(x_desc, x01_desc, x10_desc, x11_desc, xn, h0, w0, r * dh - ph, q * dw - pw, c0, ready.index(s),
                    b_bufs.index(2 * s + u), SH, SW)

    @gluon.jit
    def _load_rect(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, t, cnt, n_th, n_tw,
                   pid_k, td, oh, ow, c0, OD, D, sd, pd, dd, BH: gl.constexpr, BW: gl.constexpr, BM: gl.constexpr,
                   SH: gl.constexpr, SW: gl.constexpr, DEPTH: gl.constexpr):
        """Pixel rectangle t's dy box and its x box shifted by the tap (oh, ow) onto ring slot
        cnt % STAGES, once the consumer has released it. DEPTH (3-D): t's image is an output
        plane; the x box comes from the plane depth tap td reads (`_x_plane`)."""
        nbytes: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
        n, h0, w0, s = _rect_slot(dy_desc, a_bufs, ready, empty, t, cnt, n_th, n_tw, pid_k, nbytes, BH, BW, BM)
        _load_x(x_desc, x01_desc, x10_desc, x11_desc, _x_plane(n, td, OD, D, sd, pd, dd, DEPTH), h0, w0,
                oh, ow, c0, ready.index(s), b_bufs.index(s), SH, SW)

    @gluon.jit
    def _producer(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, n_units, tiles,
                  nj, ncb, S, tps, nt, n_th, n_tw, ph, pw, dh, dw, Kg, Cg, RS, OD, D, sd, pd, dd, n_taps,
                  DIAG: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  SH: gl.constexpr, SW: gl.constexpr, DEPTH: gl.constexpr, TAPS: gl.constexpr):
        """1 warp: for each unit of this CTA and each pixel rectangle of its slice, a dy box
        and the tap-shifted x box onto the next ring slot (stride 2: from x's phase view,
        as solver 27 reads it, `_load_x`)."""
        cnt = 0
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            sp, pid_k, tap, c0 = _unit_coords(u, tiles, nj, ncb, Kg, Cg, DIAG, BM, BN, TAPS)
            t_end = gl.minimum(sp * tps + tps, nt)
            if TAPS == 2:
                for t in range(sp * tps, t_end):
                    _load_rect2(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, t, cnt,
                                n_th, n_tw, pid_k, tap, n_taps, RS, S, ph, pw, dh, dw, c0, OD, D, sd, pd, dd, BH, BW,
                                BM, SH, SW, DEPTH)
                    cnt += 1
            else:
                td, r, q = _tap_rq(tap, RS, S, DEPTH)
                for t in range(sp * tps, t_end):
                    _load_rect(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, t, cnt,
                               n_th, n_tw, pid_k, td, r * dh - ph, q * dw - pw, c0, OD, D, sd, pd, dd, BH, BW, BM, SH,
                               SW, DEPTH)
                    cnt += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, out_ptr, n_units, tiles, nj, ncb, tps, nt, K, C, Kg, Cg, n_taps,
                  DIRECT: gl.constexpr, DIAG: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr, TAPS: gl.constexpr):
        """Async wgmma over the ring (a slot is released once the next step's wgmma is
        issued and the older ones retired), then the unit's tile to dw or its slice of the
        workspace ([SPLIT, K, taps*Cg] f32; dw is [K, taps*Cg] as well). Grouped (DIAG):
        only the entries whose channel is in the row's group are stored. TAPS 2: the second
        accumulator is the next tap's (stored while that tap exists)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BN, 16])
        ncol = n_taps * Cg
        cnt = 0
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            sp, pid_k, tap, c0 = _unit_coords(u, tiles, nj, ncb, Kg, Cg, DIAG, BM, BN, TAPS)
            steps = gl.minimum(sp * tps + tps, nt) - sp * tps
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            acc, acc1, cnt = _mma_run(a_bufs, b_bufs, ready, empty, acc, acc, steps, cnt, BH * BW, BM, BN, TAPS)
            if TAPS == 2:
                _store_unit(acc1, out_ptr, sp, pid_k, tap + 1, c0, K, C, Kg, Cg, ncol, tap + 1 < n_taps, DIRECT, BM, BN)
            _store_unit(acc, out_ptr, sp, pid_k, tap, c0, K, C, Kg, Cg, ncol, True, DIRECT, BM, BN)

    @gluon.jit
    def _store_unit(acc, out_ptr, sp, pid_k, tap, c0, K, C, Kg, Cg, ncol, live, DIRECT: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr):
        """A unit's tile of tap `tap` to dw (cast) or its slice of the f32 workspace, only the
        entries whose channel is in the row's group (all of them when ungrouped); nothing when
        not `live`."""
        acc_layout: gl.constexpr = acc.type.layout
        if live:
            rk = pid_k * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
            rc = c0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            grp = rk // Kg
            mask = (rk < K)[:, None] & (rc < C)[None, :] & ((rc // Cg)[None, :] == grp[:, None])
            off = (rk * ncol - grp * Cg)[:, None] + (tap * Cg + rc)[None, :]
            if DIRECT:
                gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                gl.store(out_ptr + sp.to(gl.int64) * K * ncol + off, acc, mask=mask)

    @gluon.jit(do_not_specialize=["N", "OH", "OW", "S", "C", "K", "ph", "pw", "dh", "dw", "tps", "split",
                                  "T", "OD", "D", "sd", "pd", "dd"])
    def _gluon_wgrad_kernel(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, out_ptr, N, OH, OW, R, S, C, K, Kg, Cg,
                            ph, pw, dh, dw, tps, split, T, OD, D, sd, pd, dd,
                            DIRECT: gl.constexpr, DIAG: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                            BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SH: gl.constexpr,
                            SW: gl.constexpr, DEPTH: gl.constexpr, TAPS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent: CTA i runs units i, i + grid, ... (see the module docstring). DEPTH
        (3-D): N counts output planes (N*OD), x is [N*D, H, W, C], taps T x R x S. TAPS taps
        a tile (2: ungrouped only)."""
        gl.static_assert(TAPS == 1 or (TAPS == 2 and not DIAG), "two taps a tile: ungrouped tiles only")
        n_th = gl.cdiv(OH, BH)
        n_tw = gl.cdiv(OW, BW)
        nt = N * n_th * n_tw
        if DIAG:
            ncb = 1
        else:
            ncb = gl.cdiv(C, BN)
        nj = gl.cdiv(T * R * S, TAPS) * ncb
        tiles = gl.cdiv(K, BM) * nj
        n_units = tiles * split
        a_bufs, b_bufs, ready, empty = _ring(dy_desc, x_desc, STAGES, TAPS)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, out_ptr, n_units, tiles, nj, ncb, tps, nt, K, C, Kg, Cg,
                         T * R * S, DIRECT, DIAG, BH, BW, BM, BN, num_warps, TAPS)),
            (_producer, (dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, n_units,
                         tiles, nj, ncb, S, tps, nt, n_th, n_tw, ph, pw, dh, dw, Kg, Cg, R * S, OD, D, sd, pd, dd,
                         T * R * S, DIAG, BH, BW, BM, BN, SH, SW, DEPTH, TAPS)),
        ], [1], [24])
        _release(ready, empty)


    # ---- stream-K: every CTA reduces an equal run of the (tile, rectangle) steps -------------
    @gluon.jit
    def _sk_range(total, nt):
        """This CTA's steps [lo, hi) of `total` (= tiles * nt, tile-major) and its tiles
        [t_first, t_last] (an empty range when it has no steps). floor(g * total / G) in int32
        (total < 2^30, sk_reasons; g <= G <= the SMs): an int64 `//` compiles to a subroutine
        call, and a kernel with a call loses the uniform datapath in its loops (decode.floor_muldiv)."""
        g = gl.program_id(0)
        G = gl.num_programs(0)
        t32 = total.to(gl.int32)
        q = t32 // G
        r = t32 - q * G
        lo = g * q + (g * r) // G
        hi = (g + 1) * q + ((g + 1) * r) // G
        return lo, hi, lo // nt, (hi + nt - 1) // nt - 1

    @gluon.jit
    def _tile_coords(tile, nj, ncb, BN: gl.constexpr):
        """(filter-row block, tap, first channel) of an ungrouped tile."""
        pid_k = tile // nj
        pid_j = tile - pid_k * nj
        tap = pid_j // ncb
        return pid_k, tap, (pid_j - tap * ncb) * BN

    @gluon.jit
    def _producer_sk(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, total, nj, ncb,
                     S, nt, n_th, n_tw, ph, pw, dh, dw, RS, OD, D, sd, pd, dd, BH: gl.constexpr, BW: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr, DEPTH: gl.constexpr):
        """`_producer` over this CTA's run of steps (see `_sk_range`)."""
        lo, hi, t_first, t_last = _sk_range(total, nt)
        cnt = 0
        for tile in range(t_first, t_last + 1):
            pid_k, tap, c0 = _tile_coords(tile, nj, ncb, BN)
            td, r, q = _tap_rq(tap, RS, S, DEPTH)
            for t in range(gl.maximum(lo, tile * nt) - tile * nt, gl.minimum(hi, tile * nt + nt) - tile * nt):
                _load_rect(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, t, cnt,
                           n_th, n_tw, pid_k, td, r * dh - ph, q * dw - pw, c0, OD, D, sd, pd, dd, BH, BW, BM, SH, SW,
                           DEPTH)
                cnt += 1

    @gluon.jit
    def _consumer_sk(a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, total, nj, ncb, nt, K, C, n_taps,
                     BH: gl.constexpr, BW: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr):
        """`_consumer` over this CTA's run: a tile whose steps all fall in the run is stored
        into dw (cast); the run's first and last tiles, when other CTAs hold the rest of their
        steps, go to this CTA's two f32 slots of the workspace [grid, 2, BM, BN]
        (`_sk_fixup_kernel` sums them in CTA order)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BN, 16])
        ncol = n_taps * C
        lo, hi, t_first, t_last = _sk_range(total, nt)
        ri = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        ci = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        slot0 = ws_ptr + gl.program_id(0).to(gl.int64) * (2 * BM * BN) + (ri * BN)[:, None] + ci[None, :]
        cnt = 0
        for tile in range(t_first, t_last + 1):
            pid_k, tap, c0 = _tile_coords(tile, nj, ncb, BN)
            s_lo = gl.maximum(lo, tile * nt)
            s_hi = gl.minimum(hi, tile * nt + nt)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            acc, _, cnt = _mma_run(a_bufs, b_bufs, ready, empty, acc, acc, s_hi - s_lo, cnt, BH * BW, BM, BN)
            if (s_lo == tile * nt) & (s_hi == tile * nt + nt):
                rk = pid_k * BM + ri
                rc = c0 + ci
                mask = (rk < K)[:, None] & (rc < C)[None, :]
                off = (rk * ncol)[:, None] + (tap * C + rc)[None, :]
                gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:   # slot 0: the run's first tile, 1: its last (a run inside one tile uses slot 0)
                gl.store(slot0 + (s_lo != lo).to(gl.int32) * (BM * BN), acc)

    @gluon.jit(do_not_specialize=["N", "OH", "OW", "S", "C", "K", "ph", "pw", "dh", "dw",
                                  "T", "OD", "D", "sd", "pd", "dd"])
    def _gluon_wgrad_sk_kernel(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, out_ptr, ws_ptr, N, OH, OW, R, S, C,
                               K, ph, pw, dh, dw, T, OD, D, sd, pd, dd, BH: gl.constexpr, BW: gl.constexpr,
                               BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SH: gl.constexpr,
                               SW: gl.constexpr, DEPTH: gl.constexpr, num_warps: gl.constexpr):
        """Stream-K (ungrouped): the persistent grid splits the tiles x rectangles steps into
        equal runs, one per CTA (see `GluonWgradPlan`)."""
        n_th = gl.cdiv(OH, BH)
        n_tw = gl.cdiv(OW, BW)
        nt = N * n_th * n_tw
        ncb = gl.cdiv(C, BN)
        nj = T * R * S * ncb
        total = (gl.cdiv(K, BM) * nj).to(gl.int64) * nt
        a_bufs, b_bufs, ready, empty = _ring(dy_desc, x_desc, STAGES)
        gl.warp_specialize([
            (_consumer_sk, (a_bufs, b_bufs, ready, empty, out_ptr, ws_ptr, total, nj, ncb, nt, K, C, T * R * S,
                            BH, BW, BM, BN, num_warps)),
            (_producer_sk, (dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, total,
                            nj, ncb, S, nt, n_th, n_tw, ph, pw, dh, dw, R * S, OD, D, sd, pd, dd, BH, BW, BM, BN,
                            SH, SW, DEPTH)),
        ], [1], [24])
        _release(ready, empty)


@triton.jit
def _sk_fixup_kernel(ws_ptr, dw_ptr, total, nt, G, nj, ncb, K, C, ncol,
                     BM: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr):
    """dw of the tiles that several stream-K runs share: their partials summed in CTA order
    (deterministic). Program (tile, chunk of BLOCK entries of the BM x BN tile)."""
    tile = tl.program_id(0)
    s0 = tile.to(tl.int64) * nt
    g_lo = ((s0 + 1) * G + total - 1) // total - 1            # the CTA holding step s0
    g_hi = ((s0 + nt) * G + total - 1) // total - 1           # ... and step s0 + nt - 1
    if g_hi > g_lo:
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        r = e // BN
        c = e - r * BN
        lo_first = g_lo * total // G
        acc = tl.load(ws_ptr + (g_lo * 2 + (lo_first != s0).to(tl.int64)) * (BM * BN) + e)
        for g in range(g_lo + 1, g_hi + 1):
            acc += tl.load(ws_ptr + g * 2 * (BM * BN) + e)
        pid_k = tile // nj
        pid_j = tile - pid_k * nj
        tap = pid_j // ncb
        rk = pid_k * BM + r
        rc = (pid_j - tap * ncb) * BN + c
        tl.store(dw_ptr + rk * ncol + tap * C + rc, acc.to(dw_ptr.dtype.element_ty), mask=(rk < K) & (rc < C))


# ---- launcher ------------------------------------------------------------------------------
class GluonWgradPlan:
    """Launch of `_gluon_wgrad_kernel` (+ the ordered split reduction) for one problem; dy
    and x as standard channels-last tensors (others are copied), dw channels-last."""

    def __init__(self, p: ConvProblem, tile: WgradTile | None = None, sms: int | None = None,
                 stream: bool | None = None):
        self.p = p
        self.gp = flat_view(p) or p    # 1x1: the pixels of all images as one flat row
        gm = self.gm = geom(self.gp)
        self.tile = t = tile or tile_config(self.gp)
        self.sms = sms
        H, W = gm.inp[1], gm.inp[2]
        OH, OW = gm.out[1], gm.out[2]
        # 3-D: the kernel's images are the N*OD output planes of dy, x is [N*D, H, W, C]
        self.depth = self.gp.ndim == 3
        self.ddy = ([gm.N * gm.out[0], OH, OW, gm.K], [OH * OW * gm.K, OW * gm.K, gm.K, 1], [1, t.BH, t.BW, t.BM],
                    _nvmma([1, t.BH, t.BW, t.BM], p.dtype))
        # x per stride phase (a, b): the view x[:, a::sh, b::sw] (one phase at stride 1)
        self.sh, self.sw = sh, sw = gm.stride[1], gm.stride[2]
        self.x_shape = (gm.N * gm.inp[0], H, W, gm.C)
        # depth (T, OD, D, stride, padding, dilation): the kernels' 3-D scalars (unused in 2-D)
        self.depth_args = (gm.filt[0], gm.out[0], gm.inp[0], gm.stride[0], gm.pad[0], gm.dil[0])
        box = [1, t.BH, t.BW, t.BN]
        self.dx = {ab: (*view_geometry(self.x_shape, *ab, sh, sw), box, _nvmma(box, p.dtype))
                   for ab in phases_of(sh, sw)}
        self.ncol = gm.taps * gm.Cg
        self.launch = self.reduce = None
        self.split = 0
        self.stream_opt, self.stream = stream, False
        self.device = None
        self.w_shape = (p.K, p.C // p.groups, *p.filter)
        self.w_strides = layout_strides(self.w_shape, "nhwc")
        self.fast_keys: dict = {}

    def _plan(self, device: torch.device) -> None:
        gm, t = self.gm, self.tile
        sms = self.sms or sm_count(device.index)
        self.split, tps, units = plan_split(self.gp, t, sms)
        self.stream = self._use_stream(sms)
        self.reduce = None
        if self.stream:
            self._plan_stream(sms)
            return
        direct = self.split == 1
        self.ws_shape = (self.split, gm.K, self.ncol)
        self.launch = Launch(_gluon_wgrad_kernel, (max(1, min(sms, units)),),
                             (gm.N * gm.out[0], gm.out[1], gm.out[2], gm.filt[1], gm.filt[2], gm.C, gm.K, gm.Kg, gm.Cg,
                              gm.pad[1], gm.pad[2], gm.dil[1], gm.dil[2], tps, self.split, *self.depth_args, direct,
                              gm.G > 1, t.BH, t.BW, t.BM, t.BN, t.STAGES, self.sh, self.sw, self.depth, t.TAPS),
                             num_warps=t.warps)
        if not direct:
            E = gm.K * self.ncol
            # dw as [K, taps*C]: the reduce kernel's (row, j = tap*C + c) with unit strides per c
            self.reduce = Launch(_split_reduce_kernel, (triton.cdiv(E, 1024),),
                                 (E, self.ncol, gm.Cg, gm.filt[1], gm.filt[2], self.split,
                                  self.ncol, 1, gm.filt[1] * gm.filt[2] * gm.Cg, gm.filt[2] * gm.Cg, gm.Cg, 1024))

    def _use_stream(self, sms: int) -> bool:
        """The stream-K schedule: as asked (`stream`, where it applies), else by the model."""
        if self.stream_opt is None:
            return use_stream_k(self.gp, self.tile, sms)
        return self.stream_opt and not stream_k_reasons(self.gp, self.tile)

    def _plan_stream(self, sms: int) -> None:
        """Stream-K: `sms` CTAs, each an equal run of the steps; the fix-up launch only when a
        run boundary falls inside a tile."""
        gm, t = self.gm, self.tile
        tiles, nt = sk_geometry(self.gp, t)
        total = tiles * nt
        grid = max(1, min(sms, total))
        self.ws_shape = (grid, 2, t.BM, t.BN)
        self.launch = Launch(_gluon_wgrad_sk_kernel, (grid,),
                             (gm.N * gm.out[0], gm.out[1], gm.out[2], gm.filt[1], gm.filt[2], gm.C, gm.K,
                              gm.pad[1], gm.pad[2], gm.dil[1], gm.dil[2], *self.depth_args, t.BH, t.BW, t.BM, t.BN,
                              t.STAGES, self.sh, self.sw, self.depth),
                             num_warps=t.warps)
        if any(g * total // grid % nt for g in range(1, grid)):
            block = min(1024, t.BM * t.BN)
            self.reduce = Launch(_sk_fixup_kernel, (tiles, t.BM * t.BN // block),
                                 (total, nt, grid, gm.taps * triton.cdiv(gm.C, t.BN), triton.cdiv(gm.C, t.BN), gm.K,
                                  gm.C, self.ncol, t.BM, t.BN, block))

    def workspace_bytes(self, device_index: int | None = None) -> int:
        sms = self.sms or sm_count(device_index)
        if self._use_stream(sms):
            return sms * 2 * self.tile.BM * self.tile.BN * 4
        split = plan_split(self.gp, self.tile, sms)[0]
        return 0 if split == 1 else split * self.gm.K * self.ncol * 4

    def _run(self, key: tuple, descs, dw, addresses: bool) -> None:
        """The launches on a dw of the plan's layout: by addresses (`dw` an int, the launches
        ready) or by tensors."""
        launch, red = self.launch, self.reduce
        if not self.stream and self.split == 1:
            (launch.run_keyed_addresses if addresses else launch.run_keyed)(key, descs, dw)
            return
        ws = workspace.empty(self.ws_shape, torch.float32, self.device)
        args = (dw, ws) if self.stream else (ws,)
        if addresses:
            launch.run_keyed_addresses(key, descs, *(a if isinstance(a, int) else a.data_ptr() for a in args))
            if red is not None:
                red.run_addresses(ws.data_ptr(), dw)
        else:
            launch.run_keyed(key, descs, *args)
            if red is not None:
                red(ws, dw)

    def _fast_inputs(self, key: tuple) -> bool:
        """dy, x with strides `key` address standard channels-last memory (size-1 dims may be
        strided otherwise)."""
        ok = self.fast_keys.get(key)
        if ok is None:
            shapes = (self.p.y_shape, self.p.x_shape)
            ok = same_memory(shapes, key, tuple(layout_strides(sh, "nhwc") for sh in shapes))
            if len(self.fast_keys) < 64:
                self.fast_keys[key] = ok
        return ok

    def _descs(self, dyl: torch.Tensor, xl: torch.Tensor) -> tuple:
        dy, x = channels_last(dyl).reshape(self.ddy[0]), channels_last(xl).reshape(self.x_shape)
        return (host_descriptor(dy, *self.ddy), *four_phase_descs(x, self.dx, self.sh, self.sw, host_descriptor))

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        launch = self.launch
        if out is None and launch is not None and launch.ready() and (self.reduce is None or self.reduce.ready()):
            # the planned path: standard aligned inputs, a fresh dw, addresses not tensors
            dyl, xl = args.dy, args.x
            dp, xp = dyl.data_ptr(), xl.data_ptr()
            if not (dp | xp) & 15 and self._fast_inputs((dyl.stride(), xl.stride())):
                dw = alloc.empty(self.w_shape, p.dtype, dyl.device, self.w_strides)
                self._run((dp, xp), lambda: self._descs(dyl, xl), dw.data_ptr(), True)
                return dw
        dy = contiguous_aligned(channels_last(args.dy)).reshape(self.ddy[0])
        x = contiguous_aligned(channels_last(args.x)).reshape(self.x_shape)
        if self.launch is None:
            self.device = dy.device
            self._plan(dy.device)
        direct_out = (out is not None and out.dtype == p.dtype and channels_last(out).is_contiguous())
        if direct_out:
            dw = out
        else:
            dw = logical(alloc.empty((p.K, *p.filter, p.C // p.groups), p.dtype, dy.device))
        self._run((dy.data_ptr(), x.data_ptr()), lambda: (host_descriptor(dy, *self.ddy),
                                                           *four_phase_descs(x, self.dx, self.sh, self.sw,
                                                                             host_descriptor)), dw, False)
        if out is not None and not direct_out:
            return out.copy_(dw)
        return dw


# ---- solver ------------------------------------------------------------------------------
@register
class GluonImplicitGemmBwdWeights(GluonConvSolver):
    """Persistent warp-specialised Hopper backward weights in Gluon (stride 1 or 2, NHWC)."""
    id = 29
    name = "gluon_implicit_gemm_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        if problem.groups > 1 and diag_tile(problem) is None:
            reasons.append(f"groups={problem.groups} with {problem.K // problem.groups} filters and "
                           f"{problem.C // problem.groups} channels per group: no tile of whole groups "
                           "(64 or 128 rows, 16-256 channels)")
        return reasons

    def workspace_size(self, problem) -> int:
        return GluonWgradPlan(problem).workspace_bytes(0 if torch.cuda.is_available() else None)

    def estimate(self, problem) -> float | None:
        if problem.groups == problem.C == problem.K:     # depthwise: measured (depthwise.DW_EFFICIENCY)
            return dw_estimate(problem, "gluon_wgrad")
        # grouped: the block-diagonal tiles' dense work (BM x BN per block of BM rows)
        if problem.groups > 1:
            d = diag_tile(problem)
            if d is None:
                return None
            gm = geom(problem)
            flops = 2.0 * d[0] * d[1] * triton.cdiv(gm.K, d[0]) * gm.taps * gm.N * gm.P
            return self.gluon_price(roofline_ms(flops, problem.bytes(), problem.dtype, 0.7), "bwd_weights")
        return self.gluon_price(super().estimate(problem), "bwd_weights")

    def prepare(self, problem):
        return GluonWgradPlan(problem)
