"""Flash attention backward in Triton (solver 111 `flash_bwd`, family `flash`).

With P_ij = exp(s_ij - lse_i) (recomputed from q, k and the forward's lse), Z the
dropout keep mask and r = 1 / (1 - p):

    D_i   = sum_d dO_id O_id                            (preprocess kernel, f32)
    dV_j  = sum_i (r Z_ij P_ij) dO_i
    dP_ij = r Z_ij dO_i . v_j
    dS_ij = P_ij (dP_ij - D_i)
    dQ_i  = scale sum_j dS_ij k_j,    dK_j = scale sum_i dS_ij q_i

Three kernels, no atomics, deterministic run to run:
1. preprocess: D_i (0 for fully masked rows, whose lse is -inf: their gradients are 0,
   as softmax_inf_as_zero asks; without it the forward's o is NaN there and the float64
   reference's gradients are NaN, while these kernels still give 0);
2. dK/dV: one program per (BLOCK_N keys, b, kv head); it loops over the query heads that
   share the kv head (the GQA reduction, in a fixed order) and over query blocks, with
   the causal range split into masked diagonal blocks and unmasked blocks;
3. dQ: one program per (BLOCK_M query rows, b, query head), looping over key blocks.
f32 accumulation throughout; results are cast to the input dtype when stored.

Head dims above 128 (max(D, Dv) > 128, `use_split`): the fused dK/dV kernel would hold
K, V and two 64x256 f32 accumulators per program and spills, so a split dK/dV kernel
takes its place: each program owns one column chunk ("half": the first 128 columns or the
rest) of dK and dV, launched once per half; S = sum_c Q_c K_c^T and dP = sum_c dO_c V_c^T
still use every chunk (so they are formed twice, 6 instead of 4 GEMM-sized products per
tile), but the accumulators are 64x128. dQ uses the fused kernel with its own tiles
(configs.DQ_TABLE: with 32-key steps and 8 warps its 128x256 f32 accumulator fits
unspilled) or, when asked, a split dQ kernel built the same way.
Masks, scales, kv_lens, causal alignment and dropout follow flash_fwd exactly; the jit
helpers for them (and delta, the query range of a key block) live in flash_bwd_common.py,
shared with the five-GEMM backward (flash_bwd_atomic.py, solvers 123/124).
Workspace: delta (f32, B x Hq x Sq) and, on Hopper, the TMA descriptors' global scratch
of the larger of the dK/dV and dQ launches (`workspace_bytes`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import alloc
from ..dropout import dropout_keep
from ..launch import Launch, ensure_allocator, interpreting
from ..search.solver import register
from . import configs
from .flash_bwd_common import _delta_rows, _kv_block, _load_scale, _lse2, _mask_scores, _query_ranges, _scores, plan_key
from .flash_fwd import (
    _CAUSAL_CODE,
    _MASK_CODE,
    TMA_DESC_BYTES,
    FlashBase,
    _dot,
    _kv_len_shift,
    block_d,
    dropout_args,
    mask_view,
    roofline_ms,
    scale_args,
    tma_expected,
    tma_ok,
)


@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, sob, soh, sos, sod, sdb, sdh, sds, sdd, Hq, Sq, Dv,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    _delta_rows(O, DO, LSE, DELTA, tl.program_id(0), tl.program_id(1), sob, soh, sos, sod,
                sdb, sdh, sds, sdd, Hq, Sq, Dv, BLOCK_M, BLOCK_DV)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base,
                sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv, lo, hi,
                kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep,
                D, Dv, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, WHICH: tl.constexpr):
    """Query blocks [lo, hi) for one key block; tiles are transposed: [BLOCK_N, BLOCK_M].
    WHICH: 3 accumulates dK and dV, 1 only dV (no dP, no Q-side dK product), 2 only dK."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        rmask = offs_m < Sq
        if USE_TMA:
            q = q_desc.load([start_m, 0])
        else:
            q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sqs + offs_d[None, :] * sqd,
                        mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
        lse = tl.load(lse_base + offs_m, mask=rmask, other=float("inf"))
        lse2 = _lse2(lse)
        mptr = mask_base
        if MASK_KIND != 0:
            mptr = mask_base + offs_m[None, :].to(tl.int64) * smi + offs_n[:, None].to(tl.int64) * smj
        sT = _scores(k, tl.trans(q), mptr, offs_m[None, :], offs_n[:, None], kv_len, shift,
                     qk_scale, Sq, Sk, MASKED, CAUSAL, MASK_KIND, UPCAST, IEEE)
        pT = tl.math.exp2(sT - lse2[None, :])
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h, offs_m[None, :], offs_n[:, None], Hq, Sq, Sk,
                                threshold)
        if USE_TMA:
            do = do_desc.load([start_m, 0])
        else:
            do = tl.load(do_base + offs_m[:, None].to(tl.int64) * sds + offs_dv[None, :] * sdd,
                         mask=rmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        if WHICH & 1:
            if DROPOUT:
                pdT = tl.where(keep, pT * inv_keep, 0.0)
            else:
                pdT = pT
            dv = _dot(pdT.to(do.dtype), do, dv, UPCAST, IEEE)
        if WHICH & 2:
            delta = tl.load(delta_base + offs_m, mask=rmask, other=0.0)
            dpT = _dot(v, tl.trans(do), None, UPCAST, IEEE)
            if DROPOUT:
                dpT = tl.where(keep, dpT * inv_keep, 0.0)
            dsT = pT * (dpT - delta[None, :])
            dk = _dot(dsT.to(q.dtype), q, dk, UPCAST, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["Hq", "Hkv", "seed", "offset"])  # head counts, RNG: no recompile
def _flash_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, MASK, SCALE, KVLENS,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sdb, sdh, sds, sdd, sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
        smb, smh, smi, smj,
        Hq, Hkv, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        WHICH: tl.constexpr = 3):
    """One program: BLOCK_N keys of one (b, kv head); loops over GROUP query heads.
    WHICH = 3 computes dK and dV; 1 (dV only) and 2 (dK only) are the split variant for
    large head dims, whose two launches each hold one f32 accumulator."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    b64 = b.to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    nmask = offs_n < Sk
    k, v = _kv_block(K, V, b64, hk, start_n, Sk, D, Dv, skb, skh, sks, skd, svb, svh, svs, svd,
                     BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA)
    sc = _load_scale(SCALE, scale, SCALE_PTR, INVERT)
    qk_scale = sc * 1.4426950408889634
    kv_len, shift = _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS, CAUSAL)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # query range: rows that see a key of the block start at lo; from `full` on (up to the
    # last whole block of rows) every row sees every key of the block.
    lo, full, m_whole, whole, m_end = _query_ranges(start_n, kv_len, shift, Sq, BLOCK_M, BLOCK_N, CAUSAL)
    for g in range(GROUP):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * sqb + h64 * sqh
        do_base = DO + b64 * sdb + h64 * sdh
        lse_base = LSE + (b64 * Hq + h64) * Sq
        delta_base = DELTA + (b64 * Hq + h64) * Sq
        mask_base = MASK
        if MASK_KIND != 0:
            mask_base = MASK + b64 * smb + h64 * smh
        if USE_TMA:
            q_desc = tl.make_tensor_descriptor(q_base, shape=[Sq, D], strides=[sqs, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
            do_desc = tl.make_tensor_descriptor(do_base, shape=[Sq, Dv], strides=[sds, 1],
                                                block_shape=[BLOCK_M, BLOCK_DV])
        else:
            q_desc = None
            do_desc = None
        # masked diagonal blocks, unmasked blocks, masked tail block(s)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base,
                             mask_base,
                             sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv, lo, full,
                             kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold,
                             inv_keep, D, Dv, BLOCK_M, True, CAUSAL, MASK_KIND, DROPOUT, USE_TMA,
                             UPCAST, IEEE, WHICH)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base,
                             mask_base,
                             sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv, full, m_whole,
                             kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold,
                             inv_keep, D, Dv, BLOCK_M, False, CAUSAL, MASK_KIND, DROPOUT, USE_TMA,
                             UPCAST, IEEE, WHICH)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base,
                             mask_base,
                             sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv, whole, m_end,
                             kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold,
                             inv_keep, D, Dv, BLOCK_M, True, CAUSAL, MASK_KIND, DROPOUT, USE_TMA,
                             UPCAST, IEEE, WHICH)
    if WHICH & 2:
        dk = dk * sc
        tl.store(DK + b64 * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None].to(tl.int64) * sdks
                 + offs_d[None, :] * sdkd, dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None] & (offs_d[None, :] < D))
    if WHICH & 1:
        tl.store(DV + b64 * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None].to(tl.int64) * sdvs
                 + offs_dv[None, :] * sdvd, dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None] & (offs_dv[None, :] < Dv))


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, mask_base, sks, skd, svs, svd, smj,
              offs_m, offs_d, offs_dv, lo, hi, kv_len, shift, qk_scale, seed, offset, b, h,
              Hq, Sq, Sk, threshold, inv_keep, D, Dv, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
              IEEE: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        nmask = offs_n < Sk
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            k = tl.load(k_base + offs_n[:, None].to(tl.int64) * sks + offs_d[None, :] * skd,
                        mask=nmask[:, None] & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_base + offs_n[:, None].to(tl.int64) * svs + offs_dv[None, :] * svd,
                        mask=nmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        mptr = mask_base
        if MASK_KIND != 0:
            mptr = mask_base + offs_n[None, :].to(tl.int64) * smj
        s = _scores(q, tl.trans(k), mptr, offs_m[:, None], offs_n[None, :], kv_len, shift,
                    qk_scale, Sq, Sk, MASKED, CAUSAL, MASK_KIND, UPCAST, IEEE)
        p = tl.math.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), None, UPCAST, IEEE)
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h, offs_m[:, None], offs_n[None, :], Hq, Sq, Sk,
                                threshold)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, UPCAST, IEEE)
    return dq


@triton.jit(do_not_specialize=["Hq", "seed", "offset"])  # head counts, RNG: no recompile
def _flash_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, MASK, SCALE, KVLENS,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sdb, sdh, sds, sdd, sdqb, sdqh, sdqs, sdqd, smb, smh, smi, smj,
        Hq, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One program: BLOCK_M query rows of one (b, h), looping over key blocks."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rmask = offs_m < Sq
    if USE_TMA:
        q = tl.make_tensor_descriptor(Q + b64 * sqb + h64 * sqh, shape=[Sq, D], strides=[sqs, 1],
                                      block_shape=[BLOCK_M, BLOCK_D]).load([start_m, 0])
        do = tl.make_tensor_descriptor(DO + b64 * sdb + h64 * sdh, shape=[Sq, Dv], strides=[sds, 1],
                                       block_shape=[BLOCK_M, BLOCK_DV]).load([start_m, 0])
    else:
        q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None].to(tl.int64) * sqs
                    + offs_d[None, :] * sqd, mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
        do = tl.load(DO + b64 * sdb + h64 * sdh + offs_m[:, None].to(tl.int64) * sds
                     + offs_dv[None, :] * sdd, mask=rmask[:, None] & (offs_dv[None, :] < Dv),
                     other=0.0)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(LSE + row, mask=rmask, other=float("inf"))
    lse2 = _lse2(lse)
    delta = tl.load(DELTA + row, mask=rmask, other=0.0)
    sc = _load_scale(SCALE, scale, SCALE_PTR, INVERT)
    qk_scale = sc * 1.4426950408889634
    kv_len, shift = _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS, CAUSAL)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Sk, D], strides=[sks, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[Sk, Dv], strides=[svs, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc = None
        v_desc = None
    mask_base = MASK
    if MASK_KIND != 0:
        mask_base = MASK + b64 * smb + h64 * smh + offs_m[:, None].to(tl.int64) * smi
    hi = kv_len
    if CAUSAL != 0:
        last_row = tl.minimum(start_m + BLOCK_M, Sq) - 1
        hi = tl.minimum(hi, last_row + shift + 1)
        full = tl.minimum(kv_len, start_m + shift + 1)
    else:
        full = kv_len
    hi = tl.maximum(hi, 0)
    full = tl.maximum(full, 0)
    full = (full // BLOCK_N) * BLOCK_N
    full = tl.minimum(full, hi)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, mask_base, sks, skd, svs, svd, smj,
                   offs_m, offs_d, offs_dv, 0, full, kv_len, shift, qk_scale, seed, offset, b, h,
                   Hq, Sq, Sk, threshold, inv_keep, D, Dv, BLOCK_N, False, CAUSAL, MASK_KIND,
                   DROPOUT, USE_TMA, UPCAST, IEEE)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, mask_base, sks, skd, svs, svd, smj,
                   offs_m, offs_d, offs_dv, full, hi, kv_len, shift, qk_scale, seed, offset, b, h,
                   Hq, Sq, Sk, threshold, inv_keep, D, Dv, BLOCK_N, True, CAUSAL, MASK_KIND,
                   DROPOUT, USE_TMA, UPCAST, IEEE)
    dq = dq * sc
    tl.store(DQ + b64 * sdqb + h64 * sdqh + offs_m[:, None].to(tl.int64) * sdqs
             + offs_d[None, :] * sdqd, dq.to(DQ.dtype.element_ty),
             mask=rmask[:, None] & (offs_d[None, :] < D))


# ---- head-dim split kernels (D or Dv > 128) --------------------------------------------
# The head dims are cut into two column chunks: chunk 0 = the first C0 (<= 128) columns,
# chunk 1 = the rest (C1 wide, 0 when absent). S = sum over chunks of Q_c K_c^T and
# dP = sum of dO_c V_c^T use every chunk; each program accumulates only one chunk ("half")
# of its outputs, so it holds a 64x128 f32 accumulator pair instead of 64x256 ones (which
# spill). The price is computing S and dP once per half.

@triton.jit
def _tile(base, desc, row0, col0, offs_r, sr, sc, nrows, ncols, BR: tl.constexpr,
          BC: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BR, BC] tile at (row0, col0): a TMA descriptor load, or a masked pointer load."""
    if USE_TMA:
        t = desc.load([row0, col0])
    else:
        offs_c = col0 + tl.arange(0, BC)
        t = tl.load(base + offs_r[:, None].to(tl.int64) * sr + offs_c[None, :] * sc,
                    mask=(offs_r[:, None] < nrows) & (offs_c[None, :] < ncols), other=0.0)
    return t


@triton.jit
def _desc(base, nrows, ncols, srow, BR: tl.constexpr, BC: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        d = tl.make_tensor_descriptor(base, shape=[nrows, ncols], strides=[srow, 1],
                                      block_shape=[BR, BC])
    else:
        d = None
    return d


@triton.jit
def _dkdv_split_inner(dk, dv, k0, k1, v0, v1, q_base, do_base, qd0, qd1, dod0, dod1,
                      lse_base, delta_base, mask_base, sqs, sqd, sds, sdd, smi, smj, offs_n, lo, hi,
                      kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep,
                      D, Dv, BLOCK_M: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
                      CV0: tl.constexpr, CV1: tl.constexpr, HALF: tl.constexpr,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                      DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
                      IEEE: tl.constexpr):
    """Query blocks [lo, hi) for one key block and one output half (transposed tiles)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        rmask = offs_m < Sq
        q0 = _tile(q_base, qd0, start_m, 0, offs_m, sqs, sqd, Sq, D, BLOCK_M, C0, USE_TMA)
        acc = _dot(k0, tl.trans(q0), None, UPCAST, IEEE)
        if C1 > 0:
            q1 = _tile(q_base, qd1, start_m, C0, offs_m, sqs, sqd, Sq, D, BLOCK_M, C1, USE_TMA)
            acc = _dot(k1, tl.trans(q1), acc, UPCAST, IEEE)
        lse = tl.load(lse_base + offs_m, mask=rmask, other=float("inf"))
        lse2 = _lse2(lse)
        mptr = mask_base
        if MASK_KIND != 0:
            mptr = mask_base + offs_m[None, :].to(tl.int64) * smi + offs_n[:, None].to(tl.int64) * smj
        sT = _mask_scores(acc, mptr, offs_m[None, :], offs_n[:, None], kv_len, shift, qk_scale,
                          Sq, Sk, MASKED, CAUSAL, MASK_KIND)
        pT = tl.math.exp2(sT - lse2[None, :])
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h, offs_m[None, :], offs_n[:, None], Hq, Sq, Sk,
                                threshold)
            pdT = tl.where(keep, pT * inv_keep, 0.0)
        else:
            pdT = pT
        # dV first (P's bf16 copy dies before dP is formed), then dP, dS and dK
        do0 = _tile(do_base, dod0, start_m, 0, offs_m, sds, sdd, Sq, Dv, BLOCK_M, CV0, USE_TMA)
        if CV1 > 0:
            do1 = _tile(do_base, dod1, start_m, CV0, offs_m, sds, sdd, Sq, Dv, BLOCK_M, CV1,
                        USE_TMA)
        if HALF == 0:
            dv = _dot(pdT.to(do0.dtype), do0, dv, UPCAST, IEEE)
        elif CV1 > 0:
            dv = _dot(pdT.to(do1.dtype), do1, dv, UPCAST, IEEE)
        dpT = _dot(v0, tl.trans(do0), None, UPCAST, IEEE)
        if CV1 > 0:
            dpT = _dot(v1, tl.trans(do1), dpT, UPCAST, IEEE)
        if DROPOUT:
            dpT = tl.where(keep, dpT * inv_keep, 0.0)
        delta = tl.load(delta_base + offs_m, mask=rmask, other=0.0)
        dsT = pT * (dpT - delta[None, :])
        if HALF == 0:
            dk = _dot(dsT.to(q0.dtype), q0, dk, UPCAST, IEEE)
        elif C1 > 0:
            dk = _dot(dsT.to(q1.dtype), q1, dk, UPCAST, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["Hq", "Hkv", "seed", "offset"])  # head counts, RNG: no recompile
def _flash_bwd_dkdv_split_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, MASK, SCALE, KVLENS,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sdb, sdh, sds, sdd, sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
        smb, smh, smi, smj,
        Hq, Hkv, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
        CV0: tl.constexpr, CV1: tl.constexpr, HALF: tl.constexpr, DKW: tl.constexpr,
        DVW: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One program: BLOCK_N keys of one (b, kv head), column chunk HALF of dK (DKW wide)
    and dV (DVW wide); loops over the GROUP query heads and the query blocks. One launch
    per HALF (a runtime branch between the halves costs registers)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    nmask = offs_n < Sk
    k_base = K + b64 * skb + hk64 * skh
    v_base = V + b64 * svb + hk64 * svh
    k0 = _tile(k_base, _desc(k_base, Sk, D, sks, BLOCK_N, C0, USE_TMA), start_n, 0, offs_n,
               sks, skd, Sk, D, BLOCK_N, C0, USE_TMA)
    v0 = _tile(v_base, _desc(v_base, Sk, Dv, svs, BLOCK_N, CV0, USE_TMA), start_n, 0, offs_n,
               svs, svd, Sk, Dv, BLOCK_N, CV0, USE_TMA)
    k1 = k0
    v1 = v0
    if C1 > 0:
        k1 = _tile(k_base, _desc(k_base, Sk, D, sks, BLOCK_N, C1, USE_TMA), start_n, C0, offs_n,
                   sks, skd, Sk, D, BLOCK_N, C1, USE_TMA)
    if CV1 > 0:
        v1 = _tile(v_base, _desc(v_base, Sk, Dv, svs, BLOCK_N, CV1, USE_TMA), start_n, CV0,
                   offs_n, svs, svd, Sk, Dv, BLOCK_N, CV1, USE_TMA)
    sc = _load_scale(SCALE, scale, SCALE_PTR, INVERT)
    qk_scale = sc * 1.4426950408889634
    kv_len, shift = _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS, CAUSAL)
    dk = tl.zeros([BLOCK_N, DKW], tl.float32)
    dv = tl.zeros([BLOCK_N, DVW], tl.float32)
    lo, full, m_whole, whole, m_end = _query_ranges(start_n, kv_len, shift, Sq, BLOCK_M, BLOCK_N, CAUSAL)
    for g in range(GROUP):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * sqb + h64 * sqh
        do_base = DO + b64 * sdb + h64 * sdh
        lse_base = LSE + (b64 * Hq + h64) * Sq
        delta_base = DELTA + (b64 * Hq + h64) * Sq
        mask_base = MASK
        if MASK_KIND != 0:
            mask_base = MASK + b64 * smb + h64 * smh
        qd0 = _desc(q_base, Sq, D, sqs, BLOCK_M, C0, USE_TMA)
        dod0 = _desc(do_base, Sq, Dv, sds, BLOCK_M, CV0, USE_TMA)
        qd1 = qd0
        dod1 = dod0
        if C1 > 0:
            qd1 = _desc(q_base, Sq, D, sqs, BLOCK_M, C1, USE_TMA)
        if CV1 > 0:
            dod1 = _desc(do_base, Sq, Dv, sds, BLOCK_M, CV1, USE_TMA)
        dk, dv = _dkdv_split_inner(
            dk, dv, k0, k1, v0, v1, q_base, do_base, qd0, qd1, dod0, dod1, lse_base, delta_base,
            mask_base, sqs, sqd, sds, sdd, smi, smj, offs_n, lo, full, kv_len, shift, qk_scale,
            seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep, D, Dv, BLOCK_M, C0, C1, CV0, CV1,
            HALF, True, CAUSAL, MASK_KIND, DROPOUT, USE_TMA, UPCAST, IEEE)
        dk, dv = _dkdv_split_inner(
            dk, dv, k0, k1, v0, v1, q_base, do_base, qd0, qd1, dod0, dod1, lse_base, delta_base,
            mask_base, sqs, sqd, sds, sdd, smi, smj, offs_n, full, m_whole, kv_len, shift,
            qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep, D, Dv, BLOCK_M, C0, C1,
            CV0, CV1, HALF, False, CAUSAL, MASK_KIND, DROPOUT, USE_TMA, UPCAST, IEEE)
        dk, dv = _dkdv_split_inner(
            dk, dv, k0, k1, v0, v1, q_base, do_base, qd0, qd1, dod0, dod1, lse_base, delta_base,
            mask_base, sqs, sqd, sds, sdd, smi, smj, offs_n, whole, m_end, kv_len, shift, qk_scale,
            seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep, D, Dv, BLOCK_M, C0, C1, CV0, CV1,
            HALF, True, CAUSAL, MASK_KIND, DROPOUT, USE_TMA, UPCAST, IEEE)
    # store the owned columns: chunk HALF of dK (if D has it) and of dV (if Dv has it)
    if HALF == 0:
        ck0 = 0
        cv0 = 0
        own_k = True
        own_v = True
    else:
        ck0 = C0
        cv0 = CV0
        own_k = C1 > 0
        own_v = CV1 > 0
    if own_k:
        offs_k = ck0 + tl.arange(0, DKW)
        dk = dk * sc
        tl.store(DK + b64 * sdkb + hk64 * sdkh + offs_n[:, None].to(tl.int64) * sdks
                 + offs_k[None, :] * sdkd, dk.to(DK.dtype.element_ty),
                 mask=nmask[:, None] & (offs_k[None, :] < D))
    if own_v:
        offs_v = cv0 + tl.arange(0, DVW)
        tl.store(DV + b64 * sdvb + hk64 * sdvh + offs_n[:, None].to(tl.int64) * sdvs
                 + offs_v[None, :] * sdvd, dv.to(DV.dtype.element_ty),
                 mask=nmask[:, None] & (offs_v[None, :] < Dv))


@triton.jit
def _dq_split_inner(dq, q0, q1, do0, do1, lse2, delta, k_base, v_base, kd0, kd1, vd0, vd1,
                    mask_base, sks, skd, svs, svd, smj, offs_m, lo, hi, kv_len, shift, qk_scale,
                    seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep, D, Dv,
                    BLOCK_N: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
                    CV0: tl.constexpr, CV1: tl.constexpr, HALF: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                    DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
                    IEEE: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k0 = _tile(k_base, kd0, start_n, 0, offs_n, sks, skd, Sk, D, BLOCK_N, C0, USE_TMA)
        acc = _dot(q0, tl.trans(k0), None, UPCAST, IEEE)
        if C1 > 0:
            k1 = _tile(k_base, kd1, start_n, C0, offs_n, sks, skd, Sk, D, BLOCK_N, C1, USE_TMA)
            acc = _dot(q1, tl.trans(k1), acc, UPCAST, IEEE)
        mptr = mask_base
        if MASK_KIND != 0:
            mptr = mask_base + offs_n[None, :].to(tl.int64) * smj
        s = _mask_scores(acc, mptr, offs_m[:, None], offs_n[None, :], kv_len, shift, qk_scale,
                         Sq, Sk, MASKED, CAUSAL, MASK_KIND)
        p = tl.math.exp2(s - lse2[:, None])
        v0 = _tile(v_base, vd0, start_n, 0, offs_n, svs, svd, Sk, Dv, BLOCK_N, CV0, USE_TMA)
        dp = _dot(do0, tl.trans(v0), None, UPCAST, IEEE)
        if CV1 > 0:
            v1 = _tile(v_base, vd1, start_n, CV0, offs_n, svs, svd, Sk, Dv, BLOCK_N, CV1, USE_TMA)
            dp = _dot(do1, tl.trans(v1), dp, UPCAST, IEEE)
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h, offs_m[:, None], offs_n[None, :], Hq, Sq, Sk,
                                threshold)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if HALF == 0:
            dq = _dot(ds.to(k0.dtype), k0, dq, UPCAST, IEEE)
        else:
            dq = _dot(ds.to(k1.dtype), k1, dq, UPCAST, IEEE)
    return dq


@triton.jit(do_not_specialize=["Hq", "seed", "offset"])  # head counts, RNG: no recompile
def _flash_bwd_dq_split_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, MASK, SCALE, KVLENS,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sdb, sdh, sds, sdd, sdqb, sdqh, sdqs, sdqd, smb, smh, smi, smj,
        Hq, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
        CV0: tl.constexpr, CV1: tl.constexpr, HALF: tl.constexpr, DQW: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One program: BLOCK_M query rows of one (b, h) and column chunk HALF of dQ (DQW
    wide), looping over key blocks; one launch per HALF."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rmask = offs_m < Sq
    q_base = Q + b64 * sqb + h64 * sqh
    do_base = DO + b64 * sdb + h64 * sdh
    q0 = _tile(q_base, _desc(q_base, Sq, D, sqs, BLOCK_M, C0, USE_TMA), start_m, 0, offs_m,
               sqs, sqd, Sq, D, BLOCK_M, C0, USE_TMA)
    do0 = _tile(do_base, _desc(do_base, Sq, Dv, sds, BLOCK_M, CV0, USE_TMA), start_m, 0, offs_m,
                sds, sdd, Sq, Dv, BLOCK_M, CV0, USE_TMA)
    q1 = q0
    do1 = do0
    if C1 > 0:
        q1 = _tile(q_base, _desc(q_base, Sq, D, sqs, BLOCK_M, C1, USE_TMA), start_m, C0, offs_m,
                   sqs, sqd, Sq, D, BLOCK_M, C1, USE_TMA)
    if CV1 > 0:
        do1 = _tile(do_base, _desc(do_base, Sq, Dv, sds, BLOCK_M, CV1, USE_TMA), start_m, CV0,
                    offs_m, sds, sdd, Sq, Dv, BLOCK_M, CV1, USE_TMA)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(LSE + row, mask=rmask, other=float("inf"))
    lse2 = _lse2(lse)
    delta = tl.load(DELTA + row, mask=rmask, other=0.0)
    sc = _load_scale(SCALE, scale, SCALE_PTR, INVERT)
    qk_scale = sc * 1.4426950408889634
    kv_len, shift = _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS, CAUSAL)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    kd0 = _desc(k_base, Sk, D, sks, BLOCK_N, C0, USE_TMA)
    vd0 = _desc(v_base, Sk, Dv, svs, BLOCK_N, CV0, USE_TMA)
    kd1 = kd0
    vd1 = vd0
    if C1 > 0:
        kd1 = _desc(k_base, Sk, D, sks, BLOCK_N, C1, USE_TMA)
    if CV1 > 0:
        vd1 = _desc(v_base, Sk, Dv, svs, BLOCK_N, CV1, USE_TMA)
    mask_base = MASK
    if MASK_KIND != 0:
        mask_base = MASK + b64 * smb + h64 * smh + offs_m[:, None].to(tl.int64) * smi
    hi = kv_len
    if CAUSAL != 0:
        last_row = tl.minimum(start_m + BLOCK_M, Sq) - 1
        hi = tl.minimum(hi, last_row + shift + 1)
        full = tl.minimum(kv_len, start_m + shift + 1)
    else:
        full = kv_len
    hi = tl.maximum(hi, 0)
    full = tl.maximum(full, 0)
    full = (full // BLOCK_N) * BLOCK_N
    full = tl.minimum(full, hi)
    dq = tl.zeros([BLOCK_M, DQW], tl.float32)
    dq = _dq_split_inner(dq, q0, q1, do0, do1, lse2, delta, k_base, v_base, kd0, kd1, vd0, vd1,
                         mask_base, sks, skd, svs, svd, smj, offs_m, 0, full, kv_len, shift,
                         qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep, D, Dv,
                         BLOCK_N, C0, C1, CV0, CV1, HALF, False, CAUSAL, MASK_KIND, DROPOUT,
                         USE_TMA, UPCAST, IEEE)
    dq = _dq_split_inner(dq, q0, q1, do0, do1, lse2, delta, k_base, v_base, kd0, kd1, vd0, vd1,
                         mask_base, sks, skd, svs, svd, smj, offs_m, full, hi, kv_len, shift,
                         qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep, D, Dv,
                         BLOCK_N, C0, C1, CV0, CV1, HALF, True, CAUSAL, MASK_KIND, DROPOUT,
                         USE_TMA, UPCAST, IEEE)
    dq = dq * sc
    offs_c = HALF * C0 + tl.arange(0, DQW)
    tl.store(DQ + b64 * sdqb + h64 * sdqh + offs_m[:, None].to(tl.int64) * sdqs
             + offs_c[None, :] * sdqd, dq.to(DQ.dtype.element_ty),
             mask=rmask[:, None] & (offs_c[None, :] < D))


def split_chunks(d: int) -> tuple[int, int]:
    """(C0, C1): the two column chunks of a head dim for the split kernels (C1 = 0: none)."""
    c0 = min(128, block_d(d))
    return c0, (block_d(d - c0) if d > c0 else 0)


def use_split(problem) -> bool:
    """The head-dim split kernels serve D or Dv > 128 (the fused kernels spill there)."""
    return max(problem.D, problem.Dv) > 128


# ---- launcher ---------------------------------------------------------------------------

_PRE = ("o", "do", "lse", "delta")
_DKDV = ("q", "k", "v", "do", "lse", "delta", "dk", "dv", "mask", "scale", "kvl")
_DQ = ("q", "k", "v", "do", "lse", "delta", "dq", "mask", "scale", "kvl")


def _contiguous_strides(*shape: int) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def backward_plan(problem, args, cfg: configs.TileConfig, *, use_tma: bool,
                  split: bool | str | None = None, dq_cfg: configs.TileConfig | None = None,
                  dq_split: bool | None = None) -> list[tuple[str, list[tuple[Launch, tuple[str, ...]]]]]:
    """The backward's planned launches by stage, [(stage, [(Launch, pointer names)])]:
    preprocess (delta = rowsum(o * do)), dK/dV, dQ. Everything but the pointers is fixed
    by the problem, the strides of q, k, v, o, do and the per-call scalars.

    `split`: the head-dim split kernels (default: use_split(problem), i.e. max(D, Dv) >
    128), or "separate": the fused dK/dV kernel launched for dV alone and then for dK
    alone (5 GEMM-sized products per tile instead of the split kernel's 6; opt-in);
    `dq_split` (default: split is True) the same for the dQ kernel alone: unsplit, it
    holds a full-width f32 accumulator but forms S and dP once, which fits with short key
    steps; `dq_cfg`: the dQ kernel's own tiles (default `cfg`; BM keys per step, BN query
    rows per program)."""
    q, k, v, do, o = args.q, args.k, args.v, args.do, args.o
    B, Hq, Hkv, Sq, Sk = problem.B, problem.Hq, problem.Hkv, problem.Sq, problem.Sk
    D, Dv = problem.D, problem.Dv
    _, ms = mask_view(problem, args.attn_mask)
    scale, _ = scale_args(problem, args)
    seed, offset, threshold, inv_keep = dropout_args(problem, args)
    BD, BDV = block_d(D), block_d(Dv)
    interp = interpreting()
    common = dict(USE_TMA=use_tma, CAUSAL=_CAUSAL_CODE[problem.causal],
                  MASK_KIND=_MASK_CODE[problem.mask], SCALE_PTR=problem.scale == "tensor",
                  INVERT=problem.invert_scale, HAS_KVLENS=args.kv_lens is not None,
                  DROPOUT=problem.dropout_p > 0, UPCAST=interp and q.dtype == torch.bfloat16,
                  IEEE=q.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sdq, sdk, sdv = _contiguous_strides(B, Hq, Sq, D), _contiguous_strides(B, Hkv, Sk, D), \
        _contiguous_strides(B, Hkv, Sk, Dv)
    scalars = (scale, seed, offset, threshold, inv_keep)
    in_strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    dkdv_tail = (*in_strides, *sdk, *sdv, *ms, Hq, Hkv, Sq, Sk, problem.group, D, Dv, *scalars)
    dq_tail = (*in_strides, *sdq, *ms, Hq, Sq, Sk, problem.group, D, Dv, *scalars)
    if problem.dropout_p > 0:    # (seed, offset) set per call: Launch.with_counters
        common["counters_at"] = len(dkdv_tail) - 4
        dq_at = len(dq_tail) - 4
    else:
        dq_at = None
    PRE_M = 64 if not interp else 16
    BM, BN = cfg.block_m, cfg.block_n
    dcfg = dq_cfg or cfg
    if split is None:
        split = use_split(problem)
    if dq_split is None:
        dq_split = split is True
    C0, C1 = split_chunks(D)
    CV0, CV1 = split_chunks(Dv)
    chunks = dict(C0=C0, C1=C1, CV0=CV0, CV1=CV1)

    pre = [(Launch(_bwd_preprocess, (triton.cdiv(Sq, PRE_M), B * Hq), (*o.stride(), *do.stride(), Hq, Sq, Dv),
                   BLOCK_M=PRE_M, BLOCK_DV=BDV), _PRE)]
    kv_grid = (triton.cdiv(Sk, BN), B * Hkv)
    if split == "separate":  # the fused kernel twice: dV only, then dK only
        dkdv = [(Launch(_flash_bwd_dkdv_kernel, kv_grid, dkdv_tail, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
                        BLOCK_DV=BDV, WHICH=which, **common), _DKDV) for which in (1, 2)]
    elif split:
        dkdv = [(Launch(_flash_bwd_dkdv_split_kernel, kv_grid, dkdv_tail, BLOCK_M=BM, BLOCK_N=BN, HALF=half,
                        DKW=max(C1, 16) if half else C0, DVW=max(CV1, 16) if half else CV0, **chunks, **common),
                 _DKDV) for half in (0, 1)]
    else:
        dkdv = [(Launch(_flash_bwd_dkdv_kernel, kv_grid, dkdv_tail, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
                        BLOCK_DV=BDV, **common), _DKDV)]
    q_grid = (triton.cdiv(Sq, dcfg.block_n), B * Hq)
    dcommon = dict(common, num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, counters_at=dq_at)
    if dq_split:
        dq = [(Launch(_flash_bwd_dq_split_kernel, q_grid, dq_tail, BLOCK_M=dcfg.block_n, BLOCK_N=dcfg.block_m,
                      HALF=half, DQW=C1 if half else C0, **chunks, **dcommon), _DQ)
              for half in ((0, 1) if C1 else (0,))]
    else:
        dq = [(Launch(_flash_bwd_dq_kernel, q_grid, dq_tail, BLOCK_M=dcfg.block_n, BLOCK_N=dcfg.block_m,
                      BLOCK_D=BD, BLOCK_DV=BDV, **dcommon), _DQ)]
    return [("pre", pre), ("dkdv", dkdv), ("dq", dq)]


def _buffers(problem, args, out=None) -> dict[str, torch.Tensor]:
    """The pointers of the backward launches: inputs, outputs (dq, dk, dv; `out` gives
    them, e.g. poisoned ones in tests) and the f32 delta scratch."""
    q = args.q
    B, Hq, Hkv, Sq, Sk = problem.B, problem.Hq, problem.Hkv, problem.Sq, problem.Sk
    if out is not None:
        dq, dk, dv = out
    else:
        dq = alloc.empty((B, Hq, Sq, problem.D), q.dtype, q.device)
        dk = alloc.empty((B, Hkv, Sk, problem.D), q.dtype, q.device)
        dv = alloc.empty((B, Hkv, Sk, problem.Dv), q.dtype, q.device)
    lse = args.lse
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.float().contiguous()
    mask, _ = mask_view(problem, args.attn_mask)
    _, scale_t = scale_args(problem, args)
    return dict(q=q, k=args.k, v=args.v, do=args.do, o=args.o, lse=lse, dq=dq, dk=dk, dv=dv,
                delta=alloc.empty((B, Hq, Sq), torch.float32, q.device),
                mask=mask if mask is not None else q, scale=scale_t if scale_t is not None else q,
                kvl=args.kv_lens if args.kv_lens is not None else q)


def _run_stage(launches, bufs: dict[str, torch.Tensor], checked: bool = False, counters: tuple | None = None):
    """Launch a stage; `checked`: the plan key fixed every pointer's alignment; `counters`:
    this call's dropout (seed, offset), where the plan was made for another call's."""
    ck = None
    for launch, names in launches:
        ptrs = tuple(bufs[n] for n in names)
        if counters is not None:
            launch = launch.with_counters(*counters)
        ck = launch.run_aligned(*ptrs) if checked else launch(*ptrs)
    return ck


def backward_launches(problem, args, cfg: configs.TileConfig, *, out=None,
                      use_tma: bool | None = None, split: bool | str | None = None,
                      dq_cfg: configs.TileConfig | None = None, dq_split: bool | None = None):
    """((dq, dk, dv), [(name, launch)]): the output buffers and the three stages
    (preprocess, dkdv, dq) as closures returning the compiled kernel, so the benchmark
    can time each. Keywords as for backward_plan; `out` = (dq, dk, dv) buffers."""
    if use_tma is None:
        use_tma = tma_ok(args.q, args.k, args.v, args.do)
    if use_tma:
        ensure_allocator(args.q.device)
    bufs = _buffers(problem, args, out)
    stages = backward_plan(problem, args, cfg, use_tma=use_tma, split=split, dq_cfg=dq_cfg, dq_split=dq_split)
    return (bufs["dq"], bufs["dk"], bufs["dv"]), [(name, lambda ls=ls: _run_stage(ls, bufs)) for name, ls in stages]


def flash_backward(problem, args, cfg: configs.TileConfig, *, out=None,
                   use_tma: bool | None = None, split: bool | str | None = None,
                   dq_cfg: configs.TileConfig | None = None, dq_split: bool | None = None):
    """Launch preprocess, dK/dV and dQ kernels. Returns (dq, dk, dv) in q's dtype. A tile
    config that does not fit the GPU's shared memory is shrunk (configs.shrink; the dQ
    kernel then takes the shrunk `cfg` too). Keywords as for backward_plan."""
    key = ("bwd", problem.key(), cfg, use_tma, split, dq_cfg, dq_split)
    cfg, dq_cfg = configs.FITTED.get(key, (cfg, dq_cfg))
    while True:
        outs, launches = backward_launches(problem, args, cfg, out=out, use_tma=use_tma,
                                           split=split, dq_cfg=dq_cfg, dq_split=dq_split)
        try:
            for _, launch in launches:
                launch()
            return outs
        except OutOfResources:
            cfg, dq_cfg = configs.shrink(cfg), None
            configs.FITTED[key] = (cfg, dq_cfg)


class BackwardPlan:
    """The solver's invoker: the planned launches per set of input strides, per-call
    scalars and TMA eligibility; a call allocates dq, dk, dv and delta and launches."""

    def __init__(self, problem, cfg: configs.TileConfig, dq_cfg: configs.TileConfig | None,
                 dq_split: bool | None):
        self.problem, self.cfg, self.dq_cfg, self.dq_split = problem, cfg, dq_cfg, dq_split
        self.plans: dict[tuple, list] = {}

    def __call__(self, args):
        key = plan_key(args)
        stages = self.plans.get(key)
        if stages is None:
            if len(self.plans) >= 64:
                self.plans.clear()
            stages = self.plans[key] = backward_plan(
                self.problem, args, self.cfg, use_tma=tma_ok(args.q, args.k, args.v, args.do),
                dq_cfg=self.dq_cfg, dq_split=self.dq_split)
        bufs = _buffers(self.problem, args)
        try:
            counters = (args.seed, args.offset) if self.problem.dropout_p > 0 else None
            for _, launches in stages:
                _run_stage(launches, bufs, checked=True, counters=counters)
        except OutOfResources:
            self.cfg, self.dq_cfg = configs.shrink(self.cfg), None
            self.plans.clear()
            return self(args)
        return bufs["dq"], bufs["dk"], bufs["dv"]


def _split_descriptors(problem) -> int:
    """In-kernel TMA descriptors of a head-dim split kernel: Q, K, dO, V for chunk 0 and
    again for chunk 1 where it exists and differs in width (identical ones are merged)."""
    (c0, c1), (cv0, cv1) = split_chunks(problem.D), split_chunks(problem.Dv)
    return 4 + 2 * (0 < c1 != c0) + 2 * (0 < cv1 != cv0)


def workspace_bytes(problem) -> int:
    """delta plus the TMA scratch of the larger launch, as the solver's invoker runs them
    (default tiles, the head-dim split kernels for max(D, Dv) > 128) on contiguous inputs."""
    delta = 4 * problem.B * problem.Hq * problem.Sq
    if not tma_expected(problem):
        return delta
    _, cfg = configs.choose(problem)
    split = use_split(problem)
    dq_cfg, dq_split = configs.choose_dq(problem) if split else (None, None)
    dq_cfg = dq_cfg or cfg
    if dq_split is None:        # as backward_launches: split like dK/dV
        dq_split = split
    dkdv = (_split_descriptors(problem) if split else 4) * triton.cdiv(problem.Sk, cfg.block_n) * problem.B * problem.Hkv
    dq = (_split_descriptors(problem) if dq_split else 4) * triton.cdiv(problem.Sq, dq_cfg.block_n) * problem.B * problem.Hq
    return delta + TMA_DESC_BYTES * max(dkdv, dq)


# ---- solver -----------------------------------------------------------------------------

@register
class FlashBackward(FlashBase):
    """Triton flash attention backward: preprocess + dK/dV + dQ, deterministic."""
    id = 111
    name = "flash_bwd"
    directions = frozenset({"bwd"})

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def estimate(self, problem) -> float | None:
        # measured on the H200: ~0.45 of peak (nominal FLOPs) up to D = 128, ~0.25 above
        # (the split kernels recompute S and dP per column half)
        return roofline_ms(problem, 0.25 if use_split(problem) else 0.45)

    def prepare(self, problem):
        dq_cfg, dq_split = configs.choose_dq(problem) if use_split(problem) else (None, None)
        return BackwardPlan(problem, configs.choose(problem)[1], dq_cfg, dq_split)

