"""Warp-specialised flash attention forward for Hopper in Gluon (solver 126 `gluon_flash_fwd`,
family `flash`).

Same definition as solver 110 (flash_fwd.py): per (b, h), kv head hk = h // (Hq // Hkv),

    s_ij = scale * q_i . k_j  (-inf where causal hides j),  lse_i = log sum_j exp(s_ij),
    o_i  = sum_j exp(s_ij - lse_i) v_j

with an online softmax in the log2 domain (log2(e) folded into the scale, exp2) and f32
accumulation. A fully masked row (bottom-right causal with Sk < Sq) gives o = NaN and
lse = -inf, or o = 0 with softmax_inf_as_zero.

Structure (FlashAttention-3's, written with Gluon's explicit Hopper ops): one CTA per
(block of BLOCK_M = 128 query rows, b, h), launched heaviest-first for causal problems.
`gl.warp_specialize` splits it into
  - a 1-warp producer partition: TMA loads of the Q tile (once) and of K and V blocks into a
    STAGES-deep shared-memory ring; per stage a ready barrier (TMA transaction count) and an
    empty barrier (the consumer's release) for K and for V separately, so QK^T can start
    as soon as K has landed while V is still in flight;
  - consumers: S = Q K^T with async `warpgroup_mma` (both operands in shared memory), the
    online softmax in registers, P cast to bf16/f16 in registers and used as the register
    A operand of O += P V (RS wgmma, no shared-memory round trip); a K slot is released
    after its S wait, a V slot after its PV wait (empty barriers count one arrival per
    consumer). Intra-warpgroup overlap (FA3's): S_{j+1} = Q K_{j+1}^T is issued before
    P_j V_j and the consumer waits for S_{j+1} only (wgmma groups retire in order), so the
    softmax of block j+1 runs while P_j V_j is on the tensor cores; the last block is
    peeled off the loop (ptxas then keeps the wgmma pipeline asynchronous).
    PINGPONG (default for D <= 128): two 4-warp consumer partitions of 64 rows each whose
    MMA issue slots alternate through two mbarriers (FA3's inter-warpgroup ping-pong: one
    warpgroup's softmax runs under the other's GEMMs). Otherwise one 8-warp consumer
    partition (two warpgroups of 64 rows in lockstep, interleaved by the warp schedulers).
Key blocks [0, full) are visible to every row (no masking), [full, hi) are masked per element
(kv tail and the causal diagonal). Q/K/V are read through in-kernel TMA descriptors over each
(b, head)'s [S, D] slab, so rows past Sq / Sk load as zeros; the output goes out through a
TMA store on the same kind of descriptor, which never writes rows past Sq. lse (B, Hq, Sq)
f32 through masked stores.

Covers bf16/f16, D == Dv in {64, 128, 256}, GQA/MQA, causal top-left and bottom-right, any
Sq/Sk (tails), float scale (inverted or not), return_lse, softmax_inf_as_zero. Everything
else (masks, dropout, kv_lens, paging, tensor scale, f32, other head dims) is solver 110's.
Needs a CUDA device of capability 9.x and Gluon; never applicable under TRITON_INTERPRET=1
(Gluon kernels do not run in the interpreter) nor with NNPRIM_DISABLE_GLUON=1 (a switch to
keep find from timing it). Inputs whose strides TMA cannot describe
(inner stride != 1, rows not 16-byte aligned) are copied contiguous first.
"""
from __future__ import annotations

import os

import torch
import triton

from ..launch import ensure_allocator, interpreting
from ..search.solver import register
from .flash_fwd import TMA_DESC_BYTES, FlashBase, roofline_ms

try:  # Gluon ships with triton >= 3.5; without it the solver is not applicable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    GLUON_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any import failure makes the solver not applicable
    gluon = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"

_CAUSAL_CODE = {None: 0, "top_left": 1, "bottom_right": 2}
HEAD_DIMS = (64, 128, 256)


def tile_config(d: int, pingpong: bool | None = None) -> dict:
    """Launch constants for head dim d: BLOCK_M = 128 query rows per CTA, BLOCK_N keys per
    ring stage, STAGES (what fits 227 KB of shared memory next to the Q tile, which the O
    store reuses), PINGPONG (two 4-warp consumer partitions of 64 rows taking turns to issue
    their MMAs, FA3's schedule) or one 8-warp consumer partition, num_warps (the default
    partition's), maxnreg: 168 x 384 threads fills the 64K-register file at one CTA per SM,
    and setmaxnreg moves the producer warpgroup's registers to the consumers (240 each)."""
    pp = d <= 128 if pingpong is None else pingpong
    base = dict(BLOCK_M=128, PINGPONG=pp, num_warps=4 if pp else 8, maxnreg=168)
    if d <= 64:
        return base | dict(BLOCK_N=128, STAGES=3)
    if d <= 128:
        return base | dict(BLOCK_N=128, STAGES=2)
    return base | dict(BLOCK_N=64, STAGES=2)


# ---- Gluon kernel ---------------------------------------------------------------------

if gluon is not None:

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, start_m, n_blocks,
                  BLOCK_N: gl.constexpr):
        """1 warp: the Q tile of each consumer once, then K_j and V_j into ring slot
        j % STAGES once every consumer has released it. Empty barriers start 'phase 1
        complete', so the first pass waits on parity 1."""
        q_bars, k_ready, k_empty, v_ready, v_empty = bars
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        NUM_C: gl.constexpr = q_bufs.type.shape[0]
        ROWS: gl.constexpr = q_bufs.type.shape[1]
        for c in gl.static_range(NUM_C):
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [start_m + c * ROWS, 0], q_bars.index(c), q_bufs.index(c))
        for j in range(n_blocks):
            s = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(s), k_bufs.index(s))
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _issue_qk(j, q_smem, k_bufs, k_ready, s_layout: gl.constexpr, ROWS: gl.constexpr,
                  BLOCK_N: gl.constexpr):
        """Wait for K_j and start S_j = Q K_j^T (async; the caller waits)."""
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        s = j % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        return warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _turn_begin(turn_bars, slot, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until it is this consumer's turn to issue MMAs (slot-th turn)."""
        if PINGPONG:
            mbarrier.wait(turn_bars.index(WG), slot & 1)

    @gluon.jit
    def _turn_end(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: hand the tensor cores to the other consumer."""
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - WG), count=1)

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
                offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                valid = offs_n[None, :] < kv_len
                if CAUSAL != 0:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
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
    def _consumer(q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, LSE, lse_off, start_m, n_full,
                  n_blocks, Sq, kv_len, shift, qk_scale,
                  WG: gl.constexpr, PINGPONG: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, SCALE_POS: gl.constexpr, STORE_LSE: gl.constexpr,
                  INF_AS_ZERO: gl.constexpr, WARPS: gl.constexpr):
        """Consumer WG (WARPS warps, ROWS query rows from start_m + WG * ROWS): QK^T, online
        softmax, PV, epilogue. Its MMA issue slots (S_0; then S_{j+1} + P_j V_j per block;
        then the last P V) take turns with the other consumer's under PINGPONG."""
        q_bars, k_ready, k_empty, v_ready, v_empty = bars
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        ROWS: gl.constexpr = q_bufs.type.shape[1]
        q_smem = q_bufs.index(WG)
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        row0 = start_m + WG * ROWS
        offs_m = row0 + gl.arange(0, ROWS, layout=row_s)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([ROWS], gl.float32, row_s)
        acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
        if PINGPONG and WG == 0:
            mbarrier.arrive(turn_bars.index(0), count=1)   # consumer 0 takes the first turn
        slot = 0

        mbarrier.wait(q_bars.index(WG), 0)
        # prologue: S_0 and its softmax. p_cur / alpha: P_j (the PV operand, in registers) and
        # the factor the accumulator takes before P_j V_j is added
        p_cur = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
        alpha = gl.full([ROWS], 1.0, gl.float32, row_s)
        if n_blocks > 0:
            _turn_begin(turn_bars, slot, WG, PINGPONG)
            qk_tok = _issue_qk(0, q_smem, k_bufs, k_ready, s_layout, ROWS, BLOCK_N)
            _turn_end(turn_bars, WG, PINGPONG)
            slot += 1
            qk = warpgroup_mma_wait(0, deps=(qk_tok,))
            mbarrier.arrive(k_empty.index(0), count=1)
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
            s = j % STAGES
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            _turn_begin(turn_bars, slot, WG, PINGPONG)
            qk_tok = _issue_qk(j + 1, q_smem, k_bufs, k_ready, s_layout, ROWS, BLOCK_N)
            mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
            acc_tok = warpgroup_mma(p_cur, v_bufs.index(s), acc, is_async=True)
            _turn_end(turn_bars, WG, PINGPONG)
            slot += 1
            qk = warpgroup_mma_wait(1, deps=(qk_tok,))      # S_{j+1} done; P_j V_j may run on
            mbarrier.arrive(k_empty.index((j + 1) % STAGES), count=1)
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
        if n_blocks > 0:
            j = n_blocks - 1
            s = j % STAGES
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            _turn_begin(turn_bars, slot, WG, PINGPONG)
            mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
            acc_tok = warpgroup_mma(p_cur, v_bufs.index(s), acc, is_async=True)
            _turn_end(turn_bars, WG, PINGPONG)
            acc, p_cur = warpgroup_mma_wait(0, deps=(acc_tok, p_cur))
            mbarrier.arrive(v_empty.index(s), count=1)

        # epilogue: normalise, store O through this consumer's Q tile (no longer read)
        inv_l = 1.0 / l_i
        o = acc * gl.convert_layout(inv_l, row_o)[:, None]
        if INF_AS_ZERO:
            o = gl.where(gl.convert_layout(l_i == 0.0, row_o)[:, None], 0.0, o)
        q_smem.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row0, 0], q_smem)
        if STORE_LSE:
            lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            gl.store(LSE + lse_off + offs_m, lse, mask=offs_m < Sq)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["Hq", "Sq", "Sk"])
    def _gluon_fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                          Hq, Sq, Sk, GROUP, qk_scale,
                          HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
                          SCALE_POS: gl.constexpr, STORE_LSE: gl.constexpr, INF_AS_ZERO: gl.constexpr,
                          num_warps: gl.constexpr):
        """One CTA: BLOCK_M query rows of one (b, h). O (B, Hq, Sq, D) and lse (B, Hq, Sq)
        contiguous. PINGPONG: two consumer partitions of num_warps (4) warps and BLOCK_M / 2
        rows each; else one of num_warps (8) warps and BLOCK_M rows."""
        NUM_C: gl.constexpr = 2 if PINGPONG else 1
        ROWS: gl.constexpr = BLOCK_M // NUM_C
        n_m = gl.cdiv(Sq, BLOCK_M)
        if CAUSAL != 0:
            pid_m = n_m - 1 - gl.program_id(0)   # heaviest tiles first
        else:
            pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        hk = h // GROUP
        start_m = pid_m * BLOCK_M
        b64 = b.to(gl.int64)

        dtype: gl.constexpr = Q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_D], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
        q_desc = tma.make_tensor_descriptor(Q + b64 * sqb + h.to(gl.int64) * sqh, shape=[Sq, HEAD_D],
                                            strides=[sqs, 1], block_shape=[ROWS, HEAD_D], layout=q_layout)
        k_desc = tma.make_tensor_descriptor(K + b64 * skb + hk.to(gl.int64) * skh, shape=[Sk, HEAD_D],
                                            strides=[sks, 1], block_shape=[BLOCK_N, HEAD_D], layout=kv_layout)
        v_desc = tma.make_tensor_descriptor(V + b64 * svb + hk.to(gl.int64) * svh, shape=[Sk, HEAD_D],
                                            strides=[svs, 1], block_shape=[BLOCK_N, HEAD_D], layout=kv_layout)
        o_desc = tma.make_tensor_descriptor(O + pid_bh.to(gl.int64) * Sq * HEAD_D, shape=[Sq, HEAD_D],
                                            strides=[HEAD_D, 1], block_shape=[ROWS, HEAD_D], layout=q_layout)

        # key range of the whole CTA (both consumers loop over the same blocks): [0, hi)
        # visible to some row, whole blocks [0, n_full) to every row
        kv_len = Sk
        if CAUSAL == 2:
            shift = Sk - Sq
        else:
            shift = 0
        hi = kv_len
        full = kv_len
        if CAUSAL != 0:
            last_row = gl.minimum(start_m + BLOCK_M, Sq) - 1
            hi = gl.minimum(hi, last_row + shift + 1)
            full = gl.minimum(kv_len, start_m + shift + 1)
        hi = gl.maximum(hi, 0)
        full = gl.maximum(full, 0)
        n_blocks = gl.cdiv(hi, BLOCK_N)
        n_full = gl.minimum(full // BLOCK_N, n_blocks)

        q_bufs = gl.allocate_shared_memory(dtype, [NUM_C, ROWS, HEAD_D], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_C, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NUM_C):
            mbarrier.init(q_bars.index(c), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_C)   # released by every consumer
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=NUM_C)
        bars = (q_bars, k_ready, k_empty, v_ready, v_empty)
        lse_off = pid_bh.to(gl.int64) * Sq

        if PINGPONG:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, LSE, lse_off, start_m, n_full,
                             n_blocks, Sq, kv_len, shift, qk_scale, 0, True, HEAD_D, BLOCK_N, CAUSAL,
                             SCALE_POS, STORE_LSE, INF_AS_ZERO, num_warps)),
                (_consumer, (q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, LSE, lse_off, start_m, n_full,
                             n_blocks, Sq, kv_len, shift, qk_scale, 1, True, HEAD_D, BLOCK_N, CAUSAL,
                             SCALE_POS, STORE_LSE, INF_AS_ZERO, num_warps)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, start_m, n_blocks, BLOCK_N)),
            ], [num_warps, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, LSE, lse_off, start_m, n_full,
                             n_blocks, Sq, kv_len, shift, qk_scale, 0, False, HEAD_D, BLOCK_N, CAUSAL,
                             SCALE_POS, STORE_LSE, INF_AS_ZERO, num_warps)),
                (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, start_m, n_blocks, BLOCK_N)),
            ], [1], [24])

        for c in gl.static_range(NUM_C):
            mbarrier.invalidate(q_bars.index(c))
        for i in gl.static_range(2):
            mbarrier.invalidate(turn_bars.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))


# ---- launcher -------------------------------------------------------------------------

def _tma_view(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when TMA cannot describe its rows (inner stride 1, 16-byte
    aligned base and row/head/batch strides)."""
    e = t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * e) % 16 == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


def gluon_forward(problem, args, *, out: torch.Tensor | None = None,
                  lse_out: torch.Tensor | None = None, cfg: dict | None = None):
    """(o, lse): run the kernel. `out` / `lse_out` (contiguous) let tests pass poisoned
    buffers; lse is computed when problem.return_lse or lse_out is given."""
    p = problem
    q, k, v = _tma_view(args.q), _tma_view(args.k), _tma_view(args.v)
    cfg = dict(cfg or tile_config(p.D))
    o = out if out is not None else torch.empty((p.B, p.Hq, p.Sq, p.Dv), dtype=q.dtype, device=q.device)
    want_lse = p.return_lse or lse_out is not None
    lse = lse_out if lse_out is not None else (
        torch.empty((p.B, p.Hq, p.Sq), dtype=torch.float32, device=q.device) if want_lse else None)
    scale = float(args.effective_scale(p.invert_scale))
    ensure_allocator(q.device)
    grid = (triton.cdiv(p.Sq, cfg["BLOCK_M"]), p.B * p.Hq)
    _gluon_fwd_kernel[grid](
        q, k, v, o, lse if lse is not None else o,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        p.Hq, p.Sq, p.Sk, p.group, scale * 1.4426950408889634,
        HEAD_D=p.D, CAUSAL=_CAUSAL_CODE[p.causal], SCALE_POS=scale > 0, STORE_LSE=lse is not None,
        INF_AS_ZERO=p.inf_as_zero, **cfg)
    return o, lse if want_lse else None


# ---- solver -----------------------------------------------------------------------------

def gluon_reasons(problem) -> list[str]:
    """Why the Gluon kernel cannot run here: Gluon missing, the interpreter, no Hopper GPU."""
    if GLUON_ERROR is not None:
        return [f"not applicable: Gluon cannot be imported ({GLUON_ERROR})"]
    if os.environ.get("NNPRIM_DISABLE_GLUON", "0") == "1":
        return ["not applicable: NNPRIM_DISABLE_GLUON=1"]
    if interpreting():
        return ["not applicable under TRITON_INTERPRET=1 (Gluon kernels do not run in the interpreter)"]
    if problem.device != "cuda" or not torch.cuda.is_available():
        return [f"not applicable on device {problem.device}: needs a CUDA GPU of capability 9.x (Hopper)"]
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return [f"not applicable on capability {cap[0]}.{cap[1]}: the kernel uses Hopper's wgmma (9.x)"]
    return []


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
        if problem.D != problem.Dv or problem.D not in HEAD_DIMS:
            reasons.append(f"head dims D={problem.D}, Dv={problem.Dv}: needs D == Dv in {HEAD_DIMS} (solver 110 covers others)")
        if problem.mask != "none":
            reasons.append(f"mask={problem.mask} is not supported (solver 110 covers masks)")
        if problem.dropout_p > 0:
            reasons.append(f"dropout_p={problem.dropout_p} is not supported (solver 110 covers dropout)")
        if problem.has_kv_lens:
            reasons.append("kv_lens are not supported (solver 110 covers them)")
        if problem.scale == "tensor":
            reasons.append("a tensor scale is not supported (solver 110 reads it in the kernel)")
        if problem.descale is not None or problem.out_dtype not in (None, problem.dtype):
            reasons.append("FP8 inputs / another output dtype are not supported (solver 125)")
        reasons += gluon_reasons(problem)
        return reasons

    def workspace_size(self, problem) -> int:
        """The four in-kernel TMA descriptors' global scratch per CTA."""
        cfg = tile_config(problem.D)
        return 4 * TMA_DESC_BYTES * triton.cdiv(problem.Sq, cfg["BLOCK_M"]) * problem.B * problem.Hq

    def estimate(self, problem) -> float | None:
        # kept below solver 110's 0.65 until H200 measurements say otherwise: heuristic mode
        # keeps choosing 110, find measures both
        return roofline_ms(problem, 0.6)

    def prepare(self, problem):
        cfg = tile_config(problem.D)

        def invoke(args):
            return gluon_forward(problem, args, cfg=cfg)
        return invoke
