"""Decode attention on quantized K/V in the swap-AB form (solver 128): keys are the M
dimension of the MMAs and the query rows their N dimension, so the codes are the MMA's
A operand (registers on Hopper's wgmma) and the small query / probability tiles its B
operand (shared memory). Same contract and launcher layout as `decode.py` / 122: GQA
batching (one program owns up to BLOCK_M of the G * Sq query rows of one KV head), split-K
with the shared LSE combine kernel, ragged kv_lens, causal, masks, return_lse, paged K/V.

Per key block (BLOCK_N keys), with x = (m, g) the expanded columns (query row m of the
block, group g along D; NG = D / group_size groups, BNG its power of two, 1 when scales and
zero points are per tensor / per head):

  K:  Sx^T = C_K (BLOCK_N, D) @ Qx^T (D, BLOCK_M * BNG)       Qx^T[d, (m, g)] = q[m, d] if group(d) == g
      s^T[j, m] = sum_g sk[j, g] * (Sx^T[j, (m, g)] - (OFF + zk[j, g]) * qsum[m, g])
  V:  Ox^T += C_V^T (Dv, BLOCK_N) @ Px^T (BLOCK_N, BLOCK_M * BNG)   Px^T[j, (m, g)] = p[j, m] * sv[j, g]
      o[m, d] = Ox^T[d, (m, group(d))] - sum_j Px^T[j, (m, group(d))] * (OFF + zv[j, group(d)])

C are the codes as exact 16-bit floats: the 4-bit codes become 0x4300 | n (bf16 128 + n) /
0x6400 | n (f16 1024 + n) by one lop3 per pair and one packed sub of the constant (`_asm_nib`;
OFF = 0). Folding that constant into the zero-point term instead (OFF = 128 or 1024, +8 for
s4) saved the sub but measured ~10x the error on the H200 (2026-12-01).
8-bit and fp8 codes convert with Triton's own (short, exact) sequences, OFF = 0.
4-bit codes are never interleaved: the low nibbles meet the even d of q (V: give the even
rows of o), the high nibbles the odd ones (layout 1: byte column c holds pair l1_pairs(c)).
V is read through its strides: stored keys-contiguous (`quantize_kv(..., order="keys")`) one
thread's register holds consecutive keys, the A-operand order of C_V^T.
Per-tensor / per-head scales fold into the softmax scale (K) and the output (V).

Not covered (122 serves them): a float K or V, dropout, more than 8 groups per row, head
dims above 256. Reading order: kernel -> launcher (`swap_forward`) -> solver (id 128).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..args import AttnArgs
from ..launch import Launch, interpreting
from ..search.solver import register
from . import decode as _dec
from .decode import DecodeConfig, _DecodeBase, _num_sms, l1_pairs
from .decode_quant import MAX_GROUPS, _groups, _sig_groups, param_vector
from .paging import page_rows, pipeline_stages

_MAX_MX = 128    # columns of an expanded tile (BLOCK_M * BNG): the MMA's N

# ---- code conversion --------------------------------------------------------------


def _asm_nib(dot: str, flip_lo: bool, flip_hi: bool) -> str:
    """PTX: 2 bytes ($2, 16 bits) -> their low nibbles ($0) and high nibbles ($1) as exact
    16-bit floats M + n, two per register (bf16 0x4300 | n = 128 + n, f16 0x6400 | n = 1024 + n),
    bit 3 of a nibble flipped where asked (s4: both, the two's complement sign; s8: the high
    nibble). Two bytes is what one thread holds per A-operand register pair of the MMA, so
    nothing is repacked; no bias fma: the kernel folds the offset into the zero-point term."""
    magic = {"bf16": 0x4300, "f16": 0x6400}[dot]
    m2 = magic | magic << 16

    sub = {"bf16": "sub.rn.bf16x2", "f16": "sub.rn.f16x2"}[dot]

    def lop(dst: str, src: str, flip: bool) -> str:   # (a & b) ^ c flips bit 3 | (a & b) | c
        c = m2 | 0x00080008 if flip else m2
        # then M (+ 8) off again, exactly: the MMA sees the codes themselves. Folding the
        # offset into the zero-point term instead saved this sub but cost ~10x the error
        # on the H200 (rel. 0.016-0.031 against 122's 0.0022: the correction does not cancel
        # the offset's products exactly)
        return (f"lop3.b32 {dst}, {src}, 0x000F000F, {c}, {0x6A if flip else 0xEA};\n"
                f"mov.b32 k, {c};\n{sub} {dst}, {dst}, k;\n")
    return ("{ .reg .b32 w, t, s, k;\n"
            "cvt.u32.u16 w, $2;\n"
            "prmt.b32 t, w, 0, 0x4140;\n"      # [b0, 0, b1, 0]
            "shr.u32 s, t, 4;\n" + lop("$0", "t", flip_lo) + lop("$1", "s", flip_hi) + "}")


# by FLIP: 0 none (u4, u8), 1 both nibbles (s4), 2 the high nibble (s8)
_NB0 = tl.constexpr(_asm_nib("bf16", False, False))
_NB1 = tl.constexpr(_asm_nib("bf16", True, True))
_NB2 = tl.constexpr(_asm_nib("bf16", False, True))
_NF0 = tl.constexpr(_asm_nib("f16", False, False))
_NF1 = tl.constexpr(_asm_nib("f16", True, True))
_NF2 = tl.constexpr(_asm_nib("f16", False, True))


def code_offset(bits: int, signed: bool, asm: bool, dot: torch.dtype, fp8: bool = False) -> float:
    """OFF of the converted codes (module docstring): 0, the codes reach the MMA exactly
    (the magic-number offset M, +8 for s4, is subtracted after the lop3)."""
    return 0.0    # the conversion subtracts M (+ 8) in registers (`_asm_nib`)


@triton.jit
def _nibbles(c, SIGNED: tl.constexpr, FLIP: tl.constexpr, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Low and high nibbles of 8-bit codes as DOT_DTYPE values: M + nibble with ASM (FLIP as
    in `_asm_nib`), else the nibbles as numbers (both two's complement for s4, the high one
    for s8: code = 16 hi + lo)."""
    if ASM:
        if DOT_DTYPE == tl.bfloat16:
            if FLIP == 0:
                return tl.inline_asm_elementwise(_NB0, "=r,=r,h", [c], (tl.bfloat16, tl.bfloat16), True, 2)
            elif FLIP == 1:
                return tl.inline_asm_elementwise(_NB1, "=r,=r,h", [c], (tl.bfloat16, tl.bfloat16), True, 2)
            else:
                return tl.inline_asm_elementwise(_NB2, "=r,=r,h", [c], (tl.bfloat16, tl.bfloat16), True, 2)
        else:
            if FLIP == 0:
                return tl.inline_asm_elementwise(_NF0, "=r,=r,h", [c], (tl.float16, tl.float16), True, 2)
            elif FLIP == 1:
                return tl.inline_asm_elementwise(_NF1, "=r,=r,h", [c], (tl.float16, tl.float16), True, 2)
            else:
                return tl.inline_asm_elementwise(_NF2, "=r,=r,h", [c], (tl.float16, tl.float16), True, 2)
    else:   # the plain nibbles: signed where FLIP says (c is int8 for s8, else uint8)
        if FLIP == 1:
            ci = c.to(tl.int8, bitcast=True)
            return ((ci << 4) >> 4).to(DOT_DTYPE), (ci >> 4).to(DOT_DTYPE)
        else:
            return (c & 15).to(DOT_DTYPE), (c >> 4).to(DOT_DTYPE)


@triton.jit
def _params(ptr, roff, n_ok, s_g, GROUPED: tl.constexpr, NG: tl.constexpr, BNG: tl.constexpr,
            OTHER: tl.constexpr, MASKED: tl.constexpr):
    """Scales / zero points of the keys at int64 offsets roff as an f32 (BLOCK_N, BNG) tile,
    or the per-tensor / per-head scalar. MASKED (the partial last block): groups >= NG and
    keys with n_ok False give OTHER. A full block loads without a mask, the padded groups
    repeating group g % NG (their columns of the expanded tiles are never picked; finite is
    all they need): a mask per group would keep the load scalar, and Triton's pipeliner takes
    only loads of >= 4 bytes per thread into its cp.async ring (with the kernel's PV), so the
    scales would be waited for in every step (s4 g64 0.30 ms against 0.24 ms with per-head
    scales, H200 2026-12-01)."""
    if GROUPED:
        offs_g = tl.arange(0, BNG)
        if MASKED:
            p = ptr + roff[:, None] + offs_g[None, :] * s_g
            return tl.load(p, mask=n_ok[:, None] & (offs_g[None, :] < NG), other=OTHER).to(tl.float32)
        elif NG == BNG:
            return tl.load(ptr + roff[:, None] + offs_g[None, :] * s_g).to(tl.float32)
        elif BNG % NG != 0:
            return tl.load(ptr + roff[:, None] + (offs_g % NG)[None, :] * s_g).to(tl.float32)
        else:   # load the NG groups, then repeat them (one vector load per key)
            x = tl.load(ptr + roff[:, None] + tl.arange(0, NG)[None, :] * s_g).to(tl.float32)
            BN: tl.constexpr = x.shape[0]
            return tl.reshape(tl.broadcast_to(x[:, None, :], (BN, BNG // NG, NG)), (BN, BNG))
    else:
        return tl.load(ptr).to(tl.float32)


@triton.jit
def _qx_t(q_cols, rx_ok, gx, d, s_qd, D: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """(len(d), MX) expanded query tile, transposed: column x holds q on the rows d of group gx[x]."""
    m = rx_ok[None, :] & (d[:, None] < D) & ((d // GROUP)[:, None] == gx[None, :])
    return tl.load(q_cols[None, :] + d[:, None] * s_qd, mask=m, other=0.0).to(DOT_DTYPE)


@triton.jit
def _spread(x, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BNG: tl.constexpr):
    """(BLOCK_N, BLOCK_M) -> (BLOCK_N, BLOCK_M * BNG): column (m, g) = column m."""
    if BNG == 1:
        return x
    else:
        return tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, BLOCK_M, BNG)), (BLOCK_N, BLOCK_M * BNG))


@triton.jit
def _pick_groups(acc, d, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BNG: tl.constexpr, BR: tl.constexpr):
    """(BR, BLOCK_M * BNG) -> (BR, BLOCK_M): row d keeps column (m, group(d))."""
    if BNG == 1:
        return acc
    else:
        a3 = tl.reshape(acc, (BR, BLOCK_M, BNG))
        sel = (d // GROUP)[:, None, None] == tl.arange(0, BNG)[None, None, :]
        return tl.sum(tl.where(sel, a3, 0.0), 2)


@triton.jit
def _roff(pg, pi, n0, s_page, s_row, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 offsets of the keys of a block: pg * s_page + pi * s_row (paged), or for the
    contiguous cache n0 * s_row + arange * s_row, whose vector part the compiler hoists out
    of the key loop (a per-key 64-bit multiply per tensor per step otherwise)."""
    if PAGE == 0:
        return tl.cast(n0, tl.int64) * s_row + tl.arange(0, BLOCK_N).to(tl.int64) * s_row
    else:
        return pg * s_page + pi * s_row


@triton.jit
def _codes(ptr, key_ok, col_ok, MASKED: tl.constexpr, FULL: tl.constexpr):
    """A code tile; full key blocks load without a key mask (so keys-contiguous V vectorises)."""
    if MASKED:
        if FULL:
            return tl.load(ptr, mask=key_ok, other=0.0)
        else:
            return tl.load(ptr, mask=key_ok & col_ok, other=0.0)
    else:
        if FULL:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=col_ok, other=0.0)


@triton.jit
def _step(n0, end, m_i, l_i, acc_a, acc_b, zcor, qx_lo, qx_hi, qsum, row_ok, row_lim, m_base, bt_row,
          k_base, v_base, ks_base, kz_base, vs_base, vz_base, offs_kh, offs_vh,
          s_kb, s_kn, s_kd, s_vb, s_vn, s_vd, s_ksb, s_ksn, s_ksg, s_kzb, s_kzn, s_kzg,
          s_vsb, s_vsn, s_vsg, s_vzb, s_vzn, s_vzg, s_mk, qk_scale,
          MASKED: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
          CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
          KBITS: tl.constexpr, K_SIGNED: tl.constexpr, K_NG: tl.constexpr,
          K_BNG: tl.constexpr, K_SC_G: tl.constexpr, K_ZP: tl.constexpr, K_ZP_G: tl.constexpr,
          K_OFF: tl.constexpr, VBITS: tl.constexpr, V_SIGNED: tl.constexpr, V_NG: tl.constexpr,
          V_BNG: tl.constexpr, V_SC_G: tl.constexpr, V_ZP: tl.constexpr, V_ZP_G: tl.constexpr,
          V_OFF: tl.constexpr, DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr, ASM4: tl.constexpr,
          PAGE: tl.constexpr, K_FLIP: tl.constexpr, K_SPLIT: tl.constexpr, V_FLIP: tl.constexpr,
          V_SPLIT: tl.constexpr):
    """One key block [n0, n0 + BLOCK_N) (MASKED: the last, partial one): scores, online
    softmax, P @ V. acc_a / acc_b: o^T of the low / high nibbles (4-bit V) or acc_a alone."""
    LOG2E: tl.constexpr = 1.4426950408889634
    VMX: tl.constexpr = BLOCK_M * V_BNG
    K_CORR: tl.constexpr = K_ZP or K_OFF != 0.0
    V_CORR: tl.constexpr = V_ZP or V_OFF != 0.0
    offs_n = tl.multiple_of(n0, BLOCK_N) + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < end
    else:
        n_ok = offs_n >= 0   # a full block: every key is < end
    pg, pi = page_rows(bt_row, offs_n, n_ok, n0, PAGE, BLOCK_N)
    # ---- S^T = codes @ Qx^T, then offset / zero point and scale per group ----
    kro = _roff(pg, pi, n0, s_kb, s_kn, PAGE, BLOCK_N)
    if KBITS == 4 or K_SPLIT:   # two MMAs: low nibbles x qx_lo, high nibbles x qx_hi
        KC: tl.constexpr = D // 2 if KBITS == 4 else D
        kc = _codes(k_base + kro[:, None] + offs_kh[None, :] * s_kd, n_ok[:, None], offs_kh[None, :] < KC,
                    MASKED, BLOCK_D == KC)
        k_lo, k_hi = _nibbles(kc, K_SIGNED, K_FLIP, ASM4, DOT_DTYPE)
        if F32_DOT:
            sx = tl.dot(k_lo, qx_lo, input_precision="ieee")
            sx = tl.dot(k_hi, qx_hi, sx, input_precision="ieee")
        elif KBITS == 8 and DOT_DTYPE == tl.float16:   # 16 q could overflow f16: scale the sum
            sx = tl.dot(k_lo, qx_lo, tl.dot(k_hi, qx_hi) * 16.0)
        else:
            sx = tl.dot(k_lo, qx_lo)
            sx = tl.dot(k_hi, qx_hi, sx)
    else:
        kc = _codes(k_base + kro[:, None] + offs_kh[None, :] * s_kd, n_ok[:, None], offs_kh[None, :] < D,
                    MASKED, BLOCK_D == D)
        if F32_DOT:
            sx = tl.dot(kc.to(DOT_DTYPE), qx_lo, input_precision="ieee")
        else:
            sx = tl.dot(kc.to(DOT_DTYPE), qx_lo)
    if K_ZP:
        zro = _roff(pg, pi, n0, s_kzb, s_kzn, PAGE, BLOCK_N)
        zb = _params(kz_base, zro, n_ok, s_kzg, K_ZP_G, K_NG, K_BNG, 0.0, MASKED) + K_OFF
    else:
        zb = K_OFF
    if K_BNG > 1:
        sx3 = tl.reshape(sx, (BLOCK_N, BLOCK_M, K_BNG))
        if K_CORR:
            qs3 = tl.reshape(qsum, (BLOCK_M, K_BNG))[None, :, :]
            if K_ZP_G:
                sx3 = sx3 - zb[:, None, :] * qs3
            else:
                sx3 = sx3 - zb * qs3
        if K_SC_G:
            ks = _params(ks_base, _roff(pg, pi, n0, s_ksb, s_ksn, PAGE, BLOCK_N), n_ok, s_ksg, True, K_NG, K_BNG, 1.0, MASKED)
            sx3 = sx3 * ks[:, None, :]
        s = tl.sum(sx3, 2)
    else:
        s = sx
        if K_CORR:
            if K_ZP_G:
                s = s - zb * qsum[None, :]     # zb: (BLOCK_N, 1)
            else:
                s = s - zb * qsum[None, :]
        if K_SC_G:
            sro = _roff(pg, pi, n0, s_ksb, s_ksn, PAGE, BLOCK_N)
            s = s * _params(ks_base, sro, n_ok, s_ksg, True, 1, 1, 1.0, MASKED)  # (BLOCK_N, 1)
    # ---- online softmax over the key axis (0) ----
    s = s * qk_scale
    valid = n_ok[:, None] & row_ok[None, :]
    if CAUSAL != 0:
        valid = valid & (offs_n[:, None] < row_lim[None, :])
    if MASK_KIND == 1:
        mk = tl.load(m_base + offs_n.to(tl.int64)[:, None] * s_mk, mask=valid, other=0)
        valid = valid & (mk != 0)
    elif MASK_KIND == 2:
        mk = tl.load(m_base + offs_n.to(tl.int64)[:, None] * s_mk, mask=valid, other=0.0)
        s = s + mk.to(tl.float32) * LOG2E
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha[None, :] + p   # per-thread partial sums: reduced over the keys after the loop
    m_i = m_new
    # ---- O^T += codes^T @ Px^T, the V scale folded into the probabilities ----
    px = _spread(p, BLOCK_N, BLOCK_M, V_BNG)
    if V_SC_G:
        vs = _params(vs_base, _roff(pg, pi, n0, s_vsb, s_vsn, PAGE, BLOCK_N), n_ok, s_vsg, True, V_NG, V_BNG, 1.0, MASKED)
        if V_BNG > 1:
            px = tl.reshape(p[:, :, None] * vs[:, None, :], (BLOCK_N, VMX))
        else:
            px = p * vs
    px = px.to(DOT_DTYPE)
    if V_BNG > 1:
        alpha_x = tl.reshape(tl.broadcast_to(alpha[:, None], (BLOCK_M, V_BNG)), (VMX,))
    else:
        alpha_x = alpha
    if V_CORR:   # per-thread partials of sum_j px (OFF + zv), with the rounded px the MMA sees
        pxf = px.to(tl.float32)
        if V_ZP_G:
            zro = _roff(pg, pi, n0, s_vzb, s_vzn, PAGE, BLOCK_N)
            zv = _params(vz_base, zro, n_ok, s_vzg, True, V_NG, V_BNG, 0.0, MASKED) + V_OFF
            if V_BNG > 1:
                pxf = tl.reshape(tl.reshape(pxf, (BLOCK_N, BLOCK_M, V_BNG)) * zv[:, None, :], (BLOCK_N, VMX))
            else:
                pxf = pxf * zv
        zcor = zcor * alpha_x[None, :] + pxf    # not grouped: times (OFF + zv) after the loop
    vro = _roff(pg, pi, n0, s_vb, s_vn, PAGE, BLOCK_N)
    if VBITS == 4 or V_SPLIT:   # low nibbles into acc_a, high nibbles into acc_b
        VC: tl.constexpr = DV // 2 if VBITS == 4 else DV
        vc = _codes(v_base + vro[None, :] + offs_vh[:, None] * s_vd, n_ok[None, :], offs_vh[:, None] < VC,
                    MASKED, BLOCK_DV == VC)
        v_lo, v_hi = _nibbles(vc, V_SIGNED, V_FLIP, ASM4, DOT_DTYPE)
        if F32_DOT:
            acc_a = tl.dot(v_lo, px, acc_a * alpha_x[None, :], input_precision="ieee")
            acc_b = tl.dot(v_hi, px, acc_b * alpha_x[None, :], input_precision="ieee")
        else:
            acc_a = tl.dot(v_lo, px, acc_a * alpha_x[None, :])
            acc_b = tl.dot(v_hi, px, acc_b * alpha_x[None, :])
    else:
        vc = _codes(v_base + vro[None, :] + offs_vh[:, None] * s_vd, n_ok[None, :], offs_vh[:, None] < DV,
                    MASKED, BLOCK_DV == DV)
        if F32_DOT:
            acc_a = tl.dot(vc.to(DOT_DTYPE), px, acc_a * alpha_x[None, :], input_precision="ieee")
        else:
            acc_a = tl.dot(vc.to(DOT_DTYPE), px, acc_a * alpha_x[None, :])

    return m_i, l_i, acc_a, acc_b, zcor


# ---- kernel -----------------------------------------------------------------------

@triton.jit(do_not_specialize=["Hq", "Hkv", "Sk", "SPLITS", "s_bt"])
def _decode_swap_kernel(
        Q, K, V, KS, KZ, VS, VZ, MASK, LENS, SCALE_PTR, O, LSE, PO, PL, BT,
        s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
        s_ksb, s_ksh, s_ksn, s_ksg, s_kzb, s_kzh, s_kzn, s_kzg,
        s_vsb, s_vsh, s_vsn, s_vsg, s_vzb, s_vzh, s_vzn, s_vzg,
        s_mb, s_mh, s_mq, s_mk, s_ob, s_oh, s_oq, s_od,
        Hq, Hkv, Sq, Sk, scale, SPLITS, s_bt,
        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        ONE_SPLIT: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_LENS: tl.constexpr,
        BALANCED: tl.constexpr,
        SCALE_FROM_PTR: tl.constexpr, INV_SCALE: tl.constexpr, INF_AS_ZERO: tl.constexpr,
        WRITE_LSE: tl.constexpr,
        KBITS: tl.constexpr, K_SIGNED: tl.constexpr, K_GROUP: tl.constexpr, K_NG: tl.constexpr,
        K_BNG: tl.constexpr, K_SC_G: tl.constexpr, K_ZP: tl.constexpr, K_ZP_G: tl.constexpr,
        K_OFF: tl.constexpr, K_L1: tl.constexpr, K_PV: tl.constexpr,
        VBITS: tl.constexpr, V_SIGNED: tl.constexpr, V_GROUP: tl.constexpr, V_NG: tl.constexpr,
        V_BNG: tl.constexpr, V_SC_G: tl.constexpr, V_ZP: tl.constexpr, V_ZP_G: tl.constexpr,
        V_OFF: tl.constexpr, V_L1: tl.constexpr, V_PV: tl.constexpr,
        DOT_DTYPE: tl.constexpr, F32_DOT: tl.constexpr, ASM4: tl.constexpr, PAGE: tl.constexpr,
        K_FLIP: tl.constexpr, K_SPLIT: tl.constexpr, V_FLIP: tl.constexpr, V_SPLIT: tl.constexpr):
    """One program: KV head (b, hk), key chunk `split`, row block `mblk`. KBITS / VBITS: 8 =
    s8/u8/fp8 codes, 4 = packed s4/u4; BLOCK_D / BLOCK_DV count rows of the code tiles
    (elements, or bytes = pairs for 4 bits). Writes o / lse (ONE_SPLIT) or the f32 partials
    PO (rows, SPLITS, DV) and PL (rows, SPLITS) that `_decode_combine_kernel` merges."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    KMX: tl.constexpr = BLOCK_M * K_BNG
    VMX: tl.constexpr = BLOCK_M * V_BNG
    V_CORR: tl.constexpr = V_ZP or V_OFF != 0.0
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

    # the plan checked that the key strides of the grouped scales / zero points are multiples
    # of PV: rebuilding them from a division lets the compiler see it (an argument's own
    # divisibility hint is 16 or nothing), so a key's groups load as one vector and the
    # pipeliner takes them into its cp.async ring with the codes
    if K_PV > 1:
        s_ksn = (s_ksn // K_PV) * K_PV
        s_kzn = (s_kzn // K_PV) * K_PV
    if V_PV > 1:
        s_vsn = (s_vsn // V_PV) * V_PV
        s_vzn = (s_vzn // V_PV) * V_PV
    if PAGE == 0:
        kvb = b64
    else:
        kvb = b64 * 0  # paged K/V (paging.py): the page of each key block is added in the loop
    bt_row = BT + b64 * s_bt
    k_base = K + kvb * s_kb + hk64 * s_kh
    v_base = V + kvb * s_vb + hk64 * s_vh
    ks_base = KS + kvb * s_ksb + hk64 * s_ksh
    kz_base = KZ + kvb * s_kzb + hk64 * s_kzh
    vs_base = VS + kvb * s_vsb + hk64 * s_vsh
    vz_base = VZ + kvb * s_vzb + hk64 * s_vzh
    if not K_SC_G:
        qk_scale = qk_scale * tl.load(ks_base).to(tl.float32)   # per tensor or per head
    if MASK_KIND != 0:
        m_base = MASK + b64 * s_mb + h.to(tl.int64)[None, :] * s_mh + qi.to(tl.int64)[None, :] * s_mq

    # expanded query columns x = (m, g): row m of the block, group g
    xk = tl.arange(0, KMX)
    rk = mblk * BLOCK_M + xk // K_BNG
    gk = xk % K_BNG
    q_cols = Q + b64 * s_qb + (hk * G + rk // Sq).to(tl.int64) * s_qh + (rk % Sq).to(tl.int64) * s_qs
    rk_ok = rk < G * Sq
    offs_kh = tl.arange(0, BLOCK_D)   # rows of q^T: elements, or byte columns of 4-bit K
    if KBITS == 4:   # low nibble = even element of the pair (layout 1: pair l1_pairs(c))
        pk = l1_pairs(offs_kh) if K_L1 else offs_kh
        qx_lo = _qx_t(q_cols, rk_ok, gk, 2 * pk, s_qd, D, K_GROUP, DOT_DTYPE)
        qx_hi = _qx_t(q_cols, rk_ok, gk, 2 * pk + 1, s_qd, D, K_GROUP, DOT_DTYPE)
        qsum = tl.sum(qx_lo.to(tl.float32), 0) + tl.sum(qx_hi.to(tl.float32), 0)  # of the rounded q
    else:
        qx_lo = _qx_t(q_cols, rk_ok, gk, offs_kh, s_qd, D, K_GROUP, DOT_DTYPE)
        if DOT_DTYPE == tl.float16:
            qx_hi = qx_lo    # 8-bit codes split in nibbles: 16 hi + lo; f16: the 16 goes on the sum
        else:
            qx_hi = qx_lo * 16   # exact (a power of two; bf16 / f32 do not overflow here)
        qsum = tl.sum(qx_lo.to(tl.float32), 0)
    offs_vh = tl.arange(0, BLOCK_DV)
    acc_a = tl.zeros((BLOCK_DV, VMX), tl.float32)
    if VBITS == 4:
        pv = l1_pairs(offs_vh) if V_L1 else offs_vh   # pair of o held by byte row c of V^T
    else:
        offs_vd = offs_vh
    if VBITS == 4 or V_SPLIT:
        acc_b = tl.zeros((BLOCK_DV, VMX), tl.float32)
    else:
        acc_b = tl.zeros((1,), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if V_CORR:
        zcor = tl.zeros((BLOCK_N, VMX), tl.float32)
    else:
        zcor = tl.zeros((1,), tl.float32)
    if CAUSAL == 0:
        row_lim = rows
    if MASK_KIND == 0:
        m_base = MASK

    # full key blocks without key masks, then the partial last block (if any) with them
    end_full = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(start, end_full, BLOCK_N):
        m_i, l_i, acc_a, acc_b, zcor = _step(
            n0, end, m_i, l_i, acc_a, acc_b, zcor, qx_lo, qx_hi, qsum, row_ok, row_lim, m_base, bt_row,
            k_base, v_base, ks_base, kz_base, vs_base, vz_base, offs_kh, offs_vh,
            s_kb, s_kn, s_kd, s_vb, s_vn, s_vd, s_ksb, s_ksn, s_ksg, s_kzb, s_kzn, s_kzg,
            s_vsb, s_vsn, s_vsg, s_vzb, s_vzn, s_vzg, s_mk, qk_scale, False, D, DV, BLOCK_M, BLOCK_N, BLOCK_D,
            BLOCK_DV, CAUSAL, MASK_KIND, KBITS, K_SIGNED, K_NG, K_BNG, K_SC_G, K_ZP, K_ZP_G, K_OFF,
            VBITS, V_SIGNED, V_NG, V_BNG, V_SC_G, V_ZP, V_ZP_G, V_OFF, DOT_DTYPE, F32_DOT, ASM4, PAGE,
            K_FLIP, K_SPLIT, V_FLIP, V_SPLIT)
    if end_full < end:
        m_i, l_i, acc_a, acc_b, zcor = _step(
            end_full, end, m_i, l_i, acc_a, acc_b, zcor, qx_lo, qx_hi, qsum, row_ok, row_lim, m_base, bt_row,
            k_base, v_base, ks_base, kz_base, vs_base, vz_base, offs_kh, offs_vh,
            s_kb, s_kn, s_kd, s_vb, s_vn, s_vd, s_ksb, s_ksn, s_ksg, s_kzb, s_kzn, s_kzg,
            s_vsb, s_vsn, s_vsg, s_vzb, s_vzn, s_vzg, s_mk, qk_scale, True, D, DV, BLOCK_M, BLOCK_N, BLOCK_D,
            BLOCK_DV, CAUSAL, MASK_KIND, KBITS, K_SIGNED, K_NG, K_BNG, K_SC_G, K_ZP, K_ZP_G, K_OFF,
            VBITS, V_SIGNED, V_NG, V_BNG, V_SC_G, V_ZP, V_ZP_G, V_OFF, DOT_DTYPE, F32_DOT, ASM4, PAGE,
            K_FLIP, K_SPLIT, V_FLIP, V_SPLIT)
    if VBITS == 4:
        acc_lo = acc_a
        acc_hi = acc_b
    elif V_SPLIT:
        acc = acc_a + acc_b * 16
    else:
        acc = acc_a

    # ---- epilogue: per-group columns, zero points, per-tensor scale; o^T stored ----
    l_i = tl.sum(l_i, 0)
    if V_CORR:
        zcor = tl.sum(zcor, 0)
        if not V_ZP_G:
            if V_ZP:
                zcor = zcor * (tl.load(vz_base).to(tl.float32) + V_OFF)   # per tensor or per head
            else:
                zcor = zcor * V_OFF
    has = l_i > 0.0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    if not V_SC_G:
        inv_l = inv_l * tl.load(vs_base).to(tl.float32)   # per tensor or per head
    if V_CORR:
        zc3 = tl.reshape(zcor, (BLOCK_M, V_BNG)) if V_BNG > 1 else zcor
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    if ONE_SPLIT:
        prow = (b64 * Hq + h) * Sq + qi
    else:
        prow = _dec.partial_row(rows, b64, hk, split, Hkv, G, Sq, SPLITS, BALANCED)
    if VBITS == 4:
        for half in tl.static_range(2):
            if half == 0:
                a = acc_lo
            else:
                a = acc_hi
            d = 2 * pv + half
            o_t = _pick_groups(a, d, V_GROUP, BLOCK_M, V_BNG, BLOCK_DV)
            if V_CORR:
                if V_BNG > 1:
                    sel = (d // V_GROUP)[:, None, None] == tl.arange(0, V_BNG)[None, None, :]
                    o_t = o_t - tl.sum(tl.where(sel, zc3[None, :, :], 0.0), 2)
                else:
                    o_t = o_t - zc3[None, :]
            _store_o(o_t, inv_l, has, d, row_ok, prow, b64, h, qi, split, O, PO, s_ob, s_oh, s_oq, s_od,
                     SPLITS, DV, ONE_SPLIT, INF_AS_ZERO)
    else:
        o_t = _pick_groups(acc, offs_vd, V_GROUP, BLOCK_M, V_BNG, BLOCK_DV)
        if V_CORR:
            if V_BNG > 1:
                sel = (offs_vd // V_GROUP)[:, None, None] == tl.arange(0, V_BNG)[None, None, :]
                o_t = o_t - tl.sum(tl.where(sel, zc3[None, :, :], 0.0), 2)
            else:
                o_t = o_t - zc3[None, :]
        _store_o(o_t, inv_l, has, offs_vd, row_ok, prow, b64, h, qi, split, O, PO, s_ob, s_oh, s_oq, s_od,
                 SPLITS, DV, ONE_SPLIT, INF_AS_ZERO)
    if ONE_SPLIT:
        if WRITE_LSE:
            tl.store(LSE + prow, lse, mask=row_ok)
    else:
        tl.store(PL + prow, lse, mask=row_ok)


@triton.jit
def _store_o(o_t, inv_l, has, d, row_ok, prow, b64, h, qi, split, O, PO, s_ob, s_oh, s_oq, s_od,
             SPLITS, DV: tl.constexpr, ONE_SPLIT: tl.constexpr, INF_AS_ZERO: tl.constexpr):
    """Rows d of o^T (len(d), BLOCK_M) divided by l: into O (ONE_SPLIT) or the f32 partials."""
    ok = (d[:, None] < DV) & row_ok[None, :]
    if ONE_SPLIT:
        if INF_AS_ZERO:
            o = tl.where(has[None, :], o_t * inv_l[None, :], 0.0)
        else:
            o = tl.where(has[None, :], o_t * inv_l[None, :], float("nan"))  # fully masked row: 0 / 0
        ptr = O + b64 * s_ob + h.to(tl.int64)[None, :] * s_oh + qi.to(tl.int64)[None, :] * s_oq + d[:, None] * s_od
        tl.store(ptr, o.to(O.dtype.element_ty), mask=ok)
    else:
        o = tl.where(has[None, :], o_t * inv_l[None, :], 0.0)
        tl.store(PO + prow[None, :] * DV + d[:, None], o, mask=ok)


# ---- launcher ---------------------------------------------------------------------

def row_block(problem, cfg: DecodeConfig) -> tuple[int, int]:
    """(BLOCK_M, number of row blocks) for the G * Sq rows of one KV head: as few rows per
    block as cover them (the softmax runs on BLOCK_M columns), with the expanded columns
    (BLOCK_M * BNG, the MMAs' N) <= 128; `tile_groups` pads BNG so that they are >= 16."""
    bng = max(triton.next_power_of_2(_sig_groups(problem.k_quant, problem.D)),
              triton.next_power_of_2(_sig_groups(problem.v_quant, problem.Dv)))
    rows = problem.group * problem.Sq
    bm = max(1, min(triton.next_power_of_2(rows), cfg.block_m, _MAX_MX // bng))
    return bm, triton.cdiv(rows, bm)


def tile_groups(bng: int, block_m: int) -> int:
    """Expanded columns per row: the groups' power of two, padded (with zero query columns)
    to the MMA's minimum N of 16."""
    return max(bng, 16 // block_m)


def default_config(problem) -> DecodeConfig:
    """One warpgroup (4 warps); keys per step by the fewest main-loop instructions per
    element in the sm_90 SASS (benchmarks/DECODE_QUANT.md, "Solver 128"): 128 when K and V
    are 4-bit and the expanded tile is the minimum 16 columns (two m64 wgmma tiles of keys),
    else 64 (8-bit codes are two 16-bit A-operand values each, wider tiles hold more
    registers: 128 spills). H200 sweep (2026-12-01, `results/decode_sweep*_s11.json`): 128 keys
    x 4 warps was best for s4 g32-g64 and u4 at b64 x 8k (0.241 ms against 0.364 with 64 keys);
    64 keys with twice the splits won at b8 x 32k for g32 (0.139 against 0.152) and for g128
    (0.189 / 0.296 against 0.215 / 0.336); 8 warps doubled every time."""
    if problem.device != "cuda":
        return DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)
    if max(problem.D, problem.Dv) > 128:
        return DecodeConfig(block_n=64, block_m=16, num_warps=4, num_stages=2)
    four = all(qs is not None and qs[0] in ("s4", "u4") for qs in (problem.k_quant, problem.v_quant))
    base = DecodeConfig(block_n=64, block_m=16, num_warps=4, num_stages=3)
    bm, _ = row_block(problem, base)
    bng = max(triton.next_power_of_2(_sig_groups(qs, d))
              for qs, d in ((problem.k_quant, problem.D), (problem.v_quant, problem.Dv)))
    if four and tile_groups(bng, bm) * bm <= 16:
        return DecodeConfig(block_n=128, block_m=16, num_warps=4, num_stages=3)
    return base


def _has_4bit(problem) -> bool:
    return any(qs is not None and qs[0] in ("s4", "u4") for qs in (problem.k_quant, problem.v_quant))


def choose_splits(problem, cfg: DecodeConfig, num_sms: int | None = None) -> int:
    """Key chunks per (b, hk, row block), each >= 4 key blocks long: ~4 CTAs per SM for 4-bit
    codes and ~8 for 8-bit ones (122's sweep preferred few CTAs for 4-bit codes, many for
    8-bit; not measured for 128 yet)."""
    if cfg.splits:
        return cfg.splits
    sms = num_sms or _num_sms(problem.device)
    _, nm = row_block(problem, cfg)
    base = problem.B * problem.Hkv * nm
    keys = problem.Sk if problem.causal != "top_left" else min(problem.Sk, problem.Sq)
    max_splits = max(1, triton.cdiv(keys, 4 * cfg.block_n))
    want = triton.cdiv((4 if _has_4bit(problem) else 8) * sms, base)
    return max(1, min(want, max_splits, 4096))


def workspace_bytes(problem, cfg: DecodeConfig | None = None) -> int:
    cfg = cfg or default_config(problem)
    s = choose_splits(problem, cfg)
    return 0 if s == 1 else problem.B * problem.Hq * problem.Sq * s * (problem.Dv + 1) * 4


def _meta(t, D: int, asm: bool, dot: torch.dtype) -> tuple[dict, int]:
    """(constexpr dict, rows of the code tile) of a quantized K or V."""
    ng, bng = _groups(t, D)
    bits = 4 if t.is_4bit else 8
    signed = t.dtype in ("s8", "s4")
    split = bits == 8 and not t.is_fp8   # 8-bit integer codes as two nibble MMAs (16 hi + lo)
    meta = dict(BITS=bits, SIGNED=signed, GROUP=t.group if ng > 1 else D, NG=ng, BNG=bng,
                SC_G=t.scale_kind == "g", ZP=t.zero_points is not None, ZP_G=t.zp_kind == "g",
                OFF=code_offset(bits, signed, asm, dot, t.is_fp8), L1=t.is_4bit and t.layout == 1,
                FLIP=(1 if bits == 4 else 2) if signed else 0, SPLIT=split)
    meta["PV"] = param_vector(t, ng)
    return meta, max(16, triton.next_power_of_2(D // 2 if bits == 4 else D))


def plan(problem, args: AttnArgs, cfg: DecodeConfig):
    """(main launch, combine launch or None, splits) of solver 128 (see decode.plan)."""
    q = args.q
    D, Dv = problem.D, problem.Dv
    interp = interpreting()
    f32 = q.dtype == torch.float32
    asm = not interp and not f32 and problem.device == "cuda"
    km, bd = _meta(args.k, D, asm, q.dtype)
    vm, bdv = _meta(args.v, Dv, asm, q.dtype)
    bm, nm = row_block(problem, cfg)
    km["BNG"], vm["BNG"] = tile_groups(km["BNG"], bm), tile_groups(vm["BNG"], bm)
    sk, sks, skz = _dec.kv_strides(args.k)
    sv, svs, svz = _dec.kv_strides(args.v)
    _, smask = _dec._mask4(args.attn_mask, q)
    splits = choose_splits(problem, cfg)
    so = (problem.Hq * problem.Sq * Dv, problem.Sq * Dv, Dv, 1)
    dot_dtype = tl.float32 if (f32 or interp) else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    scale = _dec.scalar_args(problem, args)[0]
    main = Launch(
        _decode_swap_kernel, (problem.B * problem.Hkv, splits, nm),
        (*q.stride(), *sk, *sv, *sks, *skz, *svs, *svz, *smask, *so,
         problem.Hq, problem.Hkv, problem.Sq, problem.Sk, scale, splits, _dec.bt_stride(args)),
        G=problem.group, D=D, DV=Dv, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_D=bd, BLOCK_DV=bdv,
        ONE_SPLIT=splits == 1, BALANCED=bool(_dec.balanced_bn(problem, splits, cfg)),
        **{k: v for k, v in _dec.common_flags(problem).items() if k != "DROPOUT"},
        **{f"K_{k}" if k != "BITS" else "KBITS": v for k, v in km.items()},
        **{f"V_{k}" if k != "BITS" else "VBITS": v for k, v in vm.items()},
        DOT_DTYPE=dot_dtype, F32_DOT=f32 or interp, ASM4=asm, PAGE=problem.page_size,
        num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg.num_stages, problem.page_size))
    return main, _dec.combine_launch(problem, splits, _dec.balanced_bn(problem, splits, cfg)), splits


def swap_forward(problem, args: AttnArgs, cfg: DecodeConfig | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run solver 128 for a validated `problem`; returns (o, lse or None)."""
    cfg = cfg or default_config(problem)
    return _dec.run_planned(problem, args, plan(problem, args, cfg), out)


# ---- solver -----------------------------------------------------------------------

# Per K/V element: the issue-rate equivalent of the H200 times (b64 k8k, Hq 32, Hkv 8, D 128;
# (no zero points, zero points)), not the SASS counts (128: 0.10 / 0.12 for 4-bit codes), so the
# estimate follows what the kernels measured: 128 (keys-contiguous V) 0.24 ms (s4 g32-g64),
# 0.31 (u4 with zero points), 0.61 (s8); 122 (V rows, one-warp programs) 0.28 (s4), 0.35
# (u4 zp), two-warp 0.40 (s8), 0.42 (fp8 per head) (2026-12-01, eleventh session, with the
# scales in the cp.async ring: `results/decode_sweep3_s11.json`). fp8: 128 scaled as its 4-bit.
ISSUE_128 = {"4": (0.19, 0.24), "8": (0.46, 0.51), "fp8": (0.35, 0.35)}
ISSUE_122 = {"4": (0.23, 0.28), "8": (0.30, 0.36), "fp8": (0.30, 0.30)}  # rows V
# 121 (f32 dequantisation per element) was not counted; 122 measured 1.2-2.1x faster (DECODE_QUANT.md)
ISSUE_121 = {"4": (0.4, 0.45), "8": (0.45, 0.5), "fp8": (0.45, 0.45)}   # 1.5x 122's
ISSUE_RATE = 132 * 4 * 1.98e9 * 0.8   # H200 warp-instructions / s at 80% issue efficiency


def _fmt(qs) -> str:
    return "fp8" if qs[0] == "fp8_e4m3" else ("4" if qs[0] in ("s4", "u4") else "8")


def roofline_ms(problem, table: dict, passes: int = 1, keys_factor: float = 1.0) -> float:
    """max(bytes / bandwidth, instructions / issue rate) + a quarter of the smaller (memory
    and issue overlap imperfectly, so fewer instructions still help at the memory roof);
    the instructions per element from `table` (K and V half each), times `keys_factor` for
    codes stored keys-contiguous (the signature's "keys"); `passes`: row blocks, each
    reading K and V again."""
    per = 0.0
    for qs, d in ((problem.k_quant, problem.D), (problem.v_quant, problem.Dv)):
        if qs is None:
            per += 0.07 * d    # float K or V: about the bf16 kernel's count (120)
        else:
            per += table[_fmt(qs)][qs[4] is not None] * d * (keys_factor if "keys" in qs[5:] else 1.0)
    elems = problem.B * problem.Hkv * problem.Sk * passes
    issue = elems * per / ISSUE_RATE
    mem = problem.bytes() / _dec._BW
    return (max(mem, issue) + 0.25 * min(mem, issue)) * 1e3


@register
class DecodeSwapAB(_DecodeBase):
    """Flash-decoding on quantized K/V with keys as the MMA's M dimension (swap-AB): codes
    converted in registers straight into the A operand, q / p tiles as the B operand."""
    id = 128
    name = "decode_swap_ab_quant"
    deterministic = True   # fixed split count and combine order
    paged = True  # page pools addressed as in decode.py (paging.py)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.k_quant is None or problem.v_quant is None:
            reasons.append("K and V must both be quantized (a float K or V: decode_split_k_quant_grouped, 122)")
        if problem.dropout_p > 0:
            reasons.append(f"dropout_p={problem.dropout_p}: served by decode_split_k_quant_grouped (122)")
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
        """`roofline_ms` with the instructions per element counted in the SASS; 122 uses the
        same form with its own counts, so 128 ranks first where its counts are lower."""
        passes = row_block(problem, default_config(problem))[1]
        return roofline_ms(problem, ISSUE_128, passes) + _dec._LAUNCH_MS

    def prepare(self, problem):
        return _dec.DecodePlan(problem, default_config(problem), plan)


__all__ = ["DecodeSwapAB", "choose_splits", "default_config", "row_block", "swap_forward", "workspace_bytes"]
