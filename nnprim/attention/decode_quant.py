"""Decode attention on quantized K/V with the dequantization kept out of the per-element
path (solver 122). Same contract and launcher layout as `decode.py` (solvers 120/121):
GQA batching (one program owns the G * Sq query rows of one KV head), split-K over the
keys with the shared LSE combine kernel, ragged kv_lens, causal, masks, dropout, lse.

Solver 121 dequantizes every code in registers: code -> f32 -> (c - zp) * scale -> bf16,
then the tile goes through shared memory into the mma operand layout. Here the codes go
to the mma as they are (s8/u8/s4/u4 integers are exact in f16 and bf16), and scales /
zero points are applied to the small score / probability tiles instead.

K, group size g, NG = D / g groups per row, group(d) = d // g:

    s_mj = sum_g sc_jg * (q_mg . c_jg - zp_jg * sum(q_mg))

  one mma on an *expanded* query tile Qx (BLOCK_M * NG, D): row (m, g) holds q_m on the
  columns of group g and 0 elsewhere, so Qx @ C^T gives the per-group dot products
  (BLOCK_M, NG, BLOCK_N); the zero point term uses the precomputed row sums
  qsum_mg = sum(q_mg), then the (NG, BLOCK_N) scale tile multiplies and the NG axis is
  summed. At GQA 4, Sq = 1, NG = 4 the expanded tile has 16 rows: the mma's minimum M,
  so the expansion is free there.

V:  o_md = sum_j (p_mj sc_j,g(d)) c_jd - sum_j p_mj sc_j,g(d) zp_j,g(d)

  the probabilities are expanded the same way, Px (BLOCK_M * NG, BLOCK_N) with row (m, g)
  = p_m * sc_{:, g}; Px @ C accumulates (BLOCK_M * NG, Dv) and row (m, g) is kept only
  on the columns of group g at the end (after the loop); the zero point term is a
  (BLOCK_M, NG) running sum of Px * zp.

Per-tensor scales fold into the softmax scale (K) and the final output (V); a per-token
scale (group = D) needs no expansion (NG = 1). 4-bit codes (two per byte along D, even
element in the low nibble) are never interleaved: the low nibbles meet the even columns
of q (and of o), the high nibbles the odd ones, as two mmas of depth D / 2. On CUDA they
are converted by inline PTX (magic-number bf16/f16 construction, `_asm4`): 1.5x faster than
shifts + converts on the H200 (benchmarks/DECODE_QUANT.md, which also says where the
remaining time goes: instruction issue, not memory).

Supported: everything `decode.py` supports, for K and/or V quantized (the other may be
f32/f16/bf16) with up to 8 groups per row (D / group_size <= 8; more groups fall back to
121). Dequantized values are exact up to the rounding of q and p * scale to q's dtype.

Reading order: Triton kernel -> launcher (`decode_quant_forward`) -> solver (id 122).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..args import AttnArgs
from ..dropout import dropout_keep
from ..launch import Launch, interpreting
from ..quant import KVQuant
from ..search.solver import register
from . import decode as _dec
from .code_convert import cvt4 as _cvt4
from .code_convert import cvt8 as _cvt8
from .decode import DecodeConfig, _DecodeBase, _num_sms, l1_pairs
from .paging import page_rows, pipeline_stages

MAX_GROUPS = 8   # groups per row (D / group_size) served by 122
_MAX_MX = 128    # rows of an expanded tile (BLOCK_M * NG)

# ---- Triton kernel ----------------------------------------------------------------


@triton.jit
def _param_tile(ptr, roff, n_ok, s_g, GROUPED: tl.constexpr, NG: tl.constexpr, BNG: tl.constexpr,
                OTHER: tl.constexpr):
    """Scales or zero points of the rows at int64 offsets roff as an f32 (BNG, BLOCK_N) tile
    (groups >= NG and rows with n_ok False give OTHER), or the per-tensor scalar when not GROUPED."""
    if GROUPED:
        offs_g = tl.arange(0, BNG)
        p = ptr + offs_g[:, None] * s_g + roff[None, :]
        if NG == BNG:   # no group mask: a key's groups load as one vector (see the kernel's PV)
            return tl.load(p, mask=n_ok[None, :], other=OTHER).to(tl.float32)
        return tl.load(p, mask=(offs_g[:, None] < NG) & n_ok[None, :], other=OTHER).to(tl.float32)
    else:
        return tl.load(ptr).to(tl.float32)


@triton.jit
def _zero_points(ptr, roff, n_ok, s_g, GROUPED: tl.constexpr, NG: tl.constexpr, BNG: tl.constexpr,
                 LOAD: tl.constexpr, OFF: tl.constexpr):
    """The zero points the mma's codes are taken against: the stored ones (LOAD) less OFF,
    else -OFF. OFF = 128 for u8 codes, which the kernel reads as s8 (c ^ 0x80 = c - 128)."""
    if LOAD:
        return _param_tile(ptr, roff, n_ok, s_g, GROUPED, NG, BNG, 0.0) - OFF
    else:
        return -OFF


@triton.jit
def _codes8(c, OFF: tl.constexpr):
    """8-bit codes as the mma reads them: u8 shifted to s8 when OFF (see _zero_points)."""
    if OFF != 0:
        return (c ^ 128).to(tl.int8, bitcast=True)
    else:
        return c


@triton.jit
def _rows_tile(ptr, roff, n_ok, s_c, cols, COLS: tl.constexpr, FULL: tl.constexpr):
    """Rows at int64 offsets roff, columns `cols` (< COLS unless FULL) of a (rows, columns)
    tensor; 0 elsewhere."""
    p = ptr + roff[:, None] + cols[None, :] * s_c
    if FULL:
        return tl.load(p, mask=n_ok[:, None], other=0.0)
    else:
        return tl.load(p, mask=n_ok[:, None] & (cols[None, :] < COLS), other=0.0)


@triton.jit
def _q_expanded(q_rows, row_ok, gx, cols, s_qd, D: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """(MX, len(cols)) expanded query tile: row x holds q on the columns of group gx[x]."""
    m = row_ok[:, None] & (cols[None, :] < D) & ((cols // GROUP)[None, :] == gx[:, None])
    return tl.load(q_rows[:, None] + cols[None, :] * s_qd, mask=m, other=0.0).to(DOT_DTYPE)


@triton.jit
def _expand(x, BLOCK_M: tl.constexpr, NG: tl.constexpr):
    """(BLOCK_M,) -> (BLOCK_M * NG,): each element repeated NG times."""
    if NG == 1:
        return x
    else:
        return tl.reshape(tl.broadcast_to(x[:, None], (BLOCK_M, NG)), (BLOCK_M * NG,))


@triton.jit
def _select_groups(acc, cols, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, NG: tl.constexpr, BC: tl.constexpr):
    """(BLOCK_M * NG, BC) -> (BLOCK_M, BC): keep row (m, g) on the columns of group g."""
    if NG == 1:
        return acc
    else:
        a3 = tl.reshape(acc, (BLOCK_M, NG, BC))
        sel = (cols // GROUP)[None, None, :] == tl.arange(0, NG)[None, :, None]
        return tl.sum(tl.where(sel, a3, 0.0), 1)


@triton.jit
def _select_zp(zcor, cols, GROUP: tl.constexpr, NG: tl.constexpr):
    """(BLOCK_M, NG) per-group zero-point sums -> (BLOCK_M, len(cols)) by the group of each column."""
    sel = (cols // GROUP)[None, None, :] == tl.arange(0, NG)[None, :, None]
    return tl.sum(tl.where(sel, zcor[:, :, None], 0.0), 1)


@triton.jit(do_not_specialize=["Hq", "Hkv", "Sk", "SPLITS", "s_bt", "seed", "offset"])  # as _decode_fwd_kernel
def _decode_quant_kernel(
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
        KBITS: tl.constexpr, K_SIGNED: tl.constexpr, K_GROUP: tl.constexpr, K_NG: tl.constexpr,
        K_BNG: tl.constexpr, K_SC_G: tl.constexpr, K_ZP: tl.constexpr, K_ZP_G: tl.constexpr,
        K_ZLOAD: tl.constexpr, K_ZOFF: tl.constexpr, V_ZLOAD: tl.constexpr, V_ZOFF: tl.constexpr,
        VBITS: tl.constexpr, V_SIGNED: tl.constexpr, V_GROUP: tl.constexpr, V_NG: tl.constexpr,
        V_BNG: tl.constexpr, V_SC_G: tl.constexpr, V_ZP: tl.constexpr, V_ZP_G: tl.constexpr,
        V_SPLIT: tl.constexpr, V_JOIN: tl.constexpr, K_L1: tl.constexpr, V_L1: tl.constexpr,
        K_PV: tl.constexpr, V_PV: tl.constexpr,
        DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr, ASM4: tl.constexpr, ASM8: tl.constexpr,
        PAGE: tl.constexpr = 0, CVT_PURE: tl.constexpr = True):
    """One program: KV head (b, hk), key chunk `split`, row block `mblk` (rows r = hl * Sq + i
    of the G query heads of hk). K/V: KBITS/VBITS 0 = float tensor, 8 = s8/u8 codes,
    4 = packed s4/u4. BLOCK_D / BLOCK_DV count columns of the loaded tiles: elements for
    0/8 bits, bytes (pairs) for 4 bits. K_BNG / V_BNG: groups per row of the expansion
    (power of two >= K_NG / V_NG; 1 when scales and zero points are per tensor or per
    token). Writes o / lse (ONE_SPLIT) or the f32 partials PO (rows, SPLITS, DV) and their
    lse PL (rows, SPLITS) that `_decode_combine_kernel` merges."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    KMX: tl.constexpr = BLOCK_M * K_BNG
    VMX: tl.constexpr = BLOCK_M * V_BNG
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    mblk = tl.program_id(2)
    hk = pid_bh % Hkv
    b, L, shift, start, end = _dec.program_chunk(LENS, pid_bh, split, Hkv, Sq, Sk, SPLITS, BLOCK_N, CAUSAL, HAS_LENS,
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

    if PAGE == 0:
        kvb = b64
    else:
        kvb = b64 * 0  # paged K/V (paging.py): the page of each key block is added in the loop
    if K_PV > 1:   # key strides of the grouped scales / zero points: multiples of PV (see 128)
        s_ksn = (s_ksn // K_PV) * K_PV
        s_kzn = (s_kzn // K_PV) * K_PV
    if V_PV > 1:
        s_vsn = (s_vsn // V_PV) * V_PV
        s_vzn = (s_vzn // V_PV) * V_PV
    bt_row = BT + b64 * s_bt
    k_base = K + kvb * s_kb + hk64 * s_kh
    v_base = V + kvb * s_vb + hk64 * s_vh
    ks_base = KS + kvb * s_ksb + hk64 * s_ksh
    kz_base = KZ + kvb * s_kzb + hk64 * s_kzh
    vs_base = VS + kvb * s_vsb + hk64 * s_vsh
    vz_base = VZ + kvb * s_vzb + hk64 * s_vzh
    if KBITS != 0:
        if not K_SC_G:
            qk_scale = qk_scale * tl.load(ks_base).to(tl.float32)   # per tensor or per head
    if MASK_KIND != 0:
        m_base = MASK + b64 * s_mb + h.to(tl.int64)[:, None] * s_mh + qi.to(tl.int64)[:, None] * s_mq

    # expanded query rows x = (m, g): row m of the block, group g
    xk = tl.arange(0, KMX)
    rk = mblk * BLOCK_M + xk // K_BNG
    gk = xk % K_BNG
    q_rows = Q + b64 * s_qb + (hk * G + rk // Sq).to(tl.int64) * s_qh + (rk % Sq).to(tl.int64) * s_qs
    rk_ok = rk < G * Sq
    if KBITS == 4:
        offs_kh = tl.arange(0, BLOCK_D)  # byte columns; low nibble = even element of the pair
        # layout 1 keeps the bytes where they are and permutes q's columns the same way
        pk = l1_pairs(offs_kh) if K_L1 else offs_kh
        qx_lo = _q_expanded(q_rows, rk_ok, gk, 2 * pk, s_qd, D, K_GROUP, DOT_DTYPE)
        qx_hi = _q_expanded(q_rows, rk_ok, gk, 2 * pk + 1, s_qd, D, K_GROUP, DOT_DTYPE)
        if K_ZP:
            qsum = tl.sum(qx_lo.to(tl.float32), 1) + tl.sum(qx_hi.to(tl.float32), 1)
    else:
        offs_kd = tl.arange(0, BLOCK_D)
        qx = _q_expanded(q_rows, rk_ok, gk, offs_kd, s_qd, D, K_GROUP, DOT_DTYPE)
        if KBITS == 8:
            if K_ZP:
                qsum = tl.sum(qx.to(tl.float32), 1)
    if KBITS != 0:
        if K_ZP:
            if K_BNG > 1:
                qsum3 = tl.reshape(qsum, (BLOCK_M, K_BNG))[:, :, None]
    if VBITS == 4:
        offs_vh = tl.arange(0, BLOCK_DV)
        pv = l1_pairs(offs_vh) if V_L1 else offs_vh   # pair of o held by byte column c
        if V_JOIN:
            offs_vd = tl.arange(0, 2 * BLOCK_DV)
    else:
        offs_vd = tl.arange(0, BLOCK_DV)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if V_SPLIT:
        acc_lo = tl.zeros((VMX, BLOCK_DV), tl.float32)
        acc_hi = tl.zeros((VMX, BLOCK_DV), tl.float32)
    elif V_JOIN:
        acc = tl.zeros((VMX, 2 * BLOCK_DV), tl.float32)
    else:
        acc = tl.zeros((VMX, BLOCK_DV), tl.float32)
    if V_ZP:
        if V_BNG > 1:
            zcor = tl.zeros((BLOCK_M, V_BNG), tl.float32)
        else:
            zcor = tl.zeros((BLOCK_M,), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        pg, pi = page_rows(bt_row, offs_n, n_ok, n0, PAGE, BLOCK_N)
        # ---- scores: mma on the raw codes, then zero point and scale per group ----
        if KBITS == 4:
            kc = _rows_tile(k_base, pg * s_kb + pi * s_kn, n_ok, s_kd, offs_kh, D // 2, BLOCK_D * 2 == D)
            k_lo, k_hi = _cvt4(kc, K_SIGNED, ASM4, DOT_DTYPE, CVT_PURE)
            if F32_DOT:
                sp = tl.dot(qx_lo, tl.trans(k_lo), input_precision="ieee")
                sp = tl.dot(qx_hi, tl.trans(k_hi), sp, input_precision="ieee")
            else:
                sp = tl.dot(qx_lo, tl.trans(k_lo))
                sp = tl.dot(qx_hi, tl.trans(k_hi), sp)
        else:
            kt = _rows_tile(k_base, pg * s_kb + pi * s_kn, n_ok, s_kd, offs_kd, D, BLOCK_D == D)
            if KBITS == 8:
                kt = _cvt8(_codes8(kt, K_ZOFF), K_SIGNED, ASM8, DOT_DTYPE, CVT_PURE)
            else:
                kt = kt.to(DOT_DTYPE)
            if F32_DOT:
                sp = tl.dot(qx, tl.trans(kt), input_precision="ieee")
            else:
                sp = tl.dot(qx, tl.trans(kt))
        if KBITS != 0:
            if K_BNG > 1:
                sp3 = tl.reshape(sp, (BLOCK_M, K_BNG, BLOCK_N))
                if K_ZP:
                    kz = _zero_points(kz_base, pg * s_kzb + pi * s_kzn, n_ok, s_kzg, K_ZP_G, K_NG, K_BNG, K_ZLOAD,
                                      K_ZOFF)
                    sp3 = sp3 - qsum3 * kz
                if K_SC_G:
                    sp3 = sp3 * _param_tile(ks_base, pg * s_ksb + pi * s_ksn, n_ok, s_ksg, True, K_NG, K_BNG, 1.0)[None, :, :]
                s = tl.sum(sp3, 1)
            else:
                s = sp
                if K_ZP:
                    kz = _zero_points(kz_base, pg * s_kzb + pi * s_kzn, n_ok, s_kzg, K_ZP_G, 1, 1, K_ZLOAD, K_ZOFF)
                    s = s - qsum[:, None] * kz
                if K_SC_G:
                    s = s * _param_tile(ks_base, pg * s_ksb + pi * s_ksn, n_ok, s_ksg, True, 1, 1, 1.0)
        else:
            s = sp
        # ---- online softmax (as in decode.py) ----
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
        m_i = m_new
        # ---- P @ V: scale folded into the (expanded) probabilities ----
        if VBITS != 0:
            if V_BNG > 1:
                if V_SC_G:
                    vs = _param_tile(vs_base, pg * s_vsb + pi * s_vsn, n_ok, s_vsg, True, V_NG, V_BNG, 1.0)
                    px3 = p[:, None, :] * vs[None, :, :]
                else:
                    px3 = tl.broadcast_to(p[:, None, :], (BLOCK_M, V_BNG, BLOCK_N))
                if V_ZP:
                    vz = _zero_points(vz_base, pg * s_vzb + pi * s_vzn, n_ok, s_vzg, V_ZP_G, V_NG, V_BNG, V_ZLOAD,
                                      V_ZOFF)
                    zcor = zcor * alpha[:, None] + tl.sum(px3 * vz, 2)
                px = tl.reshape(px3, (VMX, BLOCK_N))
            else:
                px = p
                if V_SC_G:
                    px = px * _param_tile(vs_base, pg * s_vsb + pi * s_vsn, n_ok, s_vsg, True, 1, 1, 1.0)
                if V_ZP:
                    vz = _zero_points(vz_base, pg * s_vzb + pi * s_vzn, n_ok, s_vzg, V_ZP_G, 1, 1, V_ZLOAD, V_ZOFF)
                    zcor = zcor * alpha + tl.sum(px * vz, 1)
        else:
            px = p
        alpha_x = _expand(alpha, BLOCK_M, V_BNG)[:, None]
        px = px.to(DOT_DTYPE)
        if VBITS == 4:
            vc = _rows_tile(v_base, pg * s_vb + pi * s_vn, n_ok, s_vd, offs_vh, DV // 2, BLOCK_DV * 2 == DV)
            v_lo, v_hi = _cvt4(vc, V_SIGNED, ASM4, DOT_DTYPE, CVT_PURE)
            if V_JOIN:
                vt = tl.interleave(v_lo, v_hi)
                if F32_DOT:
                    acc = tl.dot(px, vt, acc * alpha_x, input_precision="ieee")
                else:
                    acc = tl.dot(px, vt, acc * alpha_x)
            elif F32_DOT:
                acc_lo = tl.dot(px, v_lo, acc_lo * alpha_x, input_precision="ieee")
                acc_hi = tl.dot(px, v_hi, acc_hi * alpha_x, input_precision="ieee")
            else:
                acc_lo = tl.dot(px, v_lo, acc_lo * alpha_x)
                acc_hi = tl.dot(px, v_hi, acc_hi * alpha_x)
        else:
            vt = _rows_tile(v_base, pg * s_vb + pi * s_vn, n_ok, s_vd, offs_vd, DV, BLOCK_DV == DV)
            if VBITS == 8:
                vt = _cvt8(_codes8(vt, V_ZOFF), V_SIGNED, ASM8, DOT_DTYPE, CVT_PURE)
            else:
                vt = vt.to(DOT_DTYPE)
            if F32_DOT:
                acc = tl.dot(px, vt, acc * alpha_x, input_precision="ieee")
            else:
                acc = tl.dot(px, vt, acc * alpha_x)

    # ---- epilogue: per-group columns, zero points, per-tensor scale ----
    if V_SPLIT:
        a_lo = _select_groups(acc_lo, 2 * pv, V_GROUP, BLOCK_M, V_BNG, BLOCK_DV)
        a_hi = _select_groups(acc_hi, 2 * pv, V_GROUP, BLOCK_M, V_BNG, BLOCK_DV)
        if V_ZP:
            if V_BNG > 1:
                zc = _select_zp(zcor, 2 * pv, V_GROUP, V_BNG)
                a_lo = a_lo - zc
                a_hi = a_hi - zc
            else:
                a_lo = a_lo - zcor[:, None]
                a_hi = a_hi - zcor[:, None]
        o_acc = tl.interleave(a_lo, a_hi)
        offs_o = tl.arange(0, 2 * BLOCK_DV)
        if V_L1:   # column x of o_acc is element x % 2 of pair l1_pairs(x // 2)
            offs_o = 2 * l1_pairs(offs_o // 2) + offs_o % 2
    elif V_JOIN:
        o_acc = _select_groups(acc, offs_vd, V_GROUP, BLOCK_M, V_BNG, 2 * BLOCK_DV)
        if V_ZP:
            if V_BNG > 1:
                o_acc = o_acc - _select_zp(zcor, offs_vd, V_GROUP, V_BNG)
            else:
                o_acc = o_acc - zcor[:, None]
        offs_o = offs_vd
    else:
        o_acc = _select_groups(acc, offs_vd, V_GROUP, BLOCK_M, V_BNG, BLOCK_DV)
        if VBITS != 0:
            if V_ZP:
                if V_BNG > 1:
                    zc = _select_zp(zcor, offs_vd, V_GROUP, V_BNG)
                    o_acc = o_acc - zc
                else:
                    o_acc = o_acc - zcor[:, None]
        offs_o = offs_vd
    if VBITS != 0:
        if not V_SC_G:
            o_acc = o_acc * tl.load(vs_base).to(tl.float32)   # per tensor or per head
    if DROPOUT:
        o_acc = o_acc * drop_scale
    has = l_i > 0.0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    dv_ok = offs_o[None, :] < DV
    if ONE_SPLIT:
        if INF_AS_ZERO:
            o = tl.where(has[:, None], o_acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        else:
            o = o_acc / l_i[:, None]  # 0 / 0 = NaN for a fully masked row
        o_ptr = O + b64 * s_ob + h.to(tl.int64)[:, None] * s_oh + qi.to(tl.int64)[:, None] * s_oq + offs_o[None, :] * s_od
        tl.store(o_ptr, o.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        if WRITE_LSE:
            tl.store(LSE + (b64 * Hq + h) * Sq + qi, lse, mask=row_ok)
    else:
        o = tl.where(has[:, None], o_acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        prow = _dec.partial_row(rows, b64, hk, split, Hkv, G, Sq, SPLITS, BALANCED)
        tl.store(PO + prow[:, None] * DV + offs_o[None, :], o, mask=row_ok[:, None] & dv_ok)
        tl.store(PL + prow, lse, mask=row_ok)


# ---- launcher ---------------------------------------------------------------------

@dataclass(frozen=True)
class QuantDecodeConfig(DecodeConfig):
    # codes -> f16/bf16 by the magic-number PTX (CUDA, 16-bit q): None = for 4-bit codes only (Triton's
    # own 8-bit -> bf16 conversion is already a short integer sequence), True = also 8-bit, False = never
    asm_convert: bool | None = None
    v_join: bool = False      # 4-bit V: interleave the nibbles into one operand (one mma); measured slower
    # pin the PTX conversion where the codes load (code_convert): fewer instructions (s4 g64:
    # 951 against 1197 per 32 keys) but slower on the H200 (s4 g64 b64 x 8k 0.372 against
    # 0.286 ms, b8 x 32k 0.176 against 0.155; 8-bit equal: `results/decode_sweep_s15.json`)
    pin_convert: bool = False


def _groups(t, D: int) -> tuple[int, int]:
    """(NG, BNG): groups per row of K or V that need the expansion, and its power of two."""
    if not isinstance(t, KVQuant) or t.group == D:
        return 1, 1
    grouped = t.scale_kind == "g" or t.zp_kind == "g"
    ng = D // t.group if grouped else 1
    return ng, triton.next_power_of_2(ng)


def param_vector(t, ng: int) -> int:
    """Groups per key that load as one vector (the kernel's PV): NG when it is a power of two
    and the key strides of the grouped scales and zero points are its multiples, else 1."""
    if ng < 2 or ng & (ng - 1):
        return 1
    grouped = [x for x, kind in ((t.scales, t.scale_kind), (t.zero_points, t.zp_kind)) if kind == "g"]
    return ng if grouped and all(x.stride(-2) % ng == 0 for x in grouped) else 1


def _sig_groups(qs, D: int) -> int:
    """Groups per row needing the expansion, from a KVQuant.signature() (problem side)."""
    if qs is None or qs[1] == D or (qs[2] != "g" and qs[4] != "g"):
        return 1
    return D // qs[1]


def row_block(problem, cfg: DecodeConfig) -> tuple[int, int]:
    """(BLOCK_M, number of row blocks) for the G * Sq rows of one KV head: the expanded
    tiles (BLOCK_M * BNG rows) need >= 16 rows (mma) and are capped at 128."""
    bng = [triton.next_power_of_2(_sig_groups(problem.k_quant, problem.D)),
           triton.next_power_of_2(_sig_groups(problem.v_quant, problem.Dv))]
    rows = problem.group * problem.Sq
    lo = max(1, 16 // min(bng))
    hi = max(lo, min(cfg.block_m, _MAX_MX // max(bng)))
    bm = max(lo, min(hi, triton.next_power_of_2(rows)))
    return bm, triton.cdiv(rows, bm)


def _has_4bit(problem) -> bool:
    return any(qs is not None and qs[0] in ("s4", "u4") for qs in (problem.k_quant, problem.v_quant))


def default_config(problem) -> DecodeConfig:
    """Tiles for 122 from the H200 sweeps (D = 128; `benchmarks/diag/decode_swap_sweep.py`,
    2026-12-01, eleventh session, `results/decode_sweep*_s11.json`): one warp per program and
    32 keys per step for 4-bit codes, two warps and 64 keys for 8-bit ones. A one-warp
    program reduces its softmax with shuffles and no CTA barrier, and many of them keep more
    code bytes in flight per SM: s4 g64 0.278 ms against 0.337 ms with four warps (b64 x 8k
    keys), 0.149 against 0.229 ms (b8 x 32k); 8-bit codes 0.405 against 0.474 ms with two
    warps (one warp: 0.61). block_m caps the real rows per program (the expanded tiles have
    BLOCK_M * groups rows). That was measured with expanded tiles of the minimum 16 rows
    (Sq 1, 4 query heads per KV head); wider tiles (more query rows or groups) keep the four
    warps of the tenth session's sweep, whose registers they need (block_n 64, 128 for 4-bit
    codes with zero points)."""
    if problem.device != "cuda":
        return QuantDecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)
    d = max(problem.D, problem.Dv)
    if d > 128:
        return QuantDecodeConfig(block_n=64, block_m=16, num_warps=8, num_stages=3)
    four = _has_4bit(problem)
    base = QuantDecodeConfig(block_n=64, block_m=16, num_warps=4, num_stages=3)
    bng = max(triton.next_power_of_2(_sig_groups(qs, dd))
              for qs, dd in ((problem.k_quant, problem.D), (problem.v_quant, problem.Dv)))
    if row_block(problem, base)[0] * bng <= 16:
        return replace(base, block_n=32, num_warps=1) if four else replace(base, num_warps=2)
    zp = any(qs is not None and qs[4] is not None for qs in (problem.k_quant, problem.v_quant))
    return replace(base, block_n=128) if four and zp else base


def choose_splits(problem, cfg: DecodeConfig, num_sms: int | None = None) -> int:
    """Key chunks per (b, hk, row block), each >= 4 key blocks long: about 16 warps per SM
    for 4-bit codes and 64 for 8-bit ones (programs of 1 / 2 warps: 16 / 32 per SM; the
    eleventh session's sweep, as `default_config`: b64 x 8k s4 g64 with one-warp programs
    0.330 ms at 8 warps per SM, 0.278 at 16; with four warps the tenth session's had 2 / 16
    programs per SM, b8 x 32k s8: 0.292 ms at 9 splits, 0.232 ms at 36)."""
    if cfg.splits:
        return cfg.splits
    sms = num_sms or _num_sms(problem.device)
    _, nm = row_block(problem, cfg)
    base = problem.B * problem.Hkv * nm
    keys = problem.Sk if problem.causal != "top_left" else min(problem.Sk, problem.Sq)
    max_splits = max(1, triton.cdiv(keys, 4 * cfg.block_n))
    warps = (16 if _has_4bit(problem) else 64) * sms
    want = triton.cdiv(warps, base * cfg.num_warps)
    return max(1, min(want, max_splits, 4096))


def workspace_bytes(problem, cfg: DecodeConfig | None = None) -> int:
    cfg = cfg or default_config(problem)
    s = choose_splits(problem, cfg)
    return 0 if s == 1 else problem.B * problem.Hq * problem.Sq * s * (problem.Dv + 1) * 4


def _meta(t, D: int) -> tuple[dict, int]:
    """(constexpr dict, BLOCK_D) of K or V."""
    if not isinstance(t, KVQuant):
        return dict(BITS=0, SIGNED=False, GROUP=D, NG=1, BNG=1, SC_G=False, ZP=False, ZP_G=False, L1=False,
                    FP8=False, PV=1, ZLOAD=False, ZOFF=0.0), \
            max(16, triton.next_power_of_2(D))
    ng, bng = _groups(t, D)
    zp = t.zero_points
    bits = 4 if t.is_4bit else 8
    # u8 codes go to the mma as s8 (c - 128) against zero points 128 lower: Triton's u8 -> bf16
    # is an I2F per code, its s8 -> bf16 a short integer sequence (sm_90 SASS; `_codes8`)
    u8 = t.dtype == "u8"
    meta = dict(BITS=bits, SIGNED=t.dtype in ("s8", "s4") or u8, GROUP=t.group if ng > 1 else D, NG=ng, BNG=bng,
                SC_G=t.scale_kind == "g", ZP=zp is not None or u8, ZP_G=t.zp_kind == "g",
                L1=t.is_4bit and t.layout == 1, FP8=t.is_fp8, PV=param_vector(t, ng),
                ZLOAD=zp is not None, ZOFF=128.0 if u8 else 0.0)
    cols = D // 2 if bits == 4 else D
    return meta, max(16, triton.next_power_of_2(cols))


def plan(problem, args: AttnArgs, cfg: DecodeConfig):
    """(main launch, combine launch or None, splits) of solver 122 (see decode.plan)."""
    q = args.q
    D, Dv = problem.D, problem.Dv
    km, bd = _meta(args.k, D)
    vm, bdv = _meta(args.v, Dv)
    sk, sks, skz = _dec.kv_strides(args.k)
    sv, svs, svz = _dec.kv_strides(args.v)
    _, smask = _dec._mask4(args.attn_mask, q)
    bm, nm = row_block(problem, cfg)
    splits = choose_splits(problem, cfg)
    so = (problem.Hq * problem.Sq * Dv, problem.Sq * Dv, Dv, 1)
    interp = interpreting()
    f32 = q.dtype == torch.float32
    can_asm = not interp and not f32 and problem.device == "cuda"
    asm_cfg = getattr(cfg, "asm_convert", None)
    vjoin = bool(getattr(cfg, "v_join", False))
    dot_dtype = tl.float32 if (f32 or interp) else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    head = (*q.stride(), *sk, *sv, *sks, *skz, *svs, *svz, *smask, *so, problem.Hq, problem.Hkv, problem.Sq, problem.Sk)
    main = Launch(
        _decode_quant_kernel, (problem.B * problem.Hkv, splits, nm),
        (*head, *_dec.scalar_args(problem, args), splits, _dec.bt_stride(args)),
        counters_at=_dec.counters_at(problem, head),
        PAGE=problem.page_size, G=problem.group, D=D, DV=Dv, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_D=bd, BLOCK_DV=bdv,
        ONE_SPLIT=splits == 1, BALANCED=bool(_dec.balanced_bn(problem, splits, cfg)), **_dec.common_flags(problem),
        KBITS=km["BITS"], K_SIGNED=km["SIGNED"], K_GROUP=km["GROUP"], K_NG=km["NG"], K_BNG=km["BNG"],
        K_SC_G=km["SC_G"], K_ZP=km["ZP"], K_ZP_G=km["ZP_G"], K_ZLOAD=km["ZLOAD"], K_ZOFF=km["ZOFF"],
        V_ZLOAD=vm["ZLOAD"], V_ZOFF=vm["ZOFF"],
        VBITS=vm["BITS"], V_SIGNED=vm["SIGNED"], V_GROUP=vm["GROUP"], V_NG=vm["NG"], V_BNG=vm["BNG"],
        V_SC_G=vm["SC_G"], V_ZP=vm["ZP"], V_ZP_G=vm["ZP_G"],
        V_SPLIT=vm["BITS"] == 4 and not (vjoin and not vm["L1"]), V_JOIN=vm["BITS"] == 4 and vjoin and not vm["L1"],
        K_L1=km["L1"], V_L1=vm["L1"], K_PV=km["PV"], V_PV=vm["PV"],
        DOT_DTYPE=dot_dtype, F32_DOT=f32 or interp, ASM4=can_asm and asm_cfg is not False,
        ASM8=can_asm and asm_cfg is True and not (km["FP8"] or vm["FP8"]),
        CVT_PURE=not getattr(cfg, "pin_convert", False), num_warps=cfg.num_warps,
        num_stages=pipeline_stages(cfg.num_stages, problem.page_size))
    return main, _dec.combine_launch(problem, splits, _dec.balanced_bn(problem, splits, cfg)), splits


def decode_quant_forward(problem, args: AttnArgs, cfg: DecodeConfig | None = None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run solver 122 for a validated `problem`; returns (o, lse or None)."""
    cfg = cfg or default_config(problem)
    return _dec.run_planned(problem, args, plan(problem, args, cfg), out)


# ---- solver -----------------------------------------------------------------------

@register
class DecodeSplitKQuantGrouped(_DecodeBase):
    """Flash-decoding on quantized K/V with mmas on the raw codes; scales and zero points
    applied per group to the score / probability tiles (121 is the fallback)."""
    id = 122
    name = "decode_split_k_quant_grouped"
    paged = True  # page pools addressed as in decode.py (paging.py)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if not problem.quantized:
            reasons.append("K/V not quantized: served by decode_split_k (120)")
        for name, qs, d in (("K", problem.k_quant, problem.D), ("V", problem.v_quant, problem.Dv)):
            if qs is not None and _sig_groups(qs, d) > MAX_GROUPS:
                reasons.append(f"{name}: {d // qs[1]} groups per row (group_size {qs[1]}) > {MAX_GROUPS}: "
                               "served by decode_split_k_quant (121)")
        return reasons

    def row_blocks(self, problem) -> int:
        return row_block(problem, default_config(problem))[1]

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def estimate(self, problem) -> float:
        """Roofline of bytes read and main-loop instructions counted in the SASS
        (decode_swap.roofline_ms, shared with 128 and 121)."""
        from .decode_swap import ISSUE_122, roofline_ms
        # V stored keys-contiguous: its tiles are gathered byte by byte (2-3x the whole
        # kernel's time on the H200, DECODE_QUANT.md), so that half counts 4x
        return roofline_ms(problem, ISSUE_122, self.row_blocks(problem), keys_factor=4.0) + _dec._LAUNCH_MS

    def prepare(self, problem):
        return _dec.DecodePlan(problem, default_config(problem), plan)


__all__ = ["DecodeSplitKQuantGrouped", "QuantDecodeConfig", "choose_splits", "decode_quant_forward", "default_config",
           "row_block", "workspace_bytes"]
