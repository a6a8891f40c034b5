"""Flash attention forward in Triton (solver 110 `flash_fwd`, family `flash`).

Computes, per (b, h) with kv head hk = h // (Hq // Hkv) (GQA/MQA by index mapping):

    s_ij  = scale * q_i . k_j  + bias_ij          (bias: additive mask, or -inf where a
                                                   bool mask / causal / kv_lens hides j)
    lse_i = log sum_j exp(s_ij)                   (natural log, f32, before dropout)
    o_i   = sum_j keep_ij / (1 - p) * exp(s_ij - lse_i) v_j

with an online softmax in the log2 domain (log2(e) folded into the scale, exp2), f32
accumulation and one pass over K/V per block of BLOCK_M query rows. A fully masked row
gives o = NaN and lse = -inf (o = 0 with softmax_inf_as_zero).

Supported: f32/f16/bf16 (f32 dots in IEEE precision), head dims 1..256 with D != Dv
(tiles padded to a power of two, masked loads), any strides (64-bit base offsets),
causal top-left and bottom-right (per-batch alignment with kv_lens) with block skipping:
the key loop is split into unmasked full blocks and masked boundary blocks; bool/additive
mask buffers broadcast through zero strides; scale as float or tensor (loaded in the
kernel) and its inverse; kv_lens; dropout (nnprim.dropout's Philox definition);
return_lse. On Hopper the kernel reads Q/K/V through TMA tensor descriptors when the
strides allow (16-byte aligned, unit inner stride). Indexing: batch, head and row offsets
are int64. Workspace: only the TMA descriptors Triton builds in global scratch (128 bytes
per descriptor per program). Not supported: quantized K/V (the decode family serves
those); B * Hq above 65535 (grid axis 1).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import alloc
from ..dropout import dropout_keep, dropout_scale, dropout_threshold
from ..launch import Launch, aligned16, ensure_allocator, int_width, interpreting
from ..limits import grid_reasons
from ..search.solver import Solver, register
from . import configs
from .paging import page_rows, pipeline_stages

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_CAUSAL_CODE = {None: 0, "top_left": 1, "bottom_right": 2}
_MASK_CODE = {"none": 0, "bool": 1, "additive": 2}


# ---- Triton kernels -------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b; UPCAST (interpreter, bf16) computes in f32; IEEE for f32 inputs."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mask_scores(s, mask_ptrs, start_n, stride_mj, offs_m, offs_n, Sq, Sk, kv_len, shift,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """Scores s (log2 domain) of keys offs_n with the mask buffer applied (bool: -inf where
    False; additive: added, times log2(e)) and, in MASKED blocks, -inf for keys at or past
    kv_len or causally hidden (key j visible to row i iff j <= i + shift)."""
    if MASK_KIND != 0:
        mp = mask_ptrs + tl.cast(start_n, tl.int64) * stride_mj
        mvalid = offs_m[:, None] < Sq
        if MASKED:
            mvalid = mvalid & (offs_n[None, :] < Sk)
        if MASK_KIND == 1:
            mv = tl.load(mp, mask=mvalid, other=1)
            s = tl.where(mv != 0, s, float("-inf"))
        else:
            mv = tl.load(mp, mask=mvalid, other=0.0).to(tl.float32)
            s = s + mv * 1.4426950408889634
    if MASKED:
        valid = offs_n[None, :] < kv_len
        if CAUSAL != 0:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS: tl.constexpr, CAUSAL: tl.constexpr):
    """(kv_len, shift): batch entry b's key count, clamped to [0, Sk] (a stale value never
    reads past the keys), and the causal diagonal's offset (key j visible to row i iff
    j <= i + shift; bottom-right alignment is to kv_len). Shared by every flash kernel."""
    if HAS_KVLENS:
        kv_len = tl.minimum(tl.maximum(tl.load(KVLENS + b).to(tl.int32), 0), Sk)
    else:
        kv_len = Sk
    if CAUSAL == 2:
        shift = kv_len - Sq
    else:
        shift = 0
    return kv_len, shift


@triton.jit
def _key_bounds(start_m, Sq, kv_len, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """(full, hi) for query rows [start_m, start_m + BLOCK_M): keys [0, hi) are visible to
    some row, keys [0, full) (whole BLOCK_N blocks) to every row."""
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
    return full, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_ptrs, stride_kn, stride_vn,
               stride_mj, offs_m, offs_d, offs_dv, lo, hi, kv_len, shift, qk_scale,
               seed, offset, b, h, Hq, Sq, Sk, threshold, D, Dv,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
               EVEN_DV: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
               IEEE: tl.constexpr, SCALE_POS: tl.constexpr, WS: tl.constexpr,
               bt_row=None, stride_kp=0, stride_vp=0, k_row0=0, v_row0=0, PAGE: tl.constexpr = 0):
    """Key blocks [lo, hi). MASKED blocks check kv bounds and causality per element.
    WS: warp-specialise the loop (TMA loads in a producer warp, MMA + softmax consumers).
    PAGE > 0: K/V are page pools, bt_row the sequence's block-table row (paging.py). Pointer
    loads: k_ptrs / v_ptrs hold no row offset, stride_kp / stride_vp are page strides in
    elements, and masked blocks read only keys below kv_len (pages past it need not exist).
    TMA (PAGE a multiple of BLOCK_N, so a block is one page's rows): the descriptors span the
    pool as rows, stride_kp / stride_vp are page strides in rows and k_row0 / v_row0 the KV
    head's first row; V rows past kv_len (page tails: anything, NaN included) are zeroed."""
    FAST: tl.constexpr = (not MASKED) and MASK_KIND == 0 and SCALE_POS
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + offs_n0
        # -- K tile [BLOCK_N, BLOCK_D]
        if USE_TMA:
            if PAGE == 0:
                k = k_desc.load([start_n, 0])
            else:
                pg = tl.load(bt_row + start_n // PAGE)
                k = k_desc.load([(pg * stride_kp + k_row0 + start_n % PAGE).to(tl.int32), 0])
        else:
            if PAGE == 0:
                kp = k_ptrs + tl.cast(start_n, tl.int64) * stride_kn
                n_lim = Sk
            else:
                pg, pi = page_rows(bt_row, offs_n, offs_n < kv_len, start_n, PAGE, BLOCK_N)
                kp = k_ptrs + (pg * stride_kp + pi * stride_kn)[:, None]
                n_lim = kv_len
            if MASKED:
                k = tl.load(kp, mask=(offs_n[:, None] < n_lim) & (offs_d[None, :] < D), other=0.0)
            elif EVEN_D:
                k = tl.load(kp)
            else:
                k = tl.load(kp, mask=offs_d[None, :] < D, other=0.0)
        qk = _dot(q, tl.trans(k), None, UPCAST, IEEE)
        if FAST:
            # unmasked block, no mask buffer, positive scale: max commutes with the scale
            # and the scale folds into one FMA per element
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            m_use = m_new
        else:
            s = _mask_scores(qk * qk_scale, mask_ptrs, start_n, stride_mj, offs_m, offs_n, Sq, Sk, kv_len,
                             shift, MASKED, CAUSAL, MASK_KIND)
        if not FAST:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if MASKED or MASK_KIND != 0:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h, offs_m[:, None], offs_n[None, :], Hq, Sq, Sk,
                                threshold)
            p = tl.where(keep, p, 0.0)
        # -- V tile [BLOCK_N, BLOCK_DV]
        if USE_TMA:
            if PAGE == 0:
                v = v_desc.load([start_n, 0])
            else:
                v = v_desc.load([(pg * stride_vp + v_row0 + start_n % PAGE).to(tl.int32), 0])
                if MASKED:
                    v = tl.where((offs_n < kv_len)[:, None], v, 0.0)
        else:
            if PAGE == 0:
                vp = v_ptrs + tl.cast(start_n, tl.int64) * stride_vn
            else:
                vp = v_ptrs + (pg * stride_vp + pi * stride_vn)[:, None]
            if MASKED:
                v = tl.load(vp, mask=(offs_n[:, None] < n_lim) & (offs_dv[None, :] < Dv), other=0.0)
            elif EVEN_DV:
                v = tl.load(vp)
            else:
                v = tl.load(vp, mask=offs_dv[None, :] < Dv, other=0.0)
        acc = _dot(p.to(v.dtype), v, acc, UPCAST, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Hq", "Sq", "Sk", "s_bt", "n_pages", "seed", "offset"])  # sizes, RNG: no recompile
def _flash_fwd_kernel(
        Q, K, V, O, LSE, MASK, SCALE, KVLENS, BT,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sob, soh, sos, sod, smb, smh, smi, smj,
        Hq, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep, s_bt, n_pages,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, INF_AS_ZERO: tl.constexpr, STORE_LSE: tl.constexpr,
        USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        SCALE_POS: tl.constexpr, WS: tl.constexpr, PAGE: tl.constexpr = 0):
    """One program: BLOCK_M query rows of one (b, h). Layout: any strides; lse (B, Hq, Sq)
    contiguous f32. PAGE > 0: K/V are page pools of PAGE keys per page (skb / svb their page
    strides) named by the block table BT (row stride s_bt); pointer loads, no TMA."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h.to(tl.int64) * sqh
    if PAGE == 0:
        kvb = b64
    else:
        kvb = b64 * 0  # the page of each key block is added in _fwd_inner
    k_base = K + kvb * skb + hk.to(tl.int64) * skh
    v_base = V + kvb * svb + hk.to(tl.int64) * svh
    bt_row = BT + b64 * s_bt

    if SCALE_PTR:
        sc = tl.load(SCALE).to(tl.float32)
        if INVERT:
            sc = 1.0 / sc
    else:
        sc = scale
    qk_scale = sc * 1.4426950408889634

    kv_len, shift = _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS, CAUSAL)

    kp_stride = skb
    vp_stride = svb
    k_row0 = 0
    v_row0 = 0
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[Sq, D], strides=[sqs, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        if PAGE == 0:
            k_desc = tl.make_tensor_descriptor(k_base, shape=[Sk, D], strides=[sks, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
            v_desc = tl.make_tensor_descriptor(v_base, shape=[Sk, Dv], strides=[svs, 1],
                                               block_shape=[BLOCK_N, BLOCK_DV])
        else:  # the pools as rows (the host checked that page and head strides are whole rows)
            hkv = Hq // GROUP
            kp_stride = skb // sks
            vp_stride = svb // svs
            k_row0 = hk * (skh // sks)
            v_row0 = hk * (svh // svs)
            k_rows = (n_pages - 1) * kp_stride + (hkv - 1) * (skh // sks) + PAGE
            v_rows = (n_pages - 1) * vp_stride + (hkv - 1) * (svh // svs) + PAGE
            k_desc = tl.make_tensor_descriptor(K, shape=[k_rows, D], strides=[sks, 1],
                                               block_shape=[BLOCK_N, BLOCK_D])
            v_desc = tl.make_tensor_descriptor(V, shape=[v_rows, Dv], strides=[svs, 1],
                                               block_shape=[BLOCK_N, BLOCK_DV])
        q = q_desc.load([start_m, 0])
        k_ptrs = K
        v_ptrs = V
    else:
        q_desc = None
        k_desc = None
        v_desc = None
        q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sqs + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D), other=0.0)
        if PAGE == 0:
            k_ptrs = k_base + offs_n[:, None].to(tl.int64) * sks + offs_d[None, :] * skd
            v_ptrs = v_base + offs_n[:, None].to(tl.int64) * svs + offs_dv[None, :] * svd
        else:
            k_ptrs = k_base + offs_d[None, :] * skd
            v_ptrs = v_base + offs_dv[None, :] * svd
    if MASK_KIND != 0:
        mask_ptrs = (MASK + b64 * smb + h.to(tl.int64) * smh + offs_m[:, None].to(tl.int64) * smi
                     + offs_n[None, :].to(tl.int64) * smj)
    else:
        mask_ptrs = MASK

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # key range: [0, hi) visible to some row of the block; [0, full) visible to all rows
    full, hi = _key_bounds(start_m, Sq, kv_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_ptrs, sks, svs, smj,
        offs_m, offs_d, offs_dv, 0, full, kv_len, shift, qk_scale,
        seed, offset, b, h, Hq, Sq, Sk, threshold, D, Dv,
        BLOCK_N, False, CAUSAL, MASK_KIND, DROPOUT, BLOCK_D == D, BLOCK_DV == Dv, USE_TMA,
        UPCAST, IEEE, SCALE_POS, WS, bt_row, kp_stride, vp_stride, k_row0, v_row0, PAGE)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_ptrs, sks, svs, smj,
        offs_m, offs_d, offs_dv, full, hi, kv_len, shift, qk_scale,
        seed, offset, b, h, Hq, Sq, Sk, threshold, D, Dv,
        BLOCK_N, True, CAUSAL, MASK_KIND, DROPOUT, BLOCK_D == D, BLOCK_DV == Dv, USE_TMA,
        UPCAST, IEEE, False, False, bt_row, kp_stride, vp_stride, k_row0, v_row0, PAGE)

    # -- epilogue: normalise, lse, store
    inv_l = 1.0 / l_i
    if DROPOUT:
        inv_l = inv_l * inv_keep
    o = acc * inv_l[:, None]
    if INF_AS_ZERO:
        o = tl.where((l_i == 0.0)[:, None], 0.0, o)
    row_ok = offs_m < Sq
    o_base = O + b64 * sob + h.to(tl.int64) * soh
    tl.store(o_base + offs_m[:, None].to(tl.int64) * sos + offs_dv[None, :] * sod,
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
    if STORE_LSE:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


# ---- launcher ---------------------------------------------------------------------------

def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a CUDA Hopper+ device, unit inner stride and 16-byte aligned strides/bases."""
    if interpreting():
        return False
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1:
            return False
        e = t.element_size()
        if t.data_ptr() % 16 or any((s * e) % 16 for s in t.stride()[:-1]):
            return False
        if t.shape[-1] * e < 16:
            return False
    return torch.cuda.get_device_capability(tensors[0].device)[0] >= 9


def paged_tma_ok(problem, args, block_n: int) -> bool:
    """TMA over page pools: every key block one page's rows (page a multiple of block_n),
    page and head strides whole rows, rows addressable as int32, and tma_ok's alignment."""
    if problem.page_size % block_n or not tma_ok(args.q, args.k, args.v):
        return False
    for t in (args.k, args.v):
        sp, sh, sn, _ = t.stride()
        if sn <= 0 or sp % sn or sh % sn or t.shape[0] * (sp // sn) + t.shape[1] * (sh // sn) >= 2**31:
            return False
    return True


def use_tma_for(problem, args, block_n: int) -> bool:
    """Whether the forward reads K/V (and Q) through TMA descriptors."""
    if problem.page_size:
        return paged_tma_ok(problem, args, block_n)
    return tma_ok(args.q, args.k, args.v)


def mask_view(problem, attn_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple]:
    """(tensor, 4 strides) of the mask broadcast to (B, Hq, Sq, Sk): zero strides where
    broadcast. Bool masks are read as uint8."""
    if attn_mask is None:
        return None, (0, 0, 0, 0)
    m = attn_mask
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    m = m.expand(problem.B, problem.Hq, problem.Sq, problem.Sk)
    return m, tuple(m.stride())


def block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def scale_args(problem, args) -> tuple[float, torch.Tensor | None]:
    """(float scale, scale tensor or None): a tensor scale is read by the kernel."""
    if problem.scale == "tensor":
        return 1.0, args.scale.reshape(1)
    return float(args.effective_scale(problem.invert_scale)), None


def dropout_args(problem, args) -> tuple[int, int, int, float]:
    if problem.dropout_p > 0:
        seed = args.seed if isinstance(args.seed, torch.Tensor) else int(args.seed)   # a device seed: a pointer
        return (seed, int(args.offset), dropout_threshold(problem.dropout_p),
                dropout_scale(problem.dropout_p))
    return 0, 0, 0, 1.0


def _fwd_plan(problem, args, *, use_tma: bool, with_lse: bool):
    """(scalar tail, constexpr flags, the tail index of the dropout seed or None) of one forward
    launch: every kernel argument but the pointers, fixed by the problem, the input strides
    and the per-call scalars."""
    q, k, v = args.q, args.k, args.v
    _, ms = mask_view(problem, args.attn_mask)
    scale, scale_t = scale_args(problem, args)
    seed, offset, threshold, inv_keep = dropout_args(problem, args)
    o_strides = (problem.Hq * problem.Sq * problem.Dv, problem.Sq * problem.Dv, problem.Dv, 1)
    head = (*q.stride(), *k.stride(), *v.stride(), *o_strides, *ms,
            problem.Hq, problem.Sq, problem.Sk, problem.group, problem.D, problem.Dv, scale)
    tail = (*head, seed, offset,
            threshold, inv_keep, 0 if args.block_table is None else args.block_table.stride(0), k.shape[0])
    flags = dict(
        BLOCK_D=block_d(problem.D), BLOCK_DV=block_d(problem.Dv),
        CAUSAL=_CAUSAL_CODE[problem.causal], MASK_KIND=_MASK_CODE[problem.mask],
        SCALE_PTR=scale_t is not None, INVERT=problem.invert_scale,
        HAS_KVLENS=args.kv_lens is not None, DROPOUT=problem.dropout_p > 0,
        INF_AS_ZERO=problem.inf_as_zero, STORE_LSE=with_lse, USE_TMA=use_tma,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        SCALE_POS=scale_t is None and scale > 0, PAGE=problem.page_size)
    return tail, flags, len(head) if problem.dropout_p > 0 else None


def _pointers(problem, args, o, lse):
    """The kernel's tensor arguments in signature order (unused ones stand in as q)."""
    q = args.q
    mask, _ = mask_view(problem, args.attn_mask)
    _, scale_t = scale_args(problem, args)
    return (q, args.k, args.v, o, lse if lse is not None else o, mask if mask is not None else q,
            scale_t if scale_t is not None else q, args.kv_lens if args.kv_lens is not None else q,
            args.block_table if args.block_table is not None else q)


def _grid(problem, cfg: configs.TileConfig) -> tuple[int, int]:
    return (triton.cdiv(problem.Sq, cfg.block_m), problem.B * problem.Hq)


def forward_launch(problem, args, *, use_tma: bool | None = None,
                   out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
    """((o, lse), launch): output buffers and a closure launch(cfg) -> compiled kernel.
    lse is allocated when problem.return_lse or lse_out is given; `out`/`lse_out` let
    tests pass poisoned buffers (contiguous)."""
    q = args.q
    B, Hq, Sq, Dv = problem.B, problem.Hq, problem.Sq, problem.Dv
    o = out if out is not None else alloc.empty((B, Hq, Sq, Dv), q.dtype, q.device)
    want_lse = problem.return_lse or lse_out is not None
    lse = lse_out if lse_out is not None else (
        alloc.empty((B, Hq, Sq), torch.float32, q.device) if want_lse else None)
    if use_tma is None:  # (paged: the block-size condition is checked per config in ForwardPlan)
        use_tma = tma_ok(q, args.k, args.v) and not problem.page_size
    if use_tma:
        ensure_allocator(q.device)
    tail, flags, _ = _fwd_plan(problem, args, use_tma=use_tma, with_lse=lse is not None)
    ptrs = _pointers(problem, args, o, lse)

    def launch(cfg: configs.TileConfig):
        return _flash_fwd_kernel[_grid(problem, cfg)](*ptrs, *tail, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                                      num_warps=cfg.num_warps,
                                                      num_stages=pipeline_stages(cfg.num_stages, problem.page_size),
                                                      WS=cfg.warp_specialize and use_tma, **flags)
    return (o, lse if want_lse else None), launch


def flash_forward(problem, args, cfg: configs.TileConfig, *, use_tma: bool | None = None,
                  out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
    """Run the forward kernel: (o, lse). A tile config that does not fit the GPU's shared
    memory is shrunk (configs.shrink) and remembered."""
    outs, launch = forward_launch(problem, args, use_tma=use_tma, out=out, lse_out=lse_out)
    key = ("fwd", problem.key(), cfg, use_tma)
    cfg = configs.FITTED.get(key, cfg)
    while True:
        try:
            launch(cfg)
            return outs
        except OutOfResources:
            cfg = configs.shrink(cfg)
            configs.FITTED[key] = cfg


class ForwardPlan:
    """The solver's invoker: one planned `Launch` per set of input strides and per-call
    scalars (scale value; the dropout seed/offset are set per call) and TMA eligibility; a call allocates
    o (and lse) and launches."""

    def __init__(self, problem, cfg: configs.TileConfig):
        self.problem, self.cfg = problem, cfg
        self.plans: dict[tuple, Launch] = {}

    def _key(self, args) -> tuple:
        """Everything the launch specialises on but the problem: strides, per-call scalars,
        and every pointer's 16-byte alignment (so the launch needs no check of its own)."""
        q, k, v, m = args.q, args.k, args.v, args.attn_mask
        bt = args.block_table
        return (q.stride(), k.stride(), v.stride(), None if m is None else (m.shape, m.stride()),
                None if isinstance(args.scale, torch.Tensor) else args.scale, int_width(args.seed),
                int_width(args.offset), aligned16(q, k, v, m, args.kv_lens, args.scale, bt),
                None if bt is None else (bt.stride(0), k.shape[0]))

    def _plan(self, args) -> Launch:
        p, cfg = self.problem, self.cfg
        use_tma = use_tma_for(p, args, cfg.block_n)
        tail, flags, at = _fwd_plan(p, args, use_tma=use_tma, with_lse=p.return_lse)
        return Launch(_flash_fwd_kernel, _grid(p, cfg), tail, counters_at=at, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg.num_stages, p.page_size),
                      WS=cfg.warp_specialize and use_tma and not p.page_size, **flags)

    def __call__(self, args):
        p, q = self.problem, args.q
        key = self._key(args)
        launch = self.plans.get(key)
        if launch is None:
            if len(self.plans) >= 64:
                self.plans.clear()
            launch = self.plans[key] = self._plan(args)
        o = alloc.empty((p.B, p.Hq, p.Sq, p.Dv), q.dtype, q.device)
        lse = alloc.empty((p.B, p.Hq, p.Sq), torch.float32, q.device) if p.return_lse else None
        try:
            launch.with_counters(args.seed, args.offset).run_aligned(*_pointers(p, args, o, lse))
        except OutOfResources:
            self.cfg = configs.shrink(self.cfg)
            self.plans.clear()
            return self(args)
        return o, lse


# ---- solver -----------------------------------------------------------------------------

PEAK_TFLOPS = {torch.bfloat16: 750.0, torch.float16: 750.0, torch.float32: 50.0}
PEAK_TBS = 4.2


def roofline_ms(problem, efficiency: float, block_m: int = 1) -> float:
    """max(compute, memory) time on an H200-class GPU at `efficiency` of peak, plus a
    launch overhead; on CPU (interpreter) a slow constant rate. `block_m`: query rows per
    tile; a tile computes all of them, so a short Sq (a decode step of 2-8 rows) costs
    the whole block (decode kernels pack the G*Sq rows of a KV head instead)."""
    if problem.device != "cuda":
        return problem.flops() / 2e7 + 1.0
    flops = problem.flops() * (math.ceil(problem.Sq / block_m) * block_m / problem.Sq)
    t_c = flops / (PEAK_TFLOPS.get(problem.dtype, 750.0) * 1e12 * efficiency)
    t_m = problem.bytes() / (PEAK_TBS * 1e12 * 0.8)
    # small problems under-fill the 132 SMs: scale by the wave quantisation
    tiles = problem.B * problem.Hq * math.ceil(problem.Sq / 128)
    waves = math.ceil(tiles / 132)
    fill = tiles / (waves * 132)
    return max(t_c / max(fill, 0.05), t_m) * 1e3 + 0.01


HOST_FLOOR_MS = 0.04   # flash_fwd's host work per call on the H200 machine (find's clock)
MIN_BLOCK_M = 64       # query rows of the smallest forward tile on a GPU (configs: 64-128)
TMA_DESC_BYTES = 128   # one in-kernel TMA descriptor: Triton's global scratch, per program


def tma_expected(problem) -> bool:
    """Whether the launchers read Q/K/V (dO) through in-kernel TMA descriptors when the
    tensors are contiguous (`tma_ok` on such tensors): a Hopper+ GPU and 16-byte rows."""
    if problem.device != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    e = torch.empty((), dtype=problem.dtype).element_size()
    if (problem.D * e) % 16 or (problem.Dv * e) % 16:
        return False
    return torch.cuda.get_device_capability()[0] >= 9


class FlashBase(Solver):
    family = "flash"
    primitive = "attention"
    uses_triton = True
    max_head_dim = 256

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if problem.quantized:
            reasons.append("quantized K/V are not supported (use the decode family)")
        if max(problem.D, problem.Dv) > self.max_head_dim:
            reasons.append(f"head dims D={problem.D}, Dv={problem.Dv} exceed {self.max_head_dim}")
        # every flash kernel puts (batch, query or kv head) on grid axis 1; B*Hq >= B*Hkv
        reasons += grid_reasons(((1, "B*Hq, batch x query heads", problem.B * problem.Hq),))
        return reasons


@register
class FlashForward(FlashBase):
    """Triton flash attention forward (online softmax, TMA on Hopper when strides allow)."""
    id = 110
    name = "flash_fwd"
    directions = frozenset({"fwd"})
    paged = True  # page pools through pointer loads (no TMA), PAGE constexpr (paging.py)

    def workspace_size(self, problem) -> int:
        """The TMA descriptors' scratch (3 per program) for contiguous inputs; o and lse
        are outputs."""
        if not tma_expected(problem):
            return 0
        cfg, _ = configs.choose(problem)
        return 3 * TMA_DESC_BYTES * triton.cdiv(problem.Sq, cfg.block_m) * problem.B * problem.Hq

    def estimate(self, problem) -> float | None:
        # at least its host work per call (the system db's fastest flash_fwd call: 0.04 ms);
        # query rows padded to the smallest forward tile (a Hopper MMA's 64 rows)
        return max(roofline_ms(problem, 0.65, MIN_BLOCK_M), HOST_FLOOR_MS if problem.device == "cuda" else 0.0)

    def prepare(self, problem):
        return ForwardPlan(problem, configs.choose(problem)[0])
