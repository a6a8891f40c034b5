"""FFT convolution (family `fft`, solvers 60-65): long and large filters through the
platform FFT (torch.fft: cuFFT on the GPU, pocketfft/MKL on the CPU, as the gemm family
calls a BLAS), with the padding, the spectral product (complex multiply, channel
contraction per group) and the fused epilogue in our own code: Triton kernels on the GPU
(solvers 60/61/62), torch on the CPU (solvers 63/64/65).

Math, per spatial dim (input L, filter F, padding pb/pa, output Lo = L + pb + pa - F + 1),
stride 1, dilation 1; hat = real-to-complex DFT of length Nf over every spatial dim:
  fwd          y[n,k,o]   = sum_{c,f} x[n,g*Cg+c, o-pb+f] w[k,c,f]
               Y[n,k]     = sum_c X'[n,c] conj(W[k,c])         x' = x placed at offset pb
               y[o]       = irfft(Y)[o]                        then + bias, post-ops, cast
  bwd_data     dx[n,c,i]  = sum_{k,f} dy[n,g*Kg+k, i+pb-f] w[g*Kg+k,c,f]
               DX[n,c]    = sum_k DY[n,k] W[k,c]               dx[i] = irfft(DX)[i + pb]
  bwd_weights  dw[k,c,f]  = sum_{n,o} dy[n,k,o] x[n,g*Cg+c, o-pb+f]
               DW[k,c]    = sum_n X'[n,c] conj(DY[n,k])        dw[f] = irfft(DW)[f]
All three are circular correlations/convolutions of length Nf; none wraps onto a wanted
index when Nf >= max(L + pb, L + pa, F, Lo) (the nonzero lags of x'*w span
[pb-F+1, pb+L-1], the wanted ones [0, Lo); likewise for the other two), so one Nf per
dim -- the smallest 7-smooth length (2^a 3^b 5^c 7^d) above that bound -- serves every
direction: causal padding [(L-1, 0)] with F = L gives Nf = 2L, 'same' about 1.5 L.

Transforms run in f32 for every input dtype (f16/bf16 are exact in f32; the result is
rounded once at the end). Measured relative norm error of an f32 FFT convolution vs
float64: ~3e-7 from L = 1k to 1M (random data), inside the f32 contract (1e-5).

Work is cut into chunks, rectangles of (images n0:n1) x (groups g0:g1) -- whole groups
over all images when they fit, else a slice of one group's images -- whose padded inputs
and spectra stay under the workspace cap; within a chunk rows are ordered (n, g, c), so a
chunk of an NCHW tensor is one strided block and of an NHWC tensor reads channels
contiguously. The weight spectrum (fwd, bwd_data) or the weight-gradient spectrum
accumulator (bwd_weights) is held whole; the accumulator is written by the first chunk
of each group and added to by later ones (no zero fill).

Per chunk (GPU): pack (Triton: cast to f32, zero padding, shift, layout) -> rfftn ->
spectral product (Triton `_mix_kernel`: out[p,i,f] = sum_j a[p,j,f] * w[g,i,j,f], conj for
fwd; in place when depthwise with multiplier 1; `_wgrad_kernel` for bwd_weights) ->
irfftn -> unpack (Triton: window, bias + post-op chain through triton_epilogue, cast,
output layout). The CPU solvers run the same plan with torch ops in place of the kernels.

workspace_size is exactly the peak of the buffers the invoker holds: padded inputs,
spectra, product outputs, the weight spectrum or gradient accumulator, inverse
transforms; on CUDA also the copy of each spectrum torch makes before a complex-to-real
transform (cuFFT overwrites a C2R input). Not counted: cuFFT's plan work area (kept by
torch's plan cache, like cuBLAS's workspace for the gemm family) and temporaries inside
single torch ops of the CPU path (einsum operand copies, pocketfft scratch), each
bounded by one chunk's spectra.

Supported: 1D/2D/3D, both layouts, groups (depthwise and general), any padding (pairs,
'same'), bias + post-ops (up to 4 on the GPU, any chain on the CPU), f32/f16/bf16 with
f32 or half outputs. Not applicable: stride or dilation other than 1, filters below
MIN_TAPS taps (FFT is the wrong tool there), a weight spectrum over half the workspace
cap (dense convolutions with many channels: their spectrum is K*Cg*Nf complex values).
Not yet: a tensor-core (tl.dot) channel contraction for wide groups (the FMA loop serves
them at f32 FMA rate)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..args import ConvArgs
from ..launch import Launch
from ..post_ops import apply_post_ops
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import Solver, register
from .implicit_gemm import layout_strides, strides5_of
from .triton_epilogue import NO_EPILOGUE, epilogue, plan_epilogue, post_op_bytes, post_op_reasons

MIN_TAPS = {1: 16, 2: 49, 3: 125}            # 16-tap 1D, 7x7 2D, 5x5x5 3D
WORKSPACE_CAP = {"cuda": 1 << 30, "cpu": 256 << 20}
MAX_POINTS = 1 << 24                        # per row: keeps every launch grid within CUDA's limits
F32, C64 = torch.float32, torch.complex64


def fast_len(n: int) -> int:
    """Smallest 7-smooth integer (2^a 3^b 5^c 7^d) >= n: a fast FFT length."""
    best = 1 << max(0, (n - 1).bit_length())
    p7 = 1
    while p7 < best:
        p5 = p7
        while p5 < best:
            p3 = p5
            while p3 < best:
                m = p3
                while m < n:
                    m *= 2
                best = min(best, m)
                p3 *= 3
            p5 *= 5
        p7 *= 7
    return best


# ---- Triton kernels ------------------------------------------------------------------------
@triton.jit
def _pack_kernel(src_ptr, dst_ptr, n0, c0, NCH, ROWS, D, H, W, ND, NH, NW, od, oh, ow,
                 s_n, s_c, s_d, s_h, s_w, BR: tl.constexpr, BQ: tl.constexpr):
    """dst[r, q] = src[n0 + r // NCH, c0 + r % NCH, q - (od, oh, ow)] (f32), 0 outside the
    source: the zero-padded, shifted f32 transform input. dst is (ROWS, ND*NH*NW) contiguous;
    src is a logical (N, C, D, H, W) tensor with any strides (int64 offsets)."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rq = tl.program_id(1) * BQ + tl.arange(0, BQ)
    NQ = ND * NH * NW
    mr = rr < ROWS
    mq = rq < NQ
    qw = rq % NW
    t = rq // NW
    qh = t % NH
    qd = t // NH
    iw = qw - ow
    ih = qh - oh
    id_ = qd - od
    inside = mq & (iw >= 0) & (iw < W) & (ih >= 0) & (ih < H) & (id_ >= 0) & (id_ < D)
    n = (n0 + rr // NCH).to(tl.int64)
    c = (c0 + rr % NCH).to(tl.int64)
    pos = id_.to(tl.int64) * s_d + ih.to(tl.int64) * s_h + iw.to(tl.int64) * s_w
    v = tl.load(src_ptr + (n * s_n + c * s_c)[:, None] + pos[None, :],
                mask=mr[:, None] & inside[None, :], other=0.0)
    tl.store(dst_ptr + rr[:, None] * NQ + rq[None, :], v.to(tl.float32), mask=mr[:, None] & mq[None, :])


@triton.jit
def _mix_kernel(a_ptr, w_ptr, o_ptr, NF, GB, g0, I, J, s_wg, s_wi, s_wj,
                CONJ: tl.constexpr, BI: tl.constexpr, BF: tl.constexpr):
    """o[p*I + i, f] = sum_{j<J} a[p*J + j, f] * w'[g*s_wg + i*s_wi + j*s_wj, f],
    g = g0 + p % GB, w' = conj(w) when CONJ: the per-group channel contraction of the
    spectra at every frequency f (complex64 rows of NF values, seen as interleaved f32
    re/im). In place (o = a) is safe when I == J == 1: a program reads its row block
    before writing it."""
    p = tl.program_id(0)
    rf = tl.program_id(1) * BF + tl.arange(0, BF)
    ri = tl.program_id(2) * BI + tl.arange(0, BI)
    mf = rf < NF
    mi = ri < I
    m2 = mi[:, None] & mf[None, :]
    g = g0 + p % GB
    w_rows = g * s_wg + ri * s_wi
    acc_r = tl.zeros((BI, BF), dtype=tl.float32)
    acc_i = tl.zeros((BI, BF), dtype=tl.float32)
    for j in range(0, J):
        a_off = (p * J + j) * (2 * NF) + 2 * rf
        ar = tl.load(a_ptr + a_off, mask=mf, other=0.0)[None, :]
        ai = tl.load(a_ptr + a_off + 1, mask=mf, other=0.0)[None, :]
        w_off = ((w_rows + j * s_wj) * (2 * NF))[:, None] + 2 * rf[None, :]
        wr = tl.load(w_ptr + w_off, mask=m2, other=0.0)
        wi = tl.load(w_ptr + w_off + 1, mask=m2, other=0.0)
        if CONJ:
            wi = -wi
        acc_r += ar * wr - ai * wi
        acc_i += ar * wi + ai * wr
    o_off = ((p * I + ri) * (2 * NF))[:, None] + 2 * rf[None, :]
    tl.store(o_ptr + o_off, acc_r, mask=m2)
    tl.store(o_ptr + o_off + 1, acc_i, mask=m2)


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, acc_ptr, NF, NB, GB, g0, Kg, Cg,
                  ACCUM: tl.constexpr, BC: tl.constexpr, BF: tl.constexpr):
    """acc[k*Cg + c, f] (+)= sum_{n<NB} x[(n*GB + g-g0)*Cg + c, f] * conj(dy[(n*GB + g-g0)*Kg + kk, f])
    for k = g0*Kg + program_id(0) = g*Kg + kk: a chunk's share of the weight-gradient
    spectrum (stored when ACCUM is false: the group's first chunk)."""
    k = g0 * Kg + tl.program_id(0)
    g = k // Kg
    kk = k - g * Kg
    rf = tl.program_id(1) * BF + tl.arange(0, BF)
    rc = tl.program_id(2) * BC + tl.arange(0, BC)
    mf = rf < NF
    mc = rc < Cg
    m2 = mc[:, None] & mf[None, :]
    acc_r = tl.zeros((BC, BF), dtype=tl.float32)
    acc_i = tl.zeros((BC, BF), dtype=tl.float32)
    for n in range(0, NB):
        lp = n * GB + g - g0
        d_off = (lp * Kg + kk) * (2 * NF) + 2 * rf
        dr = tl.load(dy_ptr + d_off, mask=mf, other=0.0)[None, :]
        di = -tl.load(dy_ptr + d_off + 1, mask=mf, other=0.0)[None, :]
        x_off = ((lp * Cg + rc) * (2 * NF))[:, None] + 2 * rf[None, :]
        xr = tl.load(x_ptr + x_off, mask=m2, other=0.0)
        xi = tl.load(x_ptr + x_off + 1, mask=m2, other=0.0)
        acc_r += xr * dr - xi * di
        acc_i += xr * di + xi * dr
    o_off = ((k * Cg + rc) * (2 * NF))[:, None] + 2 * rf[None, :]
    if ACCUM:
        acc_r += tl.load(acc_ptr + o_off, mask=m2, other=0.0)
        acc_i += tl.load(acc_ptr + o_off + 1, mask=m2, other=0.0)
    tl.store(acc_ptr + o_off, acc_r, mask=m2)
    tl.store(acc_ptr + o_off + 1, acc_i, mask=m2)


@triton.jit
def _unpack_kernel(src_ptr, dst_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr,
                   n0, c0, NCH, NPB, OD, OH, OW, SH, SW, SQ, od, oh, ow,
                   s_n, s_c, s_d, s_h, s_w,
                   p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                   HAS_BIAS: tl.constexpr,
                   P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
                   P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
                   P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
                   P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
                   BP: tl.constexpr, BC: tl.constexpr):
    """dst[n0 + nl, c0 + c, o] = epilogue(src[nl*NCH + c, o + (od, oh, ow)]): the window of
    the inverse transform (rows of SQ = SD*SH*SW f32), bias and post-op chain, cast, any
    output layout (strides s_*, int64 offsets). Tile [BP output positions, BC channels];
    program_id(0) = nl * NPB + position block."""
    pid = tl.program_id(0)
    nl = pid // NPB
    ro = (pid - nl * NPB) * BP + tl.arange(0, BP)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mo = ro < OD * OH * OW
    mc = rc < NCH
    mask = mo[:, None] & mc[None, :]
    qw = ro % OW
    t = ro // OW
    qh = t % OH
    qd = t // OH
    spos = ((qd + od) * SH + (qh + oh)) * SW + (qw + ow)
    acc = tl.load(src_ptr + ((nl * NCH + rc) * SQ)[None, :] + spos[:, None], mask=mask, other=0.0)
    n = (n0 + nl).to(tl.int64)
    ch = c0 + rc
    y_off = (n * s_n + qd.to(tl.int64) * s_d + qh.to(tl.int64) * s_h + qw.to(tl.int64) * s_w)[:, None] \
        + (ch.to(tl.int64) * s_c)[None, :]
    acc = epilogue(acc, y_off, ch, mc, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(dst_ptr + y_off, acc.to(dst_ptr.dtype.element_ty), mask=mask)


# ---- geometry and memory plan ---------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """Images n0:n1 of groups g0:g1 (whole groups over all images, or one group's slice)."""
    n0: int
    n1: int
    g0: int
    g1: int

    @property
    def nb(self) -> int:
        return self.n1 - self.n0

    @property
    def gb(self) -> int:
        return self.g1 - self.g0

    @property
    def pairs(self) -> int:
        return self.nb * self.gb


def _pad3(t: tuple[int, ...], fill: int) -> tuple[int, int, int]:
    return (fill,) * (3 - len(t)) + tuple(t)


@dataclass(frozen=True)
class FftGeom:
    """Transform sizes of a problem: nf per spatial dim (padded to 3 with 1s), the real
    (Q) and spectral (S) elements per row, and the rows of each operand per (n, g) pair."""
    nd: int
    nf: tuple[int, int, int]
    Q: int
    S: int
    Cg: int
    Kg: int

    @property
    def fft_sizes(self) -> tuple[int, ...]:
        return self.nf[3 - self.nd:]

    @property
    def fft_dims(self) -> tuple[int, ...]:
        return tuple(range(1, self.nd + 1))


def fft_geom(p: ConvProblem) -> FftGeom:
    nf = tuple(fast_len(max(L + b, L + a, F, Lo))
               for L, F, b, a, Lo in zip(p.in_size, p.filter, p.pad_before, p.pad_after, p.out_size))
    nf3 = _pad3(nf, 1)
    S = math.prod(nf[:-1]) * (nf[-1] // 2 + 1)
    return FftGeom(p.ndim, nf3, math.prod(nf), S, p.C // p.groups, p.K // p.groups)


@dataclass(frozen=True)
class MemPlan:
    """The invoker's buffers as (fixed bytes, bytes per (n, g) pair) at each step; the peak
    over steps is the workspace. `c2r_copy`: count torch's copy of a C2R input (CUDA)."""
    fixed_steps: tuple[int, ...]                  # steps before any chunk (weight transform)
    chunk_steps: tuple[tuple[int, int], ...]      # (fixed, per pair) live during a chunk
    final_steps: tuple[int, ...]                  # after the chunks (bwd_weights' inverse)

    def peak(self, pairs: int) -> int:
        return max((*self.fixed_steps, *self.final_steps,
                    *(f + pairs * b for f, b in self.chunk_steps)), default=0)


def mem_plan(p: ConvProblem, g: FftGeom) -> MemPlan:
    """What `FftPlan.__call__` allocates, step by step (keep the two in step: the tests
    compare this with the buffers an invocation really holds)."""
    copy = p.device == "cuda"                    # torch clones a C2R input on CUDA
    rq, rs = 4 * g.Q, 8 * g.S                    # one real row, one spectral row
    K, Cg, Kg = p.K, g.Cg, g.Kg
    ws = K * Cg * rs                             # weight (gradient) spectrum
    if p.direction == "bwd_weights":
        chunk = ((ws, Cg * rq), (ws, Cg * (rq + rs)), (ws, Cg * rs + Kg * (rq + rs)))
        final = (ws + K * Cg * (rq + (rs if copy else 0)),)
        return MemPlan((), chunk, final)
    J, I = (Cg, Kg) if p.direction == "fwd" else (Kg, Cg)
    fixed = (K * Cg * rq, K * Cg * rq + ws)
    in_place = I == 1 and J == 1
    chunk = [(ws, J * rq), (ws, J * (rq + rs))]
    if not in_place:
        chunk.append((ws, (J + I) * rs))
    chunk.append((ws, I * (rs * (2 if copy else 1) + rq)))
    chunk.append((ws, I * rq))
    return MemPlan(fixed, tuple(chunk), ())


def _plan_chunks(p: ConvProblem, pairs: int) -> list[Chunk]:
    """Chunks of at most `pairs` (n, g) pairs, balanced (equal sizes but the last)."""
    N, G = p.N, p.groups
    if pairs >= N:
        gb = min(G, pairs // N)
        gb = -(-G // -(-G // gb))
        return [Chunk(0, N, g0, min(G, g0 + gb)) for g0 in range(0, G, gb)]
    nb = -(-N // -(-N // pairs))
    return [Chunk(n0, min(N, n0 + nb), g, g + 1) for g in range(G) for n0 in range(0, N, nb)]


def plan_chunks(p: ConvProblem, cap: int | None = None) -> list[Chunk]:
    """The chunks the plan runs (as large as the cap allows)."""
    return _plan_chunks(p, max(1, chunk_pairs(p, cap)))


def workspace_bytes(p: ConvProblem, cap: int | None = None) -> int:
    """Peak bytes of the invoker's buffers (see mem_plan)."""
    mp = mem_plan(p, fft_geom(p))
    return max(mp.peak(c.pairs) for c in plan_chunks(p, cap))


def chunk_pairs(p: ConvProblem, cap: int | None = None) -> int:
    """The most (n, g) pairs a chunk may hold under the cap (0: not even one fits)."""
    g = fft_geom(p)
    mp = mem_plan(p, g)
    cap = WORKSPACE_CAP.get(p.device, WORKSPACE_CAP["cpu"]) if cap is None else cap
    if max((*mp.fixed_steps, *mp.final_steps, *(f for f, _ in mp.chunk_steps)), default=0) > cap:
        return 0
    per = max(b for _, b in mp.chunk_steps)
    room = min((cap - f) // b for f, b in mp.chunk_steps if b)
    return int(min(room, p.N * p.groups)) if per else p.N * p.groups


def fft_reasons(p: ConvProblem, cap: int | None = None) -> list[str]:
    """Why the FFT plan cannot serve p (shared by the GPU and CPU solvers)."""
    reasons = []
    if any(s != 1 for s in p.stride):
        reasons.append(f"FFT serves stride 1 only, got stride {p.stride}")
    if any(d != 1 for d in p.dilation):
        reasons.append(f"FFT serves dilation 1 only, got dilation {p.dilation}")
    taps = math.prod(p.filter)
    if taps < MIN_TAPS[p.ndim]:
        reasons.append(f"filter {p.filter} has {taps} taps; FFT pays from {MIN_TAPS[p.ndim]} "
                       f"(small filters: winograd, direct, implicit_gemm, gemm)")
    if reasons:
        return reasons
    cap = WORKSPACE_CAP.get(p.device, WORKSPACE_CAP["cpu"]) if cap is None else cap
    g = fft_geom(p)
    ws = p.K * g.Cg * 8 * g.S
    if g.Q > MAX_POINTS:
        reasons.append(f"transform of {g.nf[3 - g.nd:]} = {g.Q} points per row exceeds {MAX_POINTS}")
    elif ws > cap // 2:
        reasons.append(f"weight spectrum K*C/groups*{g.S} complex = {ws} B exceeds half the FFT "
                       f"workspace cap ({cap} B): too many channels per group for FFT")
    elif chunk_pairs(p, cap) < 1:
        reasons.append(f"one (image, group) pair's spectra exceed the FFT workspace cap ({cap} B)")
    return reasons


# ---- the invoker -----------------------------------------------------------------------------
class Ledger:
    """Bytes the invoker holds in its buffers, and the peak (the tests read it)."""

    __slots__ = ("live", "peak")

    def __init__(self) -> None:
        self.live = self.peak = 0

    def take(self, t: torch.Tensor, extra: int = 0) -> torch.Tensor:
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live + extra)
        return t

    def drop(self, *ts: torch.Tensor) -> None:
        for t in ts:
            self.live -= t.numel() * t.element_size()


def new_ledger() -> Ledger:
    """Each invocation's ledger (tests replace this to collect them)."""
    return Ledger()


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A work buffer (tests replace this to hand out NaN-poisoned ones)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _same_strides(t: torch.Tensor, layout: str) -> bool:
    """t has the standard strides of `layout` (those of size-1 dims never matter)."""
    want = layout_strides(tuple(t.shape), layout)
    return all(a == b or n == 1 for a, b, n in zip(t.stride(), want, t.shape))


def _standard(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t with the standard strides of its layout (a copy only when they differ): the
    kernels' strides are planned for those."""
    if _same_strides(t, layout):
        return t
    if layout == "nchw":
        return t.contiguous()
    perm = (0, *range(2, t.dim()), 1)
    inv = (0, t.dim() - 1, *range(1, t.dim() - 1))
    return t.permute(*perm).contiguous().permute(*inv)


_BR, _BQ = 16, 256          # pack tile: rows x positions
_BI, _BF = 4, 256           # product tile: output channels x frequencies
_BP, _BC = 64, 16           # unpack tile: positions x channels


class FftPlan:
    """Everything but the tensors, fixed in prepare: transform sizes, chunks, the
    memory plan, and (GPU engine) every kernel launch. `engine`: "triton" or "torch"."""

    def __init__(self, p: ConvProblem, engine: str = "triton", cap: int | None = None):
        self.p, self.engine = p, engine
        self.g = g = fft_geom(p)
        self.mem = mem_plan(p, g)
        self.chunks = plan_chunks(p, cap)
        self.workspace_bytes = max(self.mem.peak(c.pairs) for c in self.chunks)
        d = p.direction
        self.out_shape = {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weights": p.w_shape}[d]
        self.out_dtype = p.out_dtype
        self.epi = plan_epilogue(p) if d == "fwd" else NO_EPILOGUE
        pb = _pad3(p.pad_before, 0)
        # (J rows per pair of the chunked operand, its pack offset, I rows per pair of the result)
        if d == "fwd":
            self.J, self.a_off, self.I, self.out_off = g.Cg, pb, g.Kg, (0, 0, 0)
        elif d == "bwd_data":
            self.J, self.a_off, self.I, self.out_off = g.Kg, (0, 0, 0), g.Cg, pb
        else:
            self.J, self.a_off, self.I, self.out_off = g.Cg, pb, g.Kg, (0, 0, 0)
        if engine == "triton":
            self._plan_launches()

    # -- GPU launches ----------------------------------------------------------------------
    def _pack_launch(self, shape: tuple[int, ...], n0: int, c0: int, nch: int, rows: int,
                     off: tuple[int, int, int]) -> Launch:
        p, g = self.p, self.g
        st = strides5_of(layout_strides(shape, p.layout))
        sp = _pad3(tuple(shape[2:]), 1)
        return Launch(_pack_kernel, (triton.cdiv(rows, _BR), triton.cdiv(g.Q, _BQ)),
                      (n0, c0, nch, rows, *sp, *g.nf, *off, *st, _BR, _BQ))

    def _unpack_launch(self, n0: int, nb: int, c0: int, nch: int) -> Launch:
        p, g = self.p, self.g
        out_sp = _pad3(tuple(self.out_shape[2:]), 1)
        st = strides5_of(layout_strides(self.out_shape, p.layout))
        npb = triton.cdiv(math.prod(out_sp), _BP)
        bc = max(2, min(_BC, triton.next_power_of_2(nch)))
        return Launch(_unpack_kernel, (nb * npb, triton.cdiv(nch, bc)),
                      (n0, c0, nch, npb, *out_sp, g.nf[1], g.nf[2], g.Q, *self.out_off, *st,
                       *self.epi.scalars(), *self.epi.constexprs(), _BP, bc))

    def _plan_launches(self) -> None:
        p, g, d = self.p, self.g, self.p.direction
        self.launches = []
        if d != "bwd_weights":
            self.w_pack = self._pack_launch(p.w_shape, 0, 0, g.Cg, p.K * g.Cg, (0, 0, 0))
        a_shape = p.x_shape if d in ("fwd", "bwd_weights") else p.y_shape
        bi = max(1, min(_BI, triton.next_power_of_2(self.I)))
        for c in self.chunks:
            L = {"a": self._pack_launch(a_shape, c.n0, c.g0 * self.J, c.gb * self.J, c.pairs * self.J, self.a_off)}
            if d == "bwd_weights":
                L["dy"] = self._pack_launch(p.y_shape, c.n0, c.g0 * g.Kg, c.gb * g.Kg, c.pairs * g.Kg, (0, 0, 0))
                bc = max(1, min(_BI, triton.next_power_of_2(g.Cg)))
                L["mix"] = Launch(_wgrad_kernel, (c.gb * g.Kg, triton.cdiv(g.S, _BF), triton.cdiv(g.Cg, bc)),
                                  (g.S, c.nb, c.gb, c.g0, g.Kg, g.Cg, c.n0 > 0, bc, _BF))
            else:
                s_w = (g.Kg * g.Cg, g.Cg, 1) if d == "fwd" else (g.Kg * g.Cg, 1, g.Cg)
                L["mix"] = Launch(_mix_kernel, (c.pairs, triton.cdiv(g.S, _BF), triton.cdiv(self.I, bi)),
                                  (g.S, c.gb, c.g0, self.I, self.J, *s_w, d == "fwd", bi, _BF))
                L["unpack"] = self._unpack_launch(c.n0, c.nb, c.g0 * self.I, c.gb * self.I)
            self.launches.append(L)
        if d == "bwd_weights":
            self.w_unpack = self._unpack_launch(0, p.K, 0, g.Cg)

    # -- steps shared by both engines ------------------------------------------------------
    def _rfft(self, led: Ledger, buf: torch.Tensor) -> torch.Tensor:
        return led.take(torch.fft.rfftn(buf, dim=self.g.fft_dims))

    def _irfft(self, led: Ledger, spec: torch.Tensor) -> torch.Tensor:
        copy = spec.numel() * 8 if spec.is_cuda else 0          # torch's C2R input copy (CUDA)
        rows = spec.shape[0]
        led.peak = max(led.peak, led.live + copy + rows * self.g.Q * 4)
        return led.take(torch.fft.irfftn(spec, s=self.g.fft_sizes, dim=self.g.fft_dims))

    def _pack(self, led: Ledger, src: torch.Tensor, launch: Launch | None, n0: int, nb: int,
              c0: int, nch: int, off: tuple[int, int, int]) -> torch.Tensor:
        """Zero-padded f32 rows (n0:n0+nb) x (c0:c0+nch) of src, shifted by off."""
        g = self.g
        buf = led.take(new_buffer((nb * nch, *g.fft_sizes), F32, src.device))
        if launch is not None:
            launch(src, buf)
            return buf
        buf.zero_()
        view = buf.view(nb, nch, *g.fft_sizes)
        o = off[3 - g.nd:]
        sl = (slice(None), slice(None), *(slice(a, a + s) for a, s in zip(o, src.shape[2:])))
        view[sl].copy_(src[n0:n0 + nb, c0:c0 + nch])
        return buf

    def _weights_spectrum(self, led: Ledger, w: torch.Tensor) -> torch.Tensor:
        """W[k*Cg + c] (fwd: conjugated by the kernel, or here for the torch engine)."""
        wr = self._pack(led, w, getattr(self, "w_pack", None), 0, self.p.K, 0, self.g.Cg, (0, 0, 0))
        ws = self._rfft(led, wr)
        led.drop(wr)
        del wr
        if self.engine == "torch" and self.p.direction == "fwd":
            ws.conj_physical_()
        return ws

    def _unpack(self, src: torch.Tensor, dst: torch.Tensor, launch: Launch | None, n0: int, nb: int,
                c0: int, nch: int, args: ConvArgs | None, ptrs: tuple) -> None:
        if launch is not None:
            launch(src, dst, *ptrs)
            return
        g = self.g
        o = self.out_off[3 - g.nd:]
        sp = dst.shape[2:]
        v = src.view(nb, nch, *g.fft_sizes)[(slice(None), slice(None), *(slice(a, a + s) for a, s in zip(o, sp)))]
        if args is not None and (args.bias is not None or args.post_ops):
            v = v.clone()
            if args.bias is not None:
                v += args.bias[c0:c0 + nch].to(F32).view(1, -1, *([1] * len(sp)))
            ops = tuple(_op_block(op, n0, nb, c0, nch) for op in args.post_ops)
            v = apply_post_ops(v, ops)
        dst[n0:n0 + nb, c0:c0 + nch].copy_(v)

    # -- the call --------------------------------------------------------------------------
    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        dev = (args.x if args.x is not None else args.dy).device
        dst = out if out is not None else empty_in_layout(self.out_shape, p.layout, dtype=self.out_dtype, device=dev)
        if self.engine == "triton" and not _same_strides(dst, p.layout):
            return dst.copy_(self(args))
        led = new_ledger()
        if p.direction == "bwd_weights":
            self._bwd_weights(led, args, dst)
        else:
            self._fwd_or_bwd_data(led, args, dst)
        return dst

    def _fwd_or_bwd_data(self, led: Ledger, args: ConvArgs, dst: torch.Tensor) -> None:
        p, fwd = self.p, self.p.direction == "fwd"
        a_src = _standard(args.x if fwd else args.dy, p.layout)
        w = _standard(args.w, p.layout)
        ws = self._weights_spectrum(led, w)
        ptrs = self.epi.pointers(args.bias, args.post_ops, dst) if self.engine == "triton" else ()
        in_place = self.I == 1 and self.J == 1
        for i, c in enumerate(self.chunks):
            L = self.launches[i] if self.engine == "triton" else {}
            a = self._pack(led, a_src, L.get("a"), c.n0, c.nb, c.g0 * self.J, c.gb * self.J, self.a_off)
            spec = self._rfft(led, a)
            led.drop(a)
            del a
            if in_place:
                res = spec
            else:
                res = led.take(new_buffer((c.pairs * self.I, *spec.shape[1:]), C64, spec.device))
            self._mix(spec, ws, res, c, L.get("mix"))
            if not in_place:
                led.drop(spec)
                del spec
            real = self._irfft(led, res)
            led.drop(res)
            del res
            self._unpack(real, dst, L.get("unpack"), c.n0, c.nb, c.g0 * self.I, c.gb * self.I,
                         args if fwd else None, ptrs)
            led.drop(real)
            del real
        led.drop(ws)

    def _mix(self, a: torch.Tensor, ws: torch.Tensor, out: torch.Tensor, c: Chunk, launch: Launch | None) -> None:
        if launch is not None:
            launch(torch.view_as_real(a), torch.view_as_real(ws), torch.view_as_real(out))
            return
        g, I, J = self.g, self.I, self.J
        av = a.view(c.nb, c.gb, J, -1)
        wv = ws.view(self.p.groups, g.Kg, g.Cg, -1)[c.g0:c.g1]          # (gb, Kg, Cg, S)
        ov = out.view(c.nb, c.gb, I, -1)
        if self.p.direction == "fwd":
            if J == 1:
                torch.mul(av, wv[:, :, 0], out=ov)
            else:
                ov.copy_(torch.einsum("ngjs,gijs->ngis", av, wv))
        elif I == 1 and J == 1:
            torch.mul(av, wv[:, :, 0], out=ov)
        else:
            ov.copy_(torch.einsum("ngjs,gjis->ngis", av, wv))

    def _bwd_weights(self, led: Ledger, args: ConvArgs, dst: torch.Tensor) -> None:
        p, g = self.p, self.g
        x, dy = _standard(args.x, p.layout), _standard(args.dy, p.layout)
        acc = led.take(new_buffer((p.K * g.Cg, *g.fft_sizes[:-1], g.fft_sizes[-1] // 2 + 1), C64, x.device))
        for i, c in enumerate(self.chunks):
            L = self.launches[i] if self.engine == "triton" else {}
            xr = self._pack(led, x, L.get("a"), c.n0, c.nb, c.g0 * g.Cg, c.gb * g.Cg, self.a_off)
            xs = self._rfft(led, xr)
            led.drop(xr)
            del xr
            dr = self._pack(led, dy, L.get("dy"), c.n0, c.nb, c.g0 * g.Kg, c.gb * g.Kg, (0, 0, 0))
            ds = self._rfft(led, dr)
            led.drop(dr)
            del dr
            if "mix" in L:
                L["mix"](torch.view_as_real(xs), torch.view_as_real(ds), torch.view_as_real(acc))
            else:
                xv = xs.view(c.nb, c.gb, g.Cg, -1)
                dv = ds.view(c.nb, c.gb, g.Kg, -1).conj_physical_()
                part = torch.einsum("ngcs,ngks->gkcs", xv, dv).reshape(c.gb * g.Kg * g.Cg, -1)
                av = acc.view(p.groups * g.Kg * g.Cg, -1)[c.g0 * g.Kg * g.Cg:c.g1 * g.Kg * g.Cg]
                if c.n0 > 0:
                    av += part
                else:
                    av.copy_(part)
                del part
            led.drop(xs, ds)
            del xs, ds
        real = self._irfft(led, acc)
        led.drop(acc)
        del acc
        ptrs = NO_EPILOGUE.pointers(None, (), dst) if self.engine == "triton" else ()
        self._unpack(real, dst, getattr(self, "w_unpack", None), 0, p.K, 0, g.Cg, None, ptrs)
        led.drop(real)


def _op_block(op, n0: int, nb: int, c0: int, nch: int):
    """A post-op restricted to output block [n0:n0+nb, c0:c0+nch] (broadcast dims kept)."""
    t = getattr(op, "tensor", None)
    if t is None:
        return op
    sl = (slice(n0, n0 + nb) if t.shape[0] > 1 else slice(None),
          slice(c0, c0 + nch) if t.dim() > 1 and t.shape[1] > 1 else slice(None))
    blk = t[sl[: min(2, t.dim())]]
    return type(op)(**{**op.__dict__, "tensor": blk})


# ---- estimates -------------------------------------------------------------------------------
def _fft_passes(q: int) -> int:
    """Rough number of passes over memory a batched transform of q points makes on the GPU."""
    return 1 if q <= 8192 else (2 if q <= 1 << 22 else 3)


def traffic(p: ConvProblem) -> tuple[float, float]:
    """(bytes moved, f32 flops of the spectral product) for one invocation of the plan."""
    g = fft_geom(p)
    e = p.dtype.itemsize
    rq, rs = 4 * g.Q, 8 * g.S
    fft = lambda rows: rows * (rq + rs) * _fft_passes(g.Q)                       # noqa: E731
    ifft = lambda rows: rows * ((2 * rs if p.device == "cuda" else 0) + (rs + rq) * _fft_passes(g.Q))  # noqa: E731
    pairs = p.N * p.groups
    Cg, Kg = g.Cg, g.Kg
    if p.direction == "bwd_weights":
        rows_x, rows_dy = pairs * Cg, pairs * Kg
        b = (math.prod(p.x_shape) + math.prod(p.y_shape)) * e + (rows_x + rows_dy) * rq
        b += fft(rows_x) + fft(rows_dy)
        b += (rows_x + rows_dy) * rs + 2 * p.K * Cg * rs
        b += ifft(p.K * Cg) + p.K * Cg * rq + math.prod(p.w_shape) * p.out_dtype.itemsize
        return b, 8.0 * pairs * Cg * Kg * g.S
    J, I = (Cg, Kg) if p.direction == "fwd" else (Kg, Cg)
    a_el = math.prod(p.x_shape if p.direction == "fwd" else p.y_shape)
    o_el = math.prod(p.y_shape if p.direction == "fwd" else p.x_shape)
    b = math.prod(p.w_shape) * e + p.K * Cg * rq + fft(p.K * Cg)
    b += a_el * e + pairs * J * rq + fft(pairs * J)
    b += pairs * (J + I) * rs + p.K * Cg * rs
    b += ifft(pairs * I) + o_el * (4 + p.out_dtype.itemsize) + post_op_bytes(p)
    return b, 8.0 * pairs * J * I * g.S


# ---- solvers ---------------------------------------------------------------------------------
class _FftBase(Solver):
    family = "fft"
    primitive = "conv"
    engine = "triton"

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        reasons += fft_reasons(problem)
        if self.engine == "triton":
            reasons += post_op_reasons(problem)
        return reasons

    def workspace_size(self, problem) -> int:
        return workspace_bytes(problem)

    def prepare(self, problem):
        return FftPlan(problem, self.engine)


class _FftGpu(_FftBase):
    uses_triton = True

    def estimate(self, problem) -> float | None:
        nbytes, flops = traffic(problem)
        chunks = len(plan_chunks(problem))
        return max(nbytes / 4.2e12, flops / 40e12) / 0.6 * 1e3 + 0.03 * chunks + 0.02


class _FftCpu(_FftBase):
    devices = frozenset({"cpu"})
    engine = "torch"
    _GBS_PER_CORE = 4.0        # FFT passes and elementwise steps, per core (measured ~3-6)

    def estimate(self, problem) -> float | None:
        nbytes, flops = traffic(problem)
        cores = max(1, torch.get_num_threads())
        return (nbytes / (self._GBS_PER_CORE * 1e9 * cores) + flops / (20e9 * cores)) * 1e3


@register
class FftFwd(_FftGpu):
    id = 60
    name = "fft_fwd"
    directions = frozenset({"fwd"})


@register
class FftBwdData(_FftGpu):
    id = 61
    name = "fft_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class FftBwdWeights(_FftGpu):
    id = 62
    name = "fft_bwd_weights"
    directions = frozenset({"bwd_weights"})


@register
class FftCpuFwd(_FftCpu):
    id = 63
    name = "fft_cpu_fwd"
    directions = frozenset({"fwd"})


@register
class FftCpuBwdData(_FftCpu):
    id = 64
    name = "fft_cpu_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class FftCpuBwdWeights(_FftCpu):
    id = 65
    name = "fft_cpu_bwd_weights"
    directions = frozenset({"bwd_weights"})


def conv(p: ConvProblem, args: ConvArgs, out: torch.Tensor | None = None, engine: str = "triton",
         cap: int | None = None) -> torch.Tensor:
    """One-shot run of any direction (plans, then runs); tests and benchmarks."""
    return FftPlan(p, engine, cap)(args, out)
