"""Warp-specialised flash attention backward for Hopper in Gluon (solver 127
`gluon_flash_bwd`, family `flash`).

Same mathematics and launches as solver 123 (flash_bwd_atomic.py, read its docstring): its
preprocess kernel (delta = rowsum(dO * O), the f32 dQ accumulator zeroed), a main kernel
that, per key block, forms the five products

    S = Q K^T,  P = exp2(S * scale * log2e - lse * log2e),  dP = dO V^T,
    dV += P^T dO,  dS = P * (dP - delta),  dK += dS^T Q,  dQ_partial = dS K

and adds dQ_partial to the f32 accumulator (in whatever order the key blocks arrive: not
deterministic), then its
cast kernel (which applies the scale: the main kernel adds dQ_partial unscaled). Only the main
kernel is new: Gluon, FA3's structure.

One CTA per (key block of BLOCK_N = 128 keys, b, kv head); grid axis 0 is the key block, so
under causal masking the long blocks (low keys, more query rows) start first. The GQA
reduction of dK/dV over the GROUP query heads of the kv head stays in the CTA (it loops over
them), as in 123. `gl.warp_specialize` splits the CTA into
  - a 1-warp producer: TMA loads of the CTA's K and V (once, two 64-key halves each) and then,
    for every query head of the group and every query block that sees a key of the block, the
    (Q_i, dO_i) tiles of BLOCK_M = 64 rows into a STAGES-deep shared-memory ring (one ready
    barrier with the TMA transaction count, one empty barrier released by both consumers);
  - two 4-warp consumer warpgroups, each owning 64 of the 128 keys: per stage S and dP as
    [64 query rows, 64 keys] tiles (async wgmma, operands in shared memory; lse and delta are
    then two values per thread, FA3's orientation), P from the lse (a fully masked row's
    lse = -inf gives P = 0), P and dS into the warpgroup's shared buffers, dV += P^T dO and
    dK += dS^T Q (P, dS read transposed as the A operands, wgmma's M = the 64 keys),
    dQ_partial = dS K, the stage released, then dQ_partial added to the accumulator: TMA_DQ
    (the default, FA3's way) stores it into the warpgroup's f32 staging tile in shared memory
    and issues TMA bulk reduce-adds of [64 rows, 32 columns] boxes (`_add_dq`; rows past Sq
    fall outside the descriptor), else per-thread `gl.atomic_add` in the accumulator's
    layout (2 x f32 reductions, masked at Sq). The atomics held d128 at 335-389 TFLOP/s; the
    reduce-adds take it to 538-600 (2026-12-01, ninth session). dQ_partial, SPLIT_DQ (d128, the default there; FA3's):
    of all 128 keys, each warpgroup HEAD_D / 2 columns, from both warpgroups' dS (double-
    buffered in shared memory, a ds_ready barrier per buffer counts both writers) and column
    halves of K: half the dQ adds and registers (d64, whose K column half would cut a
    128-byte swizzle row, reads them from a second copy of K loaded as [64 keys, 32 columns]
    boxes). Otherwise each warpgroup its 64 keys, all columns.
Element masks (key tail at Sk, the causal diagonal) only on the query blocks [lo, full) that
cross the diagonal, and on every query block of the last key block (keys past Sk): the
consumers walk [lo, full) of every query head of the group, then [full, m_end) of every head,
as two flat loops (one with a branch on the mask cost registers; a head loop around them kept
its values live across the stages: spills), and the producer loads in that order; with
ROTATE (d128 and solver 129 without causal masking) each head's walk starts at query block
j s of key block j and wraps, so the CTAs of a head add to different dQ blocks. Query rows
past Sq load as zeros and their lse as +inf (P = 0). Epilogue: dK * scale and dV cast to the
input dtype, masked stores at Sk. Non-persistent grid (a next step: FA3's persistent
scheduler). DQ_WRITER (solver 129's default): a fourth partition, one warp (`_dq_writer`), issues
the reduce-adds of both column halves; the consumers stage their halves (`_stage_dq`: a
dq_empty wait for the staging tile, a dq_full arrival) and go on, and with ordered adds the
writer alone waits for the turns and passes the blocks on (one add per key block).

Covers bf16/f16, D == Dv in {64, 128} (d256 would need 2 x 128 registers of dK/dV
accumulators per thread and ~260 KB of shared memory: not applicable), GQA/MQA, causal
top-left and bottom-right, any Sq/Sk (tails), float scale (inverted or not, any sign),
softmax_inf_as_zero (the backward of a fully masked row is 0 either way). Everything else
is solver 123's. Needs a CUDA device of capability 9.x and Gluon; never applicable under
TRITON_INTERPRET=1 nor with NNPRIM_GLUON=0 (nnprim/gluon_support.py). Inputs whose strides
TMA cannot describe are copied contiguous first (gluon_fwd._tma_view).

History (H200, benchmarks/gluon_bwd.py, solver level, cuDNN in the same run, the 13 train
problems with D <= 128): the first kernel (2026-12-01) 0.60x cuDNN, spilling 360-400 bytes per
thread at d128; spill-free (REMAT: the K/V wgmma descriptors rebuilt per stage, the flat loops,
the unscaled dQ; benchmarks/diag/gluon_bwd_regs.py) 0.62x; dQ by TMA reduce-adds instead of
f32 atomics (ninth session): d128 0.85-1.02x (0.94x geomean over its 7 problems; the atomics'
variant 0.59-0.73x, solver 111 0.60-0.69x in the same run). Known cost left: no persistent
scheduler (a CTA per key block: short sequences pay the prologue per CTA). Solver 129 (ordered
adds, deterministic, bit-identical in tests/gpu): 0.57x geomean (0.43-0.76x; 111, also
deterministic, 0.66x in the same run): it leads 111 on the causal d128 problems (0.67-0.76x) and
trails on the others, where each key block waits a step behind the one before it on every dQ
block; find picks between them when determinism is on. Sixteenth session (2026-12-02,
results/gluon_bwd_2026-12-02_s16_*): the rotated walk (ROTATE) and the deferred hand-off
(DQ_DEFER) take 129 from 0.57x to 0.66x cuDNN (d128 0.70-0.94x, ahead of 111's 0.60-0.81x; d64
0.50-0.64x, behind 111's 0.63-0.72x); the rotated walk takes 127 at d128 without causal
masking from 0.85-0.94x to 0.90-0.97x. What 129 still pays (benchmarks/diag/ordered_cost.sh,
the PTX patched piece by piece, d128 s4096): with no turn waits at all 0.77x (0.72x with
them), with a relaxed instead of a releasing increment 0.79x / causal 0.86x, with every
ordering piece off 0.89x: the release's fence on the consumers' path is the largest part. A
release by a warp of its own (tried: a 1-warp partition incrementing the counters after an
mbarrier arrival per warpgroup and step) hung: a consumer can arrive twice before the warp
waits once, so the barrier's phase parity aliases; it needs a back-pressure barrier.
Seventeenth session (2026-12-02, results/gluon_bwd_2026-12-02_s17_call1.json): that warp with
back-pressure, FA3's dQ writer (DQ_WRITER: the staging tile freed by a dq_empty barrier), takes
129 from 0.65x to 0.87x cuDNN (d128 0.85-0.96x, d64 0.78-0.85x), 1.06x 127's time; 127 itself
measured 3 % slower with it (0.88x against 0.91x) and keeps the consumers' own reduce-adds.
"""
from __future__ import annotations

import math

import torch
import triton

from .. import alloc
from ..gluon_support import (
    fence_async_shared,
    gl,
    gluon,
    host_descriptor,
    mbarrier,
    sm_count,
    tma,
    tma_reduce_add,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..launch import Launch
from ..search.solver import register
from .flash_bwd_atomic import _cast_kernel, _pre_kernel
from .flash_fwd import PEAK_TBS, PEAK_TFLOPS, FlashBase, block_d
from .gluon_fwd import _CAUSAL_CODE, _box_layout, _descriptor, _tma_view, scope_reasons

HEAD_DIMS = (64, 128)
SMEM_BYTES = 227 * 1024   # an H100/H200 CTA's shared memory
BLOCK_M = 64              # query rows per ring stage
BLOCK_N = 128             # keys per CTA (64 per consumer warpgroup)
KEYS_PER_WG = BLOCK_N // 2
# Fraction of the bf16 peak by head dim, measured on the H200 (benchmarks/gluon_bwd.py,
# long sequences). 2026-12-01 ninth session, dQ by TMA reduce-adds (results/gluon_bwd_2026-12-01_s9*.json):
# d128 (split dQ) 538-600 TFLOP/s at s4k-16k (379 at s1024); with f32 atomics 335-389 and
# solver 111 in the same run 315-365. d64: f32 atomics 228-257 (111: 246-353)
EFF_BY_D = {64: 0.33, 128: 0.72}
HOST_FLOOR_MS = 0.06      # three launches and four descriptors per call (126's floor + 2 launches)
# solver 129 against 127: the ordered dQ adds. Measured 2026-12-01 (ninth session,
# results/gluon_bwd_2026-12-01_s9_ordered.json): 1.3-1.4x on causal d128, 1.7-2.0x on non-causal
# (key block j + 1 trails j by a step on every dQ block), 1.6x geomean; with the rotated walk and
# the deferred hand-off (2026-12-02, sixteenth session, results/gluon_bwd_2026-12-02_s16_call2.json)
# 1.2-1.4x at d128, 1.4-1.7x at d64, 1.4x geomean; with the dQ writer warp (seventeenth session,
# results/gluon_bwd_2026-12-02_s17_call1.json) 0.97-1.12x, 1.06x geomean
ORDERED_COST = 1.06


def tile_config(d: int, split_dq: bool | None = None, stages: int | None = None, remat: bool = True,
                tma_dq: bool | None = None, ordered: bool = False, rotate: bool | None = None,
                defer: bool | None = None, writer: bool | None = None) -> dict:
    """Launch constants for head dim d: STAGES of the (Q, dO) ring (default 3 at d64, 2 at
    d128 as FA3; 3 also fits 227 KB at d128, which benchmarks/gluon_bwd.py times), SPLIT_DQ
    (dQ_partial of all 128 keys split by columns between the warpgroups, FA3's: half the
    atomic adds and dQ registers; default at d128, where a column half of K is whole 128-byte
    swizzle rows; d64 loads K a second time in column halves for it), num_warps of each consumer warpgroup, maxnreg (168 x 384
    threads fills the register file; setmaxnreg moves the producer's registers to the
    consumers, 240 each), REMAT (the K / V wgmma descriptors and mask indices rebuilt per
    stage instead of hoisted and spilled, _step; False: the kernel of 2026-12-01), TMA_DQ
    (how dQ_partial is added, `_add_dq`: 0 per-thread f32 atomics; 1 TMA bulk reduce-adds
    from a shared-memory staging tile per warpgroup; 2 (`ordered`) the same reduce-adds in
    descending key-block order per dQ block, through semaphores: deterministic), ROTATE
    (without causal masking, key block j walks the query blocks from block j * s on, wrapping,
    s = (query blocks) // (key blocks): the CTAs of a head add to different dQ blocks at a time
    instead of all to the same; with `ordered`, the order of the adds per dQ block follows
    (`_turn`), so no CTA waits a step behind another; default on with `ordered` and at d128,
    where it measured 3-9 % faster without causal masking (at d64 up to 6 % slower: the heads'
    Q / dO tiles read by all key blocks at once hit in L2); the plan turns it off where it does
    not apply, `rotation`), DQ_DEFER (`ordered`: a warpgroup waits
    for its reduce-adds to complete and passes the dQ block on at its next step, while that
    step's last products run (`_dq_handoff`), not at once; default on with `ordered`), DQ_WRITER
    (FA3's dQ warp: the consumers stage dQ_partial and go on, a 1-warp partition `_dq_writer`
    issues the reduce-adds and, with `ordered`, waits for the turns and passes the blocks on;
    needs the TMA reduce-adds and the split dQ, which it implies; DQ_DEFER then off; default on
    with `ordered` unless split_dq is False: 129 0.65x -> 0.87x cuDNN, seventeenth session)."""
    if writer is None:
        writer = ordered and split_dq is not False
    if writer and split_dq is False:
        raise ValueError("tile_config: writer=True needs the split dQ (split_dq=True or None)")
    split = d >= 128 or writer if split_dq is None else split_dq
    stages = stages or (3 if d <= 64 else 2)
    if tma_dq is None:      # the default where this Triton can build the TMA reduce-add
        tma_dq = tma_reduce_add is not None
    mode = 2 if ordered else int(bool(tma_dq))
    writer = writer and mode != 0
    rotate = ordered or d >= 128 if rotate is None else rotate
    defer = ordered and not writer if defer is None else defer and ordered and not writer
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, SPLIT_DQ=split, REMAT=remat, TMA_DQ=mode,
                ROTATE=rotate, DQ_DEFER=defer, DQ_WRITER=writer, num_warps=4, maxnreg=168)


# Named tile configs (benchmarks/gluon_bwd.py --configs and benchmarks/diag/gluon_bwd_regs.py
# take these names): head dim -> tile_config
CONFIGS = {
    "default": lambda d: tile_config(d),
    "wg_dq": lambda d: tile_config(d, split_dq=False),
    "split": lambda d: tile_config(d, split_dq=True),     # d64 too: K's column halves loaded apart
    # dQ by f32 atomics (the kernel before 2026-12-01's ninth session); the 3-stage ring at d128
    # fits only without the TMA staging tiles
    "atomic": lambda d: tile_config(d, tma_dq=False),
    "wg_dq_atomic": lambda d: tile_config(d, split_dq=False, tma_dq=False),
    "s3": lambda d: tile_config(d, stages=3, tma_dq=False),
    "hoisted": lambda d: tile_config(d, remat=False, tma_dq=False),   # descriptors hoisted (d128 spills)
    "ordered": lambda d: tile_config(d, ordered=True),                 # deterministic: solver 129's
    # 129 of the sixteenth session: the consumers wait for the turns and pass the blocks on
    # themselves, a step late (DQ_DEFER), with the split dQ only at d128
    "ordered_inline": lambda d: tile_config(d, ordered=True, writer=False),
    # 129 before 2026-12-02 (sixteenth session): every CTA from query block 0, the dQ block
    # passed on at once after a wait for its reduce-adds
    "ordered_fixed": lambda d: tile_config(d, ordered=True, rotate=False, defer=False, writer=False),
    "ordered_eager": lambda d: tile_config(d, ordered=True, defer=False, writer=False),   # rotated, at once
    "rotate": lambda d: tile_config(d, rotate=True),                    # 127 with the rotated walk
    "norotate": lambda d: tile_config(d, rotate=False),
    "split_ordered": lambda d: tile_config(d, split_dq=True, ordered=True, writer=False),
    # 127 with the reduce-adds in a warp of their own (`_dq_writer`; 129's default)
    "writer": lambda d: tile_config(d, writer=True),
}


def rotation(problem, cfg: dict, sms: int) -> bool:
    """Whether the rotated walk (ROTATE) applies: never under causal masking (the key blocks
    see different query blocks anyway); with ordered adds only where every key block of a head
    starts on its own query block (n_kv <= query blocks) and the CTAs of a head fit the GPU at
    once (n_kv <= sms): a CTA may wait on a key block launched after it."""
    if not cfg.get("ROTATE") or problem.causal:
        return False
    if cfg["TMA_DQ"] != 2:
        return True
    n_kv = triton.cdiv(problem.Sk, cfg["BLOCK_N"])
    return n_kv <= min(triton.cdiv(problem.Sq, cfg["BLOCK_M"]), sms)


def smem_bytes(d: int, cfg: dict) -> int:
    """Shared memory of a 16-bit launch: K and V (BLOCK_N x d each), the ring of Q and dO
    tiles, the consumers' P and dS buffers (dS double-buffered with SPLIT_DQ; barriers
    aside)."""
    n_pds = 2 + (4 if cfg["SPLIT_DQ"] else 2)
    stage = 2 * 4 * cfg["BLOCK_M"] * (d // 2 if cfg["SPLIT_DQ"] else d) if cfg.get("TMA_DQ") else 0
    kq = cfg["BLOCK_N"] * d if cfg["SPLIT_DQ"] and d < 128 else 0     # K's copy in column halves
    return 2 * (2 * cfg["BLOCK_N"] * d + kq + 2 * cfg["STAGES"] * cfg["BLOCK_M"] * d
                + n_pds * KEYS_PER_WG * cfg["BLOCK_M"]) + stage


def model_ms(problem, block_n: int = BLOCK_N, eff: float | None = None,
             host_floor_ms: float = HOST_FLOOR_MS) -> float:
    """flops / (peak * eff: EFF_BY_D by default) over the SM fill of the last wave of (key
    block of block_n, b, kv head) CTAs, at least the memory time (inputs twice, plus the dQ
    accumulator's f32 adds once per key block), plus 10 us of launches; at least
    host_floor_ms. 130 (gluon_bwd_d256) passes its own key block and efficiency."""
    if problem.device != "cuda":
        return problem.flops() / 2e7 + 1.0
    eff = EFF_BY_D.get(problem.D, 0.37) if eff is None else eff
    t_c = problem.flops() / (PEAK_TFLOPS.get(problem.dtype, 750.0) * 1e12 * eff)
    n_kv = math.ceil(problem.Sk / block_n)
    ctas = problem.B * problem.Hkv * n_kv
    fill = ctas / (math.ceil(ctas / 132) * 132)
    acc_bytes = 4.0 * problem.B * problem.Hq * problem.Sq * problem.D * n_kv * problem.causal_fraction()
    t_m = (problem.bytes() + acc_bytes) / (PEAK_TBS * 1e12 * 0.8)
    return max(max(t_c / max(fill, 0.05), t_m) * 1e3 + 0.01, host_floor_ms)


# ---- Gluon kernel ---------------------------------------------------------------------

if gluon is not None:
    # the ordered dQ adds (`_add_dq`, TMA_DQ 2), one instance per thread:
    # wait until the dQ block's counter reaches the turn (acquire loads; labels in a { } block
    # are local to it), then order this thread's later async-proxy (TMA) operations after it
    _ASM_WAIT = gl.constexpr(
        "{ .reg .pred p; .reg .b32 v;\n"
        "WAIT_TURN:\n"
        "ld.acquire.gpu.global.b32 v, [$1];\n"
        "setp.lt.s32 p, v, $2;\n"
        "@p bra WAIT_TURN;\n"
        "fence.proxy.async.global;\n"
        "mov.b32 $0, v; }")
    # the reduce-adds complete (their global writes, not only their shared-memory reads), then
    # ordered before the generic-proxy release that follows
    _ASM_DONE = gl.constexpr(
        "{ cp.async.bulk.wait_group 0;\n"
        "fence.proxy.async.global;\n"
        "mov.b32 $0, $1; }")
    # thread 0 of the warpgroup: counter += 1 (release)
    _ASM_RELEASE = gl.constexpr(
        "{ .reg .pred p;\n"
        "setp.eq.s32 p, $2, 0;\n"
        "@p red.release.gpu.global.add.s32 [$1], 1;\n"
        "mov.b32 $0, 0; }")


    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, kq_desc, q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, bars, b, hk,
                  start_n, GROUP, lo, full, m_end, rot, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
                  ROTATE: gl.constexpr, KQ_COPY: gl.constexpr):
        """1 warp: K and V (as k_bufs.shape[0] boxes of KEYS keys each: here two 64-key
        halves; one 64-key box for solver 130, gluon_bwd_d256.py) once (KQ_COPY: K again as
        [KEYS, D / 2] boxes, key half c, column half w in kq_bufs[2 c + w]), then (Q_i, dO_i) into
        ring slot it % STAGES once both consumers have released it, in the consumers' order: the
        query blocks [lo, full) of every query head of the group, then [full, m_end) of every
        head (ROTATE: each from query block rot of its range on, wrapping; `_walk_start`).
        Empty barriers start 'phase 1 complete', so the first pass waits on parity 1.
        Boxes past Sq / Sk load as zeros."""
        kv_ready, q_ready, q_empty = bars[0], bars[1], bars[2]
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        NKV: gl.constexpr = k_bufs.type.shape[0]
        if KQ_COPY:
            kv_bytes: gl.constexpr = NKV * (2 * k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        else:
            kv_bytes: gl.constexpr = NKV * (k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        mbarrier.expect(kv_ready.index(0), kv_bytes)
        DQ_N: gl.constexpr = kq_desc.block_type.shape[3]
        for c in gl.static_range(NKV):
            tma.async_copy_global_to_shared(k_desc, [b, hk, start_n + c * KEYS, 0], kv_ready.index(0),
                                            k_bufs.index(c))
            tma.async_copy_global_to_shared(v_desc, [b, hk, start_n + c * KEYS, 0], kv_ready.index(0),
                                            v_bufs.index(c))
            if KQ_COPY:
                for w in gl.static_range(2):
                    tma.async_copy_global_to_shared(kq_desc, [b, hk, start_n + c * KEYS, w * DQ_N], kv_ready.index(0),
                                                    kq_bufs.index(2 * c + w))
        it = 0
        for part in gl.static_range(2):
            if part == 0:
                m0, m1 = lo, full
            else:
                m0, m1 = full, m_end
            first = _walk_start(m0, m1, rot, BLOCK_M, ROTATE)
            for g in range(GROUP):
                h = hk * GROUP + g
                start_m = first
                for _ in range(m0, m1, BLOCK_M):
                    s = it % STAGES
                    mbarrier.wait(q_empty.index(s), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_ready.index(s), q_bufs.index(s))
                    tma.async_copy_global_to_shared(do_desc, [b, h, start_m, 0], q_ready.index(s), do_bufs.index(s))
                    it += 1
                    start_m += BLOCK_M
                    if start_m >= m1:
                        start_m = m0

    @gluon.jit
    def _causal_shift(Sq, Sk, CAUSAL: gl.constexpr):
        """Key index minus query index on the causal diagonal: Sk - Sq bottom-right, else 0."""
        if CAUSAL == 2:
            return Sk - Sq
        else:
            return 0

    @gluon.jit
    def _walk_start(m0, m1, rot, BLOCK_M: gl.constexpr, ROTATE: gl.constexpr):
        """The first query block of the walk over [m0, m1): block rot of the range with
        ROTATE (modulo its length), else m0."""
        if ROTATE:
            return m0 + (rot % gl.maximum((m1 - m0) // BLOCK_M, 1)) * BLOCK_M
        else:
            return m0

    @gluon.jit
    def _rotation(j, n_kv, Sq, BLOCK_M: gl.constexpr, ROTATE: gl.constexpr):
        """(rot, s): key block j starts its walk at query block rot = j * s (mod the query
        blocks), s = max(query blocks // key blocks, 1); (0, 1) without ROTATE."""
        if ROTATE:
            nb = gl.cdiv(Sq, BLOCK_M)
            s = gl.maximum(nb // n_kv, 1)
            return (j * s) % nb, s
        else:
            return j * 0, 1

    @gluon.jit
    def _cta_block(DESCEND: gl.constexpr):
        """(b * Hkv + hk, key block, key blocks) of this CTA of the grid (key blocks, B * Hkv);
        DESCEND (the ordered adds, whose turns wait on the key block above): key blocks
        launched from the last down. (Launching every head's key block j before any head's
        j + 1 balances the causal CTAs' last wave on paper but measured 1.1-1.6x slower on the
        H200, 2026-12-02: the heads' Q / dO no longer shared in L2.)"""
        n_kv = gl.num_programs(0)
        j = gl.program_id(0)
        if DESCEND:
            j = n_kv - 1 - j
        return gl.program_id(1), j, n_kv

    @gluon.jit
    def _query_range(start_n, Sq, Sk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """(lo, full, m_end) of the key block [start_n, start_n + BLOCK_N): the query blocks
        [lo, m_end) see a key of it, [lo, full) need element masks (the causal diagonal; every
        block when the key block ends past Sk). Shared with 130 (gluon_bwd_d256)."""
        shift = _causal_shift(Sq, Sk, CAUSAL)
        m_end = gl.cdiv(Sq, BLOCK_M) * BLOCK_M
        if CAUSAL != 0:
            lo = (gl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
            full = gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
        else:
            lo = 0
            full = 0
        lo = gl.minimum(lo, m_end)
        full = gl.maximum(gl.minimum(full, m_end), lo)
        if start_n + BLOCK_N > Sk:
            full = m_end      # the key block ends past Sk: every query block masks the key tail
        return lo, full, m_end

    @gluon.jit
    def _row_stats(LSE, DELTA, row0, rws, rmask):
        """The stage's rows' lse in the log2 domain (+inf where a row sees no key, so P = 0)
        and delta = rowsum(dO O); row0 a scalar base (int32 offsets: fewer registers)."""
        lse = gl.load(LSE + row0 + rws, mask=rmask, other=float("inf"))
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = gl.load(DELTA + row0 + rws, mask=rmask, other=0.0)
        return lse2, delta

    @gluon.jit
    def _probs(st, lse2, rws, start_m, key0, opq, Sk, shift, qk_scale, KEYS: gl.constexpr,
               s_layout: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
        """P = exp2(S scale - lse) of the S tile st (rows start_m + rws, keys key0 + opq + cols),
        with the key tail and the causal diagonal masked where MASKED."""
        if MASKED:
            cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout)) + opq   # key - key0
            valid = cols[None, :] < Sk - key0
            if CAUSAL != 0:
                valid = valid & (cols[None, :] <= (rws + (start_m + shift - key0))[:, None])
            return gl.exp2(gl.where(valid, st * qk_scale, float("-inf")) - lse2[:, None])
        else:
            return gl.exp2(st * qk_scale - lse2[:, None])

    @gluon.jit
    def _step(q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_smem, ds_bufs, bars, LSE, DELTA, DQA, dq_desc, dq_stage, SEM, bh, b,
              h, start_m, it, key0, offs_dq, Sq, Sk, shift, qk_scale, dk, dv, zero_s, zero_dq, prev, WG: gl.constexpr,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr, MASKED: gl.constexpr,
              CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr, REMAT: gl.constexpr, TMA_DQ: gl.constexpr,
              ROTATE: gl.constexpr, DEFER: gl.constexpr, WRITER: gl.constexpr, s_layout: gl.constexpr,
              dq_layout: gl.constexpr):
        """One ring stage (query rows start_m.. of head bh, the it-th stage of this CTA) for
        one consumer: the five products, the stage's release, the atomic dQ adds; (dk, dv,
        the dQ block counter that `_dq_handoff` passes on at the next step: prev without ORDERED).
        S and dP are [query rows, keys] tiles, so lse and delta are two values per thread (per
        row; FA3's orientation); P and dS go through shared memory, read transposed as the A
        operands of dV += P^T dO and dK += dS^T Q.

        REMAT: the views of K and V (and with SPLIT_DQ this warpgroup's dQ columns of the two K
        halves) are indexed by WG + (it >> 30), zero at run time but not loop-invariant to the
        compiler, so their wgmma descriptors (8 k-steps of 4 products: ~50 registers) are
        rebuilt per stage in uniform registers instead of being hoisted out of the loops and
        spilled (d128: 360-400 bytes of stack -> ~100; the flat loops take it to 0-8). The key
        indices of the element masks get the same treatment (16 registers otherwise).
        dQ_partial is added unscaled (the cast kernel applies the scale); its adds skip the
        row mask when the query block ends within Sq."""
        kv_ready, q_ready, q_empty, ds_ready, dq_full, dq_empty = bars
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        dtype: gl.constexpr = q_bufs.dtype
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        s = it % STAGES
        if REMAT:
            opq = it >> 30       # 0: see the docstring
        else:
            opq = 0
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_D], dtype)
        k_smem = k_bufs.index(WG + opq)._reinterpret(dtype, [KEYS, HEAD_D], kv2_layout)
        v_smem = v_bufs.index(WG + opq)._reinterpret(dtype, [KEYS, HEAD_D], kv2_layout)
        if SPLIT_DQ:
            DQ_N: gl.constexpr = HEAD_D // 2
            if HEAD_D < 128:   # a column half is not whole 128-byte swizzle rows: K's copy in halves
                kq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, DQ_N], dtype)
                kq0 = kq_bufs.index(WG + opq)._reinterpret(dtype, [KEYS, DQ_N], kq_layout)
                kq1 = kq_bufs.index(2 + WG + opq)._reinterpret(dtype, [KEYS, DQ_N], kq_layout)
            else:
                kq0 = k_bufs.index(opq)._reinterpret(dtype, [KEYS, HEAD_D], kv2_layout).slice(WG * DQ_N, DQ_N, dim=1)
                kq1 = k_bufs.index(1 + opq)._reinterpret(dtype, [KEYS, HEAD_D], kv2_layout).slice(WG * DQ_N, DQ_N,
                                                                                                   dim=1)
        mbarrier.wait(q_ready.index(s), (it // STAGES) & 1)
        q_smem = q_bufs.index(s)._reinterpret(dtype, [BLOCK_M, HEAD_D], q2_layout)
        do_smem = do_bufs.index(s)._reinterpret(dtype, [BLOCK_M, HEAD_D], q2_layout)
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do_smem, v_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        rws = gl.arange(0, BLOCK_M, layout=row_s)
        row0 = bh * Sq + start_m   # scalar base, int32 offsets: fewer registers per element
        lse2, delta = _row_stats(LSE, DELTA, row0, rws, rws < Sq - start_m)
        st = warpgroup_mma_wait(1, deps=(s_tok,))           # S done; dP may run on
        p = _probs(st, lse2, rws, start_m, key0, opq, Sk, shift, qk_scale, KEYS, s_layout, MASKED, CAUSAL)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do_smem, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dp_tok,))         # dP done; dV may run on
        ds = p * (dpt - delta[:, None])
        if SPLIT_DQ:
            u = it % 2
            ds_smem = ds_bufs.index(2 * u + WG)
        else:
            ds_smem = ds_bufs.index(WG)
        ds_smem.store(ds.to(dtype))
        fence_async_shared()
        if SPLIT_DQ:
            gl.thread_barrier()                               # every warp's dS is written
            mbarrier.arrive(ds_ready.index(u), count=1)
        dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_smem, dk, is_async=True)
        if SPLIT_DQ:
            # dQ[:, cols] = dS_0 K_0[:, cols] + dS_1 K_1[:, cols] once both dS are in
            mbarrier.wait(ds_ready.index(u), (it // 2) & 1)
            dq_tok = warpgroup_mma(ds_bufs.index(2 * u), kq0, zero_dq, use_acc=False, is_async=True)
            dq_tok = warpgroup_mma(ds_bufs.index(2 * u + 1), kq1, dq_tok, is_async=True)
        else:
            dq_tok = warpgroup_mma(ds_smem, k_smem, zero_dq, use_acc=False, is_async=True)
        if TMA_DQ == 2 and DEFER and not WRITER:   # the ordered adds' hand-off under the products
            _dq_handoff(SEM, prev, bh, key0 // (2 * KEYS), start_m, Sq, Sk, shift, BLOCK_M, WG, SPLIT_DQ, CAUSAL,
                        ROTATE, gl.num_warps())
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
        mbarrier.arrive(q_empty.index(s), count=1)          # Q_i, dO_i, P, dS no longer read
        if WRITER:
            _stage_dq(dq_stage, dq, it, dq_full, dq_empty, WG)
        elif TMA_DQ:
            prev = _add_dq(dq_desc, dq_stage, dq, b, h, start_m, SEM, bh, Sq, Sk, shift, key0 // (2 * KEYS), prev,
                           WG, SPLIT_DQ, CAUSAL, TMA_DQ == 2, ROTATE, DEFER)
        else:
            rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            ptrs = (DQA + row0 * HEAD_D) + (rows[:, None] * HEAD_D + offs_dq[None, :])
            if start_m + BLOCK_M <= Sq:
                gl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                gl.atomic_add(ptrs, dq, mask=rows[:, None] < Sq - start_m, sem="relaxed")
        return dk, dv, prev

    @gluon.jit
    def _add_dq(dq_desc, dq_stage, dq, b, h, start_m, SEM, bh, Sq, Sk, shift, j, prev, WG: gl.constexpr,
                SPLIT_DQ: gl.constexpr, CAUSAL: gl.constexpr, ORDERED: gl.constexpr, ROTATE: gl.constexpr,
                DEFER: gl.constexpr):
        """dQ[b, h, start_m + rows, this warpgroup's columns (SPLIT_DQ: its half, else all)] +=
        dq (f32 [BLOCK_M, DQ_N]) by TMA
        bulk reduce-adds (FA3's dQ path): dq into the warpgroup's staging tile, then one
        reduce-add per RED-column box (a 128-byte f32 swizzle row). The staging tile is
        boxes WG * NRED + [0, NRED) of dq_stage ([1, 1, BLOCK_M, RED] each) one after another,
        which is the memory order of a 128-byte-swizzled [BLOCK_M, DQ_N] f32 tile (column
        blocks of RED stacked), so the registers go in with one store. The previous step's
        reduce-adds must have read the tile first (store_wait). Rows past Sq fall outside the
        descriptor's (B, Hq, Sq, D) box and are dropped by the TMA unit.

        ORDERED (deterministic, solver 129; 124's scheme with TMA): the key blocks that reach a
        dQ block are a prefix 0..J (J from the causal shift and Sk, as 124's
        `_last_key_block`); they add in descending order, key block j as turn J - j. An int32
        counter per dQ block (zeroed by the preprocess) counts the adds done, each warpgroup
        one: a warpgroup waits (acquire loads) until it reaches 2 (J - j) (+ WG without
        SPLIT_DQ, where both warpgroups add to the same columns, warpgroup 0 first), issues its
        reduce-adds, waits for them to complete (not only to have read shared memory), and
        increments it (release). Key block j runs as CTA n_kv - 1 - j, so a CTA waits only on
        CTAs launched before it. Fixed-order f32 sums from zero: bit-identical run to run.
        ROTATE: the order of the rotated walk instead (`_turn`), where a CTA may wait on one
        launched after it (`rotation` bounds the CTAs of a head by the SMs).
        DEFER: `_dq_handoff` has passed the previous block on and waited for this block's turn
        while the step's last products ran; here only the store and the reduce-adds.
        Returns this step's counter index (prev unchanged without ORDERED)."""
        BLOCK_M: gl.constexpr = dq.type.shape[0]
        DQ_N: gl.constexpr = dq.type.shape[1]
        RED: gl.constexpr = dq_stage.type.shape[4]
        NRED: gl.constexpr = DQ_N // RED
        if SPLIT_DQ:
            col0: gl.constexpr = WG * DQ_N
        else:
            col0: gl.constexpr = 0
        flat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_N], gl.float32)
        if ORDERED:
            cur = bh * gl.cdiv(Sq, BLOCK_M) + start_m // BLOCK_M
        else:
            cur = prev
        tma.store_wait(0)
        dq_stage._reinterpret(gl.float32, [2, BLOCK_M, DQ_N], flat).index(WG).store(dq)
        fence_async_shared()
        if ORDERED and not DEFER:
            lanes: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            one = gl.full([32 * gl.num_warps()], 0, gl.int32, lanes)
            sem = SEM + cur + one
            _wait_turn(sem, one, j, start_m, Sq, Sk, shift, BLOCK_M, WG, SPLIT_DQ, CAUSAL, ROTATE)
        for c in gl.static_range(NRED):
            tma_reduce_add(dq_desc, [b, h, start_m, col0 + c * RED], dq_stage.index(WG * NRED + c))
        if ORDERED and not DEFER:
            _pass_on(sem)
        return cur

    @gluon.jit
    def _wait_turn(sem, zero, j, start_m, Sq, Sk, shift, BLOCK_M: gl.constexpr, WG: gl.constexpr, SPLIT_DQ: gl.constexpr,
                   CAUSAL: gl.constexpr, ROTATE: gl.constexpr):
        """Spin (acquire loads) until the dQ block's counter at sem (one pointer per thread;
        zero: int32 zeros in its layout) reaches this warpgroup's turn: key block j's place (`_turn`), two adds per place (one
        per warpgroup; without SPLIT_DQ warpgroup 0 first)."""
        turn = _turn(j, start_m, Sq, Sk, shift, BLOCK_M, 2 * BLOCK_M, CAUSAL, ROTATE)
        if SPLIT_DQ:
            turn = 2 * turn
        else:
            turn = 2 * turn + WG
        gl.inline_asm_elementwise(_ASM_WAIT, "=r,l,r", [sem, zero + turn], gl.int32, False, 1)

    @gluon.jit
    def _dq_handoff(SEM, prev, bh, j, start_m, Sq, Sk, shift, BLOCK_M: gl.constexpr, WG: gl.constexpr,
                    SPLIT_DQ: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr, WARPS: gl.constexpr):
        """DQ_DEFER's hand-off, placed while the step's last products run: the previous step's
        reduce-adds complete and its dQ block `prev` passed on (-1 at the first step: SEM[-1], a
        spare counter nobody waits on), then the wait for this step's turn at its block."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        one = gl.full([32 * WARPS], 0, gl.int32, lanes)
        _pass_on(SEM + prev + one)
        cur = bh * gl.cdiv(Sq, BLOCK_M) + start_m // BLOCK_M
        _wait_turn(SEM + cur + one, one, j, start_m, Sq, Sk, shift, BLOCK_M, WG, SPLIT_DQ, CAUSAL, ROTATE)

    @gluon.jit
    def _pass_on(sem):
        """This warpgroup's reduce-adds complete (global writes, ordered before the release),
        then its thread 0 increments the counter at sem (a tensor of one pointer per thread)."""
        lanes: gl.constexpr = sem.type.layout
        first = gl.arange(0, sem.type.shape[0], lanes)
        gl.inline_asm_elementwise(_ASM_DONE, "=r,r", [first], gl.int32, False, 1)
        gl.thread_barrier()          # the issuing thread's reduce-adds are complete
        gl.inline_asm_elementwise(_ASM_RELEASE, "=r,l,r", [sem, first], gl.int32, False, 1)

    @gluon.jit
    def _stage_dq(dq_stage, dq, it, dq_full, dq_empty, WG: gl.constexpr):
        """DQ_WRITER, consumer side: once the writer's reduce-adds of the previous step have read
        the staging tile (dq_empty; passes at the first step), this warpgroup's dQ column half
        into its part of the tile (`_add_dq`'s layout), then dq_full (both halves: the writer
        goes)."""
        BLOCK_M: gl.constexpr = dq.type.shape[0]
        DQ_N: gl.constexpr = dq.type.shape[1]
        flat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_N], gl.float32)
        mbarrier.wait(dq_empty, (it & 1) ^ 1)
        dq_stage._reinterpret(gl.float32, [2, BLOCK_M, DQ_N], flat).index(WG).store(dq)
        fence_async_shared()
        gl.thread_barrier()          # every warp's rows are in
        mbarrier.arrive(dq_full, count=1)

    @gluon.jit
    def _dq_writer(dq_desc, dq_stage, SEM, dq_full, dq_empty, b, hk, start_n, Hq, Sq, Sk, GROUP, lo, full, m_end, rot,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, ORDERED: gl.constexpr,
                   ROTATE: gl.constexpr):
        """DQ_WRITER's 1-warp partition (FA3's dQ writer): per step, in the consumers' walk
        (the producer's loops), wait until both halves of dQ_partial are staged (dq_full), with
        ORDERED wait for the key block's turn at the dQ block (`_turn`: one add per key block,
        both halves at once), issue the reduce-adds of the whole [BLOCK_M, HEAD_D] tile, wait
        until they have read the staging tile and free it (dq_empty), then with ORDERED wait
        for them to complete and pass the dQ block on (`_pass_on`). The consumers only wait
        for the staging tile, one step later; a wait for a turn delays them only when it is
        longer than a step."""
        RED: gl.constexpr = dq_stage.type.shape[4]
        NBOX: gl.constexpr = dq_stage.type.shape[0]
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        zero = gl.full([32], 0, gl.int32, lanes)
        shift = _causal_shift(Sq, Sk, CAUSAL)
        j = start_n // BLOCK_N
        nb = gl.cdiv(Sq, BLOCK_M)
        it = 0
        for part in gl.static_range(2):
            if part == 0:
                m0, m1 = lo, full
            else:
                m0, m1 = full, m_end
            first = _walk_start(m0, m1, rot, BLOCK_M, ROTATE)
            for g in range(GROUP):
                h = hk * GROUP + g
                start_m = first
                for _ in range(m0, m1, BLOCK_M):
                    mbarrier.wait(dq_full, it & 1)
                    if ORDERED:
                        sem = SEM + ((b * Hq + h).to(gl.int64) * nb + start_m // BLOCK_M) + zero
                        turn = _turn(j, start_m, Sq, Sk, shift, BLOCK_M, BLOCK_N, CAUSAL, ROTATE)
                        gl.inline_asm_elementwise(_ASM_WAIT, "=r,l,r", [sem, zero + turn], gl.int32, False, 1)
                    for c in gl.static_range(NBOX):
                        tma_reduce_add(dq_desc, [b, h, start_m, c * RED], dq_stage.index(c))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_empty, count=1)
                    if ORDERED:
                        _pass_on(sem)
                    it += 1
                    start_m += BLOCK_M
                    if start_m >= m1:
                        start_m = m0

    @gluon.jit
    def _turn(j, start_m, Sq, Sk, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              ROTATE: gl.constexpr):
        """Key block j's place in the order of the adds to the dQ block at start_m: the key
        blocks 0..J of BLOCK_N keys reaching it (J from the causal shift and Sk) in descending order, J - j;
        with ROTATE (no causal masking, J = n_kv - 1, key block j walking from query block
        j s on, `_rotation`) in the order the walks reach it, block a = min(m // s, J) first:
        a, a - 1, .., 0, J, .., a + 1, i.e. (a - j) mod (J + 1)."""
        hi = Sk
        if CAUSAL != 0:
            hi = gl.minimum(hi, start_m + BLOCK_M + shift)
        last = gl.cdiv(hi, BLOCK_N) - 1                          # J
        if ROTATE:
            _, s = _rotation(j, last + 1, Sq, BLOCK_M, ROTATE)
            a = gl.minimum(start_m // BLOCK_M // s, last)
            return (a - j + last + 1) % (last + 1)
        else:
            return last - j

    @gluon.jit
    def _next_block(start_m, g, first, m0, m1, BLOCK_M: gl.constexpr, ROTATE: gl.constexpr):
        """The consumers' walk over [m0, m1) of each head: the next query block and head. With
        ROTATE a head's walk wraps and the head is done when it is back at `first`."""
        start_m += BLOCK_M
        if ROTATE:
            if start_m >= m1:
                start_m = m0
            if start_m == first:
                g += 1
        elif start_m >= m1:
            start_m = m0
            g += 1
        return start_m, g

    @gluon.jit
    def _consumer(q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_bufs, ds_bufs, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                  SEM, DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot, qk_scale, scale, WG: gl.constexpr,
                  HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, KEYS: gl.constexpr, CAUSAL: gl.constexpr,
                  SPLIT_DQ: gl.constexpr, REMAT: gl.constexpr, TMA_DQ: gl.constexpr, ROTATE: gl.constexpr,
                  DEFER: gl.constexpr, WRITER: gl.constexpr, WARPS: gl.constexpr):
        """Consumer warpgroup WG: keys start_n + WG * KEYS + [0, KEYS). Per ring stage the five
        products (module doc), the stage released once every product reading it has retired,
        then the atomic dQ adds; at the end dK, dV stored. SPLIT_DQ: dQ_partial of all 128 keys,
        this warpgroup's HEAD_D / 2 columns (both warpgroups' dS through double-buffered shared
        memory, ds_ready: both written), else of this warpgroup's 64 keys, all columns."""
        kv_ready = bars[0]
        dtype: gl.constexpr = q_bufs.dtype
        # S / dP tiles [BLOCK_M, KEYS] and the [64, HEAD_D] accumulators (dK, dV: key rows;
        # dQ: query rows, KEYS == BLOCK_M)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, KEYS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, HEAD_D, 16])
        row_a: gl.constexpr = gl.SliceLayout(1, acc_layout)
        col_a: gl.constexpr = gl.SliceLayout(0, acc_layout)
        shift = _causal_shift(Sq, Sk, CAUSAL)
        key0 = start_n + WG * KEYS
        offs_d = gl.arange(0, HEAD_D, layout=col_a)
        if SPLIT_DQ:
            DQ_N: gl.constexpr = HEAD_D // 2
            dq_col0: gl.constexpr = WG * DQ_N
        else:
            DQ_N: gl.constexpr = HEAD_D
            dq_col0: gl.constexpr = 0
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, DQ_N, 16])
        offs_dq = dq_col0 + gl.arange(0, DQ_N, layout=gl.SliceLayout(0, dq_layout))
        dk = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
        zero_s = gl.zeros([BLOCK_M, KEYS], gl.float32, s_layout)
        p_smem = p_bufs.index(WG)
        zero_dq = gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout)

        mbarrier.wait(kv_ready.index(0), 0)
        # query blocks crossing the diagonal (every block of the last key block, whose keys end
        # past Sk) with element masks, then the rest without, each loop over every query head
        # of the group (flat: nothing of a head loop stays live across the stages); two
        # straight loops (a branch on the mask in one loop costs registers)
        # ROTATE: each head's walk over a range starts at block rot of it and wraps (the
        # producer's order); a head is done when the walk is back at its start
        h0 = hk * GROUP
        bh0 = (b * Hq + h0).to(gl.int64)
        n_mask = GROUP * ((full - lo) // BLOCK_M)
        prev = bh0 * 0 - 1      # the first step passes on the spare counter SEM[-1] (`_dq_handoff`)
        g = 0
        first = _walk_start(lo, full, rot, BLOCK_M, ROTATE)
        start_m = first
        for it in range(0, n_mask):
            dk, dv, prev = _step(q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_smem, ds_bufs, bars, LSE, DELTA, DQA, dq_desc,
                                 dq_stage, SEM, bh0 + g, b, h0 + g, start_m, it, key0, offs_dq, Sq, Sk, shift, qk_scale,
                                 dk, dv, zero_s, zero_dq, prev, WG, HEAD_D, BLOCK_M, KEYS, True, CAUSAL, SPLIT_DQ,
                                 REMAT, TMA_DQ, ROTATE, DEFER, WRITER, s_layout, dq_layout)
            start_m, g = _next_block(start_m, g, first, lo, full, BLOCK_M, ROTATE)
        g = 0
        first = _walk_start(full, m_end, rot, BLOCK_M, ROTATE)
        start_m = first
        for it in range(n_mask, n_mask + GROUP * ((m_end - full) // BLOCK_M)):
            dk, dv, prev = _step(q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_smem, ds_bufs, bars, LSE, DELTA, DQA, dq_desc,
                                 dq_stage, SEM, bh0 + g, b, h0 + g, start_m, it, key0, offs_dq, Sq, Sk, shift, qk_scale,
                                 dk, dv, zero_s, zero_dq, prev, WG, HEAD_D, BLOCK_M, KEYS, False, CAUSAL, SPLIT_DQ,
                                 REMAT, TMA_DQ, ROTATE, DEFER, WRITER, s_layout, dq_layout)
            start_m, g = _next_block(start_m, g, first, full, m_end, BLOCK_M, ROTATE)
        if TMA_DQ == 2 and DEFER and not WRITER:   # the last step's dQ block passed on
            lanes: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            _pass_on(SEM + prev + gl.full([32 * WARPS], 0, gl.int32, lanes))

        # epilogue: dK * scale and dV in the input dtype, rows past Sk not stored
        krows = gl.arange(0, KEYS, layout=row_a)
        kmask = krows[:, None] < Sk - key0
        base = ((b * Hkv + hk).to(gl.int64) * Sk + key0) * HEAD_D   # scalar base, int32 offsets
        out = krows[:, None] * HEAD_D + offs_d[None, :]
        gl.store((DK + base) + out, (dk * scale).to(dtype), mask=kmask)
        gl.store((DV + base) + out, dv.to(dtype), mask=kmask)
        if TMA_DQ and not WRITER:
            tma.store_wait(0)     # the last reduce-adds have read the staging tile

    @gluon.jit(do_not_specialize=["Hq", "Hkv", "Sq", "Sk"])
    def _gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, kq_desc, LSE, DELTA, DQA, dq_desc, SEM, DK, DV, Hq, Hkv, Sq, Sk, GROUP,
                          qk_scale, scale, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr, REMAT: gl.constexpr,
                          TMA_DQ: gl.constexpr, ROTATE: gl.constexpr, DQ_DEFER: gl.constexpr,
                          DQ_WRITER: gl.constexpr, num_warps: gl.constexpr):
        """CTA (key block pid 0, b * Hkv + hk pid 1). Descriptors: 4-D [B, H, S, D] views with
        boxes [1, 1, BLOCK_M, D] (Q, dO) and [1, 1, BLOCK_N / 2, D] (K, V), kq_desc K's with
        box [1, 1, BLOCK_N / 2, D / 2] (SPLIT_DQ at D < 128; else k_desc again, unused); lse, delta
        (B, Hq, Sq) f32, the dQ accumulator (B, Hq, Sq, D) f32, dK / dV (B, Hkv, Sk, D), all
        contiguous; with TMA_DQ, dq_desc: the accumulator's descriptor, box [1, 1, BLOCK_M, 32]
        (else DQA again, unused); SEM: the int32 counters of the ordered adds (TMA_DQ 2; else
        unused; SEM[-1] is a spare counter). Two consumer partitions of num_warps (4) warps,
        one producer warp (DQ_WRITER: and the dQ writer warp, `_dq_writer`); with TMA_DQ 2 CTA
        pid 0 serves key block n_kv - 1 - pid 0 (`_add_dq`). ROTATE, DQ_DEFER: tile_config's."""
        KEYS: gl.constexpr = BLOCK_N // 2
        dtype: gl.constexpr = q_desc.dtype
        pid_bh, j, n_kv = _cta_block(TMA_DQ == 2)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        start_n = j * BLOCK_N
        lo, full, m_end = _query_range(start_n, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)
        rot, _ = _rotation(j, n_kv, Sq, BLOCK_M, ROTATE)

        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        KQ_COPY: gl.constexpr = SPLIT_DQ and HEAD_D < 128
        if KQ_COPY:   # K in [KEYS, HEAD_D / 2] boxes for the column halves of dQ (`_step`)
            kq_bufs = gl.allocate_shared_memory(dtype, [4] + kq_desc.block_type.shape, kq_desc.layout)
        else:
            kq_bufs = k_bufs
        ps_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, KEYS], dtype)
        p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, KEYS], ps_layout)
        ds_bufs = gl.allocate_shared_memory(dtype, [4 if SPLIT_DQ else 2, BLOCK_M, KEYS], ps_layout)
        if TMA_DQ:   # per consumer: its [BLOCK_M, DQ_N] dQ tile as DQ_N / RED boxes of the descriptor
            RED: gl.constexpr = dq_desc.block_type.shape[3]
            if SPLIT_DQ:
                NRED: gl.constexpr = HEAD_D // 2 // RED
            else:
                NRED: gl.constexpr = HEAD_D // RED
            dq_stage = gl.allocate_shared_memory(gl.float32, [2 * NRED] + dq_desc.block_type.shape, dq_desc.layout)
        else:
            dq_stage = p_bufs     # (unused)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # DQ_WRITER's
        dq_full, dq_empty = dq_bars.index(0), dq_bars.index(1)
        mbarrier.init(dq_full, count=2)    # both consumers' halves staged
        mbarrier.init(dq_empty, count=1)   # the writer's reduce-adds have read the staging tile
        mbarrier.init(kv_ready.index(0), count=1)
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)  # both consumers' dS written
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)   # released by both consumers
        bars = (kv_ready, q_ready, q_empty, ds_ready, dq_full, dq_empty)

        if DQ_WRITER:   # the reduce-adds in a warp of their own (`_dq_writer`)
            gl.warp_specialize([
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_bufs, ds_bufs, bars, LSE, DELTA, DQA, dq_desc,
                             dq_stage, SEM, DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot,
                             qk_scale, scale, 0, HEAD_D, BLOCK_M, KEYS, CAUSAL, SPLIT_DQ, REMAT, TMA_DQ, ROTATE,
                             DQ_DEFER, DQ_WRITER, num_warps)),
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_bufs, ds_bufs, bars, LSE, DELTA, DQA, dq_desc,
                             dq_stage, SEM, DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot,
                             qk_scale, scale, 1, HEAD_D, BLOCK_M, KEYS, CAUSAL, SPLIT_DQ, REMAT, TMA_DQ, ROTATE,
                             DQ_DEFER, DQ_WRITER, num_warps)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, kq_desc, q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, bars, b,
                             hk, start_n, GROUP, lo, full, m_end, rot, BLOCK_M, KEYS, ROTATE, KQ_COPY)),
                (_dq_writer, (dq_desc, dq_stage, SEM, dq_full, dq_empty, b, hk, start_n, Hq, Sq, Sk, GROUP, lo,
                              full, m_end, rot, BLOCK_M, BLOCK_N, CAUSAL, TMA_DQ == 2, ROTATE)),
            ], [num_warps, 1, 1], [240, 24, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_bufs, ds_bufs, bars, LSE, DELTA, DQA, dq_desc,
                             dq_stage, SEM, DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot,
                             qk_scale, scale, 0, HEAD_D, BLOCK_M, KEYS, CAUSAL, SPLIT_DQ, REMAT, TMA_DQ, ROTATE,
                             DQ_DEFER, DQ_WRITER, num_warps)),
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, p_bufs, ds_bufs, bars, LSE, DELTA, DQA, dq_desc,
                             dq_stage, SEM, DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot,
                             qk_scale, scale, 1, HEAD_D, BLOCK_M, KEYS, CAUSAL, SPLIT_DQ, REMAT, TMA_DQ, ROTATE,
                             DQ_DEFER, DQ_WRITER, num_warps)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, kq_desc, q_bufs, do_bufs, k_bufs, v_bufs, kq_bufs, bars, b,
                             hk, start_n, GROUP, lo, full, m_end, rot, BLOCK_M, KEYS, ROTATE, KQ_COPY)),
            ], [num_warps, 1], [240, 24])

        mbarrier.invalidate(kv_ready.index(0))
        mbarrier.invalidate(dq_full)
        mbarrier.invalidate(dq_empty)
        for i in gl.static_range(2):
            mbarrier.invalidate(ds_ready.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_empty.index(i))


# ---- launcher -------------------------------------------------------------------------

DQ_RED = 32   # f32 columns per dQ reduce-add box: one 128-byte swizzle row


def sem_count(problem) -> int:
    """int32 counters of the ordered dQ adds: one per (b, query head, dQ block of BLOCK_M rows)."""
    return problem.B * problem.Hq * triton.cdiv(problem.Sq, BLOCK_M)
_DQ_LAYOUT = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, DQ_RED], gl.float32) if gl is not None else None


def dq_box_layout(red: int):
    """The shared layout of a [1, 1, BLOCK_M, red] f32 dQ reduce-add box (_DQ_LAYOUT at red 32)."""
    return _DQ_LAYOUT if red == DQ_RED else gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, red], gl.float32)


class GluonBwdPlan:
    """The three launches of one problem: preprocess and cast (solver 123's kernels; one
    Launch per set of O / dO strides) and the Gluon main kernel (grid and constexprs fixed
    here, descriptors built per call). A call returns (dq, dk, dv) in q's dtype. Solver 130
    (gluon_bwd_d256.py) subclasses it with its own kernel (`_kernel`), default config and K/V
    boxes (KV_BOXES: K and V are loaded as BLOCK_N / KV_BOXES-key boxes)."""
    KV_BOXES = 2    # 127: a 64-key box per consumer warpgroup

    def __init__(self, problem, cfg: dict | None = None):
        self.p = p = problem
        cfg = dict(cfg or self._default_config(p.D))
        if "ROTATE" in cfg:
            cfg["ROTATE"] = rotation(p, cfg, sm_count(torch.cuda.current_device() if torch.cuda.is_available() else None))
        self.cfg = cfg
        self.main = Launch(self._kernel(), (triton.cdiv(p.Sk, cfg["BLOCK_N"]), p.B * p.Hkv), (),
                           HEAD_D=p.D, CAUSAL=_CAUSAL_CODE[p.causal], **cfg)
        self.pre: dict[tuple, Launch] = {}
        self.casts: dict[float, Launch] = {}

    @staticmethod
    def _kernel():
        return _gluon_bwd_kernel

    @staticmethod
    def _default_config(d: int) -> dict:
        return tile_config(d)

    def _cast(self, scale: float) -> Launch:
        """The cast of the dQ accumulator, times scale (the main kernel adds dS K unscaled)."""
        launch = self.casts.get(scale)
        if launch is None:
            p, bd = self.p, block_d(self.p.D)
            cm = max(16, min(64, 8192 // bd))
            if len(self.casts) >= 64:
                self.casts.clear()
            launch = self.casts[scale] = Launch(_cast_kernel, (triton.cdiv(p.Sq, cm), p.B * p.Hq), (p.Sq, p.D, scale),
                                                BLOCK_M=cm, BLOCK_D=bd, SCALE_PTR=False, INVERT=False)
        return launch

    def _pre(self, o: torch.Tensor, do: torch.Tensor) -> Launch:
        """delta, the dQ accumulator zeroed and (ordered) the dQ blocks' counters zeroed."""
        key = (o.stride(), do.stride())
        launch = self.pre.get(key)
        if launch is None:
            p, bd = self.p, block_d(self.p.D)
            if len(self.pre) >= 64:
                self.pre.clear()
            launch = self.pre[key] = Launch(
                _pre_kernel, (triton.cdiv(p.Sq, BLOCK_M), p.B * p.Hq),
                (*o.stride(), *do.stride(), p.Hq, p.Sq, p.D, p.Dv),
                BLOCK_M=BLOCK_M, BLOCK_D=bd, BLOCK_DV=bd, ORDERED=self.cfg["TMA_DQ"] == 2)
        return launch

    def __call__(self, args, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """(dq, dk, dv). `out` (contiguous (B, Hq, Sq, D), (B, Hkv, Sk, D) x 2) lets tests pass
        poisoned buffers."""
        p = self.p
        (q, sq), (k, sk), (v, sv), (do, sd) = (_tma_view(args.q), _tma_view(args.k), _tma_view(args.v),
                                               _tma_view(args.do))
        if out is not None:
            dq, dk, dv = out
        else:
            dq = alloc.empty((p.B, p.Hq, p.Sq, p.D), q.dtype, q.device)
            dk = alloc.empty((p.B, p.Hkv, p.Sk, p.D), q.dtype, q.device)
            dv = alloc.empty((p.B, p.Hkv, p.Sk, p.Dv), q.dtype, q.device)
        lse = args.lse
        if lse.dtype != torch.float32 or not lse.is_contiguous():
            lse = lse.float().contiguous()
        n_acc, n_rows = p.B * p.Hq * p.Sq * p.D, p.B * p.Hq * p.Sq
        ordered = self.cfg["TMA_DQ"] == 2
        ws = alloc.empty((n_acc + n_rows + (1 + sem_count(p) if ordered else 0),), torch.float32, q.device)
        dqa, delta = ws[:n_acc], ws[n_acc:n_acc + n_rows]
        sem = ws[n_acc + n_rows + 1:].view(torch.int32) if ordered else dqa   # SEM[-1]: the spare counter
        scale = float(args.effective_scale(p.invert_scale))
        self._pre(args.o, args.do)(args.o, args.do, lse, delta, dqa, sem)
        rows, keys = self.cfg["BLOCK_M"], self.cfg["BLOCK_N"] // self.KV_BOXES
        red = self.cfg.get("DQ_RED", DQ_RED)
        dq_desc = host_descriptor(dqa, [p.B, p.Hq, p.Sq, p.D], [p.Hq * p.Sq * p.D, p.Sq * p.D, p.D, 1],
                                  [1, 1, rows, red], dq_box_layout(red)) if self.cfg["TMA_DQ"] else dqa
        k_desc = _descriptor(k, sk, keys)
        if self.cfg.get("SPLIT_DQ") and p.D < 128:    # K's column halves for dQ (`_step`)
            kq_desc = host_descriptor(k, list(k.shape), sk, [1, 1, keys, p.D // 2],
                                      _box_layout(keys, p.D // 2, k.dtype))
        else:
            kq_desc = k_desc
        self.main(_descriptor(q, sq, rows), k_desc, _descriptor(v, sv, keys),
                  _descriptor(do, sd, rows), kq_desc, lse, delta, dqa, dq_desc, sem, dk, dv,
                  p.Hq, p.Hkv, p.Sq, p.Sk, p.group, scale * 1.4426950408889634, scale)
        self._cast(scale)(dqa, dq, dqa)
        return dq, dk, dv


# ---- solver -----------------------------------------------------------------------------

@register
class GluonFlashBackward(FlashBase):
    """Warp-specialised Hopper backward in Gluon: TMA producer warp, two wgmma consumer
    warpgroups of 64 keys each, dQ by TMA reduce-adds in any order."""
    id = 127
    name = "gluon_flash_bwd"
    directions = frozenset({"bwd"})
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    deterministic = False   # dQ: f32 reduce-adds in whatever order the key blocks arrive
    long_compile = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + scope_reasons(problem, HEAD_DIMS, "solver 123",
                                       "; d256's dK/dV accumulators do not fit the registers")

    def workspace_size(self, problem) -> int:
        """The f32 dQ accumulator and delta (host TMA descriptors: no descriptor scratch)."""
        return 4 * problem.B * problem.Hq * problem.Sq * (problem.D + 1)

    def estimate(self, problem) -> float | None:
        return model_ms(problem)

    def prepare(self, problem):
        return GluonBwdPlan(problem)


class OrderedDq:
    """What the ordered (deterministic) variants of the Gluon backward solvers add to theirs
    (mixed in before it: 129 over 127, 132 over 130): the TMA reduce-add the ordered dQ adds
    need, and the int32 counters of the dQ blocks (and a spare) in the workspace."""
    deterministic = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if tma_reduce_add is None and not (reasons and reasons[0].startswith("serves")):
            reasons.append("not applicable: this Triton's Gluon cannot build the TMA reduce-add that the ordered "
                           "dQ adds use")
        return reasons

    def workspace_size(self, problem) -> int:
        return super().workspace_size(problem) + 4 * (sem_count(problem) + 1)


@register
class GluonFlashBackwardOrdered(OrderedDq, GluonFlashBackward):
    """Solver 127 with its dQ reduce-adds in a fixed order per dQ block (semaphores, FA3's
    deterministic mode; `_add_dq`), issued by the dQ writer warp (`_dq_writer`): bit-identical
    run to run, chosen when determinism is on."""
    id = 129
    name = "gluon_flash_bwd_ordered"
    revised = "2026-12-02T10:39:17Z"   # the dQ writer warp became the default (0.65x -> 0.87x cuDNN)
    priced_as = 127

    def estimate(self, problem) -> float | None:
        return model_ms(problem) * ORDERED_COST

    def prepare(self, problem):
        return GluonBwdPlan(problem, tile_config(problem.D, ordered=True))
