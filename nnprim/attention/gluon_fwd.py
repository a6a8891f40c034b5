"""Warp-specialised flash attention forward for Hopper in Gluon (solver 126 `gluon_flash_fwd`,
family `flash`).

Same definition as solver 110 (flash_fwd.py): per (b, h), kv head hk = h // (Hq // Hkv),

    s_ij = scale * q_i . k_j  (-inf where causal hides j),  lse_i = log sum_j exp(s_ij),
    o_i  = sum_j exp(s_ij - lse_i) v_j

with an online softmax in the log2 domain (log2(e) folded into the scale, exp2) and f32
accumulation. A fully masked row (bottom-right causal with Sk < Sq) gives o = NaN and
lse = -inf, or o = 0 with softmax_inf_as_zero.

Structure (FlashAttention-3's, written with Gluon's explicit Hopper ops). A tile is a block
of BLOCK_M = 128 query rows of one (b, h); a CTA runs one tile (grid = every tile) or, with
PERSISTENT, grid = min(#SMs, #tiles) CTAs each walk tiles pid, pid + grid, ... (FA3's static
tile scheduler): non-causal tiles (b, h)-major, causal tiles heaviest (last q block) first,
each round of `grid` tiles walked in alternating directions so every CTA's total work
evens out. `gl.warp_specialize` splits a CTA into
  - a 1-warp producer partition: TMA loads of each tile's Q (once a consumer has released
    the previous tile's) and of K and V blocks into a STAGES-deep shared-memory ring that runs
    on across tiles (the next tile's first blocks load while the consumers finish this one);
    per stage a ready barrier (TMA transaction count) and an empty barrier (the consumer's
    release) for K and for V separately, so QK^T can start as soon as K has landed while V is
    still in flight;
  - consumers: S = Q K^T with async `warpgroup_mma` (both operands in shared memory), the
    online softmax in registers, P cast to bf16/f16 in registers and used as the register
    A operand of O += P V (RS wgmma, no shared-memory round trip); a K slot is released
    after its S wait, a V slot after its PV wait (empty barriers count one arrival per
    consumer). Intra-warpgroup overlap (FA3's): S_{j+1} = Q K_{j+1}^T is issued before
    P_j V_j and the consumer waits for S_{j+1} only (wgmma groups retire in order), so the
    softmax of block j+1 runs while P_j V_j is on the tensor cores; the last block is
    peeled off the loop (ptxas then keeps the wgmma pipeline asynchronous).
    PINGPONG (the default at every head dim): CONSUMERS = two (or, at D = 64, three: 192-row tiles
    with 160 registers a thread, FA3's d64 shape) 4-warp consumer partitions of 64 rows each
    whose MMA issue slots take turns through one mbarrier each (FA3's inter-warpgroup
    ping-pong: one warpgroup's softmax runs under the others' GEMMs; at D = 64 the softmax
    of a 64x128 block takes about as long as its two GEMMs, so a third warpgroup keeps the
    tensor cores fed). Otherwise one 8-warp consumer partition (two warpgroups of 64 rows in
    lockstep, interleaved by the warp schedulers).
  - the epilogue: O normalised, written to shared memory and sent by a TMA store. With
    SEPARATE_O (persistent, D <= 128: what fits 227 KB) O has its own buffer, the Q tile is
    released as soon as the tile's last S has retired and the store runs on under the next
    tile (waited for before the buffer is written again); otherwise O goes out through the
    Q tile, which is released once the store has read it.
Key blocks [0, full) are visible to every row (no masking), [full, hi) are masked per element
(kv tail and the causal diagonal). Causal tiles end at multiples of BLOCK_M from the last row,
so a partial tile is the first and lightest. Q/K/V/O are read and written through host TMA descriptors
over 4-D [B, H, S, D] views with boxes [1, 1, rows, D], so rows past Sq / Sk load as zeros and
rows past Sq are never stored, per (b, h), with no descriptor built in the kernel (no
workspace). lse (B, Hq, Sq) f32 through masked stores.

Covers bf16/f16, D == Dv in {64, 128, 256}, GQA/MQA, causal top-left and bottom-right, any
Sq/Sk (tails), float scale (inverted or not), return_lse, softmax_inf_as_zero. Everything
else (masks, dropout, kv_lens, paging, tensor scale, f32, other head dims) is solver 110's.
Needs a CUDA device of capability 9.x and Gluon; never applicable under TRITON_INTERPRET=1
(Gluon kernels do not run in the interpreter) nor with NNPRIM_GLUON=0 (the off switch, see
nnprim/gluon_support.py). Inputs whose strides TMA cannot describe
(inner stride != 1, base or strides not 16-byte aligned) are copied contiguous first.
"""
from __future__ import annotations

import functools
import math

import torch
import triton

from .. import alloc
from ..gluon_support import (
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
from ..search.solver import register
from .flash_fwd import PEAK_TBS, PEAK_TFLOPS, FlashBase

_CAUSAL_CODE = {None: 0, "top_left": 1, "bottom_right": 2}
HEAD_DIMS = (64, 128, 256)
SMEM_BYTES = 227 * 1024   # an H100/H200 CTA's shared memory


def persistent_default(problem) -> bool:
    """Persistent scheduling unless the problem is causal with long sequences (Sk > 8192),
    where the one-tile-per-CTA launch (the hardware hands the next, lighter tile to whichever
    SM frees first) was measured at or above cuDNN and a static schedule may balance worse.
    A first guess, to revisit with the benchmark's side-by-side numbers."""
    return not problem.causal or problem.Sk <= 8192


def consumers_default(problem, d: int) -> int:
    """Ping-pong consumers when the caller does not say: three at d64 where the H200 runs of
    2026-12-03 measured them ahead (results/gluon_fwd_pp3_2026-12-03_s23.json, persistent:
    s4096 1.186 -> 1.129 ms, s16k causal 2.355 -> 2.299), else two. Short sequences lose to
    the 192-row tiles' partial tile; causal ones up to s4096 to the masked diagonal blocks,
    which spill at 160 registers (s4096 causal 0.657 -> 0.710 ms)."""
    if problem is None or d > 64 or problem.Sq < 4096 or (problem.causal and problem.Sq < 16384):
        return 2
    return 3


def tile_config(d: int, pingpong: bool | None = None, persistent: bool | None = None,
                problem=None, consumers: int | None = None) -> dict:
    """Launch constants for head dim d: CONSUMERS consumer partitions (1: one 8-warp
    partition of 128 rows; 2 or 3: ping-pong warpgroups of 64 rows each taking turns to issue
    their MMAs, FA3's schedule; `pingpong` False means 1, True or None means `consumers` or
    consumers_default; at d256 too, where the H200 run of 2026-12-03 measured two ping-pong
    warpgroups 8-15 % ahead of one 8-warp consumer from s1024 on, causal s1024 a tie,
    results/gluon_fwd_variants_2026-12-03_s24.json), BLOCK_M = their rows, BLOCK_N keys per ring stage,
    STAGES (what fits 227 KB of shared memory next to the Q tiles), PERSISTENT (grid = #SMs
    walking the tiles; default from `problem` by persistent_default, on for three consumers
    or without a problem), SEPARATE_O (an O buffer of its
    own when persistent and it fits), num_warps (the default partition's), maxnreg (the
    register file split evenly over the warpgroups, producer padded to one: 168 x 384 or
    128 x 512 threads at one CTA per SM), CONSUMER_REGS (what setmaxnreg gives each consumer
    warpgroup once the producer has given its registers up: 240 of two, 160 of three, as
    FA3's)."""
    pp = True if pingpong is None else pingpong
    n_c = (consumers or consumers_default(problem, d)) if pp else 1
    if n_c not in (1, 2, 3) or (n_c == 1 and pp) or (n_c == 3 and d > 64):
        # three consumers hold a 64x128 f32 score tile, its successor and O in 160 registers:
        # d64 only (O of d128 alone is 64 of them)
        raise ValueError(f"tile_config: consumers={consumers} with pingpong={pingpong}, d={d}: needs 2 ping-pong "
                         "consumers, 3 (d <= 64), or 1 without ping-pong")
    if persistent is None:   # three consumers: persistent measured ahead at every size they are chosen for
        persistent = True if problem is None or n_c == 3 else persistent_default(problem)
    base = dict(BLOCK_M=64 * n_c if pp else 128, CONSUMERS=n_c, PERSISTENT=persistent,
                num_warps=4 if pp else 8, maxnreg=128 if n_c == 3 else 168,
                CONSUMER_REGS=160 if n_c == 3 else 240)
    if d <= 64:
        cfg = base | dict(BLOCK_N=128, STAGES=3)
    elif d <= 128:
        cfg = base | dict(BLOCK_N=128, STAGES=2)
    else:
        cfg = base | dict(BLOCK_N=64, STAGES=2)
    return cfg | dict(SEPARATE_O=persistent and smem_bytes(d, cfg | dict(SEPARATE_O=True)) <= SMEM_BYTES)


def smem_bytes(d: int, cfg: dict) -> int:
    """Shared memory of a 16-bit launch: Q tile (+ O tile with SEPARATE_O) and the K/V ring
    (barriers aside)."""
    tiles = 2 if cfg["SEPARATE_O"] else 1
    return 2 * (tiles * cfg["BLOCK_M"] * d + 2 * cfg["STAGES"] * cfg["BLOCK_N"] * d)


# Fit of the H200 runs of 2026-12-01 (bf16, train problems of attention_gpu.json): the
# tensor-core rate reached by head dim, and the fixed cost per tile in key blocks (one CTA
# per tile: 3; persistent, whose next tile's loads run under the current one: about 1)
EFF_BY_D = {64: 0.61, 128: 0.94, 256: 0.9}   # H200, long sequences (d256: 684 TFLOP/s at s16k)
TILE_OVERHEAD_BLOCKS = {False: 3.0, True: 1.0}   # by cfg["PERSISTENT"]
# host time per call (descriptors, launch) that bounds tiny problems, on find's clock: solver
# 110's floor (flash_fwd.HOST_FLOOR_MS). It was 12 us more (0.052) from the smallest forced
# calls of results/regret_2026-12-01_run2.json (0.055 ms against 0.043), measured before the
# keyed descriptors (Launch.run_keyed, f42a8ae); since then the API's sdpa call through 126
# costs 41.4 us of host (results/host_overhead_2026-12-01_s7.json) and its smallest forced
# calls 0.039-0.045 ms, as flash_fwd's (0.043-0.053; results/regret_2026-12-01_s7.json)
HOST_FLOOR_MS = 0.04
# K/V bytes per second the tiles stream through L2: every tile reads all of its visible keys, so
# query heads of one kv head (GQA) and the query tiles of one head read K/V again, from L2 at
# best. Fit of the system db's 126 records of GQA decodes (b8 x 32k, b64 x 8k, b16 x 16k Sq 4,
# b24 x 5000 Sq 2 with 4 and 8 query heads a kv head: measured 2.2-4.5x the HBM-bound estimate,
# 0.99-1.04x this bound); long training tiles are compute-bound ahead of it
L2_TBS = 5.8


def model_ms(problem, cfg: dict) -> float:
    """Predicted time: flops / (peak * eff_D) * (n_kv + c) / n_kv, where n_kv is the mean
    number of key blocks per tile and c = TILE_OVERHEAD_BLOCKS the per-tile fixed cost (Q load
    and ring fill, epilogue; by launch variant), divided by the SM fill of the last wave (tiles / (waves * 132)),
    as flash_fwd.roofline_ms; the flops of whole ROWS-row slabs (a slab's MMAs run all of
    its rows: a 2-row decode pays 64); at least the HBM time of the problem's bytes and the L2
    time of the K/V blocks every tile reads (L2_TBS); plus 10 us of launch; at least
    HOST_FLOOR_MS. Causal halves the flops through problem.flops()."""
    if problem.device != "cuda":
        return problem.flops() / 2e7 + 1.0
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_m = math.ceil(problem.Sq / bm)
    shift = 0 if problem.causal != "bottom_right" else problem.Sk - problem.Sq
    blocks = 0
    rows = bm // cfg["CONSUMERS"]
    up = (n_m * bm - problem.Sq) // rows * rows if problem.causal else 0   # causal tiles' shift (_tile_at)
    for m in range(n_m):
        hi = problem.Sk
        if problem.causal:
            hi = min(hi, min((m + 1) * bm - up, problem.Sq) + shift)
        blocks += math.ceil(max(hi, 0) / bn)
    n_kv = max(blocks / n_m, 1e-3)
    eff = EFF_BY_D.get(problem.D, 0.7)
    t_c = problem.flops() / (PEAK_TFLOPS.get(problem.dtype, 750.0) * 1e12 * eff)
    t_c *= (n_kv + TILE_OVERHEAD_BLOCKS[bool(cfg.get("PERSISTENT"))]) / n_kv
    t_c *= math.ceil(problem.Sq / rows) * rows / problem.Sq
    tiles = problem.B * problem.Hq * n_m
    fill = tiles / (math.ceil(tiles / 132) * 132)
    t_m = problem.bytes() / (PEAK_TBS * 1e12 * 0.8)
    kv_bytes = problem.B * problem.Hq * blocks * bn * (problem.D + problem.Dv) * problem.dtype.itemsize
    t_l2 = kv_bytes / (L2_TBS * 1e12)
    return max(max(t_c / max(fill, 0.05), t_m, t_l2) * 1e3 + 0.01, HOST_FLOOR_MS)


# ---- Gluon kernel ---------------------------------------------------------------------

if gluon is not None:

    @gluon.jit
    def _tile_at(t, Sq, Sk, n_m, BH, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr,
                 CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
        """(bh, start_m, n_full, n_blocks) of this CTA's tile at loop index t (t = pid,
        pid + grid, ...). Non-causal tiles go (b, h)-major so CTAs running together share a
        head's K/V in L2; causal tiles go q-block-major from the last (heaviest) q block, and a
        persistent CTA walks each round of `grid` tiles in alternating directions (snake) so
        every CTA's sum of tile lengths stays even. Key blocks [0, n_blocks) are visible to some
        row of the tile, [0, n_full) to every row. A consumer's ROWS-row slab that lies outside
        [0, Sq) is idle (_idle_slab)."""
        tile = t
        if PERSISTENT and CAUSAL != 0:
            nprog = gl.num_programs(0)
            r = t // nprog
            if r % 2 == 1:
                width = gl.minimum(nprog, n_tiles - r * nprog)
                tile = r * nprog + width - 1 - gl.program_id(0)
        if CAUSAL != 0:
            pid_m = n_m - 1 - tile // BH
            bh = tile % BH
        else:
            pid_m = tile % n_m
            bh = tile // n_m
        start_m = pid_m * BLOCK_M
        if CAUSAL != 0:
            # causal tiles shifted up by whole slabs: the spare slabs of a partial tile sit
            # above row 0 in the first tile, whose rows see the fewest keys, instead of past
            # Sq in the last and heaviest (their consumers idle either way; no TMA box
            # starts at a negative row: the first run with such boxes faulted the GPU)
            start_m -= ((n_m * BLOCK_M - Sq) // ROWS) * ROWS
        if CAUSAL == 2:
            shift = Sk - Sq
        else:
            shift = 0
        hi = Sk
        full = Sk
        if CAUSAL != 0:
            last_row = gl.minimum(start_m + BLOCK_M, Sq) - 1
            hi = gl.minimum(hi, last_row + shift + 1)
            full = gl.minimum(Sk, start_m + shift + 1)
        hi = gl.maximum(hi, 0)
        full = gl.maximum(full, 0)
        n_blocks = gl.cdiv(hi, BLOCK_N)
        n_full = gl.minimum(full // BLOCK_N, n_blocks)
        return bh, start_m, n_full, n_blocks

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, Hq, GROUP, Sq, Sk, n_m, BH, n_tiles,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
        """1 warp, for each tile of this CTA: each consumer's Q tile once that consumer has
        released the previous one, then K_j and V_j into ring slot (it + j) % STAGES (it: the
        blocks of earlier tiles, so the ring runs on across tiles and the next tile's blocks
        load while the consumers finish this one) once every consumer has released the slot.
        Empty barriers start 'phase 1 complete', so the first pass waits on parity 1."""
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        NUM_C: gl.constexpr = q_bufs.type.shape[0]
        ROWS: gl.constexpr = BLOCK_M // NUM_C
        it = 0
        tcount = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            bh, start_m, n_full, n_blocks = _tile_at(t, Sq, Sk, n_m, BH, n_tiles, BLOCK_M, BLOCK_N, ROWS, CAUSAL,
                                                     PERSISTENT)
            b = bh // Hq
            h = bh % Hq
            hk = h // GROUP
            for c in gl.static_range(NUM_C):
                mbarrier.wait(q_empty.index(c), (tcount & 1) ^ 1)
                row = start_m + c * ROWS
                if (row >= 0) & (row < Sq):
                    mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], q_ready.index(c), q_bufs.index(c))
                else:   # an idle slab: no load, its consumer only keeps the phases
                    mbarrier.arrive(q_ready.index(c), count=1)
            for j in range(n_blocks):
                s = (it + j) % STAGES
                ph = ((it + j) // STAGES) & 1
                mbarrier.wait(k_empty.index(s), ph ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s), k_bufs.index(s))
                mbarrier.wait(v_empty.index(s), ph ^ 1)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s), v_bufs.index(s))
            it += n_blocks
            tcount += 1

    @gluon.jit
    def _issue_qk(idx, q_smem, k_bufs, k_ready, s_layout: gl.constexpr, ROWS: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, kv_layout: gl.constexpr):
        """Wait for the K block in ring position idx and start S = Q K^T (async; the caller
        waits)."""
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s = idx % STAGES
        mbarrier.wait(k_ready.index(s), (idx // STAGES) & 1)
        zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        k_smem = k_bufs.index(s)._reinterpret(k_bufs.dtype, [BLOCK_N, HEAD_D], kv_layout)
        return warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _turn_begin(turn_bars, slot, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until it is this consumer's turn to issue MMAs (slot-th turn)."""
        if PINGPONG:
            mbarrier.wait(turn_bars.index(WG), slot & 1)

    @gluon.jit
    def _turn_end(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: hand the tensor cores to the next consumer (0, 1, .., 0: one turn
        barrier per consumer)."""
        if PINGPONG:
            NUM_C: gl.constexpr = turn_bars.type.shape[0]
            mbarrier.arrive(turn_bars.index((WG + 1) % NUM_C), count=1)

    @gluon.jit
    def _idle_slab(bars, turn_bars, slot, it, tcount, n_blocks, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """A consumer whose slab of this tile lies outside [0, Sq) (the spare slabs of a
        partial tile): no MMAs, loads or stores, but the protocol the others rely on kept --
        its Q barriers, its MMA turns (passed straight on: the busy consumers ping-pong among
        themselves), each K / V ring slot released once it has landed. Returns the turn count."""
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
        STAGES: gl.constexpr = k_ready.type.shape[0]
        mbarrier.wait(q_ready.index(WG), tcount & 1)
        mbarrier.arrive(q_empty.index(WG), count=1)
        if n_blocks > 0:
            for j in range(n_blocks + 1):   # the busy consumers' turns per tile: n_blocks + 1
                _turn_begin(turn_bars, slot, WG, PINGPONG)
                _turn_end(turn_bars, WG, PINGPONG)
                slot += 1
                if j < n_blocks:
                    mbarrier.wait(k_ready.index((it + j) % STAGES), ((it + j) // STAGES) & 1)
                    mbarrier.arrive(k_empty.index((it + j) % STAGES), count=1)
                if j > 0:
                    mbarrier.wait(v_ready.index((it + j - 1) % STAGES), ((it + j - 1) // STAGES) & 1)
                    mbarrier.arrive(v_empty.index((it + j - 1) % STAGES), count=1)
        return slot

    @gluon.jit
    def _softmax_block(qk, j, m_i, l_i, offs_m, kv_len, shift, qk_scale, BLOCK_N: gl.constexpr,
                       MASKED: gl.constexpr, CAUSAL: gl.constexpr, SCALE_POS: gl.constexpr,
                       s_layout: gl.constexpr):
        """(p, alpha, m_new, l_new) of score block j (f32, log2 domain)."""
        if (not MASKED) and SCALE_POS:
            # unmasked block, positive scale: the max commutes with the scale, one FMA per score
            m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = gl.exp2(qk * qk_scale - m_new[:, None])
        else:
            sc = qk * qk_scale
            if MASKED:
                # key j * BLOCK_N + c is visible to row m when c < kv_len - j * BLOCK_N and
                # (causal) c < m + shift + 1 - j * BLOCK_N: one limit per row against the
                # column constants c (compile-time per thread), one compare per score and no
                # column-index registers (the 3-consumer d64 kernel spilled with those)
                cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                lim = kv_len - j * BLOCK_N
                if CAUSAL != 0:
                    valid = cols[None, :] < gl.minimum(offs_m + (shift + 1 - j * BLOCK_N), lim)[:, None]
                else:
                    valid = cols[None, :] < lim
                sc = gl.where(valid, sc, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            if MASKED:
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = gl.exp2(sc - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                  qk_scale, WG: gl.constexpr, PINGPONG: gl.constexpr, HEAD_D: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  PERSISTENT: gl.constexpr, SEPARATE_O: gl.constexpr, SCALE_POS: gl.constexpr,
                  STORE_LSE: gl.constexpr, INF_AS_ZERO: gl.constexpr, WARPS: gl.constexpr):
        """Consumer WG (WARPS warps, ROWS query rows from start_m + WG * ROWS of each tile):
        QK^T, online softmax, PV, epilogue. Its MMA issue slots (S_0; then S_{j+1} + P_j V_j
        per block; then the last P V) take turns with the other consumers' under PINGPONG
        (0, 1, .., 0); every consumer takes the same number of turns per tile, so the cycle
        runs on across tiles too. The Q tile is released once its last S has retired (SEPARATE_O: the next
        tile's Q loads during the last P V and the epilogue), else after O, written through
        it, has left for global memory."""
        q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        NUM_C: gl.constexpr = q_bufs.type.shape[0]
        ROWS: gl.constexpr = BLOCK_M // NUM_C
        dtype: gl.constexpr = q_bufs.dtype
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
        q_smem = q_bufs.index(WG)._reinterpret(dtype, [ROWS, HEAD_D], q2_layout)
        o_smem4 = o_bufs.index(WG)
        o_smem = o_smem4._reinterpret(dtype, [ROWS, HEAD_D], q2_layout)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        if CAUSAL == 2:
            shift = Sk - Sq
        else:
            shift = 0
        kv_len = Sk

        if PINGPONG and WG == 0:
            mbarrier.arrive(turn_bars.index(0), count=1)   # consumer 0 takes the first turn
        slot = 0
        it = 0
        tcount = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            bh, start_m, n_full, n_blocks = _tile_at(t, Sq, Sk, n_m, BH, n_tiles, BLOCK_M, BLOCK_N, ROWS, CAUSAL,
                                                     PERSISTENT)
            b = bh // Hq
            h = bh % Hq
            row0 = start_m + WG * ROWS
            if (row0 < 0) | (row0 >= Sq):
                slot = _idle_slab(bars, turn_bars, slot, it, tcount, n_blocks, WG, PINGPONG)
            else:
                if CAUSAL != 0:   # this slab's own first row: its diagonal starts later
                    n_full = gl.minimum(gl.maximum(gl.minimum(row0 + shift + 1, Sk), 0) // BLOCK_N, n_blocks)
                offs_m = row0 + gl.arange(0, ROWS, layout=row_s)
                m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
                l_i = gl.zeros([ROWS], gl.float32, row_s)
                acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)

                mbarrier.wait(q_ready.index(WG), tcount & 1)
                # prologue: S_0 and its softmax. p_cur / alpha: P_j (the PV operand, in registers)
                # and the factor the accumulator takes before P_j V_j is added
                p_cur = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
                alpha = gl.full([ROWS], 1.0, gl.float32, row_s)
                if n_blocks > 0:
                    _turn_begin(turn_bars, slot, WG, PINGPONG)
                    qk_tok = _issue_qk(it, q_smem, k_bufs, k_ready, s_layout, ROWS, BLOCK_N, HEAD_D, kv_layout)
                    _turn_end(turn_bars, WG, PINGPONG)
                    slot += 1
                    qk = warpgroup_mma_wait(0, deps=(qk_tok,))
                    mbarrier.arrive(k_empty.index(it % STAGES), count=1)
                    if n_full > 0:
                        p, alpha, m_i, l_i = _softmax_block(qk, 0, m_i, l_i, offs_m, kv_len, shift, qk_scale,
                                                            BLOCK_N, False, CAUSAL, SCALE_POS, s_layout)
                    else:
                        p, alpha, m_i, l_i = _softmax_block(qk, 0, m_i, l_i, offs_m, kv_len, shift, qk_scale,
                                                            BLOCK_N, True, CAUSAL, SCALE_POS, s_layout)
                    p_cur = gl.convert_layout(p.to(dtype), p_layout)
                # steady state (FA3's intra-warpgroup overlap): issue S_{j+1} = Q K_{j+1}^T, then
                # O = alpha O + P_j V_j; wait for S_{j+1} only and run its softmax while P_j V_j is
                # still on the tensor cores. The last block is peeled off (no S_{j+1}): branch-free
                # issue/wait pairs let ptxas keep the wgmma pipeline asynchronous.
                for j in range(n_blocks - 1):
                    s = (it + j) % STAGES
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    _turn_begin(turn_bars, slot, WG, PINGPONG)
                    qk_tok = _issue_qk(it + j + 1, q_smem, k_bufs, k_ready, s_layout, ROWS, BLOCK_N, HEAD_D, kv_layout)
                    mbarrier.wait(v_ready.index(s), ((it + j) // STAGES) & 1)
                    v_smem = v_bufs.index(s)._reinterpret(dtype, [BLOCK_N, HEAD_D], kv_layout)
                    acc_tok = warpgroup_mma(p_cur, v_smem, acc, is_async=True)
                    _turn_end(turn_bars, WG, PINGPONG)
                    slot += 1
                    qk = warpgroup_mma_wait(1, deps=(qk_tok,))      # S_{j+1} done; P_j V_j may run on
                    mbarrier.arrive(k_empty.index((it + j + 1) % STAGES), count=1)
                    if j + 1 < n_full:
                        p, alpha, m_i, l_i = _softmax_block(qk, j + 1, m_i, l_i, offs_m, kv_len, shift, qk_scale,
                                                            BLOCK_N, False, CAUSAL, SCALE_POS, s_layout)
                    else:
                        p, alpha, m_i, l_i = _softmax_block(qk, j + 1, m_i, l_i, offs_m, kv_len, shift, qk_scale,
                                                            BLOCK_N, True, CAUSAL, SCALE_POS, s_layout)
                    p_next = gl.convert_layout(p.to(dtype), p_layout)
                    # P_j stays live (a dependency) until its product is done
                    acc, p_cur = warpgroup_mma_wait(0, deps=(acc_tok, p_cur))
                    mbarrier.arrive(v_empty.index(s), count=1)
                    p_cur = p_next
                if SEPARATE_O:
                    mbarrier.arrive(q_empty.index(WG), count=1)   # every S of this tile has retired
                if n_blocks > 0:
                    j = n_blocks - 1
                    s = (it + j) % STAGES
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    _turn_begin(turn_bars, slot, WG, PINGPONG)
                    mbarrier.wait(v_ready.index(s), ((it + j) // STAGES) & 1)
                    v_smem = v_bufs.index(s)._reinterpret(dtype, [BLOCK_N, HEAD_D], kv_layout)
                    acc_tok = warpgroup_mma(p_cur, v_smem, acc, is_async=True)
                    _turn_end(turn_bars, WG, PINGPONG)
                    slot += 1
                    acc, p_cur = warpgroup_mma_wait(0, deps=(acc_tok, p_cur))
                    mbarrier.arrive(v_empty.index(s), count=1)

                # epilogue: normalise, TMA store of O (clipped at Sq by the descriptor)
                inv_l = 1.0 / l_i
                o = acc * gl.convert_layout(inv_l, row_o)[:, None]
                if INF_AS_ZERO:
                    o = gl.where(gl.convert_layout(l_i == 0.0, row_o)[:, None], 0.0, o)
                if SEPARATE_O:
                    tma.store_wait(0)          # the previous tile's O has left the buffer
                o_smem.store(o.to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], o_smem4)
                if STORE_LSE:
                    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
                    gl.store(LSE + bh.to(gl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)
                if not SEPARATE_O:
                    tma.store_wait(0)          # O went out through the Q tile: now it may be reloaded
                    gl.thread_barrier()        # (the store's issuing thread has waited; thread 0 arrives)
                    mbarrier.arrive(q_empty.index(WG), count=1)
            it += n_blocks
            tcount += 1
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["B", "Hq", "Sq", "Sk"])
    def _gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, B, Hq, Sq, Sk, GROUP, qk_scale,
                          HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          PERSISTENT: gl.constexpr,
                          SEPARATE_O: gl.constexpr, CAUSAL: gl.constexpr, SCALE_POS: gl.constexpr,
                          STORE_LSE: gl.constexpr, INF_AS_ZERO: gl.constexpr, num_warps: gl.constexpr):
        """Tiles (BLOCK_M query rows of one (b, h)) t = pid, pid + grid, ... of the
        cdiv(Sq, BLOCK_M) * B * Hq: one per CTA (grid = every tile) or persistent (grid <=
        #SMs). Descriptors: 4-D [B, H, S, D] views with boxes [1, 1, rows, D]; O (B, Hq, Sq, D)
        and lse (B, Hq, Sq) contiguous. CONSUMERS 2 or 3: ping-pong consumer partitions of
        num_warps (4) warps and BLOCK_M / CONSUMERS rows each, CONSUMER_REGS registers a
        thread; 1: one of num_warps (8) warps and BLOCK_M rows."""
        NUM_C: gl.constexpr = CONSUMERS
        dtype: gl.constexpr = q_desc.dtype
        n_m = gl.cdiv(Sq, BLOCK_M)
        BH = B * Hq
        n_tiles = n_m * BH

        q_bufs = gl.allocate_shared_memory(dtype, [NUM_C] + q_desc.block_type.shape, q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        if SEPARATE_O:
            o_bufs = gl.allocate_shared_memory(dtype, [NUM_C] + o_desc.block_type.shape, o_desc.layout)
        else:
            o_bufs = q_bufs
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_C, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_C, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_C, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NUM_C):
            mbarrier.init(q_ready.index(c), count=1)
            mbarrier.init(q_empty.index(c), count=1)
        for i in gl.static_range(NUM_C):
            mbarrier.init(turn_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_C)   # released by every consumer
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=NUM_C)
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)

        # (a Gluon kernel cannot hold the partitions in variables: each list is written out)
        if NUM_C == 3:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                             qk_scale, 0, True, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT, SEPARATE_O, SCALE_POS,
                             STORE_LSE, INF_AS_ZERO, num_warps)),
                (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                             qk_scale, 1, True, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT, SEPARATE_O, SCALE_POS,
                             STORE_LSE, INF_AS_ZERO, num_warps)),
                (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                             qk_scale, 2, True, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT, SEPARATE_O, SCALE_POS,
                             STORE_LSE, INF_AS_ZERO, num_warps)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, Hq, GROUP, Sq, Sk, n_m, BH,
                             n_tiles, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT)),
            ], [num_warps, num_warps, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
        elif NUM_C == 2:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                             qk_scale, 0, True, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT, SEPARATE_O, SCALE_POS,
                             STORE_LSE, INF_AS_ZERO, num_warps)),
                (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                             qk_scale, 1, True, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT, SEPARATE_O, SCALE_POS,
                             STORE_LSE, INF_AS_ZERO, num_warps)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, Hq, GROUP, Sq, Sk, n_m, BH,
                             n_tiles, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT)),
            ], [num_warps, 1], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, bars, turn_bars, o_desc, LSE, Hq, Sq, Sk, n_m, BH, n_tiles,
                             qk_scale, 0, False, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT, SEPARATE_O, SCALE_POS,
                             STORE_LSE, INF_AS_ZERO, num_warps)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, Hq, GROUP, Sq, Sk, n_m, BH,
                             n_tiles, BLOCK_M, BLOCK_N, CAUSAL, PERSISTENT)),
            ], [1], [24])

        for c in gl.static_range(NUM_C):
            mbarrier.invalidate(q_ready.index(c))
            mbarrier.invalidate(q_empty.index(c))
        for i in gl.static_range(NUM_C):
            mbarrier.invalidate(turn_bars.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))


# ---- launcher -------------------------------------------------------------------------

def _tma_strides(t: torch.Tensor) -> list[int] | None:
    """The strides a host TMA descriptor of t (4-D, inner stride 1) takes, or None when TMA
    cannot describe t: a 16-byte aligned base and 16-byte multiples for the strides of the
    dims that are stepped over (a size-1 dim's stride is never used: the contiguous one
    stands in for it)."""
    e = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return None
    out = []
    for i in range(t.dim() - 1):
        s = t.stride(i)
        if t.shape[i] == 1:
            s = math.prod(t.shape[i + 1:])
        elif s <= 0 or (s * e) % 16:
            return None
        out.append(s)
    return out + [1]


def _tma_view(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(t, its TMA strides), or a contiguous copy of t when TMA cannot describe it."""
    st = _tma_strides(t)
    if st is None:   # clone, not contiguous(): a contiguous view at an odd offset stays odd
        t = t.clone(memory_format=torch.contiguous_format)
        st = _tma_strides(t)
    return t, st


_GL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def _box_layout(rows: int, d: int, dtype: torch.dtype):
    """The swizzled shared layout of a [1, 1, rows, d] box (what the kernel allocates)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], getattr(gl, _GL_DTYPE[dtype]))


def _descriptor(t: torch.Tensor, strides: list[int], rows: int):
    """Host TMA descriptor of a [B, H, S, D] tensor with box [1, 1, rows, D]: rows past S
    load as zeros and are not stored, per (b, h). `strides` come from _tma_strides, which
    checked what TensorDescriptor's own validation would."""
    d = t.shape[3]
    return host_descriptor(t, list(t.shape), strides, [1, 1, rows, d], _box_layout(rows, d, t.dtype))


class GluonFwdPlan:
    """Launches of `_gluon_fwd_kernel` for one problem and tile config. The grid and every
    constexpr are fixed here; a call builds the four descriptors (unvalidated, see
    _descriptor) and launches through nnprim.launch.Launch (compiled-kernel fast path,
    CUtensorMaps cached per address), one Launch per (scale sign, lse stored): the two
    constexprs a call's arguments decide."""

    def __init__(self, problem, cfg: dict | None = None):
        self.p = p = problem
        cfg = dict(cfg or tile_config(p.D, problem=p))
        self.persistent = cfg["PERSISTENT"]
        self.rows = cfg["BLOCK_M"] // cfg["CONSUMERS"]
        self.block_n = cfg["BLOCK_N"]
        self.n_tiles = triton.cdiv(p.Sq, cfg["BLOCK_M"]) * p.B * p.Hq
        self.o_strides = [p.Hq * p.Sq * p.Dv, p.Sq * p.Dv, p.Dv, 1]
        self.options = dict(HEAD_D=p.D, CAUSAL=_CAUSAL_CODE[p.causal], INF_AS_ZERO=p.inf_as_zero, **cfg)
        self.launches: dict[tuple[bool, bool], Launch] = {}
        # TMA strides of (q, k, v) by their stride tuples: what _tma_strides found for
        # inputs it took in place (the shapes are the problem's)
        self.strides: dict[tuple, tuple[tuple[int, ...], ...]] = {}

    def _launch(self, device: torch.device, scale_pos: bool, store_lse: bool) -> Launch:
        key = (scale_pos, store_lse)
        launch = self.launches.get(key)
        if launch is None:
            grid = (min(self.n_tiles, sm_count(device.index)),) if self.persistent else (self.n_tiles,)
            launch = self.launches[key] = Launch(_gluon_fwd_kernel, grid, (), SCALE_POS=scale_pos,
                                                 STORE_LSE=store_lse, **self.options)
        return launch

    def __call__(self, args, out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
        """(o, lse). `out` / `lse_out` (contiguous) let tests pass poisoned buffers; lse is
        computed when problem.return_lse or lse_out is given."""
        p = self.p
        q, k, v = args.q, args.k, args.v
        o = out if out is not None else alloc.empty((p.B, p.Hq, p.Sq, p.Dv), q.dtype, q.device)
        want_lse = p.return_lse or lse_out is not None
        lse = lse_out if lse_out is not None else (
            alloc.empty((p.B, p.Hq, p.Sq), torch.float32, q.device) if want_lse else None)
        scale = float(args.effective_scale(p.invert_scale))
        launch = self._launch(q.device, scale > 0, lse is not None)
        rest = (lse if lse is not None else o, p.B, p.Hq, p.Sq, p.Sk, p.group, scale * 1.4426950408889634)
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        st = self.strides.get((q.stride(), k.stride(), v.stride()))
        if st is None or (ptrs[0] | ptrs[1] | ptrs[2]) & 15:
            # strides not seen yet, or a base TMA cannot take: checked, copied if need be
            (q, sq), (k, sk), (v, sv) = _tma_view(q), _tma_view(k), _tma_view(v)
            if q is args.q and k is args.k and v is args.v:
                self.strides[(q.stride(), k.stride(), v.stride())] = (tuple(sq), tuple(sk), tuple(sv))
            launch(*self._descriptors(q, k, v, o, (sq, sk, sv)), *rest)
        else:   # TMA-able in place: the encoded descriptors are reused per address
            launch.run_keyed(ptrs + (o.data_ptr(),) + st,
                             lambda: self._descriptors(q, k, v, o, st), *rest)
        return o, lse if want_lse else None

    def _descriptors(self, q, k, v, o, strides) -> tuple:
        sq, sk, sv = strides
        return (_descriptor(q, sq, self.rows), _descriptor(k, sk, self.block_n), _descriptor(v, sv, self.block_n),
                _descriptor(o, self.o_strides, self.rows))


def gluon_forward(problem, args, *, out: torch.Tensor | None = None,
                  lse_out: torch.Tensor | None = None, cfg: dict | None = None):
    """(o, lse) of one call with a tile config of the caller's (tests, benchmarks, the
    compile check); the solver keeps one GluonFwdPlan per problem instead."""
    return GluonFwdPlan(problem, cfg)(args, out=out, lse_out=lse_out)


# ---- solver -----------------------------------------------------------------------------

def scope_reasons(problem, head_dims: tuple[int, ...], fallback: str, why_dims: str = "") -> list[str]:
    """What the Gluon attention kernels (126 forward, 127 backward) leave to the Triton
    solver `fallback`: other head dims, masks, dropout, kv_lens, a tensor scale; and the
    Gluon gate (Hopper, Gluon importable, not switched off, not the interpreter)."""
    reasons = []
    if problem.D != problem.Dv or problem.D not in head_dims:
        reasons.append(f"head dims D={problem.D}, Dv={problem.Dv}: needs D == Dv in {head_dims}"
                       f"{why_dims} ({fallback} covers others)")
    if problem.mask != "none":
        reasons.append(f"mask={problem.mask} is not supported ({fallback} covers masks)")
    if problem.dropout_p > 0:
        reasons.append(f"dropout_p={problem.dropout_p} is not supported ({fallback} covers dropout)")
    if problem.has_kv_lens:
        reasons.append(f"kv_lens are not supported ({fallback} covers them)")
    if problem.scale == "tensor":
        reasons.append(f"a tensor scale is not supported ({fallback} reads it in the kernel)")
    return reasons + gluon_reasons(problem.device)


@register
class GluonFlashForward(FlashBase):
    """Warp-specialised Hopper forward in Gluon: TMA producer warp, wgmma consumers."""
    id = 126
    name = "gluon_flash_fwd"
    directions = frozenset({"fwd"})
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    deterministic = True   # one CTA owns each output row; the key order is fixed
    long_compile = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        reasons += scope_reasons(problem, HEAD_DIMS, "solver 110")
        if problem.descale is not None or problem.out_dtype not in (None, problem.dtype):
            reasons.append("FP8 inputs / another output dtype are not supported (solver 125)")
        return reasons

    def workspace_size(self, problem) -> int:
        """0: host TMA descriptors, no in-kernel descriptor scratch (inputs TMA cannot
        describe are copied, as every solver's launcher copies what it cannot read)."""
        return 0

    def estimate(self, problem) -> float | None:
        return model_ms(problem, tile_config(problem.D, problem=problem))

    def prepare(self, problem):
        return GluonFwdPlan(problem)
