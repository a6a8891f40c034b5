"""Triton helpers shared by the flash attention backward solvers (111 `flash_bwd`,
123 `flash_bwd_atomic`, 124 `flash_bwd_ordered`): score masking in the log2 domain,
the scale, the per-batch kv length and causal shift, and the query range of one key
block. Each is inlined into its kernels, so the kernels compile as if written there."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import aligned16, int_width
from .flash_fwd import _dot


@triton.jit
def _mask_scores(s, mask_ptrs, rows, cols, kv_len, shift, qk_scale, Sq, Sk,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """log2-domain scores from the raw dot tile `s` with masks; rows/cols are the
    query/key index blocks broadcast to the tile's shape (either orientation)."""
    s = s * qk_scale
    if MASK_KIND != 0:
        mvalid = (rows < Sq) & (cols < Sk)
        if MASK_KIND == 1:
            mv = tl.load(mask_ptrs, mask=mvalid, other=1)
            s = tl.where(mv != 0, s, float("-inf"))
        else:
            mv = tl.load(mask_ptrs, mask=mvalid, other=0.0).to(tl.float32)
            s = s + mv * 1.4426950408889634
    if MASKED:
        valid = cols < kv_len
        if CAUSAL != 0:
            valid = valid & (cols <= rows + shift)
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _scores(a, b_t, mask_ptrs, rows, cols, kv_len, shift, qk_scale, Sq, Sk,
            MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
            UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """log2-domain scores of the tile a @ b_t with masks."""
    return _mask_scores(_dot(a, b_t, None, UPCAST, IEEE), mask_ptrs, rows, cols, kv_len, shift,
                        qk_scale, Sq, Sk, MASKED, CAUSAL, MASK_KIND)


@triton.jit
def _load_scale(SCALE, scale, SCALE_PTR: tl.constexpr, INVERT: tl.constexpr):
    """The softmax scale: the float argument, or the tensor's value (inverted if asked)."""
    if SCALE_PTR:
        sc = tl.load(SCALE).to(tl.float32)
        if INVERT:
            sc = 1.0 / sc
    else:
        sc = scale
    return sc


@triton.jit
def _kv_block(K, V, b64, hk, start_n, Sk, D, Dv, skb, skh, sks, skd, svb, svh, svs, svd,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr):
    """The (k [BLOCK_N, BLOCK_D], v [BLOCK_N, BLOCK_DV]) tiles of keys start_n.. of one
    (b, kv head), zero past Sk / D / Dv: through in-kernel TMA descriptors or masked loads."""
    if USE_TMA:
        k = tl.make_tensor_descriptor(K + b64 * skb + hk.to(tl.int64) * skh, shape=[Sk, D],
                                      strides=[sks, 1], block_shape=[BLOCK_N, BLOCK_D]).load([start_n, 0])
        v = tl.make_tensor_descriptor(V + b64 * svb + hk.to(tl.int64) * svh, shape=[Sk, Dv],
                                      strides=[svs, 1], block_shape=[BLOCK_N, BLOCK_DV]).load([start_n, 0])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        nmask = offs_n < Sk
        k = tl.load(K + b64 * skb + hk.to(tl.int64) * skh + offs_n[:, None].to(tl.int64) * sks
                    + offs_d[None, :] * skd, mask=nmask[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + b64 * svb + hk.to(tl.int64) * svh + offs_n[:, None].to(tl.int64) * svs
                    + offs_dv[None, :] * svd, mask=nmask[:, None] & (offs_dv[None, :] < Dv),
                    other=0.0)
    return k, v


@triton.jit
def _lse2(lse):
    """log2-domain lse; a fully masked row (-inf) becomes +inf so its P is 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634


@triton.jit
def _query_ranges(start_n, kv_len, shift, Sq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """(lo, full, m_whole, whole, m_end): the query rows that see a key of the block
    [start_n, start_n + BLOCK_N) are [lo, m_end); [lo, full) and [whole, m_end) need the
    per-element masks, [full, m_whole) does not (every row sees every key there). All
    multiples of BLOCK_M; lo is nondecreasing in start_n (the ordered dQ relies on it)."""
    m_end = tl.cdiv(Sq, BLOCK_M) * BLOCK_M
    m_whole = (Sq // BLOCK_M) * BLOCK_M
    if CAUSAL != 0:
        lo = tl.maximum(start_n - shift, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        full = tl.maximum(start_n + BLOCK_N - 1 - shift, 0)
        full = tl.cdiv(full, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full = 0
    lo = tl.minimum(lo, m_end)
    if start_n >= kv_len:
        lo = m_end  # no visible key in this block
    full = tl.maximum(full, lo)
    if start_n + BLOCK_N > kv_len:
        full = m_end  # the block crosses kv_len: mask every query block
    full = tl.minimum(full, m_end)
    whole = tl.maximum(m_whole, full)
    return lo, full, m_whole, whole, m_end


@triton.jit
def _delta_rows(O, DO, LSE, DELTA, pid_m, pid_bh, sob, soh, sos, sod, sdb, sdh, sds, sdd, Hq, Sq, Dv,
                BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta = rowsum(o * do) (f32) of BLOCK_M rows of one (b, h); 0 for fully masked rows
    (lse = -inf), whose gradients are 0."""
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    msk = (offs_m[:, None] < Sq) & (offs_d[None, :] < Dv)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sos + offs_d[None, :] * sod,
                mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None].to(tl.int64) * sds + offs_d[None, :] * sdd,
                 mask=msk, other=0.0).to(tl.float32)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(LSE + row, mask=offs_m < Sq, other=0.0)
    delta = tl.sum(o * do, 1)
    delta = tl.where(lse == float("-inf"), 0.0, delta)
    tl.store(DELTA + row, delta, mask=offs_m < Sq)


def plan_key(args) -> tuple:
    """What a backward plan specialises on besides the problem: the strides, the per-call
    scalars (of the dropout counters only their integer widths: `Launch.with_counters` sets
    them per call) and every pointer's 16-byte alignment (the invokers of 111, 123 and 124)."""
    m = args.attn_mask
    return (args.q.stride(), args.k.stride(), args.v.stride(), args.o.stride(), args.do.stride(),
            None if m is None else (m.shape, m.stride()),
            None if isinstance(args.scale, torch.Tensor) else args.scale, int_width(args.seed), int_width(args.offset),
            aligned16(args.q, args.k, args.v, args.do, args.o, args.lse, m, args.kv_lens, args.scale))
