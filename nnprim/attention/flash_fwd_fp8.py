"""FP8 flash attention forward in Triton (solver 125 `flash_fwd_fp8`, family `flash`).

q, k, v are float8_e4m3fn with descale factors dq, dk, dv (nnprim.fp8: none, per tensor or
per (b, head)); the result is the attention of (q dq, k dk, v dv):

    s_ij  = (scale dq dk) * q_i . k_j + bias_ij     q.k an e4m3 x e4m3 dot, f32 accumulation;
                                                    the descales fold into the softmax scale
    p_ij  = exp2(s_ij log2(e) - m_i + 8)            online softmax (log2 domain) as solver 110;
                                                    the +8 (FA3's max offset) puts P in [0, 256]
                                                    so small probabilities stay normal in e4m3
    o_i   = dv * sum_j e4m3(p_ij) v_j / sum_j p_ij  P rounded to e4m3 (round to nearest even)
                                                    for the PV dot; dv applied once at the end
    lse_i = ln 2 * (m_i - 8 + log2 sum_j p_ij)

Each key block's PV product goes to a fresh f32 partial (`max_num_imprecise_acc=BLOCK_N`)
added to the f32 accumulator: Hopper's FP8 MMA accumulates with ~14 mantissa bits, which over
thousands of keys would bias the sum (DeepSeek-V3 notes the same for FP8 GEMMs).

Layout: Hopper's FP8 wgmma takes both operands K-major from shared memory. For QK^T the K
rows (head dim contiguous) already are; for PV the reduction runs over keys, so V must have
keys contiguous. With TMA (Hopper, 16-byte aligned strides, Sk >= 16) the invoker writes a
transposed copy V^T (B, Hkv, Dv, Sk rounded up to 16) each call, as Triton's fused-attention
tutorial stores V for FP8, and the kernel loads [Dv, BLOCK_N] tiles of it and uses
`tl.trans` of the tile (a view: K-major for the MMA). The copy costs one read and one write
of V (1 byte per element), under 1% of the attention at S >= 1k; `workspace_size` counts it.
Without TMA the kernel loads the same transposed tiles straight from v's strides.

Options: GQA/MQA, causal top-left and bottom-right (block skipping as solver 110), bool and
additive masks, kv_lens, scale (float or tensor, inverted), dropout, softmax_inf_as_zero,
return_lse, head dims up to 256 (D != Dv), tails. Output bf16 / f16 / f32 (problem.out_dtype).
Descales must be positive (checked on a call signature's first call; the unmasked loop
takes the row max before scaling). Needs FP8 tensor cores (sm_89+) or the interpreter.

Interpreter (TRITON_INTERPRET=1): e4m3 tiles, loads and the FP8 dots run (the interpreter
widens FP8 to f16, exactly), but its f32 -> e4m3 cast truncates and drops the carry into the
exponent (0.031 -> 0.0156), so P is rounded to e4m3 by integer arithmetic first
(`_round_e4m3`, bit-exact round to nearest even, subnormals included): the CPU tests see the
GPU's numerics.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import fp8
from ..dropout import dropout_keep
from ..errors import NotSupportedError
from ..launch import Launch, aligned16, ensure_allocator, int_width, interpreting
from ..search.solver import register
from . import configs
from .flash_fwd import (
    _CAUSAL_CODE,
    _MASK_CODE,
    TMA_DESC_BYTES,
    FlashBase,
    _key_bounds,
    _kv_len_shift,
    _mask_scores,
    dropout_args,
    mask_view,
    roofline_ms,
    scale_args,
    tma_expected,
    tma_ok,
)

P_SHIFT = tl.constexpr(8.0)  # P = exp2(s - m + P_SHIFT) lies in [0, 2**8]; e4m3's largest finite is 448
VT_ALIGN = 16          # keys of the V^T copy are padded to this (TMA row strides: 16 bytes)


# ---- Triton kernels -------------------------------------------------------------------

@triton.jit
def _round_e4m3(x):
    """x >= 0 (f32, < 464) rounded to the nearest e4m3 value, ties to even: keep 3 mantissa
    bits of the f32 pattern (the carry may step the exponent). Below 2**-6 (e4m3 subnormals,
    spacing 2**-9) x + 2**-6 lies in [2**-6, 2**-5) whose 3-bit grid has that same spacing."""
    small = x < 0.015625
    y = tl.where(small, x + 0.015625, x)
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    r = bits.to(tl.float32, bitcast=True)
    return tl.where(small, r - 0.015625, r)


@triton.jit
def _fp8_inner(acc, l_i, m_i, q, k_ptrs, vt_ptrs, k_desc, vt_desc, mask_ptrs, stride_kn, stride_vn,
               stride_mj, offs_m, offs_d, offs_dv, lo, hi, kv_len, shift, qk_scale,
               seed, offset, b, h, Hq, Sq, Sk, threshold, D, Dv,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
               EVEN_DV: tl.constexpr, USE_TMA: tl.constexpr, EMULATE: tl.constexpr,
               SCALE_POS: tl.constexpr):
    """Key blocks [lo, hi); MASKED blocks check kv bounds and causality per element."""
    FAST: tl.constexpr = (not MASKED) and MASK_KIND == 0 and SCALE_POS
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        # -- K tile [BLOCK_N, BLOCK_D] (e4m3)
        if USE_TMA:
            k = k_desc.load([start_n, 0])
        else:
            kp = k_ptrs + tl.cast(start_n, tl.int64) * stride_kn
            if MASKED:
                k = tl.load(kp, mask=(offs_n[:, None] < Sk) & (offs_d[None, :] < D), other=0.0)
            elif EVEN_D:
                k = tl.load(kp)
            else:
                k = tl.load(kp, mask=offs_d[None, :] < D, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        if FAST:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - (m_new - P_SHIFT)[:, None])
        else:
            s = _mask_scores(qk * qk_scale, mask_ptrs, start_n, stride_mj, offs_m, offs_n, Sq, Sk, kv_len,
                             shift, MASKED, CAUSAL, MASK_KIND)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if MASKED or MASK_KIND != 0:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.math.exp2(s - (m_use - P_SHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = dropout_keep(seed, offset, b, h, offs_m[:, None], offs_n[None, :], Hq, Sq, Sk,
                                threshold)
            p = tl.where(keep, p, 0.0)
        # -- V^T tile [BLOCK_DV, BLOCK_N] (keys contiguous: K-major for the PV product)
        if USE_TMA:
            vt = vt_desc.load([0, start_n])
        else:
            vp = vt_ptrs + tl.cast(start_n, tl.int64) * stride_vn
            if MASKED:
                vt = tl.load(vp, mask=(offs_n[None, :] < Sk) & (offs_dv[:, None] < Dv), other=0.0)
            elif EVEN_DV:
                vt = tl.load(vp)
            else:
                vt = tl.load(vp, mask=offs_dv[:, None] < Dv, other=0.0)
        if EMULATE:
            p = _round_e4m3(p)
        acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc, max_num_imprecise_acc=BLOCK_N)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Hq", "Sq", "Sk", "seed", "offset"])  # sizes, RNG: no recompile (as solver 110)
def _flash_fwd_fp8_kernel(
        Q, K, V, O, LSE, MASK, SCALE, KVLENS, DQ, DK, DV,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sob, soh, sos, sod, smb, smh, smi, smj, sdqb, sdqh, sdkb, sdkh, sdvb, sdvh,
        Hq, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, INF_AS_ZERO: tl.constexpr, STORE_LSE: tl.constexpr,
        HAS_DQ: tl.constexpr, HAS_DK: tl.constexpr, HAS_DV: tl.constexpr,
        USE_TMA: tl.constexpr, EMULATE: tl.constexpr, SCALE_POS: tl.constexpr):
    """One program: BLOCK_M query rows of one (b, h). V strides (svb, svh, svs, svd) are those
    of the tensor read (v, or its V^T copy with svs = 1 under TMA); descales are f32 with
    (b, head) strides (0, 0 for per tensor)."""
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
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh

    if SCALE_PTR:
        sc = tl.load(SCALE).to(tl.float32)
        if INVERT:
            sc = 1.0 / sc
    else:
        sc = scale
    if HAS_DQ:
        sc = sc * tl.load(DQ + b * sdqb + h * sdqh)
    if HAS_DK:
        sc = sc * tl.load(DK + b * sdkb + hk * sdkh)
    qk_scale = sc * 1.4426950408889634

    kv_len, shift = _kv_len_shift(KVLENS, b, Sq, Sk, HAS_KVLENS, CAUSAL)

    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[Sq, D], strides=[sqs, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Sk, D], strides=[sks, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        vt_desc = tl.make_tensor_descriptor(v_base, shape=[Dv, Sk], strides=[svd, 1],
                                            block_shape=[BLOCK_DV, BLOCK_N])
        q = q_desc.load([start_m, 0])
        k_ptrs = K
        vt_ptrs = V
    else:
        k_desc = None
        vt_desc = None
        q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sqs + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D), other=0.0)
        k_ptrs = k_base + offs_n[:, None].to(tl.int64) * sks + offs_d[None, :] * skd
        vt_ptrs = v_base + offs_n[None, :].to(tl.int64) * svs + offs_dv[:, None] * svd
    if MASK_KIND != 0:
        mask_ptrs = (MASK + b64 * smb + h.to(tl.int64) * smh + offs_m[:, None].to(tl.int64) * smi
                     + offs_n[None, :].to(tl.int64) * smj)
    else:
        mask_ptrs = MASK

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    full, hi = _key_bounds(start_m, Sq, kv_len, shift, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fp8_inner(
        acc, l_i, m_i, q, k_ptrs, vt_ptrs, k_desc, vt_desc, mask_ptrs, sks, svs, smj,
        offs_m, offs_d, offs_dv, 0, full, kv_len, shift, qk_scale,
        seed, offset, b, h, Hq, Sq, Sk, threshold, D, Dv,
        BLOCK_N, False, CAUSAL, MASK_KIND, DROPOUT, BLOCK_D == D, BLOCK_DV == Dv, USE_TMA,
        EMULATE, SCALE_POS)
    acc, l_i, m_i = _fp8_inner(
        acc, l_i, m_i, q, k_ptrs, vt_ptrs, k_desc, vt_desc, mask_ptrs, sks, svs, smj,
        offs_m, offs_d, offs_dv, full, hi, kv_len, shift, qk_scale,
        seed, offset, b, h, Hq, Sq, Sk, threshold, D, Dv,
        BLOCK_N, True, CAUSAL, MASK_KIND, DROPOUT, BLOCK_D == D, BLOCK_DV == Dv, USE_TMA,
        EMULATE, False)

    # -- epilogue: normalise, v's descale, lse, store
    inv_l = 1.0 / l_i
    if DROPOUT:
        inv_l = inv_l * inv_keep
    if HAS_DV:
        inv_l = inv_l * tl.load(DV + b * sdvb + hk * sdvh)
    o = acc * inv_l[:, None]
    if INF_AS_ZERO:
        o = tl.where((l_i == 0.0)[:, None], 0.0, o)
    row_ok = offs_m < Sq
    o_base = O + b64 * sob + h.to(tl.int64) * soh
    tl.store(o_base + offs_m[:, None].to(tl.int64) * sos + offs_dv[None, :] * sod,
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
    if STORE_LSE:
        lse = (m_i - P_SHIFT + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


# ---- planning -----------------------------------------------------------------------------

# (head-dim bucket) -> forward tiles on Hopper; FP8 halves the shared memory per tile, so the
# bf16 table's 128-row tiles fit with longer key steps. First guesses: tune on the H200
# (NNPRIM_SDPA_CONFIG="BM,BN,WARPS,STAGES" overrides, as for solver 110).
_T = configs.TileConfig
FP8_TABLE = {64: _T(128, 128, 8, 3), 128: _T(128, 128, 8, 3), 256: _T(128, 64, 8, 2)}
_FP8_GENERIC = _T(64, 64, 4, 2)
_INTERP = _T(16, 32, 4, 1)


def choose_tiles(problem) -> configs.TileConfig:
    arch = configs.device_arch(problem.device)
    if arch == "interp":
        cfg = _INTERP
    else:
        d = max(problem.D, problem.Dv)
        cfg = FP8_TABLE.get(64 if d <= 64 else (128 if d <= 128 else 256), _FP8_GENERIC) \
            if arch == "sm90" else _FP8_GENERIC
    override, _ = configs.parse_override(os.environ.get(configs.ENV))
    cfg = override or cfg
    if arch != "interp" and cfg.block_n < 32:
        cfg = _T(cfg.block_m, 32, cfg.num_warps, cfg.num_stages)   # FP8 MMA: 32-deep reductions
    return cfg


def shrink(cfg: configs.TileConfig) -> configs.TileConfig:
    """configs.shrink, keeping key steps of at least 32 (the FP8 MMA reduction depth): below
    that the rows are halved instead."""
    nxt = configs.shrink(cfg)
    if nxt.block_n < 32 <= cfg.block_n:
        if cfg.block_m <= 16:
            raise NotSupportedError(f"no FP8 tile config fits the GPU's shared memory (last tried {cfg})")
        nxt = _T(cfg.block_m // 2, 32, cfg.num_warps, 2)
    return nxt


def block_d(d: int) -> int:
    """Padded head-dim tile: a power of two, at least 32 (FP8 MMA reduction depth)."""
    return max(32, triton.next_power_of_2(d))


def _descale_view(d: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple[int, int]]:
    """(tensor, (b, head) strides) of a descale: per tensor has zero strides."""
    if d is None:
        return None, (0, 0)
    if d.numel() == 1:
        return d.reshape(()), (0, 0)
    return d, (d.stride(0), d.stride(1))


def _descales(args) -> tuple:
    dev = args.q.device
    return tuple(_descale_view(fp8.descale_tensor(d, dev)) for d in (args.q_descale, args.k_descale, args.v_descale))


def _padded_keys(Sk: int) -> int:
    return -(-Sk // VT_ALIGN) * VT_ALIGN


def transposed_v(v: torch.Tensor) -> torch.Tensor:
    """V^T (B, H, Dv, Sk) with keys contiguous and rows padded to VT_ALIGN keys (a view of
    the first Sk columns of the padded buffer)."""
    B, H, Sk, Dv = v.shape
    vt = torch.empty((B, H, Dv, _padded_keys(Sk)), dtype=v.dtype, device=v.device)[..., :Sk]
    vt.copy_(v.transpose(2, 3))
    return vt


def _v_strides(problem, v: torch.Tensor, transposed: bool) -> tuple[int, ...]:
    """(batch, head, key, dv) strides of what the kernel reads for V: v, or its V^T copy."""
    if transposed:
        Skp = _padded_keys(problem.Sk)
        return (problem.Hkv * problem.Dv * Skp, problem.Dv * Skp, 1, Skp)
    return tuple(v.stride())


def _plan_parts(problem, args, use_tma: bool, with_lse: bool):
    """(scalar tail, Launch keywords: constexpr flags and `counters_at`) of one launch."""
    q, k = args.q, args.k
    _, ms = mask_view(problem, args.attn_mask)
    scale, scale_t = scale_args(problem, args)
    seed, offset, threshold, inv_keep = dropout_args(problem, args)
    (dq, dqs), (dk, dks), (dv, dvs) = _descales(args)
    o_strides = (problem.Hq * problem.Sq * problem.Dv, problem.Sq * problem.Dv, problem.Dv, 1)
    tail = (*q.stride(), *k.stride(), *_v_strides(problem, args.v, use_tma), *o_strides, *ms, *dqs, *dks, *dvs,
            problem.Hq, problem.Sq, problem.Sk, problem.group, problem.D, problem.Dv, scale, seed, offset,
            threshold, inv_keep)
    flags = dict(
        BLOCK_D=block_d(problem.D), BLOCK_DV=block_d(problem.Dv),
        CAUSAL=_CAUSAL_CODE[problem.causal], MASK_KIND=_MASK_CODE[problem.mask],
        SCALE_PTR=scale_t is not None, INVERT=problem.invert_scale,
        HAS_KVLENS=args.kv_lens is not None, DROPOUT=problem.dropout_p > 0,
        INF_AS_ZERO=problem.inf_as_zero, STORE_LSE=with_lse,
        HAS_DQ=dq is not None, HAS_DK=dk is not None, HAS_DV=dv is not None,
        USE_TMA=use_tma, EMULATE=interpreting(), SCALE_POS=scale_t is None and scale > 0,
        counters_at=len(tail) - 4 if problem.dropout_p > 0 else None)   # (seed, offset): Launch.with_counters
    return tail, flags


def _pointers(problem, args, v_read, o, lse) -> tuple:
    q = args.q
    mask, _ = mask_view(problem, args.attn_mask)
    _, scale_t = scale_args(problem, args)
    ds = [d if d is not None else q for d, _ in _descales(args)]
    return (q, args.k, v_read, o, lse if lse is not None else o, mask if mask is not None else q,
            scale_t if scale_t is not None else q, args.kv_lens if args.kv_lens is not None else q, *ds)


def _grid(problem, cfg: configs.TileConfig) -> tuple[int, int]:
    return (triton.cdiv(problem.Sq, cfg.block_m), problem.B * problem.Hq)


def use_tma_for(problem, args) -> bool:
    """TMA when q and k qualify (Hopper, 16-byte rows and bases) and there are at least 16
    keys (the V^T copy is made aligned)."""
    return problem.Sk >= VT_ALIGN and tma_ok(args.q, args.k)


class Fp8ForwardPlan:
    """The solver's invoker: a planned `Launch` per set of input strides, per-call scalars
    and TMA eligibility; a call makes V^T (TMA), allocates o (and lse) and launches."""

    def __init__(self, problem, cfg: configs.TileConfig):
        self.problem, self.cfg = problem, cfg
        self.plans: dict[tuple, tuple[Launch, bool]] = {}

    def _key(self, args) -> tuple:
        """Everything the launch specialises on but the problem: strides, per-call scalars,
        descale layouts and every pointer's 16-byte alignment."""
        q, k, v, m = args.q, args.k, args.v, args.attn_mask
        ds = (args.q_descale, args.k_descale, args.v_descale)
        return (q.stride(), k.stride(), v.stride(), None if m is None else (m.shape, m.stride()),
                None if isinstance(args.scale, torch.Tensor) else args.scale, int_width(args.seed),
                int_width(args.offset),
                tuple(d if not isinstance(d, torch.Tensor) else (d.shape, d.stride()) for d in ds),
                aligned16(q, k, v, m, args.kv_lens, args.scale, *ds))

    def _plan(self, args) -> tuple[Launch, bool]:
        p, cfg = self.problem, self.cfg
        use_tma = use_tma_for(p, args)
        tail, flags = _plan_parts(p, args, use_tma, p.return_lse)
        return Launch(_flash_fwd_fp8_kernel, _grid(p, cfg), tail, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags), use_tma

    def __call__(self, args, out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
        """(o, lse or None); `out` / `lse_out` (contiguous; lse_out when problem.return_lse)
        let tests pass poisoned buffers."""
        p, q = self.problem, args.q
        key = self._key(args)
        hit = self.plans.get(key)
        if hit is None:
            if len(self.plans) >= 64:
                self.plans.clear()
            hit = self.plans[key] = self._plan(args)
        launch, use_tma = hit
        if use_tma:
            ensure_allocator(q.device)
        o = out if out is not None else torch.empty((p.B, p.Hq, p.Sq, p.Dv), dtype=p.result_dtype, device=q.device)
        lse = None
        if p.return_lse:
            lse = lse_out if lse_out is not None else torch.empty((p.B, p.Hq, p.Sq), dtype=torch.float32,
                                                                  device=q.device)
        v_read = transposed_v(args.v) if use_tma else args.v
        try:
            launch.with_counters(args.seed, args.offset).run_aligned(*_pointers(p, args, v_read, o, lse))
        except OutOfResources:
            self.cfg = shrink(self.cfg)
            self.plans.clear()
            return self(args, out, lse_out)
        return o, lse


# ---- solver -----------------------------------------------------------------------------

def fp8_mma_reasons(problem) -> list[str]:
    """FP8 tensor cores: sm_89 (Ada) and newer; the interpreter emulates them."""
    if problem.device != "cuda" or not torch.cuda.is_available():
        return []
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return [f"FP8 MMA needs compute capability 8.9 or newer, this GPU is {cap[0]}.{cap[1]}"]
    return []


@register
class FlashForwardFp8(FlashBase):
    """Triton flash attention forward on float8_e4m3fn q/k/v with descales (module doc)."""
    id = 125
    name = "flash_fwd_fp8"
    directions = frozenset({"fwd"})
    dtypes = frozenset({fp8.FP8})

    def not_supported_reasons(self, problem) -> list[str]:
        return super().not_supported_reasons(problem) + fp8_mma_reasons(problem)

    def workspace_size(self, problem) -> int:
        """The V^T copy and the TMA descriptors' scratch (3 per program) for contiguous
        inputs; o and lse are outputs."""
        if not tma_expected(problem) or problem.Sk < VT_ALIGN:
            return 0
        Skp = -(-problem.Sk // VT_ALIGN) * VT_ALIGN
        progs = triton.cdiv(problem.Sq, choose_tiles(problem).block_m) * problem.B * problem.Hq
        return problem.B * problem.Hkv * problem.Dv * Skp + 3 * TMA_DESC_BYTES * progs

    def estimate(self, problem) -> float | None:
        # FP8 MMAs run at twice the bf16 rate; the softmax does not speed up: ~1.6x solver 110
        return roofline_ms(problem, 0.65 * 1.6)

    def prepare(self, problem):
        return Fp8ForwardPlan(problem, choose_tiles(problem))
