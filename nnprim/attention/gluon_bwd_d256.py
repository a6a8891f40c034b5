"""Warp-specialised flash attention backward for head dim 256 on Hopper in Gluon (solver 130
`gluon_flash_bwd_d256`, family `flash`).

Solver 127 (gluon_bwd.py, read its docstring) with FA3's hdim-256 tiling: the same launches
(solver 123's preprocess and cast kernels around a Gluon main kernel), the same mathematics

    S = Q K^T,  P = exp2(S * scale * log2e - lse * log2e),  dP = dO V^T,
    dV += P^T dO,  dS = P * (dP - delta),  dK += dS^T Q,  dQ_partial = dS K

and the same 1-warp TMA producer (127's `_producer`: K and V once, then the (Q_i, dO_i) ring
in the consumers' order) and flat loops (the query blocks [lo, full) of every query head of
the group with element masks, then [full, m_end) without). 127's split (each warpgroup 64
keys, dK and dV of all head-dim columns in its registers) needs 2 x 64 x 256 f32 accumulators
per warpgroup at d256: 256 registers a thread. Here the two consumer warpgroups split the HEAD
DIMENSION of the accumulators instead:

  - a CTA per (key block of BLOCK_N = 64 keys, b, kv head); BLOCK_M = 64 query rows per stage;
  - S and dP as [64 rows, 64 keys] tiles, split by keys: warpgroup w computes S[:, 32w:32w+32]
    = Q K_w^T and dP[:, 32w:32w+32] = dO V_w^T (wgmma N = 32, K = 256; FA3's SdP split,
    balanced, P and dS formed in f32 registers from the lse / delta of the 64 rows), and
    writes its column half of P and of dS (bf16/f16) into the CTA's single P and dS buffers
    in shared memory;
  - barriers among the two consumers (mbarriers of count 2: p_ready, ds_ready: both halves
    written; pds_free: both warpgroups' products of the stage that read P and dS retired,
    before the next stage overwrites them: the buffers are single, 2 x 8 KB);
  - warpgroup w owns head-dim columns [128w, 128w + 128) of dK and dV (64 keys x 128 f32
    each: 64 + 64 registers a thread): dV_w += P^T dO[:, w half], dK_w += dS^T Q[:, w half]
    (A from shared memory read transposed, B a column half of the ring tile: two whole
    128-byte swizzle column blocks), and dQ_partial[:, w half] = dS K[:, w half], computed
    and added as DQ_RED-column boxes (a wgmma of N = DQ_RED each, issued as dV, box 0, dK,
    box 1, box 2, ... so that the add of box 0 overlaps dK and that of box n the product of
    box n + 1):
      TMA_DQ (the default; 127's and FA3's way at d <= 128): the box into one of DQ_SLOTS f32 staging
      tiles of the warpgroup and a TMA bulk reduce-add of it (`tma_reduce_add`; the slot is
      rewritten once the reduce-add DQ_SLOTS boxes back has read it: `tma.store_wait`), rows
      past Sq outside the descriptor;
      else per-thread f32 atomics in the accumulator's layout, masked at Sq.
Shared memory (bf16/f16; 227 KB per CTA): K and V 2 x 32 KB, the (Q, dO) ring STAGES x 64 KB
(2 stages: 128 KB), P and dS 2 x 8 KB: 208 KB, plus the dQ staging 2 x DQ_SLOTS x 64 x DQ_RED
x 4 bytes (default 2 x 1 x 8 KB = 16 KB: 224 KB). A full [64, 256] f32 staging tile (64 KB)
does not fit next to a 2-stage ring, which is why dQ is streamed through small boxes.
Registers: 240 per consumer thread by setmaxnreg (127's 168 x 384 launch bound); dK and dV
take 128, S and dP 2 x 16, the dQ boxes DQ_RED / 2 each (two in flight). Offline (sm_90,
benchmarks/diag/gluon_bwd_regs.py --dims 256): no spills for `default`, `atomic`, `red16`
in every causal mode; 24 bytes a thread with 64- or 128-column boxes (`aligned`).
Two views start inside a 128-byte swizzle row: each warpgroup's 32-key half of P / dS (64
bytes) and, with DQ_RED < 64, the dQ boxes' column slices of K (wgmma B operands); the
`aligned` config has neither (64-byte-swizzled P / dS, 64-column boxes) should one of them
misbehave on the GPU.

The `ordered` config (TMA_DQ 2; solver 132 `gluon_flash_bwd_d256_ordered`) is deterministic,
solver 129's scheme at d256: the consumers stage each dQ box in their slot and go on (box_full /
box_empty barriers per warpgroup), a fourth partition of one warp (`_box_writer`) waits for the
key block's turn at the dQ block (127's `_turn` with 64-key blocks, the CTAs launched in
descending key-block order), reduce-adds both warpgroups' boxes in a fixed order and passes the
block on once they are complete; 127's rotated walk where `gluon_bwd.rotation` allows it (no
causal mask, n_kv <= query blocks and <= SMs); dK's product after the step's last dQ box
(DK_AFTER), so the writer gets that box sooner. Offline (sm_90): no spills, 4160-4280 SASS
instructions (3792-3920 for the default). On the H200 (2026-12-02, nineteenth session,
results/gluon_bwd_d256_box_2026-12-02_s19.json): 164-317 TFLOP/s on the six d256 train problems,
0.744x cuDNN geomean (0.636-0.864x); solver 111, the deterministic choice before, 0.49x. What the
causal problems lose (the `writer` config, without turns, in the same run): the waits for turns
1.26x (s1024) / 1.18x (s4096) / 1.03x (s16384), the writer's hand-off another 1.03-1.16x
against the default: with one staging slot a warpgroup cannot stage a step's second box before
the step's turn, which follows the completion of key block j + 1's adds one step earlier.

Covers bf16/f16, D == Dv == 256, GQA/MQA, causal top-left and bottom-right, any Sq/Sk
(tails), float scale (inverted or not, any sign), softmax_inf_as_zero (a fully masked row's
backward is 0 either way); other head dims are 127's / solver 123's, masks, dropout, kv_lens
and tensor scales solver 123's (gluon_fwd.scope_reasons). Needs Hopper and Gluon as 127.
Not deterministic (dQ adds in arrival order) but for the `ordered` config. Non-persistent grid.

Measured on the H200 (2026-12-01, tenth session; benchmarks/diag/d256_device.sh): 0 spills in
every causal mode (benchmarks/diag/gluon_bwd_regs.py --dims 256), tests/gpu/test_gluon_bwd_d256_gpu.py
32 passed; on the suite's six d256 train problems 270-347 TFLOP/s, 0.80-0.90x cuDNN (0.86x geomean;
solver 111, which served d256 before, 0.45-0.53x). dQ variants in the same run: the default (TMA
reduce-adds of 32-column boxes) 0.86x, `red16` 0.80x, `aligned` 0.73x, `atomic` 0.71x.
"""
from __future__ import annotations

from ..gluon_support import (
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_reduce_add,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..search.solver import register
from .gluon_bwd import (
    _ASM_WAIT,
    GluonBwdPlan,
    GluonFlashBackward,
    OrderedDq,
    _causal_shift,
    _cta_block,
    _next_block,
    _pass_on,
    _probs,
    _producer,
    _query_range,
    _rotation,
    _row_stats,
    _turn,
    _walk_start,
    model_ms,
)
from .gluon_fwd import scope_reasons

HEAD_DIMS = (256,)
SMEM_BYTES = 227 * 1024   # an H100/H200 CTA's shared memory
BLOCK_M = 64              # query rows per ring stage
BLOCK_N = 64              # keys per CTA; S / dP: 32 per consumer warpgroup
# Fraction of the bf16 peak at d256, measured on the H200 (2026-12-01, tenth session,
# results/gluon_bwd_d256_2026-12-01_s10.json): 270-347 TFLOP/s on the suite's six d256 problems
# (cuDNN 300-413 in the same run: 0.80-0.90x)
EFF = 0.42
HOST_FLOOR_MS = 0.06      # as 127: three launches and four descriptors per call
# The ordered config's time over the default's (2026-12-02, nineteenth session, dK after the
# last dQ box: 1.04x on train_d256_s4096, 1.14-1.34x with the causal mask)
ORDERED_COST = {False: 1.06, True: 1.25}


def tile_config(stages: int = 2, tma_dq: bool | None = None, red: int | None = None, slots: int = 1,
                ps_swizzle: int = 128, ordered: bool = False, turns: bool = True, dk_after: int | None = None) -> dict:
    """Launch constants: STAGES of the (Q, dO) ring, TMA_DQ (1: dQ boxes by TMA reduce-adds
    from DQ_SLOTS staging tiles per warpgroup, the default where this Triton has the reduce-add;
    0: f32 atomics), DQ_RED (columns of a dQ box, a wgmma of N = DQ_RED: 32, a 128-byte f32
    swizzle row; 64 or 128 spill 24 bytes a thread where 32 spills none:
    benchmarks/diag/gluon_bwd_regs.py), num_warps of each consumer
    warpgroup and maxnreg (as 127: setmaxnreg gives the consumers 240), PS_SWIZZLE (the P / dS
    tiles' swizzle in bytes: 128, each warpgroup's 32-key half a half swizzle row; 64, whole
    column blocks), ordered (TMA_DQ 2, deterministic: the boxes handed to a dQ writer warp,
    `_box_writer`, which adds each dQ block's boxes in a fixed key-block order, 127's turns;
    one staging slot per warpgroup; ROTATE: 127's rotated walk where `gluon_bwd.rotation`
    allows it; turns=False: the writer adds the boxes as they come, not deterministic, the
    writer's cost without the waits for turns), DK_AFTER (dK's wgmma issued after that dQ box's:
    0 overlaps box 0's add with dK; later hands the writer the step's last box sooner: the
    default with `ordered`, the last box, 1-4 % faster than 0 on the H200, 2026-12-02)."""
    if ordered:
        if tma_dq is False or slots != 1:
            raise ValueError("tile_config: ordered=True needs the TMA reduce-adds and one staging slot")
        tma_dq = True
    if tma_dq is None:
        tma_dq = tma_reduce_add is not None
    red = red or 32
    mode = 2 if ordered else int(bool(tma_dq))
    if dk_after is None:
        dk_after = 128 // red - 1 if ordered else 0
    if not 0 <= dk_after < 128 // red:
        raise ValueError(f"tile_config: dk_after={dk_after} is not a dQ box (0..{128 // red - 1})")
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, TMA_DQ=mode, DQ_RED=red,
                DQ_SLOTS=slots if tma_dq else 1, PS_SWIZZLE=ps_swizzle, ROTATE=ordered and turns,
                DK_AFTER=dk_after, TURNS=ordered and turns, num_warps=4, maxnreg=168)


# Named tile configs (benchmarks/gluon_bwd.py --configs256 <name>, timed as g130_<name>;
# benchmarks/diag/gluon_bwd_regs.py --dims 256 --configs <name>)
CONFIGS = {
    "default": lambda: tile_config(),
    "atomic": lambda: tile_config(tma_dq=False),                  # f32 atomics, 32-column boxes
    "red16": lambda: tile_config(tma_dq=True, red=16, slots=2),   # 64-byte boxes, two slots each
    # no shared-memory view that starts inside a 128-byte swizzle row (dQ boxes of whole column
    # blocks of K, P / dS with a 64-byte swizzle): the fallback should a sliced view misbehave
    "aligned": lambda: tile_config(tma_dq=False, red=64, ps_swizzle=64),
    # deterministic: the boxes added in a fixed key-block order by a writer warp (`_box_writer`)
    "ordered": lambda: tile_config(ordered=True),
    # 132 before 2026-12-02's nineteenth session: dK issued after the first dQ box
    "ordered_dk0": lambda: tile_config(ordered=True, dk_after=0),
    # the writer warp without turns (not deterministic): what the waits for turns cost
    "writer": lambda: tile_config(ordered=True, turns=False),
}


def smem_bytes(cfg: dict, d: int = 256) -> int:
    """Shared memory of a 16-bit launch (barriers aside): K and V, the (Q, dO) ring, P and dS,
    the dQ staging tiles."""
    stage = 2 * cfg["DQ_SLOTS"] * cfg["BLOCK_M"] * cfg["DQ_RED"] * 4 if cfg["TMA_DQ"] else 0
    return 2 * (2 * cfg["BLOCK_N"] * d + 2 * cfg["STAGES"] * cfg["BLOCK_M"] * d + 2 * cfg["BLOCK_M"] * cfg["BLOCK_N"]) \
        + stage


# ---- Gluon kernel ---------------------------------------------------------------------

if gluon is not None:
    @gluon.jit
    def _add_box(dq_desc, dq_stage, DQA, dq, b, h, row0, start_m, col, Sq, kb, box_bars, n: gl.constexpr,
                 WG: gl.constexpr, HEAD_D: gl.constexpr, TMA_DQ: gl.constexpr, dq_layout: gl.constexpr):
        """dQ[b, h, start_m + rows, col + [0, RED)] += dq (f32 [BLOCK_M, RED]), the warpgroup's
        n-th box of the stage. TMA_DQ: into staging slot n % SLOTS of the warpgroup (once the
        reduce-add SLOTS boxes back has read it; every box count per stage is a multiple of
        SLOTS, so slots follow on across stages), then a TMA reduce-add (127's `_add_dq`, one
        box); TMA_DQ 2: into the warpgroup's slot once the writer has read the previous box from
        it (box_bars[1]; kb: this box's number in the warpgroup's sequence), then box_bars[0]:
        the writer (`_box_writer`) adds it; else f32 atomics, masked at Sq on the last query block."""
        BLOCK_M: gl.constexpr = dq.type.shape[0]
        RED: gl.constexpr = dq.type.shape[1]
        if TMA_DQ == 2:
            flat2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RED], gl.float32)
            box_full, box_empty = box_bars
            mbarrier.wait(box_empty.index(WG), (kb & 1) ^ 1)
            dq_stage.index(WG)._reinterpret(gl.float32, [BLOCK_M, RED], flat2).store(dq)
            fence_async_shared()
            gl.thread_barrier()          # every warp's rows are in
            mbarrier.arrive(box_full.index(WG), count=1)
        elif TMA_DQ:
            SLOTS: gl.constexpr = dq_stage.type.shape[0] // 2
            flat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RED], gl.float32)
            slot = dq_stage.index(WG * SLOTS + n % SLOTS)
            tma.store_wait(SLOTS - 1)
            slot._reinterpret(gl.float32, [BLOCK_M, RED], flat).store(dq)
            fence_async_shared()
            tma_reduce_add(dq_desc, [b, h, start_m, col], slot)
        else:
            rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            cols = col + gl.arange(0, RED, layout=gl.SliceLayout(0, dq_layout))
            ptrs = (DQA + row0 * HEAD_D) + (rows[:, None] * HEAD_D + cols[None, :])
            if start_m + BLOCK_M <= Sq:
                gl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                gl.atomic_add(ptrs, dq, mask=rows[:, None] < Sq - start_m, sem="relaxed")

    @gluon.jit
    def _step(q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage, b, h, bh,
              start_m, it, key0, Sq, Sk, shift, qk_scale, dk, dv, zero_s, zero_dq, WG: gl.constexpr,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr,
              CAUSAL: gl.constexpr, TMA_DQ: gl.constexpr, DK_AFTER: gl.constexpr, s_layout: gl.constexpr,
              dq_layout: gl.constexpr):
        """One ring stage (query rows start_m.. of head bh, the it-th stage of this CTA) for
        consumer WG: S and dP of its 32 keys (key0 = the first), P and dS of them into the
        shared buffers, then (both halves in) dV and dK of its 128 columns and the dQ boxes of
        its columns; (dk, dv). K / V views indexed by it >> 30 (0, not loop-invariant to the
        compiler: 127's REMAT, the wgmma descriptors rebuilt per stage, not hoisted and
        spilled)."""
        kv_ready, q_ready, q_empty, p_ready, ds_ready, pds_free, box_full, box_empty = bars
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        dtype: gl.constexpr = q_bufs.dtype
        KEYS: gl.constexpr = BLOCK_N // 2
        COLS: gl.constexpr = HEAD_D // 2
        RED: gl.constexpr = zero_dq.type.shape[1]
        NRED: gl.constexpr = COLS // RED
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        s = it % STAGES
        opq = it >> 30
        k_smem = k_bufs.index(opq)._reinterpret(dtype, [BLOCK_N, HEAD_D], kv2_layout)
        v_smem = v_bufs.index(opq)._reinterpret(dtype, [BLOCK_N, HEAD_D], kv2_layout)
        mbarrier.wait(q_ready.index(s), (it // STAGES) & 1)
        q_smem = q_bufs.index(s)._reinterpret(dtype, [BLOCK_M, HEAD_D], q2_layout)
        do_smem = do_bufs.index(s)._reinterpret(dtype, [BLOCK_M, HEAD_D], q2_layout)
        s_tok = warpgroup_mma(q_smem, k_smem.slice(WG * KEYS, KEYS, dim=0).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        dp_tok = warpgroup_mma(do_smem, v_smem.slice(WG * KEYS, KEYS, dim=0).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        rws = gl.arange(0, BLOCK_M, layout=row_s)
        row0 = bh * Sq + start_m   # scalar base, int32 offsets: fewer registers per element
        lse2, delta = _row_stats(LSE, DELTA, row0, rws, rws < Sq - start_m)
        st = warpgroup_mma_wait(1, deps=(s_tok,))           # S done; dP may run on
        p = _probs(st, lse2, rws, start_m, key0, opq, Sk, shift, qk_scale, KEYS, s_layout, MASKED, CAUSAL)
        # both warpgroups' products of the previous stage that read P and dS have retired
        mbarrier.wait(pds_free.index(0), (it & 1) ^ 1)
        p_smem.slice(WG * KEYS, KEYS, dim=1).store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()                                  # every warp's part is written
        mbarrier.arrive(p_ready.index(0), count=1)
        dpt = warpgroup_mma_wait(0, deps=(dp_tok,))
        ds = p * (dpt - delta[:, None])
        ds_smem.slice(WG * KEYS, KEYS, dim=1).store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(0), count=1)
        mbarrier.wait(p_ready.index(0), it & 1)              # both halves of P
        dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do_smem.slice(WG * COLS, COLS, dim=1), dv, is_async=True)
        mbarrier.wait(ds_ready.index(0), it & 1)             # both halves of dS
        # dQ boxes in issue order dV, box 0, .., box DK_AFTER, dK, box DK_AFTER + 1, ..: each box
        # is added while the next product runs (DK_AFTER 0: box 0 while dK runs); a later dK hands
        # the writer the step's last box sooner (the ordered config's turn waits on it)
        kq = k_smem.slice(WG * COLS, COLS, dim=1)
        tok = warpgroup_mma(ds_smem, kq.slice(0, RED, dim=1), zero_dq, use_acc=False, is_async=True)
        if DK_AFTER == 0:
            dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_smem.slice(WG * COLS, COLS, dim=1), dk, is_async=True)
        if NRED > 1:
            nxt = warpgroup_mma(ds_smem, kq.slice(RED, RED, dim=1), zero_dq, use_acc=False, is_async=True)
            if DK_AFTER == 1:
                dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_smem.slice(WG * COLS, COLS, dim=1), dk,
                                       is_async=True)
        # products issued after box n when it is waited for: box n + 1, and dK once issued after box n
        dv, dq = warpgroup_mma_wait((1 if NRED > 1 else 0) + (1 if DK_AFTER <= 1 else 0), deps=(dv_tok, tok))
        _add_box(dq_desc, dq_stage, DQA, dq, b, h, row0, start_m, WG * COLS, Sq, it * NRED, (box_full, box_empty), 0,
                 WG, HEAD_D, TMA_DQ, dq_layout)
        if DK_AFTER == 0:
            dk = warpgroup_mma_wait(1 if NRED > 1 else 0, deps=(dk_tok,))
            mbarrier.arrive(q_empty.index(s), count=1)       # Q_i, dO_i no longer read
        for n in gl.static_range(1, NRED):
            tok = nxt
            if n + 1 < NRED:
                nxt = warpgroup_mma(ds_smem, kq.slice((n + 1) * RED, RED, dim=1), zero_dq, use_acc=False,
                                    is_async=True)
                if DK_AFTER == n + 1:
                    dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_smem.slice(WG * COLS, COLS, dim=1), dk,
                                           is_async=True)
            dq = warpgroup_mma_wait((1 if n + 1 < NRED else 0) + (1 if n <= DK_AFTER and DK_AFTER <= n + 1 else 0),
                                    deps=(tok,))
            if n == NRED - 1 and DK_AFTER < n:
                mbarrier.arrive(pds_free.index(0), count=1)  # this warpgroup's reads of P, dS done
            _add_box(dq_desc, dq_stage, DQA, dq, b, h, row0, start_m, WG * COLS + n * RED, Sq, it * NRED + n,
                     (box_full, box_empty), n, WG, HEAD_D, TMA_DQ, dq_layout)
            if DK_AFTER == n:
                dk = warpgroup_mma_wait(1 if n + 1 < NRED else 0, deps=(dk_tok,))
                mbarrier.arrive(q_empty.index(s), count=1)
        if DK_AFTER == NRED - 1:
            mbarrier.arrive(pds_free.index(0), count=1)
        return dk, dv

    @gluon.jit
    def _box_writer(dq_desc, dq_stage, SEM, box_full, box_empty, b, hk, start_n, Hq, Sq, Sk, GROUP, lo, full, m_end,
                    rot, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr,
                    ROTATE: gl.constexpr, TURNS: gl.constexpr):
        """Ordered dQ (TMA_DQ 2), the writer warp: per step, in the consumers' walk (their flat
        loops over the heads and query blocks), wait for the key block's turn at the dQ block (127's `_turn`, one
        add per key block), then for each box n of the step and each warpgroup w: wait until
        the box is staged (box_full[w]), reduce-add it to columns 128 w + n RED; once both
        boxes n have been read from shared memory, free the slots (box_empty); after the
        step's last box, wait for the adds to complete and pass the dQ block on (`_pass_on`).
        Fixed-order f32 sums from zero: bit-identical run to run."""
        RED: gl.constexpr = dq_stage.type.shape[4]
        COLS: gl.constexpr = HEAD_D // 2
        NRED: gl.constexpr = COLS // RED
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        zero = gl.full([32], 0, gl.int32, lanes)
        shift = _causal_shift(Sq, Sk, CAUSAL)
        j = start_n // BLOCK_N
        nb = gl.cdiv(Sq, BLOCK_M)
        it = 0
        for part in gl.static_range(2):     # the consumers' two flat walks (`_next_block`)
            if part == 0:
                m0, m1 = lo, full
            else:
                m0, m1 = full, m_end
            first = _walk_start(m0, m1, rot, BLOCK_M, ROTATE)
            start_m = first
            g = 0
            for _ in range(GROUP * ((m1 - m0) // BLOCK_M)):
                h = hk * GROUP + g
                sem = SEM + ((b * Hq + h).to(gl.int64) * nb + start_m // BLOCK_M) + zero
                if TURNS:
                    turn = _turn(j, start_m, Sq, Sk, shift, BLOCK_M, BLOCK_N, CAUSAL, ROTATE)
                    gl.inline_asm_elementwise(_ASM_WAIT, "=r,l,r", [sem, zero + turn], gl.int32, False, 1)
                for n in gl.static_range(NRED):
                    kb = it * NRED + n
                    for w in gl.static_range(2):
                        mbarrier.wait(box_full.index(w), kb & 1)
                        tma_reduce_add(dq_desc, [b, h, start_m, w * COLS + n * RED], dq_stage.index(w))
                    tma.store_wait(0)
                    mbarrier.arrive(box_empty.index(0), count=1)
                    mbarrier.arrive(box_empty.index(1), count=1)
                if TURNS:
                    _pass_on(sem)
                it += 1
                start_m, g = _next_block(start_m, g, first, m0, m1, BLOCK_M, ROTATE)

    @gluon.jit
    def _consumer(q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage, DK, DV,
                  b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot, qk_scale, scale, WG: gl.constexpr,
                  HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  TMA_DQ: gl.constexpr, RED: gl.constexpr, ROTATE: gl.constexpr, DK_AFTER: gl.constexpr,
                  WARPS: gl.constexpr):
        """Consumer warpgroup WG: S / dP of keys start_n + 32 WG + [0, 32), dK / dV / dQ of
        head-dim columns 128 WG + [0, 128); 127's two flat loops (`_step` per stage; ROTATE:
        127's rotated walk, `_walk_start` / `_next_block`), then dK, dV of its columns stored."""
        kv_ready = bars[0]
        dtype: gl.constexpr = q_bufs.dtype
        KEYS: gl.constexpr = BLOCK_N // 2
        COLS: gl.constexpr = HEAD_D // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, KEYS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, COLS, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, RED, 16])
        row_a: gl.constexpr = gl.SliceLayout(1, acc_layout)
        col_a: gl.constexpr = gl.SliceLayout(0, acc_layout)
        shift = _causal_shift(Sq, Sk, CAUSAL)
        key0 = start_n + WG * KEYS
        dk = gl.zeros([BLOCK_N, COLS], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, COLS], gl.float32, acc_layout)
        zero_s = gl.zeros([BLOCK_M, KEYS], gl.float32, s_layout)
        zero_dq = gl.zeros([BLOCK_M, RED], gl.float32, dq_layout)

        mbarrier.wait(kv_ready.index(0), 0)
        h0 = hk * GROUP
        bh0 = (b * Hq + h0).to(gl.int64)
        n_mask = GROUP * ((full - lo) // BLOCK_M)
        g = 0
        first = _walk_start(lo, full, rot, BLOCK_M, ROTATE)
        start_m = first
        for it in range(0, n_mask):
            dk, dv = _step(q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                           b, h0 + g, bh0 + g, start_m, it, key0, Sq, Sk, shift, qk_scale, dk, dv, zero_s, zero_dq,
                           WG, HEAD_D, BLOCK_M, BLOCK_N, True, CAUSAL, TMA_DQ, DK_AFTER, s_layout, dq_layout)
            start_m, g = _next_block(start_m, g, first, lo, full, BLOCK_M, ROTATE)
        g = 0
        first = _walk_start(full, m_end, rot, BLOCK_M, ROTATE)
        start_m = first
        for it in range(n_mask, n_mask + GROUP * ((m_end - full) // BLOCK_M)):
            dk, dv = _step(q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                           b, h0 + g, bh0 + g, start_m, it, key0, Sq, Sk, shift, qk_scale, dk, dv, zero_s, zero_dq,
                           WG, HEAD_D, BLOCK_M, BLOCK_N, False, CAUSAL, TMA_DQ, DK_AFTER, s_layout, dq_layout)
            start_m, g = _next_block(start_m, g, first, full, m_end, BLOCK_M, ROTATE)

        # epilogue: dK * scale and dV in the input dtype, this warpgroup's columns, rows past Sk not stored
        krows = gl.arange(0, BLOCK_N, layout=row_a)
        kmask = krows[:, None] < Sk - start_n
        base = ((b * Hkv + hk).to(gl.int64) * Sk + start_n) * HEAD_D   # scalar base, int32 offsets
        out = krows[:, None] * HEAD_D + (WG * COLS + gl.arange(0, COLS, layout=col_a))[None, :]
        gl.store((DK + base) + out, (dk * scale).to(dtype), mask=kmask)
        gl.store((DV + base) + out, dv.to(dtype), mask=kmask)
        if TMA_DQ == 1:
            tma.store_wait(0)     # the last reduce-adds have read the staging tiles

    @gluon.jit(do_not_specialize=["Hq", "Hkv", "Sq", "Sk"])
    def _gluon_bwd_d256_kernel(q_desc, k_desc, v_desc, do_desc, kq_desc, LSE, DELTA, DQA, dq_desc, SEM, DK, DV, Hq, Hkv, Sq, Sk,
                               GROUP, qk_scale, scale, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               TMA_DQ: gl.constexpr, DQ_RED: gl.constexpr, DQ_SLOTS: gl.constexpr,
                               PS_SWIZZLE: gl.constexpr, ROTATE: gl.constexpr, DK_AFTER: gl.constexpr,
                               TURNS: gl.constexpr, num_warps: gl.constexpr):
        """CTA (key block pid 0, b * Hkv + hk pid 1); 127's kernel arguments (SEM, kq_desc unused).
        Descriptors: 4-D [B, H, S, D] views with boxes [1, 1, BLOCK_M, D] (Q, dO) and
        [1, 1, BLOCK_N, D] (K, V); with TMA_DQ, dq_desc: the f32 accumulator's, box
        [1, 1, BLOCK_M, DQ_RED]. TMA_DQ 2 (ordered): SEM the dQ blocks' counters, a fourth
        partition (`_box_writer`), CTA pid 0 serves key block n_kv - 1 - pid 0 (127's order);
        ROTATE: 127's rotated walk (the plan sets it where `gluon_bwd.rotation` allows)."""
        dtype: gl.constexpr = q_desc.dtype
        pid_bh, j, n_kv = _cta_block(TMA_DQ == 2)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        start_n = j * BLOCK_N
        lo, full, m_end = _query_range(start_n, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)
        rot, _ = _rotation(j, n_kv, Sq, BLOCK_M, ROTATE)

        q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
        ps_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=PS_SWIZZLE, element_bitwidth=16, rank=2)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], ps_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], ps_layout)
        if TMA_DQ:   # per consumer: DQ_SLOTS boxes of the descriptor (ordered: one)
            dq_stage = gl.allocate_shared_memory(gl.float32, [2 * DQ_SLOTS] + dq_desc.block_type.shape, dq_desc.layout)
        else:
            dq_stage = p_smem     # (unused)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        pds_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        if TMA_DQ == 2:   # the writer's barriers, per consumer
            box_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            box_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(box_full.index(i), count=1)
                mbarrier.init(box_empty.index(i), count=1)
        else:             # (unused)
            box_full = pds_free
            box_empty = pds_free
        mbarrier.init(kv_ready.index(0), count=1)
        mbarrier.init(p_ready.index(0), count=2)     # both consumers' halves written
        mbarrier.init(ds_ready.index(0), count=2)
        mbarrier.init(pds_free.index(0), count=2)    # both consumers' reads retired
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)   # released by both consumers
        bars = (kv_ready, q_ready, q_empty, p_ready, ds_ready, pds_free, box_full, box_empty)

        if TMA_DQ == 2:   # ordered: the dQ boxes added by a writer warp (`_box_writer`)
            gl.warp_specialize([
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                             DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot, qk_scale, scale,
                             0, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, TMA_DQ, DQ_RED, ROTATE, DK_AFTER, num_warps)),
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                             DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot, qk_scale, scale,
                             1, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, TMA_DQ, DQ_RED, ROTATE, DK_AFTER, num_warps)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, k_desc, q_bufs, do_bufs, k_bufs, v_bufs, k_bufs, bars, b,
                             hk, start_n, GROUP, lo, full, m_end, rot, BLOCK_M, BLOCK_N, ROTATE, False)),
                (_box_writer, (dq_desc, dq_stage, SEM, box_full, box_empty, b, hk, start_n, Hq, Sq, Sk, GROUP, lo,
                               full, m_end, rot, BLOCK_M, BLOCK_N, HEAD_D, CAUSAL, ROTATE, TURNS)),
            ], [num_warps, 1, 1], [240, 24, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                             DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot, qk_scale, scale,
                             0, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, TMA_DQ, DQ_RED, ROTATE, DK_AFTER, num_warps)),
                (_consumer, (q_bufs, do_bufs, k_bufs, v_bufs, p_smem, ds_smem, bars, LSE, DELTA, DQA, dq_desc, dq_stage,
                             DK, DV, b, hk, start_n, Hq, Hkv, Sq, Sk, GROUP, lo, full, m_end, rot, qk_scale, scale,
                             1, HEAD_D, BLOCK_M, BLOCK_N, CAUSAL, TMA_DQ, DQ_RED, ROTATE, DK_AFTER, num_warps)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, k_desc, q_bufs, do_bufs, k_bufs, v_bufs, k_bufs, bars, b,
                             hk, start_n, GROUP, lo, full, m_end, rot, BLOCK_M, BLOCK_N, ROTATE, False)),
            ], [num_warps, 1], [240, 24])

        mbarrier.invalidate(kv_ready.index(0))
        mbarrier.invalidate(p_ready.index(0))
        mbarrier.invalidate(ds_ready.index(0))
        mbarrier.invalidate(pds_free.index(0))
        if TMA_DQ == 2:
            for i in gl.static_range(2):
                mbarrier.invalidate(box_full.index(i))
                mbarrier.invalidate(box_empty.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(q_empty.index(i))
else:
    _gluon_bwd_d256_kernel = None


# ---- launcher -------------------------------------------------------------------------

class GluonBwdD256Plan(GluonBwdPlan):
    """127's plan (preprocess, main kernel, cast) with this module's kernel: K and V as one
    BLOCK_N-key box each."""
    KV_BOXES = 1

    @staticmethod
    def _kernel():
        return _gluon_bwd_d256_kernel

    @staticmethod
    def _default_config(d: int) -> dict:
        return tile_config()


# ---- solver -----------------------------------------------------------------------------

@register
class GluonFlashBackwardD256(GluonFlashBackward):
    """Solver 127's structure at head dim 256: 64-key CTAs, S / dP split by keys and dK / dV /
    dQ by head-dim columns between the two consumer warpgroups."""
    id = 130
    name = "gluon_flash_bwd_d256"
    deterministic = False   # dQ: f32 adds in whatever order the key blocks arrive

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super(GluonFlashBackward, self).not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        return reasons + scope_reasons(problem, HEAD_DIMS, "solvers 127 / 123",
                                       "; d256 only (127 covers d64 / d128)")

    def estimate(self, problem) -> float | None:
        return model_ms(problem, BLOCK_N, EFF, HOST_FLOOR_MS)   # 127's model, 64-key CTAs

    def prepare(self, problem):
        return GluonBwdD256Plan(problem)


@register
class GluonFlashBackwardD256Ordered(OrderedDq, GluonFlashBackwardD256):
    """Solver 130 with its dQ boxes added in a fixed key-block order by a writer warp
    (`_box_writer`, the `ordered` config): bit-identical run to run, chosen when determinism is
    on (solver 129's scheme at d256)."""
    id = 132
    name = "gluon_flash_bwd_d256_ordered"
    priced_as = 130
    revised = "2026-12-02T14:21:00Z"   # dK's wgmma after the last dQ box (DK_AFTER 3)

    def estimate(self, problem) -> float | None:
        return super().estimate(problem) * ORDERED_COST[problem.causal is not None]

    def prepare(self, problem):
        return GluonBwdD256Plan(problem, tile_config(ordered=True))
