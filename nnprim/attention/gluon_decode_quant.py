"""Decode attention on 4-bit K/V codes with the codes unpacked in registers straight into
the tensor-core operands (solver 133, Gluon, Hopper).

Why: solvers 122 / 128 (Triton) send each K/V tile through shared memory on its way to the
mma (cp.async of the codes, then the converted 16-bit tile stored and read back as the
operand): 4 bytes of shared-memory traffic per 4-bit code, which at the bandwidth roof of
s4 (~32 codes per clock per SM) is the SM's whole shared-memory bandwidth. Here each
thread loads, with plain global loads, exactly the bytes its mma fragments hold, unpacks
them with one `lop3` and one subtraction per two codes into exact 16-bit floats (0x4300 | n
is bf16 128 + n, 0x6400 | n f16 1024 + n; s4 flips the nibble's sign bit first; 136 / 1032
subtracted: s4 code v becomes v, u4 code n becomes n - 8, i.e. OFF + code with OFF = 0 / -8)
and hands them to `mma.sync` (m16n8k16) without converting through shared memory. The next key
block's words are on their way while the current block is computed: through a cp.async ring
in shared memory (default; each thread copies the very words it later reads back, so the
ring needs no barrier between threads) or in registers (`Q4Config.ring = 0`).

The offsets come out of the accumulators instead of out of every code:

    K:  s_m,key = sum_g sc[key, g] * (Q_mg . C'_key,g - (OFF + zp[key, g]) * sum(Q_mg))
    V:  o_m,d   = sum_key P'_m,g(d),key C'_key,d - sum_key P'_m,g(d),key (OFF + zp[key, g(d)])
        with P'_m,g,key = p_m,key * sc[key, g]

Groups along D (group_size 8..D) use the *expanded* rows of solver 122: the mma's 16 rows
are (query row m, group g) pairs, row (m, g) of Q holds q_m on the columns of group g (so
one mma gives every group's partial dot product, the g rows are summed by a shuffle), and
row (m, g) of P' holds p_m * the V scale of group g (row (m, g) of the output is kept on
the columns of group g). G * Sq * groups <= 16.

Fragment order. The contraction index of Q K^T (the head dim) may be permuted freely if q
is permuted the same way, and the output columns of P V likewise if the store follows: so
the codes stay in KVQuant's layout 0 or 1 and each thread reads contiguous bytes:
- K (mma B operand, k = head dim, n = keys; lane = 4 r + c): thread (r, c) reads bytes
  [c D/8, (c+1) D/8) of its keys r + 8 j (one 16-byte load per key at D = 128).
- V (mma B operand, k = keys, n = head dim): thread (r, c) reads bytes [r Dv/16, (r+1) Dv/16)
  of keys 2 p and 2 p + 1, p = c + 4 h + 8 t; a `prmt` puts the two keys' nibbles of one
  column side by side (the fragment pairs two keys).
The unpacked tensors are reshaped and permuted (register renaming only) into the
fragments' logical order; `natural_dim_*` give the head-dim column each position holds.

Supported: s4 / u4 K and V (both 4-bit, layout 0 or 1, codes contiguous along D, rows
order), scales per tensor / head / (key, group) with optional zero points of any kind,
bf16 or f16 q (the codes' float type follows q), D = Dv in {64, 128}, Sq * G * groups <=
16, causal (both alignments), kv_lens, splits with the shared combine kernel, return_lse,
paged K/V of any page size (`page_mode`: a block-table entry per 32-key block when the page
size is a multiple of 32, two at page 16, else one per row; each entry is read a step before
the words it addresses). Keys past a chunk's end are never read past its last row, so page
tails and keys past kv_lens may hold anything (NaN scales included).

The step's instructions (sm_90 SASS per 32 keys, `benchmarks/diag/q4_sass.py`; s4 g64
contiguous / u4 g64 with zero points / s4 on 64- and 16-key pages): 721 / 766 / 783 / 830,
from 856 / 941 / 891 / 924 before three changes (2026-12-03):
- Row and group strides are constants, and while the next block lies wholly inside the
  chunk the step runs unclamped rows: one 64-bit base per block (per page at page 16), a
  thread's loads differing by immediates. The last one or two steps run a second copy of
  the step with rows clamped (no branch inside either loop: a branch there splits the
  scheduler's window, and an if/else version measured slower than before).
- The online softmax rescales acc only when some row's max grows by more than 2^8 (p stays
  <= 256 meanwhile), as FlashAttention-4 does: most steps skip DV / 2 multiplies per thread.
- Each block's scales and zero points load at the top of its step.
Measured gain 3-7 % (b8 x 32k, b64 x 8k): the kernel is latency-bound, issuing ~40 % of the
SM's instruction rate. With the words prefetched in registers it holds 232 registers, 8
one-warp programs an SM; through the cp.async ring (2026-12-03, twenty-eighth session) 168,
12 programs an SM, at the same instruction count per step: 5-9 % faster on the contiguous
cache and 4-19 % on 16- / 64-key pages (`default_config` gives the ring's measured depths).
An L2 prefetch of a block further ahead (`Q4Config.prefetch`) helped the register version
and measured slower with the ring.
Not here (122 serves them): masks, dropout, f32 q, 8-bit / fp8 / float K or V,
keys-contiguous storage. As in 122, P' is in q's dtype: with f16 q and V scales below ~1e-4
it loses precision in f16's subnormals (bf16 q, the usual decode, does not).

Reading order: helpers -> Gluon kernel -> launcher (`plan`) -> solver (id 133).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..args import AttnArgs
from ..gluon_support import async_copy, gl, gluon, gluon_reasons, mma_v2
from ..launch import Launch
from ..quant import NIB1
from ..search.solver import register
from . import decode as _dec
from . import decode_quant
from .decode import DecodeConfig, _DecodeBase, _num_sms
from .decode_quant import _groups, _sig_groups

ROWS = 16          # the mma's M: expanded rows (query row, group)
Q4_BW = 2.6e12     # bytes / s solver 133 reads at on the H200 (estimate)
HEAD_DIMS = (64, 128)
NIB_A = (0, 4, 1, 5)   # nibbles of a 32-bit word in K's first unpacked tensor (elements q = 0..3)
NIB_B = (2, 6, 3, 7)   # ... and in its second


def _lop3(signed: bool, f16: bool) -> tuple[int, int, int, str]:
    """(immediate, LUT, magic, subtraction) of the unpack: lop3 (x & 0x000F000F) ^ c for
    signed codes (the nibble's sign bit flipped and the magic exponent set in one step),
    | c for unsigned; then the pair minus magic + 8 (exact): s4 v -> v, u4 n -> n - 8.
    Leaving the magic's 128 / 1024 in the operands and taking it out of the f32 accumulators
    measured 3-4x bf16's error on the H200 (7-8e-3 against 2.2e-3; 2026-12-03): the
    accumulators would hold ~45x the result, and the tensor cores' f32 sums keep fewer bits."""
    c = (0x43084308 if signed else 0x43004300) + (0x64006400 - 0x43004300 if f16 else 0)
    return c, (0x6A if signed else 0xEA), (0x64086408 if f16 else 0x43084308), \
        ("sub.rn.f16x2" if f16 else "sub.rn.bf16x2")


def _asm_k(f16: bool, signed: bool) -> str:
    """A 32-bit word of 8 nibbles ($4) -> 4 registers ($0..$3): register s = nibbles (s, s + 4)
    as exact 16-bit floats OFF + code (see _lop3)."""
    c, lut, m, sub = _lop3(signed, f16)
    lines = ["{ .reg .b32 s1, s2, s3, m;", "shr.u32 s1, $4, 4;", "shr.u32 s2, $4, 8;", "shr.u32 s3, $4, 12;",
             f"mov.b32 m, {m};"]
    src = ("$4", "s1", "s2", "s3")
    for i in range(4):
        lines += [f"lop3.b32 ${i}, {src[i]}, 0x000F000F, {c}, {lut};", f"{sub} ${i}, ${i}, m;"]
    return "\n".join(lines) + "\n}"


def _asm_v(f16: bool, signed: bool) -> str:
    """A 32-bit word of an even key ($8) and of the next key ($9) -> 8 registers ($0..$7),
    register s = (even key's nibble s, odd key's nibble s) as exact 16-bit floats."""
    c, lut, m, sub = _lop3(signed, f16)
    lines = ["{ .reg .b32 t0, t1, t2, t3, u0, u1, u2, u3, m;", f"mov.b32 m, {m};",
             "prmt.b32 t0, $8, $9, 0x5410;", "prmt.b32 u0, $8, $9, 0x7632;"]
    for x in ("t", "u"):
        lines += [f"shr.u32 {x}1, {x}0, 4;", f"shr.u32 {x}2, {x}0, 8;", f"shr.u32 {x}3, {x}0, 12;"]
    for i in range(8):
        x = "t" if i < 4 else "u"
        lines += [f"lop3.b32 ${i}, {x}{i % 4}, 0x000F000F, {c}, {lut};", f"{sub} ${i}, ${i}, m;"]
    return "\n".join(lines) + "\n}"


def code_offset(signed: bool) -> float:
    """OFF: the unpacked value of code v (s4) / n (u4) is OFF + v / OFF + n."""
    return 0.0 if signed else -8.0


# warm L2 (and the TLB) with a K / V line of a block further ahead; the dummy output keeps
# the instruction in the kernel
_PREFETCH_ASM = "prefetch.global.L2 [$1];\nmov.u32 $0, 0;"

if gl is not None:
    _PREFETCH = gl.constexpr(_PREFETCH_ASM)
    _K_BF16_S = gl.constexpr(_asm_k(False, True))
    _K_BF16_U = gl.constexpr(_asm_k(False, False))
    _K_F16_S = gl.constexpr(_asm_k(True, True))
    _K_F16_U = gl.constexpr(_asm_k(True, False))
    _V_BF16_S = gl.constexpr(_asm_v(False, True))
    _V_BF16_U = gl.constexpr(_asm_v(False, False))
    _V_F16_S = gl.constexpr(_asm_v(True, True))
    _V_F16_U = gl.constexpr(_asm_v(True, False))


def _element(nib: int, layout: int) -> int:
    """Element (0..7) of a 32-bit word that nibble `nib` holds in KVQuant `layout`."""
    return NIB1[nib] if layout == 1 else nib


def natural_dim_k(k: torch.Tensor, second: bool, D: int, layout: int) -> torch.Tensor:
    """Head-dim column held at contraction position k (0..D/2-1) of K's first / second
    unpacked operand: k = 16 i + 8 q1 + 2 c + q0 -> word c * D/32 + i, nibble NIB_A/B[2 q1 + q0]."""
    q0, c, q1, i = k & 1, (k >> 1) & 3, (k >> 3) & 1, k >> 4
    nibs = torch.tensor(NIB_B if second else NIB_A, device=k.device)[2 * q1 + q0]
    elem = torch.tensor([_element(n, layout) for n in range(8)], device=k.device)[nibs]
    return 8 * (c * (D // 32) + i) + elem


def natural_dim_v(n: torch.Tensor, DV: int, layout: int) -> torch.Tensor:
    """Head-dim column held at output position n (0..Dv-1) of the P V accumulator:
    n = 64 i + 32 a1 + 16 a0 + 8 q1 + r -> word r * Dv/64 + i, nibble 2 (a0 + 2 a1) + q1."""
    r, q1, a0, a1, i = n & 7, (n >> 3) & 1, (n >> 4) & 1, (n >> 5) & 1, n >> 6
    nib = 2 * (a0 + 2 * a1) + q1
    elem = torch.tensor([_element(x, layout) for x in range(8)], device=n.device)[nib]
    return 8 * (r * (DV // 64) + i) + elem


# ---- Gluon kernel ---------------------------------------------------------------------

if gluon is not None:
    @gluon.jit
    def _halves(x, DT: gl.constexpr):
        """int32 tensor of 16-bit pairs -> (..., 2) tensor of DT (register renaming)."""
        lo = x.to(gl.int16).to(DT, bitcast=True)
        hi = (x >> 16).to(gl.int16).to(DT, bitcast=True)
        return gl.join(lo, hi)

    @gluon.jit
    def _unpack_k(w, F16: gl.constexpr, SIGNED: gl.constexpr):
        """K's int32 words -> 4 int32 tensors of value pairs (see _asm_k)."""
        if F16:
            asm: gl.constexpr = _K_F16_S if SIGNED else _K_F16_U
        else:
            asm: gl.constexpr = _K_BF16_S if SIGNED else _K_BF16_U
        return gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [w], dtype=(gl.int32,) * 4, is_pure=True, pack=1)

    @gluon.jit
    def _unpack_v(we, wo, F16: gl.constexpr, SIGNED: gl.constexpr):
        """V's int32 words of even and odd keys -> 8 int32 tensors of key pairs (see _asm_v)."""
        if F16:
            asm: gl.constexpr = _V_F16_S if SIGNED else _V_F16_U
        else:
            asm: gl.constexpr = _V_BF16_S if SIGNED else _V_BF16_U
        return gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [we, wo], dtype=(gl.int32,) * 8,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _page_of(bt_row, n, NPAGES, PAGE: gl.constexpr, ROW32: gl.constexpr):
        """Page id of key n, clamped into the pool (entries past a sequence's pages may hold
        anything, and only masked rows read them); int32 when every pool's offsets fit in 32
        bits (ROW32), else int64."""
        pg = gl.minimum(gl.maximum(gl.load(bt_row + n // PAGE), 0), NPAGES - 1)
        if ROW32:
            return pg
        else:
            return pg.to(gl.int64)

    @gluon.jit
    def _block_page(bt_row, n, hi, NPAGES, PAGE: gl.constexpr, MODE: gl.constexpr, ROW32: gl.constexpr):
        """The pages of key block n (clamped to hi): (its page, the same) when the block lies in
        one page (MODE 1), (the page of its first half, of its second) when it spans two (MODE
        2); zeros otherwise (contiguous, or a page per row)."""
        if ROW32:
            zero = n * 0
        else:
            zero = n.to(gl.int64) * 0
        if MODE == 1:
            pg = _page_of(bt_row, gl.minimum(n, hi), NPAGES, PAGE, ROW32)
            return pg, pg
        elif MODE == 2:
            return (_page_of(bt_row, gl.minimum(n, hi), NPAGES, PAGE, ROW32),
                    _page_of(bt_row, gl.minimum(n + PAGE, hi), NPAGES, PAGE, ROW32))
        else:
            return zero, zero

    @gluon.jit
    def _rows_ptr(base, rows, rel, s_b, s_n, pg, pg2, n, hi, bt_row, NPAGES, PAGE: gl.constexpr,
                  MODE: gl.constexpr, ROW32: gl.constexpr):
        """Pointers to key rows `rows` (clamped into the chunk; `rel`: their place in key block
        n before clamping): contiguous (MODE 0); in the block's page pg (MODE 1) or its two
        pages pg / pg2 (MODE 2), one scalar offset per page and block added in the rows' own
        multiply-add when int32 (ROW32); or through a block-table entry per row (MODE 3)."""
        if MODE == 0:
            return base + rows * s_n
        elif MODE == 1:
            p0 = (gl.minimum(n, hi) // PAGE) * PAGE
            return base + (rows * s_n + (pg * s_b - p0 * s_n))
        elif MODE == 2:
            p0 = (gl.minimum(n, hi) // PAGE) * PAGE
            p1 = (gl.minimum(n + PAGE, hi) // PAGE) * PAGE
            return base + (rows * s_n + gl.where(rel < PAGE, pg * s_b - p0 * s_n, pg2 * s_b - p1 * s_n))
        else:
            return base + _page_of(bt_row, rows, NPAGES, PAGE, ROW32) * s_b + (rows % PAGE) * s_n

    @gluon.jit
    def _block_ptrs(k_w0, v_w0, n, hi, pg, pg2, kn, vp, k_cols, v_cols, s_kbw, s_knw, s_vbw, s_vnw, bt_row, NPAGES,
                    PAGE: gl.constexpr, MODE: gl.constexpr, ROW32: gl.constexpr):
        """Pointers to the int32 words of key block n (rows clamped to hi; pages pg / pg2, see
        _block_page) each thread's fragments hold: K [BN, 4, D/32], V's even and odd keys
        [BN/2, 8, DV/64]."""
        kp = _rows_ptr(k_w0, gl.minimum(n + kn, hi), kn, s_kbw, s_knw, pg, pg2, n, hi, bt_row, NPAGES,
                       PAGE, MODE, ROW32)[:, None, None] + k_cols
        e = 2 * vp
        vep = _rows_ptr(v_w0, gl.minimum(n + e, hi), e, s_vbw, s_vnw, pg, pg2, n, hi, bt_row, NPAGES,
                        PAGE, MODE, ROW32)[:, None, None] + v_cols
        vop = _rows_ptr(v_w0, gl.minimum(n + e + 1, hi), e + 1, s_vbw, s_vnw, pg, pg2, n, hi, bt_row,
                        NPAGES, PAGE, MODE, ROW32)[:, None, None] + v_cols
        return kp, vep, vop

    @gluon.jit
    def _prefetch_block(k_w0, v_w0, n, hi, lanes, s_kbw, s_knw, s_vbw, s_vnw, bt_row, NPAGES,
                        PAGE: gl.constexpr, MODE: gl.constexpr, ROW32: gl.constexpr):
        """L2 prefetch of key block n's K and V rows (lane i: row i of each): no registers held,
        so the block can be further ahead than the words' one-block register prefetch (paged
        caches scatter blocks over the pool, and the first touch of a page is a TLB miss)."""
        pg, pg2 = _block_page(bt_row, n, hi, NPAGES, PAGE, MODE, ROW32)
        rows = gl.minimum(n + lanes, hi)
        kp = _rows_ptr(k_w0, rows, lanes, s_kbw, s_knw, pg, pg2, n, hi, bt_row, NPAGES, PAGE, MODE, ROW32)
        vp = _rows_ptr(v_w0, rows, lanes, s_vbw, s_vnw, pg, pg2, n, hi, bt_row, NPAGES, PAGE, MODE, ROW32)
        a = gl.inline_asm_elementwise(_PREFETCH, "=r,l", [kp], dtype=gl.int32, is_pure=False, pack=1)
        b = gl.inline_asm_elementwise(_PREFETCH, "=r,l", [vp], dtype=gl.int32, is_pure=False, pack=1)
        return a + b

    @gluon.jit
    def _block_base(base, n, pg, pg2, s_b, S_N: gl.constexpr, PAGE: gl.constexpr, MODE: gl.constexpr):
        """Scalar pointers to the first rows of key block n's halves: both its first row when
        the block lies in the contiguous cache (MODE 0) or in one page (MODE 1); the first
        rows of its two pages pg / pg2 (MODE 2). 64-bit: no int32 bound on the pools."""
        if MODE == 0:
            a = base + n.to(gl.int64) * S_N
            return a, a
        elif MODE == 1:
            a = base + (pg.to(gl.int64) * s_b + (n % PAGE) * S_N)
            return a, a
        else:
            return base + pg.to(gl.int64) * s_b, base + pg2.to(gl.int64) * s_b

    @gluon.jit
    def _rows_fast(base, rel, LANE: gl.constexpr, n, pg, pg2, s_b, S_N: gl.constexpr, PAGE: gl.constexpr,
                   MODE: gl.constexpr):
        """Pointers to rows n + rel of a key block wholly inside the chunk (no clamp; MODE 0-2).
        LANE masks the bits of rel that vary across a thread's lanes; the rest varies across its
        registers and is constant. Written as (block base + the lane's 64-bit offset) + a
        constant, so a thread's loads share one address register and differ by immediates (an
        int32 row offset sign-extended per element would be hoisted out of the loop as one
        64-bit register each)."""
        a, a2 = _block_base(base, n, pg, pg2, s_b, S_N, PAGE, MODE)
        lane = rel & LANE
        c = rel & ~LANE   # (not rel - lane: LLVM folds the mask to a constant, not the difference)
        if MODE == 2:
            return (gl.where(c < PAGE, a, a2) + lane.to(gl.int64) * S_N) + (c % PAGE) * S_N
        else:
            return (a + lane.to(gl.int64) * S_N) + c * S_N

    @gluon.jit
    def _block_ptrs_fast(k_w0, v_w0, n, pg, pg2, kn, vp, k_cols, v_cols, s_kbw, s_vbw, K_SNW: gl.constexpr,
                         V_SNW: gl.constexpr, PAGE: gl.constexpr, MODE: gl.constexpr):
        """_block_ptrs for a key block wholly inside the chunk (MODE 0-2)."""
        # lanes: K rows r + 8 j (r = lane // 4), V pairs c + 4 h + 8 t (c = lane % 4)
        kp = _rows_fast(k_w0, kn, 7, n, pg, pg2, s_kbw, K_SNW, PAGE, MODE)[:, None, None] + k_cols
        e = 2 * vp
        vep = _rows_fast(v_w0, e, 6, n, pg, pg2, s_vbw, V_SNW, PAGE, MODE)[:, None, None] + v_cols
        vop = _rows_fast(v_w0, e + 1, 6, n, pg, pg2, s_vbw, V_SNW, PAGE, MODE)[:, None, None] + v_cols
        return kp, vep, vop

    @gluon.jit
    def _fetch_block(FAST: gl.constexpr, k_w0, v_w0, n, hi, pg, pg2, kn, vp, k_cols, v_cols, s_kbw, s_knw, s_vbw,
                     s_vnw, bt_row, NPAGES, PAGE: gl.constexpr, MODE: gl.constexpr, ROW32: gl.constexpr):
        """The pointers of key block n's words: FAST (MODE 0-2) when the block lies wholly inside
        the chunk, else with rows clamped to hi."""
        if FAST:
            return _block_ptrs_fast(k_w0, v_w0, n, pg, pg2, kn, vp, k_cols, v_cols, s_kbw, s_vbw, s_knw, s_vnw,
                                    PAGE, MODE)
        else:
            return _block_ptrs(k_w0, v_w0, n, hi, pg, pg2, kn, vp, k_cols, v_cols, s_kbw, s_knw, s_vbw, s_vnw,
                               bt_row, NPAGES, PAGE, MODE, ROW32)

    @gluon.jit
    def _copy_block(k_slot, ve_slot, vo_slot, kp, vep, vop):
        """Start key block's words on their way into one ring slot (cp.async; each thread copies
        the words it later reads back, so no barrier orders the copy and the reads)."""
        async_copy.async_copy_global_to_shared(k_slot, kp)
        async_copy.async_copy_global_to_shared(ve_slot, vep)
        async_copy.async_copy_global_to_shared(vo_slot, vop)
        async_copy.commit_group()

    @gluon.jit
    def _param_tile(FAST: gl.constexpr, base, keys8, s_b, S_N: gl.constexpr, pg, pg2, n, hi, bt_row, NPAGES, g8,
                    S_G: gl.constexpr, GROUPED: gl.constexpr, OTHER: gl.constexpr, PAGE: gl.constexpr,
                    MODE: gl.constexpr, ROW32: gl.constexpr):
        """The (8, BN) tile (layout param_layout) of scales or zero points of group g8[row] of
        key block n's rows, as stored (GROUPED), else the scalar at base. FAST: the block lies
        wholly inside the chunk; otherwise its rows are clamped into it (page tails and keys
        past kv_lens may hold NaN)."""
        if GROUPED:
            if FAST:
                at = _rows_fast(base, keys8, 6, n, pg, pg2, s_b, S_N, PAGE, MODE)
            else:
                at = _rows_ptr(base, gl.minimum(n + keys8, hi), keys8, s_b, S_N, pg, pg2, n, hi, bt_row, NPAGES,
                               PAGE, MODE, ROW32)
            return gl.load(at[None, :] + g8[:, None] * S_G, mask=g8[:, None] >= 0, other=OTHER)
        else:
            return gl.load(base)

    @gluon.jit
    def _param_rows(t, GROUPED: gl.constexpr, MMA: gl.constexpr):
        """A _param_tile as f32 on the accumulator's 16 rows (GROUPED): rows r and r + 8 live
        in one thread and share their group, so the 8-row tile is doubled in registers."""
        t = t.to(gl.float32)
        if GROUPED:
            t = gl.permute(gl.join(t, t), (2, 0, 1))
            return gl.convert_layout(gl.reshape(t, [16, t.shape[2]]), MMA)
        else:
            return t

    @gluon.jit
    def _rescale(acc, l_i, zc, m_i, m_new):
        """The online softmax's state moved from running max m_i to m_new (rows still at -inf
        stay there)."""
        alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        return acc * alpha[:, None], l_i * alpha, zc * alpha, m_new

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _balanced_chunk(LENS, p, B, Sq, Sk, SPLITS, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """(b, L, shift, start, end) of program p of a KV head's B * SPLITS when the chunks are
        shared by kv_lens (decode.balanced_counts): with ragged lengths one wave then ends
        when the mean sequence would, not the longest. Idle programs get an empty chunk.
        The lengths are read decode.LENS_PER_LOAD at a time (decode.balanced_chunk, the Triton twin)."""
        BB: gl.constexpr = _dec.LENS_PER_LOAD
        LB: gl.constexpr = gl.BlockedLayout([BB // 32], [32], [1], [0])
        bi = gl.arange(0, BB, layout=LB)
        lv = _dec.clamped_lens(LENS, bi, B, Sk)
        nb = _dec.visible_blocks(lv, Sq, BN, CAUSAL)
        total = gl.sum(nb, 0)
        for b0 in range(BB, B, BB):
            total += gl.sum(_dec.visible_blocks(_dec.clamped_lens(LENS, b0 + bi, B, Sk), Sq, BN, CAUSAL), 0)
        total = gl.maximum(total, 1)
        cum = gl.associative_scan(gl.where(bi < B, _dec.chunk_count(nb, total, B, SPLITS), 0), 0, _add)
        before = cum <= p
        b = gl.sum(before.to(gl.int32), 0)
        first = gl.max(gl.where(before, cum, 0), 0)
        carry = gl.max(cum, 0)
        L = gl.sum(gl.where(bi == b, lv, 0), 0)
        for b0 in range(BB, B, BB):
            lb = _dec.clamped_lens(LENS, b0 + bi, B, Sk)
            cnt = gl.where(b0 + bi < B, _dec.chunk_count(_dec.visible_blocks(lb, Sq, BN, CAUSAL), total, B, SPLITS), 0)
            cum = carry + gl.associative_scan(cnt, 0, _add)
            before = cum <= p
            b += gl.sum(before.to(gl.int32), 0)
            first = gl.maximum(first, gl.max(gl.where(before, cum, 0), 0))
            L += gl.sum(gl.where(b0 + bi == b, lb, 0), 0)
            carry += gl.sum(cnt, 0)
        return _dec.chunk_range(p, b, first, L, total, B, Sq, SPLITS, BN, CAUSAL)

    @gluon.jit
    def _gluon_decode_q4_kernel(
            Q, K, V, KS, KZ, VS, VZ, MASK, LENS, SCALE_PTR, O, LSE, PO, PL, BT,
            s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_vb, s_vh,
            s_ksb, s_ksh, s_kzb, s_kzh, s_vsb, s_vsh, s_vzb, s_vzh,
            s_ob, s_oh, s_oq, s_od,
            Hq, Hkv, Sq, Sk, scale, SPLITS, s_bt, NPAGES,
            G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BN: gl.constexpr, NG: gl.constexpr,
            K_NG: gl.constexpr, V_NG: gl.constexpr, K_GROUP: gl.constexpr, V_GROUP: gl.constexpr,
            K_SC_G: gl.constexpr, K_ZP: gl.constexpr, K_ZP_G: gl.constexpr,
            V_SC_G: gl.constexpr, V_ZP: gl.constexpr, V_ZP_G: gl.constexpr,
            K_SIGNED: gl.constexpr, V_SIGNED: gl.constexpr, K_L1: gl.constexpr, V_L1: gl.constexpr,
            F16: gl.constexpr, ONE_SPLIT: gl.constexpr, CAUSAL: gl.constexpr, HAS_LENS: gl.constexpr,
            SCALE_FROM_PTR: gl.constexpr, INV_SCALE: gl.constexpr, INF_AS_ZERO: gl.constexpr,
            WRITE_LSE: gl.constexpr, L8: gl.constexpr, PAGE: gl.constexpr, PAGE_MODE: gl.constexpr,
            ROW32: gl.constexpr, PREFETCH: gl.constexpr, BALANCED: gl.constexpr,
            K_SN: gl.constexpr, V_SN: gl.constexpr, KS_SN: gl.constexpr, KS_SG: gl.constexpr,
            KZ_SN: gl.constexpr, KZ_SG: gl.constexpr, VS_SN: gl.constexpr, VS_SG: gl.constexpr,
            VZ_SN: gl.constexpr, VZ_SG: gl.constexpr, FAST_ROWS: gl.constexpr, LAZY: gl.constexpr,
            RING: gl.constexpr):
        """One program (one warp): KV head (b, hk), key chunk `split`; the G * Sq query
        rows of hk times NG groups are the mma's 16 rows. Writes o / lse (ONE_SPLIT) or the
        f32 partials PO (rows, SPLITS, DV) and their lse PL (rows, SPLITS). Paged K/V (PAGE >
        0): K, V and their grouped parameters are page pools with page strides s_kb, ...; BT is
        the block table (row stride s_bt) of NPAGES-page pools."""
        ROWS: gl.constexpr = 16
        LOG2E: gl.constexpr = 1.4426950408889634
        LN2: gl.constexpr = 0.6931471805599453
        RESCALE: gl.constexpr = 8.0
        DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        K_OFF: gl.constexpr = 0.0 if K_SIGNED else -8.0    # code_offset
        V_OFF: gl.constexpr = 0.0 if V_SIGNED else -8.0
        KW: gl.constexpr = D // 32      # 32-bit words per thread and key of K
        VW: gl.constexpr = DV // 64     # ... of V (per key of a pair)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DOT_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW_L: gl.constexpr = gl.SliceLayout(1, MMA)
        COL_L: gl.constexpr = gl.SliceLayout(0, MMA)
        # K words [BN keys, 4 (c), D/32]: thread (r, c) holds words c*D/32.. of keys r + 8 j
        LK: gl.constexpr = gl.BlockedLayout([1, 1, KW], [8, 4, 1], [1, 1, 1], [2, 1, 0])
        # V words [BN/2 key pairs, 8 (r), DV/64]: thread (r, c) holds words r*DV/64.. of pairs c + 4 h
        LV: gl.constexpr = gl.BlockedLayout([1, 1, VW], [4, 8, 1], [1, 1, 1], [2, 0, 1])
        LQ: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])

        pid_bh = gl.program_id(0)
        split = gl.program_id(1)
        hk = pid_bh % Hkv
        if BALANCED:   # chunks shared by kv_lens: b from the schedule, partials in slot p
            b, L, shift, start, end = _balanced_chunk(LENS, (pid_bh // Hkv) * SPLITS + split, gl.num_programs(0) // Hkv,
                                                      Sq, Sk, SPLITS, BN, CAUSAL)
        else:
            b = pid_bh // Hkv
            L, shift, start, end = _dec.key_chunk(LENS, b, split, Sq, Sk, SPLITS, BN, CAUSAL, HAS_LENS)
        b64 = b.to(gl.int64)
        hk64 = hk.to(gl.int64)

        if SCALE_FROM_PTR:
            sc = gl.load(SCALE_PTR).to(gl.float32)
            if INV_SCALE:
                sc = 1.0 / sc
        else:
            sc = scale
        qk_scale = sc * LOG2E

        if PAGE == 0:
            kvb = b64
        else:
            kvb = b64 * 0   # the pages are added per key block (or row)
        bt_row = BT + b64 * s_bt
        k_row0 = kvb * s_kb + hk64 * s_kh
        v_row0 = kvb * s_vb + hk64 * s_vh
        ks_base = KS + kvb * s_ksb + hk64 * s_ksh
        kz_base = KZ + kvb * s_kzb + hk64 * s_kzh
        vs_base = VS + kvb * s_vsb + hk64 * s_vsh
        vz_base = VZ + kvb * s_vzb + hk64 * s_vzh
        if not K_SC_G:
            qk_scale = qk_scale * gl.load(ks_base).to(gl.float32)

        # ---- rows x = (m, g): query row m = hl * Sq + qi, group g ----
        xr = gl.arange(0, ROWS, layout=ROW_L)
        mr = xr // NG
        gr = xr % NG
        row_ok = mr < G * Sq
        qi_r = mr % Sq
        if CAUSAL != 0:
            row_lim = gl.minimum(qi_r + shift + 1, L)

        # ---- Q's two operands: position k of the first / second holds head-dim column
        # natural_dim_k(k, 0 / 1), masked to the row's K group ----
        xq = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LQ))
        kq = gl.arange(0, D // 2, layout=gl.SliceLayout(0, LQ))
        mq = xq // NG
        gq = xq % NG
        q_row = Q + b64 * s_qb + (hk * G + mq // Sq).to(gl.int64) * s_qh + (mq % Sq).to(gl.int64) * s_qs
        q0 = kq & 1
        cq = (kq >> 1) & 3
        q1 = (kq >> 3) & 1
        iq = kq >> 4
        word = cq * KW + iq
        sel = 2 * q1 + q0                                    # NIB_A = (0, 4, 1, 5), NIB_B = (2, 6, 3, 7)
        nib_a = gl.where(sel == 0, 0, gl.where(sel == 1, 4, gl.where(sel == 2, 1, 5)))
        nib_b = nib_a + 2
        if K_L1:   # layout 1: nibble s holds element NIB1[s] = (0, 1, 4, 5, 2, 3, 6, 7)[s]
            el_a = (nib_a & 1) | ((nib_a & 2) << 1) | ((nib_a & 4) >> 1)
            el_b = (nib_b & 1) | ((nib_b & 2) << 1) | ((nib_b & 4) >> 1)
        else:
            el_a = nib_a
            el_b = nib_b
        d_a = 8 * word + el_a
        d_b = 8 * word + el_b
        if K_NG > 1:
            ok_a = (mq < G * Sq)[:, None] & ((d_a // K_GROUP)[None, :] == gq[:, None])
            ok_b = (mq < G * Sq)[:, None] & ((d_b // K_GROUP)[None, :] == gq[:, None])
        else:
            ok_a = (mq < G * Sq)[:, None] & (gq == 0)[:, None] & (d_a >= 0)[None, :]
            ok_b = (mq < G * Sq)[:, None] & (gq == 0)[:, None] & (d_b >= 0)[None, :]
        qa = gl.load(q_row[:, None] + d_a[None, :].to(gl.int64) * s_qd, mask=ok_a, other=0.0).to(DT)
        qb = gl.load(q_row[:, None] + d_b[None, :].to(gl.int64) * s_qd, mask=ok_b, other=0.0).to(DT)
        qsum = gl.convert_layout(gl.sum(qa.to(gl.float32), axis=1) + gl.sum(qb.to(gl.float32), axis=1), ROW_L)
        qa = gl.convert_layout(qa, DOT_A)
        qb = gl.convert_layout(qb, DOT_A)

        # ---- code pointers ----
        kn = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LK)))
        kc = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(0, LK)))
        ku = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(0, LK)))
        k_cols = (kc[:, None] * KW + ku[None, :])[None, :, :]
        vp = gl.arange(0, BN // 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, LV)))
        vr = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(0, LV)))
        vu = gl.arange(0, VW, layout=gl.SliceLayout(0, gl.SliceLayout(0, LV)))
        v_cols = (vr[:, None] * VW + vu[None, :])[None, :, :]
        keys_c = gl.arange(0, BN, layout=COL_L)
        # int32 offsets within a key block from its first row (loop invariant)
        KW32 = K.to(gl.pointer_type(gl.int32), bitcast=True)
        VW32 = V.to(gl.pointer_type(gl.int32), bitcast=True)
        keys8 = gl.arange(0, BN, layout=gl.SliceLayout(0, L8))
        x8 = gl.arange(0, 8, layout=gl.SliceLayout(1, L8))
        if K_NG > 1:
            gk8 = x8 % NG
        else:
            gk8 = gl.where(x8 % NG == 0, 0, -1)
        if V_NG > 1:
            gv8 = x8 % NG
        else:
            gv8 = gl.where(x8 % NG == 0, 0, -1)

        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=ROW_L)
        l_i = gl.zeros([ROWS], gl.float32, layout=ROW_L)
        zc = gl.zeros([ROWS], gl.float32, layout=ROW_L)
        acc = gl.zeros([ROWS, DV], gl.float32, layout=MMA)

        # Words run AHEAD blocks ahead of the compute: in registers (RING = 0: each step loads
        # the next block's before computing its own) or through a RING-slot shared-memory ring
        # of cp.async copies (more bytes in flight per warp, 32 fewer registers held).
        # Rows past the chunk are clamped to its last row (hi), not masked (a masked load
        # zero-fills its registers first): their scores are masked and their probabilities 0.
        AHEAD: gl.constexpr = RING - 1 if RING > 1 else 1
        k_w0 = KW32 + k_row0 // 4
        v_w0 = VW32 + v_row0 // 4
        s_kbw = s_kb // 4
        s_vbw = s_vb // 4
        s_knw: gl.constexpr = K_SN // 4
        s_vnw: gl.constexpr = V_SN // 4
        hi = gl.maximum(end - 1, 0)
        # a block's page is loaded one step before its words, so the block-table read does not
        # add its latency to the words' prefetch
        lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        pg, pg2 = _block_page(bt_row, start, hi, NPAGES, PAGE, PAGE_MODE, ROW32)
        pg_nx, pg2_nx = _block_page(bt_row, start + BN, hi, NPAGES, PAGE, PAGE_MODE, ROW32)
        slot = 0
        if RING > 1:
            RS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
            k_ring = gl.allocate_shared_memory(gl.int32, [RING, BN, 4, KW], RS)
            ve_ring = gl.allocate_shared_memory(gl.int32, [RING, BN // 2, 8, VW], RS)
            vo_ring = gl.allocate_shared_memory(gl.int32, [RING, BN // 2, 8, VW], RS)
            for j in gl.static_range(AHEAD):
                pj, pj2 = _block_page(bt_row, start + j * BN, hi, NPAGES, PAGE, PAGE_MODE, ROW32)
                kp, vep, vop = _block_ptrs(k_w0, v_w0, start + j * BN, hi, pj, pj2, kn, vp, k_cols, v_cols, s_kbw,
                                           s_knw, s_vbw, s_vnw, bt_row, NPAGES, PAGE, PAGE_MODE, ROW32)
                _copy_block(k_ring.index(j), ve_ring.index(j), vo_ring.index(j), kp, vep, vop)
            pgf, pgf2 = _block_page(bt_row, start + AHEAD * BN, hi, NPAGES, PAGE, PAGE_MODE, ROW32)
        else:
            kp, vep, vop = _block_ptrs(k_w0, v_w0, start, hi, pg, pg2, kn, vp, k_cols, v_cols, s_kbw, s_knw, s_vbw,
                                       s_vnw, bt_row, NPAGES, PAGE, PAGE_MODE, ROW32)
            kw_ = gl.load(kp)
            ve = gl.load(vep)
            vo = gl.load(vop)
        # two copies of the step: while the block fetched AHEAD too lies wholly inside the
        # chunk, every row is unclamped (FAST: constant offsets from one base per block, no
        # branch in the loop, so the scheduler moves loads freely); the last steps clamp
        if FAST_ROWS and PAGE_MODE < 3:
            mid = start + gl.maximum((end - start) // BN - AHEAD, 0) * BN
        else:
            mid = start
        for phase in gl.static_range(2):
            if phase == 0:   # FAST
                lo = start
                hi_n = mid
            else:
                lo = mid
                hi_n = end
            for n0 in range(lo, hi_n, BN):
                nf = n0 + AHEAD * BN    # the block whose words this step fetches
                pg_nx2, pg2_nx2 = _block_page(bt_row, n0 + 2 * BN, hi, NPAGES, PAGE, PAGE_MODE, ROW32)
                if RING > 1:
                    pgf_nx, pgf2_nx = _block_page(bt_row, nf + BN, hi, NPAGES, PAGE, PAGE_MODE, ROW32)
                    kp, vep, vop = _fetch_block(phase == 0, k_w0, v_w0, nf, hi, pgf, pgf2, kn, vp, k_cols, v_cols,
                                                s_kbw, s_knw, s_vbw, s_vnw, bt_row, NPAGES, PAGE, PAGE_MODE, ROW32)
                    ns = (slot + AHEAD) % RING
                    _copy_block(k_ring.index(ns), ve_ring.index(ns), vo_ring.index(ns), kp, vep, vop)
                    async_copy.wait_group(AHEAD)   # this block's group is done
                    kw_c = k_ring.index(slot).load(LK)
                    ve_c = ve_ring.index(slot).load(LV)
                    vo_c = vo_ring.index(slot).load(LV)
                else:
                    kp, vep, vop = _fetch_block(phase == 0, k_w0, v_w0, nf, hi, pg_nx, pg2_nx, kn, vp, k_cols, v_cols,
                                                s_kbw, s_knw, s_vbw, s_vnw, bt_row, NPAGES, PAGE, PAGE_MODE, ROW32)
                    kw_nx = gl.load(kp)
                    ve_nx = gl.load(vep)
                    vo_nx = gl.load(vop)
                    kw_c = kw_
                    ve_c = ve
                    vo_c = vo
                if PREFETCH > 0:
                    _prefetch_block(k_w0, v_w0, n0 + PREFETCH * BN, hi, lanes, s_kbw, s_knw, s_vbw, s_vnw, bt_row,
                                    NPAGES, PAGE, PAGE_MODE, ROW32)
                # this block's scales and zero points, loaded before any of its compute
                if K_ZP:
                    kz_t = _param_tile(phase == 0, kz_base, keys8, s_kzb, KZ_SN, pg, pg2, n0, hi, bt_row, NPAGES, gk8,
                                       KZ_SG, K_ZP_G, 0.0, PAGE, PAGE_MODE, ROW32)
                if K_SC_G:
                    ks_t = _param_tile(phase == 0, ks_base, keys8, s_ksb, KS_SN, pg, pg2, n0, hi, bt_row, NPAGES, gk8,
                                       KS_SG, True, 0.0, PAGE, PAGE_MODE, ROW32)
                if V_SC_G:
                    vs_t = _param_tile(phase == 0, vs_base, keys8, s_vsb, VS_SN, pg, pg2, n0, hi, bt_row, NPAGES, gv8,
                                       VS_SG, True, 0.0, PAGE, PAGE_MODE, ROW32)
                if V_ZP:
                    vz_t = _param_tile(phase == 0, vz_base, keys8, s_vzb, VZ_SN, pg, pg2, n0, hi, bt_row, NPAGES, gv8,
                                       VZ_SG, V_ZP_G, 0.0, PAGE, PAGE_MODE, ROW32)

                # ---- K: unpack into the two B operands, s = Q K^T on the codes ----
                r0, r1, r2, r3 = _unpack_k(kw_c, F16, K_SIGNED)
                # [BN, 4 (c), KW (i), 2 (q0: half), 2 (q1: register)] -> k = 16 i + 8 q1 + 2 c + q0
                ka = gl.join(_halves(r0, DT), _halves(r1, DT))
                ka = gl.reshape(gl.permute(ka, (0, 2, 4, 1, 3)), [BN, D // 2])
                ka = gl.convert_layout(gl.permute(ka, (1, 0)), DOT_B)
                kb = gl.join(_halves(r2, DT), _halves(r3, DT))
                kb = gl.reshape(gl.permute(kb, (0, 2, 4, 1, 3)), [BN, D // 2])
                kb = gl.convert_layout(gl.permute(kb, (1, 0)), DOT_B)
                s = gl.zeros([ROWS, BN], gl.float32, layout=MMA)
                s = mma_v2(qa, ka, s)
                s = mma_v2(qb, kb, s)

                keys = n0 + keys_c
                keys_ok = keys < end
                # ---- offsets, zero points and scales per (row, key); groups summed ----
                if K_ZP:
                    s = s - (K_OFF + _param_rows(kz_t, K_ZP_G, MMA)) * qsum[:, None]
                else:
                    s = s - K_OFF * qsum[:, None]
                if K_SC_G:
                    s = s * _param_rows(ks_t, True, MMA)
                if NG > 1:
                    s3 = gl.reshape(s, [ROWS // NG, NG, BN])
                    s = gl.convert_layout(gl.reshape(gl.broadcast(gl.expand_dims(gl.sum(s3, axis=1), 1), s3)[0],
                                                     [ROWS, BN]), MMA)
                # ---- online softmax ----
                s = s * qk_scale
                valid = keys_ok[None, :] & row_ok[:, None]
                if CAUSAL != 0:
                    valid = valid & (keys[None, :] < row_lim[:, None])
                s = gl.where(valid, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                if LAZY:
                    # the running max m_i moves only when some row's max passes it by more than
                    # RESCALE (log2 units): p <= 2^RESCALE meanwhile, and acc / l / zc are
                    # rescaled in those steps only (most steps skip DV / 2 multiplies per row)
                    if gl.max((m_new > m_i + RESCALE).to(gl.int32), axis=0) > 0:
                        acc, l_i, zc, m_i = _rescale(acc, l_i, zc, m_i, m_new)
                else:
                    acc, l_i, zc, m_i = _rescale(acc, l_i, zc, m_i, m_new)
                p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
                l_i = l_i + gl.sum(p, axis=1)
                # ---- P' = p * V scale of the row's group; P' V on the codes ----
                if V_SC_G:
                    p = p * _param_rows(vs_t, True, MMA)
                p16 = p.to(DT)
                pf = p16.to(gl.float32)
                if V_ZP:
                    zc = zc + gl.sum(pf * (V_OFF + _param_rows(vz_t, V_ZP_G, MMA)), axis=1)
                else:
                    zc = zc + gl.sum(pf, axis=1) * V_OFF
                v0, v1, v2, v3, v4, v5, v6, v7 = _unpack_v(ve_c, vo_c, F16, V_SIGNED)
                # register s = q1 + 2 a0 + 4 a1: [BN/2 (p), 8 (r), VW (i), 2 (q0), 2 (q1), 2 (a0), 2 (a1)]
                vj = gl.join(gl.join(gl.join(_halves(v0, DT), _halves(v1, DT)),
                                     gl.join(_halves(v2, DT), _halves(v3, DT))),
                             gl.join(gl.join(_halves(v4, DT), _halves(v5, DT)),
                                     gl.join(_halves(v6, DT), _halves(v7, DT))))
                vj = gl.reshape(gl.permute(vj, (0, 3, 2, 6, 5, 4, 1)), [BN, DV])
                vt = gl.convert_layout(vj, DOT_B)
                acc = mma_v2(gl.convert_layout(p16, DOT_A), vt, acc)
                if RING > 1:
                    slot = (slot + 1) % RING
                    pgf = pgf_nx
                    pgf2 = pgf2_nx
                else:
                    kw_ = kw_nx
                    ve = ve_nx
                    vo = vo_nx
                pg = pg_nx
                pg2 = pg2_nx
                pg_nx = pg_nx2
                pg2_nx = pg2_nx2

        if RING > 1:
            async_copy.wait_group(0)   # copies past the chunk's end (clamped rows) still in flight
        # ---- epilogue: offsets, per-tensor scale, each row's group columns ----
        o_acc = acc - zc[:, None]
        if not V_SC_G:
            o_acc = o_acc * gl.load(vs_base).to(gl.float32)
        has = l_i > 0.0
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        nn = gl.arange(0, DV, layout=COL_L)
        r_ = nn & 7
        q1_ = (nn >> 3) & 1
        a_ = (nn >> 4) & 3
        i_ = nn >> 6
        nib = 2 * a_ + q1_
        if V_L1:
            el = (nib & 1) | ((nib & 2) << 1) | ((nib & 4) >> 1)
        else:
            el = nib
        d_o = 8 * (r_ * VW + i_) + el
        if V_NG > 1:
            keep = row_ok[:, None] & ((d_o // V_GROUP)[None, :] == gr[:, None])
        else:
            keep = row_ok[:, None] & (gr == 0)[:, None] & (d_o >= 0)[None, :]
        h = hk * G + mr // Sq
        if ONE_SPLIT:
            if INF_AS_ZERO:
                o = gl.where(has[:, None], o_acc / gl.where(has, l_i, 1.0)[:, None], 0.0)
            else:
                o = o_acc / l_i[:, None]
            o_ptr = O + b64 * s_ob + h.to(gl.int64)[:, None] * s_oh + qi_r.to(gl.int64)[:, None] * s_oq \
                + d_o.to(gl.int64)[None, :] * s_od
            gl.store(o_ptr, o.to(O.dtype.element_ty), mask=keep)
            if WRITE_LSE:
                gl.store(LSE + (b64 * Hq + h) * Sq + qi_r, lse, mask=row_ok & (gr == 0))
        else:
            o = gl.where(has[:, None], o_acc / gl.where(has, l_i, 1.0)[:, None], 0.0)
            if BALANCED:   # slot p recomputed from the program ids: nothing held through the loop
                p_slot = (gl.program_id(0) // Hkv) * SPLITS + gl.program_id(1)
                prow = (hk64 * (gl.num_programs(0) // Hkv) * SPLITS + p_slot) * (G * Sq) + mr
            else:
                prow = ((b64 * Hq + h) * Sq + qi_r) * SPLITS + split
            gl.store(PO + prow[:, None] * DV + d_o[None, :], o, mask=keep)
            gl.store(PL + prow, lse, mask=row_ok & (gr == 0))
else:
    _gluon_decode_q4_kernel = None


# ---- launcher ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Q4Config(DecodeConfig):
    maxnreg: int | None = None    # register cap per thread (more resident warps, maybe spills)
    prefetch: int = 0             # L2 prefetch of the key block this many blocks ahead (0: none)
    fast_rows: bool = True        # unclamped rows (constant offsets) while the next block is whole
    lazy_rescale: bool = True     # rescale acc only when the running max grows by > 2^8
    ring: int = 0                 # cp.async ring of this many slots for the words (0: registers)


def param_layout(bn: int):
    """The (8, bn) tile of scales / zero points: the mma accumulator's rows 0..7 (lane // 4),
    its keys (2 (lane % 4) + registers)."""
    regs = [[0, 1]] + [[0, 8 << i] for i in range((bn // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[8, bn])


def default_config(problem) -> Q4Config:
    """The words through a cp.async ring with one block in flight beyond the one computed
    (ring 2) under a 168-register cap: 12 programs an SM where the register prefetch's 232
    registers allowed 8; no L2 prefetch. Measured on the H200 (2026-12-03, b8 x 32k and b64 x
    8k, s4 / u4 g64): 5-9 % faster than the register prefetch on the contiguous cache, 4-19 %
    on 16- and 64-key pages; ring 3 and 4 and an L2 prefetch 1-6 % slower than ring 2. Zero
    points with fewer than four groups a row on the contiguous cache take ring 3 (u4 g64: 4-5 %
    faster; g32: 11-12 % slower, 2026-12-04). Every variant keeps the 168 cap even where its
    SASS spills (zero points 8-16 bytes, group 32 48-96): caps of 176 and 200 were 3-56 %
    slower on the H200 (2026-12-04, results/paged_q4_caps_2026-12-04_s29.json), as any cap
    over 168 leaves room for only two warps a register-file quarter (`resident_per_sm`)."""
    kq, vq = problem.k_quant, problem.v_quant
    zp = kq is not None and vq is not None and (kq[4] is not None or vq[4] is not None)
    ng = max(_sig_groups(kq, problem.D), _sig_groups(vq, problem.Dv)) if kq is not None and vq is not None else 1
    ring = 3 if zp and ng < 4 and not problem.page_size else 2
    return Q4Config(block_n=32, block_m=16, num_warps=1, num_stages=1, prefetch=0, ring=ring, maxnreg=168)


def resident_per_sm(cfg: DecodeConfig) -> int:
    """One-warp programs an SM holds at once. A Hopper SM's 64K registers are four files of 16K,
    one per scheduler, and a warp lives in one: each holds 16K // (32 lanes x the cap rounded up
    to 8) warps (255 uncapped). So 168 registers give 3 a quarter, 12 an SM, and 176-232 give 8."""
    regs = getattr(cfg, "maxnreg", None) or 256
    return 4 * (16384 // (32 * (-(-regs // 8) * 8)))


def choose_splits(problem, cfg: DecodeConfig, num_sms: int | None = None) -> int:
    """Key chunks per KV head so that the programs fill the GPU's resident slots once
    (`resident_per_sm`), each chunk >= 4 key blocks; with more KV heads than slots, one
    chunk each."""
    if cfg.splits:
        return cfg.splits
    sms = num_sms or _num_sms(problem.device)
    base = problem.B * problem.Hkv
    keys = problem.Sk if problem.causal != "top_left" else min(problem.Sk, problem.Sq)
    max_splits = max(1, triton.cdiv(keys, 4 * cfg.block_n))
    return max(1, min((resident_per_sm(cfg) * sms) // base, max_splits, 4096))


def workspace_bytes(problem, cfg: DecodeConfig | None = None) -> int:
    cfg = cfg or default_config(problem)
    s = choose_splits(problem, cfg)
    return 0 if s == 1 else problem.B * problem.Hq * problem.Sq * s * (problem.Dv + 1) * 4


def plan(problem, args: AttnArgs, cfg: DecodeConfig):
    """(main launch, combine launch or None, splits) of solver 133 (see decode.plan)."""
    q, k, v = args.q, args.k, args.v
    D, Dv = problem.D, problem.Dv
    if not (words_ok(k.data) and words_ok(v.data)):   # off 32-bit words: 122 reads bytes
        return decode_quant.plan(problem, args, decode_quant.default_config(problem))
    sk, sks, skz = _dec.kv_strides(k)
    sv, svs, svz = _dec.kv_strides(v)
    splits = choose_splits(problem, cfg)
    bal = _dec.balanced_bn(problem, splits, cfg)
    so = (problem.Hq * problem.Sq * Dv, problem.Sq * Dv, Dv, 1)
    kng, vng = _groups(k, D)[0], _groups(v, Dv)[0]
    flags = _dec.common_flags(problem)
    for drop in ("MASK_KIND", "DROPOUT"):
        flags.pop(drop)
    scale_val = _dec.scalar_args(problem, args)[0]
    main = Launch(
        _gluon_decode_q4_kernel, (problem.B * problem.Hkv, splits),
        (*q.stride(), *sk[:2], *sv[:2], *sks[:2], *skz[:2], *svs[:2], *svz[:2], *so,
         problem.Hq, problem.Hkv, problem.Sq, problem.Sk, scale_val, splits, _dec.bt_stride(args),
         min(k.shape[0], v.shape[0]) if problem.page_size else 1),
        G=problem.group, D=D, DV=Dv, BN=cfg.block_n, NG=max(kng, vng), K_NG=kng, V_NG=vng,
        K_GROUP=k.group, V_GROUP=v.group,
        K_SC_G=k.scale_kind == "g", K_ZP=k.zero_points is not None, K_ZP_G=k.zp_kind == "g",
        V_SC_G=v.scale_kind == "g", V_ZP=v.zero_points is not None, V_ZP_G=v.zp_kind == "g",
        K_SIGNED=k.dtype == "s4", V_SIGNED=v.dtype == "s4", K_L1=k.layout == 1, V_L1=v.layout == 1,
        F16=q.dtype == torch.float16, ONE_SPLIT=splits == 1, L8=param_layout(cfg.block_n), PAGE=problem.page_size,
        PAGE_MODE=page_mode(problem.page_size, cfg.block_n), PREFETCH=getattr(cfg, "prefetch", 0),
        ROW32=not problem.page_size or pools_fit_int32(k, v),
        # row and group strides as constants: a key block's loads then differ by immediates
        K_SN=sk[2], V_SN=sv[2], KS_SN=sks[2], KS_SG=sks[3], KZ_SN=skz[2], KZ_SG=skz[3],
        VS_SN=svs[2], VS_SG=svs[3], VZ_SN=svz[2], VZ_SG=svz[3],
        FAST_ROWS=getattr(cfg, "fast_rows", True), LAZY=getattr(cfg, "lazy_rescale", True),
        RING=getattr(cfg, "ring", 0), BALANCED=bool(bal),
        **flags,
        num_warps=1, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return main, _dec.combine_launch(problem, splits, bal), splits


def page_mode(page: int, bn: int) -> int:
    """How a key block of bn keys finds its rows: 0 contiguous cache, 1 in one page (page a
    multiple of bn), 2 in two pages (page = bn / 2), 3 a block-table entry per row."""
    return 0 if not page else 1 if page % bn == 0 else 2 if 2 * page == bn else 3


def pools_fit_int32(*pools) -> bool:
    """Every element offset into the page pools (codes in 32-bit words, grouped scales and
    zero points) fits in int32, so a key block's page offset joins its rows' multiply-add."""
    ts = [(p.data, 4) for p in pools] + [(t, 1) for p in pools for t in (p.scales, p.zero_points)
                                         if t is not None and t.dim() == 4]
    return all(t.shape[0] * t.stride(0) // unit < 2**31 for t, unit in ts)


def words_ok(d: torch.Tensor) -> bool:
    """The kernel reads the codes as 32-bit words: unit stride along D, the other strides and
    the address multiples of 4 bytes."""
    return d.stride(3) == 1 and not any(x % 4 for x in d.stride()[:3]) and d.data_ptr() % 4 == 0


class Q4Plan(_dec.DecodePlan):
    """133's invoker. Codes off 32-bit words run solver 122's plan, which reads bytes: the same
    results at 122's speed. Strides are checked once per plan (`plan`); a call checks the two
    addresses (a view at an odd byte offset keeps its strides)."""

    def __init__(self, problem, cfg: DecodeConfig):
        super().__init__(problem, cfg, plan)
        self.fallback = None

    def __call__(self, args: AttnArgs):
        if not (args.k.data.data_ptr() | args.v.data.data_ptr()) & 3:
            return super().__call__(args)
        if self.fallback is None:
            self.fallback = _dec.DecodePlan(self.problem, decode_quant.default_config(self.problem),
                                            decode_quant.plan)
        return self.fallback(args)


# ---- solver -----------------------------------------------------------------------------

def _q4_reasons(problem) -> list[str]:
    """Why 133's kernel does not cover a (device-independent) problem."""
    reasons = []
    kq, vq = problem.k_quant, problem.v_quant
    if kq is None or vq is None or kq[0] not in ("s4", "u4") or vq[0] not in ("s4", "u4"):
        reasons.append("needs 4-bit (s4 / u4) codes for both K and V")
        return reasons
    if "keys" in kq or "keys" in vq:
        reasons.append("codes stored keys-contiguous: served by 128")
    if problem.D != problem.Dv or problem.D not in HEAD_DIMS:
        reasons.append(f"head dims D={problem.D}, Dv={problem.Dv}: needs D = Dv in {HEAD_DIMS}")
    if problem.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"q dtype {problem.dtype}: needs bf16 / f16")
    if problem.mask != "none":
        reasons.append("attention masks: served by 122")
    if problem.dropout_p > 0:
        reasons.append("dropout: served by 122")
    kng, vng = _sig_groups(kq, problem.D), _sig_groups(vq, problem.Dv)
    ng = max(kng, vng)
    for name, n in (("K", kng), ("V", vng)):
        if n not in (1, ng):
            reasons.append(f"{name} has {n} groups per row and the other {ng}: needs equal counts or one")
    if kq[1] < 8 or vq[1] < 8:
        reasons.append(f"group sizes {kq[1]}, {vq[1]}: needs >= 8")
    if problem.group * problem.Sq * ng > ROWS:
        reasons.append(f"G * Sq * groups = {problem.group * problem.Sq * ng} > {ROWS} rows")
    if problem.Sk == 0:
        reasons.append("an empty cache (Sk = 0): served by 122")
    return reasons


@register
class GluonDecodeQ4(_DecodeBase):
    """Decode on s4 / u4 K/V with the codes unpacked in registers into mma.sync operands
    (no shared memory), scales and zero points on the score / probability tiles."""
    id = 133
    name = "gluon_decode_q4"
    paged = True  # any page size: a page id per key block, or per row below the block

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        reasons += gluon_reasons(problem.device)
        reasons += _q4_reasons(problem)
        return reasons

    def row_blocks(self, problem) -> int:
        return 1

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def estimate(self, problem) -> float:
        """Bytes read (codes, scales, zero points) at the 2.3-2.9 TB/s it measured on the H200
        through its plan with the cp.async ring (2026-12-03, s4 / u4 g64 and s4 per head, b8 x
        32k and b64 x 8k, cuDNN in the same run; shuffled page pools of 16-256 keys at
        0.93-1.04x of the contiguous time)."""
        t = problem.bytes() / Q4_BW * 1e3
        host = _dec.HOST_FLOOR_MS if problem.device == "cuda" else 0.0
        return max(t + _dec._LAUNCH_MS, host)

    def prepare(self, problem):
        return Q4Plan(problem, default_config(problem))


__all__ = ["GluonDecodeQ4", "Q4Plan", "code_offset", "natural_dim_k", "natural_dim_v", "plan"]
