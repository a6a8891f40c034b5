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

Covers 2-D NHWC bf16/f16, any groups with such a tile, stride 1 or 2 per dim, any
dilation/padding/filter, C and K multiples of 16, dw in the input dtype. Hopper + Gluon only (see gluon_support.gluon_reasons)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import workspace
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
from .gluon_conv import SMEM_BYTES, GluonConvSolver, _nvmma, flat_view, rect
from .gluon_phases import four_phase_descs, phases_of, view_geometry
from .implicit_gemm import geom, roofline_ms
from .implicit_gemm_bwd import REDUCE_SLICES, _split_reduce_kernel, max_split

MAX_STAGES = 6
SLICE_STEPS = 4    # fewest pixel rectangles per reduction slice (the ring's fill per unit)


@dataclass(frozen=True)
class WgradTile:
    """BM filter rows (k) x BN channels (c) per unit, BP = BH*BW output pixels per step."""
    BH: int
    BW: int
    BM: int
    BN: int
    STAGES: int
    warps: int = 4

    @property
    def BP(self) -> int:
        return self.BH * self.BW

    def stage_bytes(self, elem: int = 2) -> int:
        return (self.BM + self.BN) * self.BP * elem


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
    """BM/BN 128 where K/C reach 128 (else 64), BP 64 pixels (a 7x7 image fills 49 of 64),
    as many ring stages as fit (at most MAX_STAGES). Grouped: `diag_tile`."""
    gm = geom(p)
    if p.groups > 1:
        BM, BN = diag_tile(p)
    else:
        BM = 128 if gm.K >= 128 else 64
        BN = 128 if gm.C >= 128 else 64
    BH, BW = rect(64, gm.out[1], gm.out[2])
    t = WgradTile(BH, BW, BM, BN, 1)
    stages = min(MAX_STAGES, (SMEM_BYTES - 2048) // t.stage_bytes())
    return WgradTile(BH, BW, BM, BN, stages, 8 if BM * BN > 128 * 64 else 4)


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
    nt = gm.N * triton.cdiv(gm.out[1], t.BH) * triton.cdiv(gm.out[2], t.BW)
    tiles = triton.cdiv(gm.K, t.BM) * gm.taps * (1 if p.groups > 1 else triton.cdiv(gm.C, t.BN))
    step_us = max(STEP_FLOOR_US, 2 * t.BM * t.BN * t.BP / (600e6 / 132))
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


# ---- Gluon kernel ------------------------------------------------------------------------
if gluon is not None:
    from .gluon_conv import _load_x

    @gluon.jit
    def _unit_coords(u, tiles, nj, ncb, Kg, Cg, DIAG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
        """(slice, filter-row block, tap, first channel) of work unit u: units of one slice
        are adjacent; DIAG (grouped): the channels of the groups of rows [pid_k*BM, +BM)."""
        sp = u // tiles
        tile = u - sp * tiles
        pid_k = tile // nj
        pid_j = tile - pid_k * nj
        tap = pid_j // ncb
        if DIAG:
            c0 = (pid_k * BM // Kg) * Cg
        else:
            c0 = (pid_j - tap * ncb) * BN
        return sp, pid_k, tap, c0

    @gluon.jit
    def _producer(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, n_units, tiles,
                  nj, ncb, S, tps, nt, n_th, n_tw, ph, pw, dh, dw, Kg, Cg, DIAG: gl.constexpr, BH: gl.constexpr,
                  BW: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, SH: gl.constexpr, SW: gl.constexpr):
        """1 warp: for each unit of this CTA and each pixel rectangle of its slice, a dy box
        and the tap-shifted x box onto the next ring slot (stride 2: from x's phase view,
        as solver 27 reads it, `_load_x`)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        nbytes: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
        cnt = 0
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            sp, pid_k, tap, c0 = _unit_coords(u, tiles, nj, ncb, Kg, Cg, DIAG, BM, BN)
            r = tap // S
            q = tap - r * S
            t_end = gl.minimum(sp * tps + tps, nt)
            for t in range(sp * tps, t_end):
                tw = t % n_tw
                tmp = t // n_tw
                th = tmp % n_th
                n = tmp // n_th
                s = cnt % STAGES
                mbarrier.wait(empty.index(s), ((cnt // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(dy_desc, [n, th * BH, tw * BW, pid_k * BM], ready.index(s),
                                                a_bufs.index(s))
                _load_x(x_desc, x01_desc, x10_desc, x11_desc, n, th * BH, tw * BW, r * dh - ph, q * dw - pw, c0,
                        ready.index(s), b_bufs.index(s), SH, SW)
                cnt += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, out_ptr, n_units, tiles, nj, ncb, tps, nt, K, C, Kg, Cg, n_taps,
                  DIRECT: gl.constexpr, DIAG: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr):
        """Async wgmma over the ring (a slot is released once the next step's wgmma is
        issued and the older ones retired), then the unit's tile to dw or its slice of the
        workspace ([SPLIT, K, taps*Cg] f32; dw is [K, taps*Cg] as well). Grouped (DIAG):
        only the entries whose channel is in the row's group are stored."""
        STAGES: gl.constexpr = ready.type.shape[0]
        BP: gl.constexpr = BH * BW
        dtype: gl.constexpr = a_bufs.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BN, 16])
        a2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BP, BM], dtype)
        b2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BP, BN], dtype)
        ncol = n_taps * Cg
        cnt = 0
        for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
            sp, pid_k, tap, c0 = _unit_coords(u, tiles, nj, ncb, Kg, Cg, DIAG, BM, BN)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            steps = gl.minimum(sp * tps + tps, nt) - sp * tps
            for st in range(steps):
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                a = a_bufs.index(s)._reinterpret(dtype, [BP, BM], a2_layout).permute((1, 0))
                b = b_bufs.index(s)._reinterpret(dtype, [BP, BN], b2_layout)
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))
                if st > 0:
                    mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
                cnt += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1)
            rk = pid_k * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
            rc = c0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            grp = rk // Kg
            mask = (rk < K)[:, None] & (rc < C)[None, :] & ((rc // Cg)[None, :] == grp[:, None])
            off = (rk * ncol - grp * Cg)[:, None] + (tap * Cg + rc)[None, :]
            if DIRECT:
                gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                gl.store(out_ptr + sp.to(gl.int64) * K * ncol + off, acc, mask=mask)

    @gluon.jit(do_not_specialize=["N", "OH", "OW", "S", "C", "K", "ph", "pw", "dh", "dw", "tps", "split"])
    def _gluon_wgrad_kernel(dy_desc, x_desc, x01_desc, x10_desc, x11_desc, out_ptr, N, OH, OW, R, S, C, K, Kg, Cg,
                            ph, pw, dh, dw, tps, split,
                            DIRECT: gl.constexpr, DIAG: gl.constexpr, BH: gl.constexpr, BW: gl.constexpr,
                            BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, SH: gl.constexpr,
                            SW: gl.constexpr, num_warps: gl.constexpr):
        """Persistent: CTA i runs units i, i + grid, ... (see the module docstring)."""
        dtype: gl.constexpr = dy_desc.dtype
        n_th = gl.cdiv(OH, BH)
        n_tw = gl.cdiv(OW, BW)
        nt = N * n_th * n_tw
        if DIAG:
            ncb = 1
        else:
            ncb = gl.cdiv(C, BN)
        nj = R * S * ncb
        tiles = gl.cdiv(K, BM) * nj
        n_units = tiles * split
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + dy_desc.block_type.shape, dy_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, out_ptr, n_units, tiles, nj, ncb, tps, nt, K, C, Kg, Cg,
                         R * S, DIRECT, DIAG, BH, BW, BM, BN, num_warps)),
            (_producer, (dy_desc, x_desc, x01_desc, x10_desc, x11_desc, a_bufs, b_bufs, ready, empty, n_units,
                         tiles, nj, ncb, S, tps, nt, n_th, n_tw, ph, pw, dh, dw, Kg, Cg, DIAG, BH, BW, BM, BN,
                         SH, SW)),
        ], [1], [24])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


# ---- launcher ------------------------------------------------------------------------------
class GluonWgradPlan:
    """Launch of `_gluon_wgrad_kernel` (+ the ordered split reduction) for one problem; dy
    and x as standard channels-last tensors (others are copied), dw channels-last."""

    def __init__(self, p: ConvProblem, tile: WgradTile | None = None, sms: int | None = None):
        self.p = p
        self.gp = flat_view(p) or p    # 1x1: the pixels of all images as one flat row
        gm = self.gm = geom(self.gp)
        self.tile = t = tile or tile_config(self.gp)
        self.sms = sms
        H, W = gm.inp[1], gm.inp[2]
        OH, OW = gm.out[1], gm.out[2]
        self.ddy = ([gm.N, OH, OW, gm.K], [OH * OW * gm.K, OW * gm.K, gm.K, 1], [1, t.BH, t.BW, t.BM],
                    _nvmma([1, t.BH, t.BW, t.BM], p.dtype))
        # x per stride phase (a, b): the view x[:, a::sh, b::sw] (one phase at stride 1)
        self.sh, self.sw = sh, sw = gm.stride[1], gm.stride[2]
        self.x_shape = (gm.N, H, W, gm.C)
        box = [1, t.BH, t.BW, t.BN]
        self.dx = {ab: (*view_geometry(self.x_shape, *ab, sh, sw), box, _nvmma(box, p.dtype))
                   for ab in phases_of(sh, sw)}
        self.ncol = gm.taps * gm.Cg
        self.launch = self.reduce = None
        self.split = 0

    def _plan(self, device: torch.device) -> None:
        gm, t = self.gm, self.tile
        sms = self.sms or sm_count(device.index)
        self.split, tps, units = plan_split(self.gp, t, sms)
        direct = self.split == 1
        self.ws_shape = (self.split, gm.K, self.ncol)
        self.launch = Launch(_gluon_wgrad_kernel, (max(1, min(sms, units)),),
                             (gm.N, gm.out[1], gm.out[2], gm.filt[1], gm.filt[2], gm.C, gm.K, gm.Kg, gm.Cg,
                              gm.pad[1], gm.pad[2], gm.dil[1], gm.dil[2], tps, self.split, direct, gm.G > 1,
                              t.BH, t.BW, t.BM, t.BN, t.STAGES, self.sh, self.sw),
                             num_warps=t.warps)
        if not direct:
            E = gm.K * self.ncol
            # dw as [K, taps*C]: the reduce kernel's (row, j = tap*C + c) with unit strides per c
            self.reduce = Launch(_split_reduce_kernel, (triton.cdiv(E, 1024),),
                                 (E, self.ncol, gm.Cg, gm.filt[1], gm.filt[2], self.split,
                                  self.ncol, 1, 0, gm.filt[2] * gm.Cg, gm.Cg, 1024))

    def workspace_bytes(self, device_index: int | None = None) -> int:
        split = plan_split(self.gp, self.tile, self.sms or sm_count(device_index))[0]
        return 0 if split == 1 else split * self.gm.K * self.ncol * 4

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        dy = contiguous_aligned(args.dy.permute(0, 2, 3, 1)).reshape(self.ddy[0])
        x = contiguous_aligned(args.x.permute(0, 2, 3, 1)).reshape(self.x_shape)
        if self.launch is None:
            self._plan(dy.device)
        direct_out = (out is not None and out.dtype == p.dtype and out.permute(0, 2, 3, 1).is_contiguous())
        if direct_out:
            dw = out
        else:
            dw = torch.empty((p.K, *p.filter, p.C // p.groups), dtype=p.dtype, device=dy.device).permute(0, 3, 1, 2)
        descs = lambda: (host_descriptor(dy, *self.ddy),  # noqa: E731
                         *four_phase_descs(x, self.dx, self.sh, self.sw, host_descriptor))
        if self.split == 1:
            self.launch.run_keyed((dy.data_ptr(), x.data_ptr()), descs, dw)
        else:
            ws = workspace.empty(self.ws_shape, torch.float32, dy.device)
            self.launch.run_keyed((dy.data_ptr(), x.data_ptr()), descs, ws)
            self.reduce(ws, dw)
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
            return self.gluon_price(roofline_ms(flops, problem.bytes(), problem.dtype, 0.7))
        return self.gluon_price(super().estimate(problem))

    def prepare(self, problem):
        return GluonWgradPlan(problem)
