"""Five-GEMM flash attention backward in Triton: solvers 123 `flash_bwd_atomic` (dQ by
unordered f32 atomic adds, not deterministic) and 124 `flash_bwd_ordered` (the same adds
in a fixed order through per-block semaphores, FA3's deterministic mode), family `flash`.

Same mathematics as solver 111 (flash_bwd.py), but one program per (BLOCK_N keys, b, kv
head) forms, per query block, the five products

    S^T = K Q^T (P from the forward's lse),  dP^T = V dO^T,  dV += P^T dO,
    dK += dS^T Q,  dQ_partial = dS K

and adds dQ_partial (f32) into a workspace accumulator (B, Hq, Sq, D) with
`tl.atomic_add`, where 111 recomputes S and dP in a separate dQ kernel (seven products).
The GQA reduction of dK/dV stays inside the program (it loops over the query heads of
its kv head), so only dQ needs atomics. Launches:
1. preprocess: delta = rowsum(dO * O) (0 on fully masked rows), zero the dQ accumulator
   and (ordered) the semaphores;
2. the main kernel (dK, dV stored in the input dtype, dQ accumulated);
3. cast: dQ = scale * accumulator, in the input dtype.

Ordered adds (124): a dQ block (BLOCK_M rows of one (b, query head)) receives the adds of
the key blocks j = 0..J, a prefix, because the first query row a key block reaches is
nondecreasing in j (`_query_ranges`); J follows from the causal shift and kv_len
(`_last_key_block`). The adds go in descending j: program j waits on an int32 counter
per dQ block until it reads J - j, adds, then increments it. Key block j runs as program
n_kv - 1 - j of the grid's first axis, so a program waits only on programs with lower
linear ids (launched earlier: no deadlock on the GPU; the interpreter runs programs in
id order, so each turn has come when a program reaches it). With causal masking the
short key blocks (high j) start first and stay ahead of the long ones, so programs
seldom wait. f32 adds in a fixed order from zero: bit-identical run to run.

Covers what 111 covers: masks (bool/additive, broadcast), kv_lens (clamped to [0, Sk]),
float/tensor scale and its inverse, softmax_inf_as_zero, both causal alignments,
Sq != Sk, tails, any strides, f16/bf16/f32, D and Dv up to 256 (D != Dv), dropout (the
same Philox keep mask), TMA loads on Hopper where the strides allow. Workspace: delta,
the f32 dQ accumulator, the semaphores (124) and the TMA descriptors' scratch.
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
from .flash_bwd_common import _delta_rows, _kv_block, _load_scale, _lse2, _query_ranges, _scores, plan_key
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
def _pre_kernel(O, DO, LSE, DELTA, DQA, SEM, sob, soh, sos, sod, sdb, sdh, sds, sdd, Hq, Sq, D, Dv,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                ORDERED: tl.constexpr):
    """delta of BLOCK_M rows; zeroes their dQ accumulator rows and (ORDERED) the
    semaphore of the main kernel's dQ block with the same index (same BLOCK_M)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    _delta_rows(O, DO, LSE, DELTA, pid_m, pid_bh, sob, soh, sos, sod, sdb, sdh, sds, sdd, Hq, Sq, Dv,
                BLOCK_M, BLOCK_DV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = DQA + (pid_bh.to(tl.int64) * Sq + offs_m[:, None]) * D + offs_d[None, :]
    tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
             mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D))
    if ORDERED:
        tl.store(SEM + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, 0)


@triton.jit
def _last_key_block(start_m, kv_len, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """J: the highest key block that adds to the dQ block at start_m (they are 0..J).
    Key block j reaches the rows from lo(j) = floor(max(j BN - shift, 0) / BM) BM on
    (`_query_ranges`), so it reaches start_m iff j BN < start_m + BM + shift, and has
    a visible key iff j BN < kv_len."""
    hi = kv_len
    if CAUSAL != 0:
        hi = tl.minimum(hi, start_m + BLOCK_M + shift)
    return tl.cdiv(hi, BLOCK_N) - 1


@triton.jit
def _inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base, dqa_base,
           sem_base, j, sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv, lo, hi,
           kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold, inv_keep,
           D, Dv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
           USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
           ORDERED: tl.constexpr, INTERP: tl.constexpr):
    """Query blocks [lo, hi) for one key block; score tiles are transposed [BLOCK_N, BLOCK_M]."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        rmask = offs_m < Sq
        if USE_TMA:
            q = q_desc.load([start_m, 0])
        else:
            q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sqs + offs_d[None, :] * sqd,
                        mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
        lse2 = _lse2(tl.load(lse_base + offs_m, mask=rmask, other=float("inf")))
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
        if DROPOUT:
            pdT = tl.where(keep, pT * inv_keep, 0.0)
        else:
            pdT = pT
        dv = _dot(pdT.to(do.dtype), do, dv, UPCAST, IEEE)
        delta = tl.load(delta_base + offs_m, mask=rmask, other=0.0)
        dpT = _dot(v, tl.trans(do), None, UPCAST, IEEE)
        if DROPOUT:
            dpT = tl.where(keep, dpT * inv_keep, 0.0)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = _dot(dsT, q, dk, UPCAST, IEEE)
        dq = _dot(tl.trans(dsT), k, None, UPCAST, IEEE)
        dq_ptrs = dqa_base + offs_m[:, None].to(tl.int64) * D + offs_d[None, :]
        dq_mask = rmask[:, None] & (offs_d[None, :] < D)
        if ORDERED:
            sem = sem_base + start_m // BLOCK_M
            turn = _last_key_block(start_m, kv_len, shift, BLOCK_M, BLOCK_N, CAUSAL) - j
            cur = tl.atomic_add(sem, 0, sem="acquire")
            if INTERP:  # programs run one after another, so the turn must have come:
                dq = tl.where(cur == turn, dq, float("nan"))  # else poison dQ (tests see it)
                cur = turn
            while cur != turn:
                cur = tl.atomic_add(sem, 0, sem="acquire")
            tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
            tl.debug_barrier()  # every thread's adds precede the release
            tl.atomic_add(sem, 1, sem="release")
        else:
            tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["Hq", "Hkv", "seed", "offset"])  # head counts, RNG: no recompile
def _bwd_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, DQA, SEM, MASK, SCALE, KVLENS,
        sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
        sdb, sdh, sds, sdd, sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
        smb, smh, smi, smj,
        Hq, Hkv, Sq, Sk, GROUP, D, Dv, scale, seed, offset, threshold, inv_keep,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
        SCALE_PTR: tl.constexpr, INVERT: tl.constexpr, HAS_KVLENS: tl.constexpr,
        DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        ORDERED: tl.constexpr, INTERP: tl.constexpr):
    """One program: BLOCK_N keys of one (b, kv head); loops over the GROUP query heads and
    their query blocks. ORDERED: key block j = n_kv - 1 - pid (see the module doc)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if ORDERED:
        j = tl.num_programs(0) - 1 - pid_n
    else:
        j = pid_n
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    b64 = b.to(tl.int64)
    start_n = j * BLOCK_N
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
    lo, full, m_whole, whole, m_end = _query_ranges(start_n, kv_len, shift, Sq, BLOCK_M, BLOCK_N, CAUSAL)
    n_mb = tl.cdiv(Sq, BLOCK_M)
    for g in range(GROUP):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        bh64 = b64 * Hq + h64
        q_base = Q + b64 * sqb + h64 * sqh
        do_base = DO + b64 * sdb + h64 * sdh
        lse_base = LSE + bh64 * Sq
        delta_base = DELTA + bh64 * Sq
        dqa_base = DQA + bh64 * Sq * D
        sem_base = SEM + bh64 * n_mb
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
        # masked diagonal blocks, unmasked blocks, masked tail block(s): ascending rows
        dk, dv = _inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base,
                        dqa_base, sem_base, j, sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv,
                        lo, full, kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold,
                        inv_keep, D, Dv, BLOCK_M, BLOCK_N, True, CAUSAL, MASK_KIND, DROPOUT, USE_TMA,
                        UPCAST, IEEE, ORDERED, INTERP)
        dk, dv = _inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base,
                        dqa_base, sem_base, j, sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv,
                        full, m_whole, kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk,
                        threshold, inv_keep, D, Dv, BLOCK_M, BLOCK_N, False, CAUSAL, MASK_KIND,
                        DROPOUT, USE_TMA, UPCAST, IEEE, ORDERED, INTERP)
        dk, dv = _inner(dk, dv, k, v, q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base,
                        dqa_base, sem_base, j, sqs, sqd, sds, sdd, smi, smj, offs_n, offs_d, offs_dv,
                        whole, m_end, kv_len, shift, qk_scale, seed, offset, b, h, Hq, Sq, Sk, threshold,
                        inv_keep, D, Dv, BLOCK_M, BLOCK_N, True, CAUSAL, MASK_KIND, DROPOUT, USE_TMA,
                        UPCAST, IEEE, ORDERED, INTERP)
    dk = dk * sc
    tl.store(DK + b64 * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None].to(tl.int64) * sdks
             + offs_d[None, :] * sdkd, dk.to(DK.dtype.element_ty),
             mask=nmask[:, None] & (offs_d[None, :] < D))
    tl.store(DV + b64 * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None].to(tl.int64) * sdvs
             + offs_dv[None, :] * sdvd, dv.to(DV.dtype.element_ty),
             mask=nmask[:, None] & (offs_dv[None, :] < Dv))


@triton.jit
def _cast_kernel(DQA, DQ, SCALE, Sq, D, scale, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 SCALE_PTR: tl.constexpr, INVERT: tl.constexpr):
    """dq = scale * accumulator in dq's dtype (both contiguous (B, Hq, Sq, D))."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    off = (pid_bh.to(tl.int64) * Sq + offs_m[:, None]) * D + offs_d[None, :]
    msk = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
    sc = _load_scale(SCALE, scale, SCALE_PTR, INVERT)
    acc = tl.load(DQA + off, mask=msk, other=0.0)
    tl.store(DQ + off, (acc * sc).to(DQ.dtype.element_ty), mask=msk)


# ---- launcher ---------------------------------------------------------------------------

_PRE = ("o", "do", "lse", "delta", "dqa", "sem")
_MAIN = ("q", "k", "v", "do", "lse", "delta", "dk", "dv", "dqa", "sem", "mask", "scale", "kvl")
_CAST = ("dqa", "dq", "scale")


def _contiguous_strides(*shape: int) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def plan(problem, args, cfg: configs.TileConfig, *, ordered: bool,
         use_tma: bool) -> list[tuple[str, list[tuple[Launch, tuple[str, ...]]]]]:
    """The planned launches by stage, [(stage, [(Launch, pointer names)])]: preprocess,
    main (dK, dV, dQ accumulation), cast. BM query rows per step, BN keys per program."""
    q, k, v, do, o = args.q, args.k, args.v, args.do, args.o
    B, Hq, Hkv, Sq, Sk = problem.B, problem.Hq, problem.Hkv, problem.Sq, problem.Sk
    D, Dv = problem.D, problem.Dv
    _, ms = mask_view(problem, args.attn_mask)
    scale, _ = scale_args(problem, args)
    seed, offset, threshold, inv_keep = dropout_args(problem, args)
    BD, BDV = block_d(D), block_d(Dv)
    BM, BN = cfg.block_m, cfg.block_n
    interp = interpreting()
    flags = dict(CAUSAL=_CAUSAL_CODE[problem.causal], MASK_KIND=_MASK_CODE[problem.mask],
                 SCALE_PTR=problem.scale == "tensor", INVERT=problem.invert_scale,
                 HAS_KVLENS=args.kv_lens is not None, DROPOUT=problem.dropout_p > 0,
                 USE_TMA=use_tma, UPCAST=interp and q.dtype == torch.bfloat16,
                 IEEE=q.dtype == torch.float32, ORDERED=ordered, INTERP=interp)
    sdk, sdv = _contiguous_strides(B, Hkv, Sk, D), _contiguous_strides(B, Hkv, Sk, Dv)
    tail = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *sdk, *sdv, *ms,
            Hq, Hkv, Sq, Sk, problem.group, D, Dv, scale, seed, offset, threshold, inv_keep)
    counters_at = len(tail) - 4 if problem.dropout_p > 0 else None     # Launch.with_counters
    pre = Launch(_pre_kernel, (triton.cdiv(Sq, BM), B * Hq), (*o.stride(), *do.stride(), Hq, Sq, D, Dv),
                 BLOCK_M=BM, BLOCK_D=BD, BLOCK_DV=BDV, ORDERED=ordered)
    main = Launch(_bwd_kernel, (triton.cdiv(Sk, BN), B * Hkv), tail, counters_at=counters_at, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
                  BLOCK_DV=BDV, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    CM = 16 if interp else max(16, min(64, 8192 // BD))
    cast = Launch(_cast_kernel, (triton.cdiv(Sq, CM), B * Hq), (Sq, D, scale), BLOCK_M=CM, BLOCK_D=BD,
                  SCALE_PTR=problem.scale == "tensor", INVERT=problem.invert_scale)
    return [("pre", [(pre, _PRE)]), ("main", [(main, _MAIN)]), ("cast", [(cast, _CAST)])]


def sem_count(problem, cfg: configs.TileConfig) -> int:
    """int32 semaphores of the ordered variant: one per (dQ block, b, query head)."""
    return problem.B * problem.Hq * triton.cdiv(problem.Sq, cfg.block_m)


def _buffers(problem, args, cfg: configs.TileConfig, ordered: bool, out=None) -> dict[str, torch.Tensor]:
    """The launches' pointers: inputs, outputs (`out` = (dq, dk, dv), e.g. poisoned) and
    the workspace (delta, dQ accumulator, semaphores)."""
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
    ws = alloc.empty((B * Hq * Sq * (problem.D + 1) + (sem_count(problem, cfg) if ordered else 1),),
                     torch.float32, q.device)
    n_acc = B * Hq * Sq * problem.D
    return dict(q=q, k=args.k, v=args.v, do=args.do, o=args.o, lse=lse, dq=dq, dk=dk, dv=dv,
                dqa=ws[:n_acc], delta=ws[n_acc:n_acc + B * Hq * Sq],
                sem=ws[n_acc + B * Hq * Sq:].view(torch.int32),
                mask=mask if mask is not None else q, scale=scale_t if scale_t is not None else q,
                kvl=args.kv_lens if args.kv_lens is not None else q)


def _run(stages, bufs: dict[str, torch.Tensor], checked: bool = False, counters: tuple | None = None) -> None:
    """`counters`: this call's dropout (seed, offset) (flash_bwd._run_stage)."""
    for _, launches in stages:
        for launch, names in launches:
            ptrs = tuple(bufs[n] for n in names)
            if counters is not None:
                launch = launch.with_counters(*counters)
            launch.run_aligned(*ptrs) if checked else launch(*ptrs)


def backward(problem, args, cfg: configs.TileConfig, *, ordered: bool, out=None,
             use_tma: bool | None = None):
    """Run the three launches: (dq, dk, dv) in q's dtype. Tiles that do not fit the GPU's
    shared memory are shrunk (configs.shrink) and remembered."""
    if use_tma is None:
        use_tma = tma_ok(args.q, args.k, args.v, args.do)
    if use_tma:
        ensure_allocator(args.q.device)
    key = ("bwd5", problem.key(), cfg, use_tma, ordered)
    cfg = configs.FITTED.get(key, cfg)
    while True:
        bufs = _buffers(problem, args, cfg, ordered, out)
        try:
            _run(plan(problem, args, cfg, ordered=ordered, use_tma=use_tma), bufs)
            return bufs["dq"], bufs["dk"], bufs["dv"]
        except OutOfResources:
            cfg = configs.shrink(cfg)
            configs.FITTED[key] = cfg


class AtomicPlan:
    """The solvers' invoker: the planned launches per set of input strides, per-call
    scalars and TMA eligibility; a call allocates the outputs and workspace and launches."""

    def __init__(self, problem, cfg: configs.TileConfig, ordered: bool):
        self.problem, self.cfg, self.ordered = problem, cfg, ordered
        self.plans: dict[tuple, list] = {}

    def __call__(self, args):
        key = plan_key(args)
        stages = self.plans.get(key)
        if stages is None:
            if len(self.plans) >= 64:
                self.plans.clear()
            use_tma = tma_ok(args.q, args.k, args.v, args.do)
            if use_tma:
                ensure_allocator(args.q.device)
            stages = self.plans[key] = plan(self.problem, args, self.cfg, ordered=self.ordered,
                                            use_tma=use_tma)
        bufs = _buffers(self.problem, args, self.cfg, self.ordered)
        try:
            _run(stages, bufs, checked=True,
                 counters=(args.seed, args.offset) if self.problem.dropout_p > 0 else None)
        except OutOfResources:
            self.cfg = configs.shrink(self.cfg)
            self.plans.clear()
            return self(args)
        return bufs["dq"], bufs["dk"], bufs["dv"]


def workspace_bytes(problem, ordered: bool) -> int:
    """dQ accumulator + delta (+ semaphores) + the main launch's TMA scratch (4
    descriptors per program) on contiguous inputs."""
    # a CUDA problem described on a machine without one (planning): the generic tiles
    no_gpu = problem.device == "cuda" and not torch.cuda.is_available()
    cfg = configs.choose_bwd_atomic(problem, "cuda" if no_gpu else None)
    n = problem.B * problem.Hq * problem.Sq * (problem.D + 1) + (sem_count(problem, cfg) if ordered else 1)
    tma = 0
    if tma_expected(problem):
        tma = 4 * TMA_DESC_BYTES * triton.cdiv(problem.Sk, cfg.block_n) * problem.B * problem.Hkv
    return 4 * n + tma


# ---- solvers ----------------------------------------------------------------------------

class _FiveGemmBase(FlashBase):
    directions = frozenset({"bwd"})
    ordered: bool = False
    # fraction of the bf16 peak (nominal FLOPs) assumed by `estimate` (111 assumes 0.45 for
    # D <= 128, 0.25 above). Measured on the H200 2026-11-30 through the public API
    # (benchmarks/results/attention_api_2026-11-30.json), untuned tiles: the atomic dQ
    # kernel ran at 0.45-0.93x solver 111 (atomics contend; 150-220 TFLOP/s), the ordered
    # one at 0.28-0.57x, so both rank below 111 until tuned
    efficiency: tuple[float, float] = (0.3, 0.11)

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem, self.ordered)

    def estimate(self, problem) -> float | None:
        return roofline_ms(problem, self.efficiency[max(problem.D, problem.Dv) > 128])

    def prepare(self, problem):
        return AtomicPlan(problem, configs.choose_bwd_atomic(problem), self.ordered)


@register
class FlashBackwardAtomic(_FiveGemmBase):
    """Five-GEMM backward, dQ by unordered f32 atomic adds (not deterministic)."""
    id = 123
    name = "flash_bwd_atomic"
    deterministic = False


@register
class FlashBackwardOrdered(_FiveGemmBase):
    """Five-GEMM backward, dQ adds ordered by per-block semaphores (deterministic)."""
    id = 124
    name = "flash_bwd_ordered"
    ordered = True
    efficiency = (0.15, 0.09)
