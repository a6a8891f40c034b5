"""Decode attention (flash-decoding): few query rows against a long K/V cache.

Computes, for every batch b and query head h (KV head hk = h // G, G = Hq // Hkv):

    s_ij = scale * q_i . k_j  (+ additive mask | bool mask | causal | kv_lens)
    lse_i = log sum_j exp(s_ij)         (natural log, f32; -inf for a fully masked row)
    o_i   = sum_j dropout(softmax(s)_ij) v_j

Layout of the work (memory bound: the time is the time to read K and V once):
- GQA batching: one program owns all G query heads x Sq rows of one KV head (the rows
  r = hl * Sq + i, up to `block_m` of them), so K/V of that head are read once.
- Split-K: the keys of each batch entry (its own kv_lens length) are cut into `splits`
  contiguous chunks, one program each; a second kernel merges the partial outputs
  with their LSEs:  o = sum_s exp(lse_s - LSE) o_s,  LSE = log sum_s exp(lse_s).
  `splits` is chosen so that >= ~2 waves of the GPU's SMs are busy even at batch 1.
- Quantized K and/or V (`KVQuant`: s8/u8 codes, s4/u4 two per byte along D with the
  even element in the low nibble, scales and optional zero points per tensor or per
  (b, h, token, group along D)) are dequantized in registers: (code - zp) * scale.

Supported: Sq 1..16, any Sk (ragged kv_lens incl. 0), D and Dv up to 256 (any size,
masked to the next power of two), q f32/f16/bf16 (o has q's dtype), GQA/MQA, causal
top-left and bottom-right (aligned to each entry's kv_lens), bool/additive masks
broadcastable to (B, Hq, Sq, Sk), scale float/tensor/inverted, dropout (nnprim.dropout),
return_lse. Forward only: decode serves inference.

Indexing: batch, head, query-row and key-row offsets are int64 (a K/V cache whose key
stride times Sk passes 2**31 elements, e.g. a (B, Sk, H, D) cache seen as (B, H, Sk, D),
is fine). Workspace: the f32 split partials (`workspace_bytes`), none with one split.

Reading order: Triton kernels -> launcher (`decode_forward`) -> solvers (ids 120, 121).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import alloc
from ..args import AttnArgs
from ..dropout import dropout_keep, dropout_scale, dropout_threshold
from ..launch import Launch, int_width, interpreting
from ..limits import grid_reasons
from ..quant import KVQuant
from ..search.solver import Solver, register
from .code_convert import codes_f16
from .paging import page_rows, pipeline_stages

# ---- Triton kernels ---------------------------------------------------------------

# group-parameter layouts (how scales / zero points map onto the (N, D) tile)
_GL_ROW = 0      # one group per token row (group_size == D)
_GL_RESHAPE = 1  # power-of-two group: view the tile as (N, D // g, g)
_GL_GATHER = 2   # any other group size: gather per element
# kv_lens the balanced schedule reads at once, one width for every batch (a new batch size
# compiles nothing; reading B rounded up to a power of two at once ran no faster, H200 2026-12-04)
LENS_PER_LOAD: tl.constexpr = tl.constexpr(32)


@triton.jit
def visible_keys(L, Sq, CAUSAL: tl.constexpr):
    """(shift, kv_end) of a sequence of L >= 0 valid keys: query row i sees key j < kv_end with
    (causal) j <= i + shift (CAUSAL 1: top-left, shift 0, no key past Sq seen; 2: bottom-right,
    shift L - Sq). L may be a vector (one per sequence)."""
    if CAUSAL == 1:
        shift = 0
        kv_end = tl.minimum(L, Sq)
    else:
        shift = L - Sq
        kv_end = L
    return shift, kv_end


@triton.jit
def key_chunk(LENS, b, split, Sq, Sk, SPLITS, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_LENS: tl.constexpr):
    """(L, shift, start, end) of key chunk `split` of sequence b, shared by the decode kernels:
    L its valid keys (kv_lens clamped into [0, Sk]); query row i sees key j < L with (causal)
    j <= i + shift (CAUSAL 1: top-left, shift 0; 2: bottom-right, shift L - Sq); [start, end)
    the chunk's keys: whole BLOCK_N blocks of the visible range, divided evenly over SPLITS."""
    if HAS_LENS:
        L = tl.minimum(tl.maximum(tl.load(LENS + b).to(tl.int32), 0), Sk)  # clamped: never past the keys
    else:
        L = Sk
    shift, kv_end = visible_keys(L, Sq, CAUSAL)
    per = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), SPLITS)
    start = split * per * BLOCK_N
    return L, shift, start, tl.minimum(start + per * BLOCK_N, kv_end)


@triton.jit
def clamped_lens(LENS, bi, B, Sk):
    """kv_lens of sequences `bi` (a vector; those >= B give 0) clamped into [0, Sk]."""
    return tl.minimum(tl.maximum(tl.load(LENS + bi, mask=bi < B, other=0).to(tl.int32), 0), Sk)


@triton.jit
def visible_blocks(L, Sq, BN: tl.constexpr, CAUSAL: tl.constexpr):
    """Key blocks of BN keys a sequence of L valid keys attends to (visible_keys)."""
    kv_end = visible_keys(L, Sq, CAUSAL)[1]
    return (kv_end + BN - 1) // BN


@triton.jit
def chunk_count(nblk, total, B, SPLITS):
    """Chunks a sequence of `nblk` key blocks gets when a KV head's B * SPLITS programs are
    shared in proportion to length (`balanced_counts`): one each, the other B * (SPLITS - 1)
    by share of the `total` blocks (rounded down, so they never run out), each chunk >= 4
    blocks where the sequence has them."""
    share = floor_muldiv(nblk, B * SPLITS - B, total)
    return tl.minimum(share + 1, tl.maximum((nblk + 3) // 4, 1))


@triton.jit
def floor_muldiv(a, k, d):
    """floor(a * k / d) for 0 <= a <= d and k < 2^20 (balanced_bn keeps B * SPLITS under it),
    exact: an f32 estimate (off by at most 1) corrected against the int64 product. An int64
    `//` calls a subroutine, and a kernel with a call lost the uniform datapath in its main loop
    (solver 133 ~8 % slower, sm_90 SASS, 2026-12-04)."""
    q = (a.to(tl.float32) * k.to(tl.float32) / d.to(tl.float32)).to(tl.int32)
    r = a.to(tl.int64) * k - q.to(tl.int64) * d
    for _ in tl.static_range(2):
        q = tl.where(r < 0, q - 1, tl.where(r >= d, q + 1, q))
        r = tl.where(r < 0, r + d, tl.where(r >= d, r - d, r))
    return q


@triton.jit
def balanced_chunk(LENS, p, B, Sq, Sk, SPLITS, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(b, L, shift, start, end) of program p of a KV head's B * SPLITS when the chunks are
    shared by kv_lens (`balanced_counts`): with ragged lengths the wave then ends when the
    mean sequence would, not the longest. Programs past the last chunk get an empty one.
    The lengths are read LENS_PER_LOAD at a time: the first ones once for both passes, the
    rest in loops.
    (gluon_decode_quant._balanced_chunk is the Gluon twin.)"""
    bi = tl.arange(0, LENS_PER_LOAD)
    lv = clamped_lens(LENS, bi, B, Sk)
    nb = visible_blocks(lv, Sq, BLOCK_N, CAUSAL)
    total = tl.sum(nb, 0)
    for b0 in range(LENS_PER_LOAD, B, LENS_PER_LOAD):
        total += tl.sum(visible_blocks(clamped_lens(LENS, b0 + bi, B, Sk), Sq, BLOCK_N, CAUSAL), 0)
    total = tl.maximum(total, 1)
    cum = tl.cumsum(tl.where(bi < B, chunk_count(nb, total, B, SPLITS), 0), 0)
    before = cum <= p
    b = tl.sum(before.to(tl.int32), 0)
    first = tl.max(tl.where(before, cum, 0), 0)
    carry = tl.max(cum, 0)
    L = tl.sum(tl.where(bi == b, lv, 0), 0)
    for b0 in range(LENS_PER_LOAD, B, LENS_PER_LOAD):
        lb = clamped_lens(LENS, b0 + bi, B, Sk)
        cnt = tl.where(b0 + bi < B, chunk_count(visible_blocks(lb, Sq, BLOCK_N, CAUSAL), total, B, SPLITS), 0)
        cum = carry + tl.cumsum(cnt, 0)
        before = cum <= p
        b += tl.sum(before.to(tl.int32), 0)
        first = tl.maximum(first, tl.max(tl.where(before, cum, 0), 0))
        L += tl.sum(tl.where(b0 + bi == b, lb, 0), 0)
        carry += tl.sum(cnt, 0)
    return chunk_range(p, b, first, L, total, B, Sq, SPLITS, BLOCK_N, CAUSAL)


@triton.jit
def chunk_range(p, b, first, L, total, B, Sq, SPLITS, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(b, L, shift, start, end) of program p, chunk p - first of sequence b of L clamped
    valid keys (b == B: idle, an empty chunk of sequence B - 1, L 0); scalars only, so the
    Gluon twin shares it."""
    live = b < B
    b = tl.minimum(b, B - 1)
    shift, kv_end = visible_keys(L, Sq, CAUSAL)
    nb = (kv_end + BLOCK_N - 1) // BLOCK_N
    per = tl.cdiv(nb, chunk_count(nb, total, B, SPLITS))
    start = (p - first) * per * BLOCK_N
    end = tl.where(live, tl.minimum(start + per * BLOCK_N, kv_end), 0)
    start = tl.where(live, start, 0)
    return b, L, shift, start, end


@triton.jit
def program_chunk(LENS, pid_bh, split, Hkv, Sq, Sk, SPLITS, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_LENS: tl.constexpr, BALANCED: tl.constexpr):
    """(b, L, shift, start, end) of the program (pid_bh = b' * Hkv + hk, split): key_chunk of
    sequence b', or with BALANCED the chunks shared by kv_lens (balanced_chunk)."""
    if BALANCED:
        b, L, shift, start, end = balanced_chunk(LENS, (pid_bh // Hkv) * SPLITS + split, tl.num_programs(0) // Hkv,
                                                 Sq, Sk, SPLITS, BLOCK_N, CAUSAL)
    else:
        b = pid_bh // Hkv
        L, shift, start, end = key_chunk(LENS, b, split, Sq, Sk, SPLITS, BLOCK_N, CAUSAL, HAS_LENS)
    return b, L, shift, start, end


@triton.jit
def partial_row(rows, b64, hk, split, Hkv, G, Sq, SPLITS, BALANCED: tl.constexpr):
    """Index of the f32 partial (PO / DV, PL) of query rows `rows` (hl * Sq + qi) of KV head hk:
    row (b, h, qi) of the output times SPLITS plus the split, or with BALANCED slot p of the
    head's B * SPLITS (combine reads chunk_count of them from first_b)."""
    if BALANCED:
        p = (tl.program_id(0) // Hkv) * SPLITS + split
        r = (hk.to(tl.int64) * (tl.num_programs(0) // Hkv) * SPLITS + p) * (G * Sq) + rows
    else:
        r = ((b64 * Hkv + hk) * (G * Sq) + rows) * SPLITS + split
    return r


@triton.jit
def _group_param(ptr, roff, n_ok, s_g, GROUPED: tl.constexpr, GL: tl.constexpr,
                 GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, OTHER: tl.constexpr):
    """Scale or zero point for a (BLOCK_N, BLOCK_D) tile, broadcastable against it (or
    against its (BLOCK_N, BLOCK_D // GROUP, GROUP) view when GL == _GL_RESHAPE)."""
    if not GROUPED:
        return tl.load(ptr).to(tl.float32)
    elif GL == 0:
        return tl.load(ptr + roff, mask=n_ok, other=OTHER).to(tl.float32)[:, None]
    elif GL == 1:
        offs_g = tl.arange(0, BLOCK_D // GROUP)
        p = ptr + roff[:, None] + offs_g[None, :] * s_g
        m = n_ok[:, None] & (offs_g[None, :] < D // GROUP)
        return tl.load(p, mask=m, other=OTHER).to(tl.float32)[:, :, None]
    else:
        offs_d = tl.arange(0, BLOCK_D)
        p = ptr + roff[:, None] + (offs_d // GROUP)[None, :] * s_g
        m = n_ok[:, None] & (offs_d[None, :] < D)
        return tl.load(p, mask=m, other=OTHER).to(tl.float32)


@triton.jit
def l1_pairs(c):
    """Pair index held by byte column c of 4-bit codes in KVQuant layout 1 (within each 4-byte
    word, bytes 1 and 2 swap: nibble order (0, 1, 4, 5, 2, 3, 6, 7)); layout 0: c itself."""
    return (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)


@triton.jit
def _load_kv_tile(ptr, roff, n_ok, s_d, sc_ptr, sc_roff, sc_g, zp_ptr, zp_roff, zp_g,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  QBITS: tl.constexpr, SIGNED: tl.constexpr, GROUP: tl.constexpr,
                  SC_GROUPED: tl.constexpr, HAS_ZP: tl.constexpr, ZP_GROUPED: tl.constexpr,
                  GL: tl.constexpr, DOT_DTYPE: tl.constexpr, L1: tl.constexpr, FOLD: tl.constexpr = False):
    """A (BLOCK_N, BLOCK_D) tile of K or V rows at int64 element offsets `roff` from ptr (of
    scales / zero points: sc_roff / zp_roff) in DOT_DTYPE; rows with n_ok False and columns
    >= D are 0. QBITS: 0 = float tensor, 8 = s8/u8/fp8 codes, 4 = packed s4/u4
    (L1: KVQuant layout 1, the bytes of each pair read from their layout-1 place).
    FOLD (8-bit codes, one scale per tensor or head, no zero point): the codes themselves,
    converted exactly to DOT_DTYPE (f16); the kernel applies the scale to s / o."""
    if FOLD:
        offs_d = tl.arange(0, BLOCK_D)
        p = ptr + roff[:, None] + offs_d[None, :] * s_d
        c = tl.load(p, mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        if DOT_DTYPE == tl.float16:   # CUDA: converted in registers (code_convert.codes_f16)
            return codes_f16(c, c.dtype == tl.float8e4nv, SIGNED)
        return c.to(DOT_DTYPE)
    elif QBITS == 0:
        offs_d = tl.arange(0, BLOCK_D)
        p = ptr + roff[:, None] + offs_d[None, :] * s_d
        x = tl.load(p, mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        return x.to(DOT_DTYPE)
    else:
        # integer codes -> f32 by conversion (a "magic number" OR into the mantissa of 2**23
        # measured slower on the H200: benchmarks/DECODE.md)
        if QBITS == 8:
            offs_d = tl.arange(0, BLOCK_D)
            p = ptr + roff[:, None] + offs_d[None, :] * s_d
            c = tl.load(p, mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            x = c.to(tl.float32)
        else:
            offs_b = tl.arange(0, BLOCK_D // 2)
            if L1:
                p = ptr + roff[:, None] + l1_pairs(offs_b)[None, :] * s_d
            else:
                p = ptr + roff[:, None] + offs_b[None, :] * s_d
            c = tl.load(p, mask=n_ok[:, None] & (offs_b[None, :] < D // 2), other=0).to(tl.int32)
            lo = c & 15
            hi = (c >> 4) & 15
            if SIGNED:
                lo = (lo ^ 8) - 8
                hi = (hi ^ 8) - 8
            x = tl.interleave(lo, hi).to(tl.float32)
        if GL == 1:
            x = tl.reshape(x, (BLOCK_N, BLOCK_D // GROUP, GROUP))
        if HAS_ZP:
            x = x - _group_param(zp_ptr, zp_roff, n_ok, zp_g, ZP_GROUPED, GL, GROUP, D, BLOCK_D, 0.0)
        x = x * _group_param(sc_ptr, sc_roff, n_ok, sc_g, SC_GROUPED, GL, GROUP, D, BLOCK_D, 1.0)
        if GL == 1:
            x = tl.reshape(x, (BLOCK_N, BLOCK_D))
        return x.to(DOT_DTYPE)


@triton.jit
def _pow2_rows(x):
    """(x * 2**-e, 2**e) per row, e = the exponent of the row's largest |x| (clamped to
    normal floats): exact scalings that put every row's maximum in [1, 2)."""
    top = tl.max(tl.abs(x), 1).to(tl.int32, bitcast=True) & 0x7F800000
    top = tl.minimum(tl.maximum(top, 1 << 23), 254 << 23)
    inv = (0x7F000000 - top).to(tl.float32, bitcast=True)
    return x * inv[:, None], top.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["Hq", "Hkv", "Sk", "SPLITS", "s_bt", "seed", "offset"])  # sizes, split count, RNG: no recompile
def _decode_fwd_kernel(
        Q, K, V, KS, KZ, VS, VZ, MASK, LENS, SCALE_PTR, O, LSE, PO, PL, BT,
        s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
        s_ksb, s_ksh, s_ksn, s_ksg, s_kzb, s_kzh, s_kzn, s_kzg,
        s_vsb, s_vsh, s_vsn, s_vsg, s_vzb, s_vzh, s_vzn, s_vzg,
        s_mb, s_mh, s_mq, s_mk, s_ob, s_oh, s_oq, s_od,
        Hq, Hkv, Sq, Sk, scale, seed, offset, threshold, drop_scale, SPLITS, s_bt,
        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        ONE_SPLIT: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_LENS: tl.constexpr,
        BALANCED: tl.constexpr,
        SCALE_FROM_PTR: tl.constexpr, INV_SCALE: tl.constexpr, DROPOUT: tl.constexpr,
        INF_AS_ZERO: tl.constexpr, WRITE_LSE: tl.constexpr,
        KBITS: tl.constexpr, K_SIGNED: tl.constexpr, K_GROUP: tl.constexpr, K_SC_G: tl.constexpr,
        K_ZP: tl.constexpr, K_ZP_G: tl.constexpr, K_GL: tl.constexpr, K_L1: tl.constexpr,
        VBITS: tl.constexpr, V_SIGNED: tl.constexpr, V_GROUP: tl.constexpr, V_SC_G: tl.constexpr,
        V_ZP: tl.constexpr, V_ZP_G: tl.constexpr, V_GL: tl.constexpr, V_L1: tl.constexpr,
        DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr, PAGE: tl.constexpr = 0,
        K_FOLD: tl.constexpr = False, V_FOLD: tl.constexpr = False, Q_NORM: tl.constexpr = False):
    """One program: KV head (b, hk), key chunk `split`, query-row block `mblk` (rows
    r = hl * Sq + i of the G query heads sharing hk). K_FOLD / V_FOLD (solver 131): 8-bit
    codes go to the mma as exact f16 values, their per-tensor / per-head scale multiplies
    the scores / the output; Q_NORM: q enters the f16 mma scaled per row by a power of two
    (exact), which the scores take back, so no q is out of f16's range. ONE_SPLIT (SPLITS == 1) writes o (q's dtype)
    and lse directly; otherwise it writes f32 partials PO (rows, SPLITS, DV) normalised
    by their own sum, and PL (rows, SPLITS) = their lse (natural log). PAGE > 0: K/V (and
    their scales / zero points) are page pools, s_kb (...) their page strides, BT the
    (B, max_pages) block table with row stride s_bt (paging.py)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    mblk = tl.program_id(2)
    hk = pid_bh % Hkv
    # keys visible to row i: j < L and (causal) j <= i + shift
    b, L, shift, start, end = program_chunk(LENS, pid_bh, split, Hkv, Sq, Sk, SPLITS, BLOCK_N, CAUSAL, HAS_LENS,
                                            BALANCED)
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * Sq
    hl = rows // Sq
    qi = rows % Sq
    h = hk * G + hl
    if CAUSAL != 0:
        row_lim = tl.minimum(qi + shift + 1, L)

    if SCALE_FROM_PTR:
        sc = tl.load(SCALE_PTR).to(tl.float32)
        if INV_SCALE:
            sc = 1.0 / sc
    else:
        sc = scale
    qk_scale = sc * LOG2E

    offs_d = tl.arange(0, BLOCK_D)
    qi64 = qi.to(tl.int64)
    q_ptr = Q + b64 * s_qb + h.to(tl.int64)[:, None] * s_qh + qi64[:, None] * s_qs + offs_d[None, :] * s_qd
    q = tl.load(q_ptr, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if Q_NORM:
        q, q_pow = _pow2_rows(q.to(tl.float32))
        q = q.to(DOT_DTYPE)
    else:
        q = q.to(DOT_DTYPE)

    if PAGE == 0:
        kvb = b64
    else:
        kvb = b64 * 0  # the page of each key block is added in the loop
    bt_row = BT + b64 * s_bt
    k_base = K + kvb * s_kb + hk64 * s_kh
    v_base = V + kvb * s_vb + hk64 * s_vh
    ks_base = KS + kvb * s_ksb + hk64 * s_ksh
    kz_base = KZ + kvb * s_kzb + hk64 * s_kzh
    vs_base = VS + kvb * s_vsb + hk64 * s_vsh
    vz_base = VZ + kvb * s_vzb + hk64 * s_vzh
    if MASK_KIND != 0:
        m_base = MASK + b64 * s_mb + h.to(tl.int64)[:, None] * s_mh + qi64[:, None] * s_mq
    if K_FOLD:
        qk_scale = qk_scale * tl.load(ks_base).to(tl.float32)
    if Q_NORM:
        qk_rows = qk_scale * q_pow   # (BLOCK_M,): the scale of each row's scores

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        pg, pi = page_rows(bt_row, offs_n, n_ok, n0, PAGE, BLOCK_N)
        k = _load_kv_tile(k_base, pg * s_kb + pi * s_kn, n_ok, s_kd, ks_base, pg * s_ksb + pi * s_ksn, s_ksg,
                          kz_base, pg * s_kzb + pi * s_kzn, s_kzg,
                          D, BLOCK_D, BLOCK_N, KBITS, K_SIGNED, K_GROUP, K_SC_G, K_ZP, K_ZP_G, K_GL,
                          DOT_DTYPE, K_L1, K_FOLD)
        if F32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if Q_NORM:
            s = s * qk_rows[:, None]
        else:
            s = s * qk_scale
        valid = n_ok[None, :] & row_ok[:, None]
        if CAUSAL != 0:
            valid = valid & (offs_n[None, :] < row_lim[:, None])
        if MASK_KIND == 1:
            mk = tl.load(m_base + offs_n.to(tl.int64)[None, :] * s_mk, mask=valid, other=0)
            valid = valid & (mk != 0)
        elif MASK_KIND == 2:
            mk = tl.load(m_base + offs_n.to(tl.int64)[None, :] * s_mk, mask=valid, other=0.0)
            s = s + mk.to(tl.float32) * LOG2E
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h[:, None], qi[:, None], offs_n[None, :], Hq, Sq, Sk,
                                threshold)
            p = tl.where(keep, p, 0.0)
        v = _load_kv_tile(v_base, pg * s_vb + pi * s_vn, n_ok, s_vd, vs_base, pg * s_vsb + pi * s_vsn, s_vsg,
                          vz_base, pg * s_vzb + pi * s_vzn, s_vzg,
                          DV, BLOCK_DV, BLOCK_N, VBITS, V_SIGNED, V_GROUP, V_SC_G, V_ZP, V_ZP_G, V_GL,
                          DOT_DTYPE, V_L1, V_FOLD)
        if F32_DOT:
            pv = tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(DOT_DTYPE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if DROPOUT:
        acc = acc * drop_scale
    if V_FOLD:
        acc = acc * tl.load(vs_base).to(tl.float32)
    has = l_i > 0.0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv[None, :] < DV
    if ONE_SPLIT:
        if INF_AS_ZERO:
            o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        else:
            o = acc / l_i[:, None]  # 0 / 0 = NaN for a fully masked row
        o_ptr = O + b64 * s_ob + h.to(tl.int64)[:, None] * s_oh + qi64[:, None] * s_oq + offs_dv[None, :] * s_od
        tl.store(o_ptr, o.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        if WRITE_LSE:
            tl.store(LSE + (b64 * Hq + h) * Sq + qi, lse, mask=row_ok)
    else:
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        prow = partial_row(rows, b64, hk, split, Hkv, G, Sq, SPLITS, BALANCED)
        tl.store(PO + prow[:, None] * DV + offs_dv[None, :], o, mask=row_ok[:, None] & dv_ok)
        tl.store(PL + prow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows", "s_ob", "s_oh", "s_oq", "Hq", "Hkv", "Sq", "Sk", "SPLITS", "B"])
def _decode_combine_kernel(PO, PL, O, LSE, LENS, n_rows, s_ob, s_oh, s_oq, s_od, Hq, Hkv, Sq, Sk, SPLITS, B,
                           DV: tl.constexpr, BLOCK_R: tl.constexpr, SC: tl.constexpr, BLOCK_DV: tl.constexpr,
                           INF_AS_ZERO: tl.constexpr, WRITE_LSE: tl.constexpr, BALANCED: tl.constexpr,
                           BN: tl.constexpr, CAUSAL: tl.constexpr):
    """Merge the split partials of BLOCK_R output rows: LSE = log sum_s exp(lse_s),
    o = sum_s exp(lse_s - LSE) o_s (NaN, or 0 with INF_AS_ZERO, when every lse_s = -inf).
    Row r's partials: SPLITS of them at r * SPLITS + s; BALANCED (chunks shared by kv_lens,
    `balanced_counts`): chunk_count of them at slots first_b + s of its KV head's
    B * SPLITS, partial row ((hk * B * SPLITS + slot) * G + hl) * Sq + qi.
    The splits are read SC at a time (two passes: the largest lse, then the sums), so the
    [BLOCK_R, SC, BLOCK_DV] tile stays small when SPLITS runs into the thousands; SPLITS
    and the sizes are runtime values (a new split count or shape compiles nothing)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    offs_c = tl.arange(0, SC)
    offs_dv = tl.arange(0, BLOCK_DV)
    # (b, h, qi) by int32 division (n_rows < 2^31): an int64 one is a subroutine call
    b32 = rows // (Hq * Sq)
    h32 = (rows // Sq) % Hq
    qi32 = rows % Sq
    b, h, qi = b32.to(tl.int64), h32.to(tl.int64), qi32.to(tl.int64)
    if BALANCED:
        G = Hq // Hkv
        bi = tl.arange(0, LENS_PER_LOAD)
        nb = visible_blocks(clamped_lens(LENS, bi, B, Sk), Sq, BN, CAUSAL)
        total = tl.sum(nb, 0)
        for b0 in range(LENS_PER_LOAD, B, LENS_PER_LOAD):
            total += tl.sum(visible_blocks(clamped_lens(LENS, b0 + bi, B, Sk), Sq, BN, CAUSAL), 0)
        total = tl.maximum(total, 1)
        cnt = tl.where(bi < B, chunk_count(nb, total, B, SPLITS), 0)
        first = tl.sum(tl.where(bi[None, :] < b32[:, None], cnt[None, :], 0), 1)
        n_s = tl.sum(tl.where(bi[None, :] == b32[:, None], cnt[None, :], 0), 1)
        for b0 in range(LENS_PER_LOAD, B, LENS_PER_LOAD):
            cnt = chunk_count(visible_blocks(clamped_lens(LENS, b0 + bi, B, Sk), Sq, BN, CAUSAL), total, B, SPLITS)
            cnt = tl.where(b0 + bi < B, cnt, 0)
            first += tl.sum(tl.where((b0 + bi)[None, :] < b32[:, None], cnt[None, :], 0), 1)
            n_s += tl.sum(tl.where((b0 + bi)[None, :] == b32[:, None], cnt[None, :], 0), 1)
        # partial rows number B * Hq * Sq * SPLITS < 2^31 (the workspace): int32, then int64
        base = (((h32 // G) * B * SPLITS + first) * (G * Sq) + (h32 % G) * Sq + qi32).to(tl.int64)
        step = G * Sq
        n_max = tl.max(tl.where(r_ok, n_s, 0), 0)
    else:
        base = rows64 * SPLITS
        step = 1
        n_s = tl.zeros((BLOCK_R,), tl.int32) + SPLITS
        n_max = SPLITS
    mx = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for s0 in range(0, n_max, SC):
        offs_s = s0 + offs_c
        ok = r_ok[:, None] & (offs_s[None, :] < n_s[:, None])
        lse_s = tl.load(PL + base[:, None] + offs_s[None, :] * step, mask=ok, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(lse_s, 1))
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros((BLOCK_R,), tl.float32)
    num = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    for s0 in range(0, n_max, SC):
        offs_s = s0 + offs_c
        ok = r_ok[:, None] & (offs_s[None, :] < n_s[:, None])
        idx = base[:, None] + offs_s[None, :] * step
        lse_s = tl.load(PL + idx, mask=ok, other=float("-inf"))
        w = tl.exp(lse_s - mx_safe[:, None])
        den += tl.sum(w, 1)
        po = tl.load(PO + idx[:, :, None] * DV + offs_dv[None, None, :],
                     mask=ok[:, :, None] & (offs_dv[None, None, :] < DV), other=0.0)
        num += tl.sum(w[:, :, None] * po, 1)
    if INF_AS_ZERO:
        o = tl.where(den[:, None] > 0.0, num / tl.where(den > 0.0, den, 1.0)[:, None], 0.0)
    else:
        o = num / den[:, None]
    o_ptr = O + b[:, None] * s_ob + h[:, None] * s_oh + qi[:, None] * s_oq + offs_dv[None, :] * s_od
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=r_ok[:, None] & (offs_dv[None, :] < DV))
    if WRITE_LSE:
        tl.store(LSE + rows64, mx_safe + tl.log(den), mask=r_ok)


# ---- launcher ---------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64    # keys per step: power of two in [16, 256]
    block_m: int = 64    # cap on query rows (G * Sq) per program: power of two in [16, 128]
    num_warps: int = 4   # 1, 2, 4, 8
    num_stages: int = 3  # 1..6
    splits: int = 0      # key chunks per (b, hk): 0 = choose from the problem, else 1..4096
    balanced: bool = True   # with kv_lens, chunks shared by length (balanced_counts)


def _num_sms(device: str) -> int:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132  # H200; under the interpreter only the split logic is exercised


def default_config(problem) -> DecodeConfig:
    """Tiles by head dim and quantization, from the H200 sweeps in benchmarks/DECODE.md
    (bf16 D=128: block_n 128 is within ~4% of the best config on every suite problem;
    quantized: block_n 64, 8 warps for grouped 8-bit codes)."""
    if problem.device != "cuda":
        return DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)
    d = max(problem.D, problem.Dv)
    if d > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=3)
    if problem.quantized:
        grouped8 = any(qs is not None and qs[0] in ("s8", "u8") and qs[1] < d
                       for qs in (problem.k_quant, problem.v_quant))
        return DecodeConfig(block_n=64, num_warps=8 if grouped8 else 4, num_stages=3)
    return DecodeConfig(block_n=128, num_warps=4, num_stages=3)


def m_blocks(problem, cfg: DecodeConfig) -> tuple[int, int]:
    """(BLOCK_M, number of row blocks) for the G * Sq rows of one KV head."""
    rows = problem.group * problem.Sq
    bm = max(16, min(cfg.block_m, triton.next_power_of_2(rows)))
    return bm, triton.cdiv(rows, bm)


def ctas_per_sm(problem, cfg: DecodeConfig) -> int:
    """Programs of `cfg` one SM holds at once: its K/V ring ((num_stages - 1) tiles of K and
    V) against Hopper's 227 KB of shared memory, and ~128 registers per thread."""
    def tile_bytes(quant, d: int) -> float:
        if quant is None:
            return d * problem.dtype.itemsize
        return d * (0.5 if quant[0] in ("s4", "u4") else 1.0)
    ring = max(1, cfg.num_stages - 1) * cfg.block_n * (tile_bytes(problem.k_quant, problem.D)
                                                        + tile_bytes(problem.v_quant, problem.Dv))
    by_smem = int(227 * 1024 // (ring + 4096))
    by_regs = 65536 // (cfg.num_warps * 32 * 128)
    return max(1, min(by_smem, by_regs))


def choose_splits(problem, cfg: DecodeConfig, num_sms: int | None = None) -> int:
    """Key chunks per (b, hk, row block), by a wave model: the programs run in waves of
    (SMs x programs per SM), each as long as its chunk's key blocks plus ~2 blocks of
    pipeline fill; the split count with the shortest total (fewest splits on a tie: no
    combine for one) wins, chunks at least 4 key blocks long. Fewer, longer programs in
    whole waves beat ~4 programs per SM in a partial last wave (H200, bf16 b8 x 32k: 2 splits
    0.249 ms against 9 splits 0.265; b64 x 8k: 1 split 0.480 against 2 splits 0.489)."""
    if cfg.splits:
        return cfg.splits
    slots = (num_sms or _num_sms(problem.device)) * ctas_per_sm(problem, cfg)
    _, nm = m_blocks(problem, cfg)
    base = problem.B * problem.Hkv * nm
    keys = problem.Sk if problem.causal != "top_left" else min(problem.Sk, problem.Sq)
    blocks = max(1, triton.cdiv(keys, cfg.block_n))
    max_splits = max(1, min(4096, triton.cdiv(keys, 4 * cfg.block_n)))

    def span(s: int) -> float:
        return triton.cdiv(base * s, slots) * (triton.cdiv(blocks, s) + 2)
    return min(range(1, max_splits + 1), key=lambda s: (span(s), s))


def workspace_bytes(problem, cfg: DecodeConfig | None = None) -> int:
    cfg = cfg or default_config(problem)
    s = choose_splits(problem, cfg)
    if s == 1:
        return 0
    return problem.B * problem.Hq * problem.Sq * s * (problem.Dv + 1) * 4


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer the launcher allocates (tests replace this to poison them)."""
    return alloc.empty(shape, dtype, device)


def foldable(qs) -> bool:
    """Whether K or V of this KVQuant signature (None: a float tensor) goes to the mma as its
    codes with the scale folded out (solver 131): 8-bit codes, one scale per tensor or per
    head, no zero point."""
    return qs is None or (qs[0] in ("s8", "u8", "fp8_e4m3") and qs[2] in ("t", "h") and qs[4] is None)


def _quant_meta(t, D: int, fold: bool = False):
    """(strides of data / scales / zps, constexpr dict) of K or V; fold: solver 131's codes
    with the scale folded out (`foldable`)."""
    if not isinstance(t, KVQuant):
        meta = dict(BITS=0, SIGNED=False, GROUP=D, SC_G=False, ZP=False, ZP_G=False, GL=_GL_ROW, L1=False,
                    FOLD=False)
        return (tuple(t.stride()), (0, 0, 0, 0), (0, 0, 0, 0)), meta
    g = t.group
    gl = _GL_ROW if g == D else (_GL_RESHAPE if g & (g - 1) == 0 else _GL_GATHER)
    zp = t.zero_points
    meta = dict(BITS=4 if t.is_4bit else 8, SIGNED=t.dtype in ("s8", "s4"), GROUP=g,
                SC_G=t.scale_kind == "g", ZP=zp is not None, ZP_G=t.zp_kind == "g",
                GL=gl, L1=t.is_4bit and t.layout == 1, FOLD=fold)
    return kv_strides(t), meta


def kv_strides(t) -> tuple[tuple[int, ...], ...]:
    """Strides of a K/V argument's data, scales and zero points (0s for per-tensor ones)."""
    if not isinstance(t, KVQuant):
        return (tuple(t.stride()), (0, 0, 0, 0), (0, 0, 0, 0))

    def strides(x):   # per tensor: all 0; per head (B, H): (s_b, s_h, 0, 0)
        if x is None or x.numel() == 1:
            return (0, 0, 0, 0)
        return (*x.stride(), 0, 0) if x.dim() == 2 else tuple(x.stride())
    return (tuple(t.data.stride()), strides(t.scales), strides(t.zero_points))


def _kv_pointers(t, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not isinstance(t, KVQuant):
        return t, dummy, dummy
    return t.data, t.scales, dummy if t.zero_points is None else t.zero_points


def _mask4(mask: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The mask as 4 dims (bool read as uint8) and its strides (0 where broadcast)."""
    if mask is None:
        return dummy, (0, 0, 0, 0)
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    smask = tuple(0 if m4.shape[i] == 1 else m4.stride(i) for i in range(4))
    return (m4.view(torch.uint8) if mask.dtype == torch.bool else m4), smask


def bt_stride(args: AttnArgs) -> int:
    """Row stride of the block table (paged K/V), else 0."""
    return 0 if args.block_table is None else args.block_table.stride(0)


def scalar_args(problem, args: AttnArgs) -> tuple:
    """(scale, seed, offset, dropout threshold, dropout scale) of the decode kernels."""
    scale_val = problem.D ** -0.5
    if problem.scale == "float":
        scale_val = 1.0 / args.scale if problem.invert_scale else float(args.scale)
    dropout = problem.dropout_p > 0
    return (scale_val, args.seed, args.offset, dropout_threshold(problem.dropout_p) if dropout else 0,
            dropout_scale(problem.dropout_p) if dropout else 1.0)


def counters_at(problem, head: tuple) -> int | None:
    """The tail index of the dropout seed when the tail is `head` + scalar_args (+ ...):
    the counters are set per call (`Launch.with_counters`)."""
    return len(head) + 1 if problem.dropout_p > 0 else None


CAUSAL_CODE = {None: 0, "top_left": 1, "bottom_right": 2}


def common_flags(problem) -> dict:
    """Constexprs the decode kernels share."""
    return dict(CAUSAL=CAUSAL_CODE[problem.causal],
                MASK_KIND={"none": 0, "bool": 1, "additive": 2}[problem.mask], HAS_LENS=problem.has_kv_lens,
                SCALE_FROM_PTR=problem.scale == "tensor", INV_SCALE=problem.invert_scale,
                DROPOUT=problem.dropout_p > 0, INF_AS_ZERO=problem.inf_as_zero, WRITE_LSE=problem.return_lse)


MAX_BALANCED_SLOTS = 1 << 20   # B * splits a KV head shares: floor_muldiv exact with margin


def balanced_bn(problem, splits: int, cfg: DecodeConfig) -> int:
    """The key block (cfg.block_n) when the kernels share the chunks by kv_lens (kv_lens, more
    than one split, cfg.balanced), else 0: the kernels' BALANCED and combine_launch's argument."""
    # the combine kernel numbers the balanced partial rows in int32
    ok = problem.B * splits < MAX_BALANCED_SLOTS and problem.B * problem.Hq * problem.Sq * splits < 2**31
    return cfg.block_n if problem.has_kv_lens and splits > 1 and cfg.balanced and ok else 0


def combine_launch(problem, splits: int, bn: int = 0) -> Launch | None:
    """The merge of the split partials (None for one split): o = sum_s exp(lse_s - LSE) o_s.
    bn > 0: the main kernel shared its chunks by kv_lens in blocks of bn keys (balanced_bn)."""
    if splits == 1:
        return None
    n_rows = problem.B * problem.Hq * problem.Sq
    sc = 16  # splits read per step, fixed: one compiled variant for every split count
    block_dv = max(16, triton.next_power_of_2(problem.Dv))
    block_r = max(1, min(16, 4096 // (sc * block_dv)))
    block_r = 1 << (block_r.bit_length() - 1)
    so = (problem.Hq * problem.Sq * problem.Dv, problem.Sq * problem.Dv, problem.Dv, 1)
    return Launch(_decode_combine_kernel, (triton.cdiv(n_rows, block_r),),
                  (n_rows, *so, problem.Hq, problem.Hkv, problem.Sq, problem.Sk, splits, problem.B), DV=problem.Dv,
                  BLOCK_R=block_r, SC=sc, BLOCK_DV=block_dv, INF_AS_ZERO=problem.inf_as_zero,
                  WRITE_LSE=problem.return_lse, BALANCED=bn > 0, BN=max(bn, 1),
                  CAUSAL=CAUSAL_CODE[problem.causal], num_warps=4)


def balanced_counts(kv_lens: torch.Tensor, Sq: int, Sk: int, splits: int, bn: int,
                    causal: str | None = None) -> torch.Tensor:
    """Chunks per sequence when a KV head's B * splits programs are shared by length
    (`chunk_count`; the reference of the kernels' schedule): program p = b' * splits + s
    of a head serves chunk p - first_b of the sequence b whose slots [first_b, first_b +
    count_b) hold p, each chunk cdiv(blocks_b, count_b) blocks; programs past the last
    slot are idle. Counts sum to at most B * splits."""
    L = kv_lens.to(torch.int64).clamp(0, Sk)
    if causal == "top_left":
        L = L.clamp(max=Sq)
    nblk = (L + bn - 1) // bn
    B = L.numel()
    total = max(int(nblk.sum()), 1)
    return torch.minimum(nblk * (B * splits - B) // total + 1, ((nblk + 3) // 4).clamp(min=1))


def plan(problem, args: AttnArgs, cfg: DecodeConfig, fold: bool = False) -> tuple[Launch, Launch | None, int]:
    """(main launch, combine launch or None, splits) of solvers 120/121 (fold: 131) for
    `args`' strides and per-call scalars; o (B, Hq, Sq, Dv) is contiguous."""
    q = args.q
    D, Dv = problem.D, problem.Dv
    (sk, sks, skz), km = _quant_meta(args.k, D, fold)
    (sv, svs, svz), vm = _quant_meta(args.v, Dv, fold)
    _, smask = _mask4(args.attn_mask, q)
    bm, nm = m_blocks(problem, cfg)
    splits = choose_splits(problem, cfg)
    so = (problem.Hq * problem.Sq * Dv, problem.Sq * Dv, Dv, 1)
    interp = interpreting()
    f32 = q.dtype == torch.float32
    # 131: f16 mmas, which hold every s8 / u8 / e4m3 code exactly (bf16 q scaled per row: Q_NORM)
    half = tl.float16 if fold else tl.bfloat16
    dot_dtype = tl.float32 if (f32 or interp) else (half if q.dtype == torch.bfloat16 else tl.float16)
    head = (*q.stride(), *sk, *sv, *sks, *skz, *svs, *svz, *smask, *so,
            problem.Hq, problem.Hkv, problem.Sq, problem.Sk)
    main = Launch(
        _decode_fwd_kernel, (problem.B * problem.Hkv, splits, nm),
        (*head, *scalar_args(problem, args), splits, bt_stride(args)), counters_at=counters_at(problem, head),
        G=problem.group, D=D, DV=Dv, BLOCK_M=bm, BLOCK_N=cfg.block_n, PAGE=problem.page_size,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        ONE_SPLIT=splits == 1, BALANCED=bool(balanced_bn(problem, splits, cfg)), **common_flags(problem),
        KBITS=km["BITS"], K_SIGNED=km["SIGNED"], K_GROUP=km["GROUP"], K_SC_G=km["SC_G"], K_ZP=km["ZP"],
        K_ZP_G=km["ZP_G"], K_GL=km["GL"], K_L1=km["L1"],
        VBITS=vm["BITS"], V_SIGNED=vm["SIGNED"], V_GROUP=vm["GROUP"], V_SC_G=vm["SC_G"], V_ZP=vm["ZP"],
        V_ZP_G=vm["ZP_G"], V_GL=vm["GL"], V_L1=vm["L1"],
        DOT_DTYPE=dot_dtype, F32_DOT=f32 or interp, **(dict(
            K_FOLD=km["FOLD"], V_FOLD=vm["FOLD"], Q_NORM=q.dtype == torch.bfloat16) if fold else {}),
        num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg.num_stages, problem.page_size))
    return main, combine_launch(problem, splits, balanced_bn(problem, splits, cfg)), splits


def run_planned(problem, args: AttnArgs, planned: tuple[Launch, Launch | None, int],
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate o (or take `out`, contiguous), lse and the split partials; launch.

    The partials (f32 o, then lse) share one buffer. Once both launches are compiled with
    every pointer 16-byte aligned they run by address (`Launch.run_addresses`): no per-launch
    alignment check and no driver pointer query per tensor argument; a decode step's host
    time is what a small batch waits for (b8 x 32k: ~110 us on the GPU, 66-125 us of host on
    the H200's machine, 2026-12-03)."""
    main, combine, splits = planned
    q = args.q
    if problem.dropout_p > 0:
        main = main.with_counters(args.seed, args.offset)
    dev = q.device
    B, Hq, Sq, Dv = problem.B, problem.Hq, problem.Sq, problem.Dv
    o = out if out is not None else _empty((B, Hq, Sq, Dv), q.dtype, dev)
    lse = _empty((B, Hq, Sq), torch.float32, dev) if problem.return_lse else q
    n_po = B * Hq * Sq * splits * Dv
    ws = q if splits == 1 else _empty((n_po + B * Hq * Sq * splits,), torch.float32, dev)
    k, ks, kz = _kv_pointers(args.k, q)
    v, vs, vz = _kv_pointers(args.v, q)
    m4, _ = _mask4(args.attn_mask, q)
    scale_ptr = args.scale.reshape(1) if problem.scale == "tensor" else q
    lens = args.kv_lens if problem.has_kv_lens else q
    bt = args.block_table if problem.page_size else q
    if main.ready() and (combine is None or combine.ready()):
        a = [t.data_ptr() for t in (q, k, v, ks, kz, vs, vz, m4, lens, scale_ptr, o, lse, ws, bt)]
        po = a[12]
        pl = po if splits == 1 else po + 4 * n_po
        if not (a[0] | a[1] | a[2] | a[3] | a[4] | a[5] | a[6] | a[7] | a[8] | a[9] | a[10] | a[11] | pl
                | a[13]) & 15:
            main.run_addresses(*a[:12], po, pl, a[13])
            if combine is not None:
                combine.run_addresses(po, pl, a[10], a[11], a[8])
            return o, (lse if problem.return_lse else None)
    po, pl = (q, q) if splits == 1 else (ws[:n_po], ws[n_po:])
    main(q, k, v, ks, kz, vs, vz, m4, lens, scale_ptr, o, lse, po, pl, bt)
    if combine is not None:
        combine(po, pl, o, lse, lens)
    return o, (lse if problem.return_lse else None)


def decode_forward(problem, args: AttnArgs, cfg: DecodeConfig | None = None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run decode attention for a validated `problem`; returns (o, lse or None)."""
    cfg = cfg or default_config(problem)
    return run_planned(problem, args, plan(problem, args, cfg), out)


class DecodePlan:
    """The decode solvers' invoker: launches planned once per set of strides and per-call
    scalars (`plan_fn(problem, args, cfg)`); a call allocates and launches."""

    def __init__(self, problem, cfg: DecodeConfig, plan_fn):
        self.problem, self.cfg, self.plan_fn = problem, cfg, plan_fn
        self.plans: dict[tuple, tuple] = {}

    def __call__(self, args: AttnArgs):
        m = args.attn_mask
        key = (args.q.stride(), kv_strides(args.k), kv_strides(args.v),
               None if m is None else (m.shape, m.stride()),
               None if isinstance(args.scale, torch.Tensor) else args.scale, int_width(args.seed),
               int_width(args.offset), bt_stride(args))
        planned = self.plans.get(key)
        if planned is None:
            if len(self.plans) >= 64:
                self.plans.clear()
            planned = self.plans[key] = self.plan_fn(self.problem, args, self.cfg)
        try:
            return run_planned(self.problem, args, planned)
        except OutOfResources:  # the tiles do not fit this GPU's shared memory: smaller ones
            smaller = shrink(self.cfg)
            if smaller == self.cfg:
                raise
            self.cfg = smaller
            self.plans.clear()
            return self(args)


def shrink(cfg: DecodeConfig) -> DecodeConfig:
    """Fewer pipeline stages first, then half the keys per step (down to 16)."""
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 16:
        return replace(cfg, block_n=cfg.block_n // 2)
    return cfg


# ---- solvers ----------------------------------------------------------------------

_BW = 3.8e12         # achievable K/V read bandwidth on an H200, bytes/s
HOST_FLOOR_MS = 0.045   # per call on the H200 machine, find's clock (system db minimum)
_LAUNCH_MS = 0.008   # two kernel launches


class _DecodeBase(Solver):
    family = "decode"
    primitive = "attention"
    directions = frozenset({"fwd"})
    uses_triton = True
    max_sq = 16
    max_d = 256

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.Sq > self.max_sq:
            reasons.append(f"Sq={problem.Sq} > {self.max_sq}: decode serves thin queries (use flash)")
        if max(problem.D, problem.Dv) > self.max_d:
            reasons.append(f"head dim D={problem.D}, Dv={problem.Dv} > {self.max_d}")
        if not reasons:   # grid (B*Hkv, splits <= 4096, row blocks of the G*Sq rows)
            reasons += grid_reasons(((2, "row blocks of Hq/Hkv * Sq query rows", self.row_blocks(problem)),))
        return reasons

    def row_blocks(self, problem) -> int:
        return m_blocks(problem, default_config(problem))[1]

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def estimate(self, problem) -> float:
        """Roofline: bytes read (q, K/V incl. scales, o) at ~3.8 TB/s; dequant adds ALU."""
        t = problem.bytes() / _BW * 1e3
        if problem.quantized:
            t *= 1.15
        # two launches (split, combine) and their host work bound short decodes: the fastest
        # decode the H200 system db holds took 0.045 ms per call (flash_fwd's floor: 0.04)
        host = HOST_FLOOR_MS if problem.device == "cuda" else 0.0
        return max(t + _LAUNCH_MS, host)

    def prepare(self, problem):
        return DecodePlan(problem, default_config(problem), plan)


@register
class DecodeSplitK(_DecodeBase):
    """Flash-decoding with f32/f16/bf16 K/V."""
    id = 120
    name = "decode_split_k"
    paged = True  # any page size: a page id per key block, or per row below the block (paging.py)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.quantized:
            reasons.append("quantized K/V: served by decode_split_k_quant (121)")
        return reasons


@register
class DecodeSplitKQuant(_DecodeBase):
    """Flash-decoding with K and/or V quantized (KVQuant s8/u8/s4/u4), dequantized in registers."""
    id = 121
    name = "decode_split_k_quant"
    paged = True  # any page size: a page id per key block, or per row below the block (paging.py)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if not problem.quantized:
            reasons.append("K/V not quantized: served by decode_split_k (120)")
        for name, qs, d in (("K", problem.k_quant, problem.D), ("V", problem.v_quant, problem.Dv)):
            if problem.device == "cuda" and qs is not None and qs[0] in ("s4", "u4") and d < 32:
                # the GPU fuzz (2026-11-30) found wrong results for 4-bit K with D = 16 that the
                # interpreter does not reproduce; 122 serves these rows
                reasons.append(f"4-bit {name} with head dim {d} < 32 on the GPU: served by "
                               "decode_split_k_quant_grouped (122)")
        return reasons

    def estimate(self, problem) -> float:
        """The base estimate, or the roofline with 121's instructions (decode_swap.ISSUE_121)
        where that is larger: 121 stays behind 122 / 128, which count fewer."""
        from .decode_swap import ISSUE_121, roofline_ms
        return max(super().estimate(problem), roofline_ms(problem, ISSUE_121) + _LAUNCH_MS)


__all__ = ["DecodeConfig", "DecodeSplitK", "DecodeSplitKQuant", "choose_splits", "decode_forward",
           "default_config", "workspace_bytes"]
