"""CPU Winograd convolution (family `winograd`): forward (solver 14 `cpu_winograd_fwd`),
backward data (15 `cpu_winograd_bwd_data`) and backward weights (16
`cpu_winograd_bwd_weights`). F(4x4,3x3) or F(2x2,3x3): the GEMMs in torch ops, the input and
output transforms native (cpu_wino_native.py: both passes per tile in registers, 4x the torch
ops' speed) where a C++ compiler built them, else in torch ops; for 3x3 (3x3x3)
stride-1 undilated ungrouped problems with padding <= 2 a side (asymmetric too), nchw and
nhwc, f32 (bf16/f16 inputs computed in f32).

Backward data = the forward of dy with the transposed filter rotated by 180 degrees
(cpu_gemm.transposed_fwd; the rotation is folded into the filter matrix's columns).
Backward weights = the transposed algorithm F(3x3, m x m): dw = G^T [sum over tiles of
(A dy A^T) (.) (B^T x B)] G, i.e. the forward's input transform, a dy transform (one mm by
kron(A, A)), ONE batched GEMM per block M[e] (K, C) += DY[e]^T V[e] accumulating in f32,
and one mm by G^T at the end. 3-D problems run 2-D Winograd over (H, W) per depth slice
and sum the three depth taps as f32 GEMMs accumulating in place (Wino3Plan); the post-op
chain runs on each output block as in 2-D, its operands viewed as (D, K, H, W) pseudo-images
(c3d_small fused f32: 0.37x torch on the im2col solver, 0.78x here, AMX Xeon, 2026-12-01).

Math (winograd_math.py, Lavin & Gray): per tile of m x m outputs (alpha = m + 2),
    U[e] = G w G^T (per call: weights change in training), V[e] = B^T d B,
    M[e] = U[e] . V[e] over the channels (alpha^2 GEMMs), y = A^T M A.
F(4x4) does 4x fewer GEMM multiplies than the direct convolution, F(2x2) 2.25x.

Structure, per block of images (or of tile rows of one image) so that the transforms'
operands stay in cache: the block's images are staged zero-padded in f32 (the halo and the
zero rows/columns completing the last tile are zeroed once per call); the input transform
runs as two separable passes of explicit add/sub/scale ops (`_bt_*`: B^T's zeros and
common subexpressions, 12 ops per pass for F(4)) over strided views of the whole block
-- rows first, then columns (stride-m views) -- writing V as alpha^2 contiguous GEMM
operands (alpha^2, tiles, C); ONE torch.bmm computes every M[e] (alpha^2, tiles, K) against
U (one mm: (alpha^2 x 9) . w read as (9, K*C)); the bias is added to the M[1, 1] plane
(A^T's column 1 is all ones: it reaches every output once); the output transform's two
passes (`_at_*`, 10 ops each for F(4)) write y's strided m x m tile views directly (tails:
the partial last tile row / column as separate regions, outputs past the edge skipped);
then the post-op chain runs in place on the block of y while it is in cache.
Every transform operand is channels-innermost (C or K contiguous: long vectorised inner
loops). nhwc problems read x and write y in place. nchw problems convert on the way, with
the native transforms as 16 x 16 blocks transposed in registers (issue 16: as strided
torch copies they cost rn50_r2_3x3 nchw +3 ms over nhwc): the staging transposes the block
to channels-last (wino_stage), and the output transform writes y's nchw rows in place
(through a per-tile-row scratch). On the torch-op path the staging is a strided copy and the
output an f32 channels-last block that one copy (fused with a leading residual add) puts
into y (the nchw-native order has the tile column innermost, 4-14 long: 1.3-2x slower);
the plan (WinoPlan.native) says which of the two it sized the workspace for.
bf16/f16 outputs (and any out_dtype != f32) also go through the f32 block (in y's order on
the native path), then one cast.
Fused pass (`fuses`: K % 16 == 0 and U within FUSED_U_BYTES, the native library built): per
block, one native call runs the input transform, the alpha^2 GEMMs (an f32 register tile, V's
values broadcast against U's rows) and the output transform (+ bias) for each group of tile rows
on one core, V and M in that core's cache; the post-op chain then runs on the block as above.
3-D: the three depth taps' transforms and GEMMs accumulate into M in the same pass.
Threads: one worker on torch's threads (each op and the bmm are parallel). `workers=2`
(prepare_with) runs the blocks on two Python workers of one thread each: measured 1.5-2x
slower on this 2-core machine, kept for experiments. Many small ops are this solver's
weak point on a loaded machine: every op is an OpenMP region (CPU_SPEED.md).

Numerics: transforms and GEMM in f32 for every input dtype (bf16/f16 inputs are
converted in the staging copy). Relative norm error vs float64 measured 1.7-2.2e-6 for
F(4x4) on the suite (C = 64..256; f32 contract 1e-5), ~1e-7 for F(2x2).
bf16: the error is the output rounding's (1.7e-3), but the f32 GEMM loses to the im2col
solver's native bf16 GEMM (avx512_bf16), so the estimate ranks it behind there.
Choice of m: the smaller estimate (m = 4 wastes work on small images' partial tiles and
moves 2.25x the filter-transform bytes)."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..args import ConvArgs
from ..post_ops import Binary, Sum
from ..problems.conv import ConvProblem, empty_in_layout, to_layout
from ..search.solver import Solver, register
from . import cpu_wino_native as native
from .cpu_gemm import _block_index as block_index
from .cpu_gemm import apply_post_ops_block, cpu_has_native_bf16, transposed_fwd, workspace
from .cpu_im2col import F32, Block, balance211
from .winograd_math import VARIANTS, Transform

BLOCK_BYTES = 8 << 20          # f32 transform buffers (T, V, M, Z) per block on 1 thread (20 % faster
                               # than whole batches); 2x this per thread on more (2 threads: 16 and 32
                               # MiB equally fast, 4 MiB 1.7x slower: fewer, larger OpenMP regions)
# The fused pass (native wino_fused): each core runs input transform, GEMMs and output transform
# for a group of tile rows whose V and M (alpha^2 x tiles x (C + K) f32) fit this budget, reading
# all of U (alpha^2 x C x K f32) per group. The blocked passes move V and M through memory, which
# two cores share: rn50_r2_3x3 f32 on this 2-core EPYC (1 MiB L2 a core, 32 MiB L3) spent 2x the
# CPU time in its transforms on two threads as on one (2026-12-04, perf); fused, its forward went
# 9.0 -> 4.7 ms, a C = K = 128 28x28 layer (U 2.4 MiB) 7.7 -> 4.8-5.1. Groups of 1 MiB (was 256
# KiB: 4-8 tiles re-reading U each) serve C = K = 256 too: rn50_r4 F(2x2) (U 4 MiB) fused 5.5 ms
# against 6.5 blocked (F(4x4) blocked 6.0-6.4), 2 threads, 2026-12-04; larger U stays blocked
FUSED_GROUP_BYTES = 1 << 20
FUSED_U_BYTES = 4 << 20
USE_FUSED = True                 # tests and A/B runs turn it off
MIN_TILES = 128                # per block where 4x BLOCK_BYTES allow: (64 x C) . (C x K) GEMMs run
                               # ~15 % slower than (128 x C) ones (rn50_r4: 8 images of 16 tiles)
MAX_PAD = 2
MAX_U_BYTES = 1 << 30          # U (alpha^2 K C f32) is rebuilt and read by every block: wider
                               # layers belong to the im2col solver
_GFLOPS_PER_CORE = 72.0        # f32 bmm of alpha^2 (tiles x C) . (C x K) products (measured 70-80)
_ELEMS_PER_S_PER_CORE = 2.5e9  # strided add/sub/scale ops over the transform planes
_OP_S = 6e-6                   # per torch op
_NATIVE_BF16_PENALTY = 2.8     # bf16 inputs on avx512_bf16/AMX CPUs: the im2col solvers' native bf16 GEMM
                               # runs 1.2-1.9x faster than this f32 path with native transforms (rn50 3x3,
                               # 2026-12-01; 1.2-1.3x at C = 64 where the estimates said 0.87x at 2.0)
NATIVE_SPEEDUP = 4.0           # cpu_wino_native's transforms against the torch ops' (F(4,3) input
                               # transform of rn50_r2_3x3's block: 0.99 vs 3.96 ms, 1 thread, AMX Xeon)
_U_BYTES_PER_S = 7.5e9         # U's traffic (written once, read by every block's bmm): measured
                               # 7.5-8.5 GB/s at 1 and 2 threads; dominant for small images with wide C, K


# ---- explicit transform programs (tests check them against winograd_math's matrices) -------
# Each takes the alpha (B^T) or alpha (A^T) input views `d`, writes the output views `o`
# (None: not needed, e.g. outputs past a tail) and uses temporaries `t` shaped like an output.
add, sub = torch.add, torch.sub


def _bt_f43(d: list, o: list, t: list) -> None:
    """B^T of F(4,3): o0 = 4d0 - 5d2 + d4, o1/2 = (d4 - 4d2) +- (d3 - 4d1),
    o3/4 = (d4 - d2) +- 2(d3 - d1), o5 = 4d1 - 5d3 + d5."""
    d0, d1, d2, d3, d4, d5 = d
    tmp = t[0]
    add(d4, d2, alpha=-5, out=o[0]).add_(d0, alpha=4)
    add(d4, d2, alpha=-4, out=o[1])
    add(d3, d1, alpha=-4, out=tmp)
    sub(o[1], tmp, out=o[2])
    o[1].add_(tmp)
    add(d4, d2, alpha=-1, out=o[3])
    add(d3, d1, alpha=-1, out=tmp)
    add(o[3], tmp, alpha=-2, out=o[4])
    o[3].add_(tmp, alpha=2)
    add(d5, d3, alpha=-5, out=o[5]).add_(d1, alpha=4)


def _at_f43(d: list, o: list, t: list) -> None:
    """A^T of F(4,3): s = d1 + d2, S = d3 + d4, e = d1 - d2, E = d3 - d4;
    o0 = d0 + s + S, o1 = e + 2E, o2 = s + 4S, o3 = e + 8E + d5."""
    d0, d1, d2, d3, d4, d5 = d
    t1, t2 = t
    add(d1, d2, out=t1)
    add(d3, d4, out=t2)
    if o[2] is not None:
        add(t1, t2, alpha=4, out=o[2])
    add(t1, t2, out=o[0]).add_(d0)
    if o[1] is None:
        return
    sub(d1, d2, out=t1)
    sub(d3, d4, out=t2)
    add(t1, t2, alpha=2, out=o[1])
    if o[3] is not None:
        add(t1, t2, alpha=8, out=o[3]).add_(d5)


def _bt_f23(d: list, o: list, t: list) -> None:
    """B^T of F(2,3): o0 = d0 - d2, o1 = d1 + d2, o2 = d2 - d1, o3 = d1 - d3."""
    sub(d[0], d[2], out=o[0])
    add(d[1], d[2], out=o[1])
    sub(d[2], d[1], out=o[2])
    sub(d[1], d[3], out=o[3])


def _at_f23(d: list, o: list, t: list) -> None:
    """A^T of F(2,3): o0 = d0 + d1 + d2, o1 = d1 - d2 - d3."""
    add(d[0], d[1], out=o[0]).add_(d[2])
    if o[1] is not None:
        sub(d[1], d[2], out=o[1]).sub_(d[3])


PROGRAMS = {4: (_bt_f43, _at_f43, 1, 2), 2: (_bt_f23, _at_f23, 0, 0)}   # m: (B^T, A^T, temps)
OPS = {4: (12, 10), 2: (4, 4)}                                           # torch ops per pass


@lru_cache(maxsize=8)
def filter_matrix(tr: Transform, flipped: bool = False) -> torch.Tensor:
    """Gk (alpha^2, 9): U[(xi, nu)] = sum_{r,s} G[xi][r] G[nu][s] w[r, s] (computed in float64).
    flipped: of the 180-degree rotated filter (w[2 - r, 2 - s]: the 9 columns reversed)."""
    g = torch.tensor(tr.G, dtype=torch.float64)
    gk = torch.einsum("ar,bs->abrs", g, g).reshape(tr.alpha ** 2, 9)
    return (gk.flip(1) if flipped else gk).to(F32).contiguous()


# ---- plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WinoBlock:
    n0: int
    n1: int
    th0: int        # tile rows [th0, th1) of images [n0, n1)
    th1: int

    @property
    def nb(self) -> int:
        return self.n1 - self.n0


@dataclass(frozen=True)
class WinoPlan:
    p: ConvProblem
    m: int
    TH: int         # tiles per column / row of the output
    TW: int
    blocks: tuple[WinoBlock, ...]
    nb: int         # most images / tile rows of any block (buffer sizes)
    thb: int
    workers: int    # Python workers, each on one core (1: torch's threads inside each op)
    native: bool    # native transforms expected when planned: they write nchw f32 outputs in place
    fused: bool = False   # the native fused pass per group of tile rows (`fuses`)

    def work(self, t: int) -> tuple[WinoBlock, ...]:
        """Worker t's contiguous share of the blocks (balance211)."""
        lo, hi = balance211(len(self.blocks), self.workers, t)
        return self.blocks[lo:hi]

    @property
    def alpha(self) -> int:
        return self.m + 2

    @property
    def Hp(self) -> int:
        return self.TH * self.m + 2

    @property
    def Wp(self) -> int:
        return self.TW * self.m + 2

    def shared(self) -> dict[str, int]:
        """f32 element counts of the buffers all workers read: w (f32) and U."""
        K, C, a = self.p.K, self.p.C, self.alpha
        return {"w": K * C * 9, "u": a * a * K * C}

    def buffers(self) -> dict[str, int]:
        """f32 element counts of one worker's buffers."""
        p, a, m = self.p, self.alpha, self.m
        C, K, nb, thb = p.C, p.K, self.nb, self.thb
        tiles = nb * thb * self.TW
        nt = PROGRAMS[m][2]
        bufs = {
            "stage": nb * C * self.Hp * self.Wp,
            "t": a * nb * C * thb * self.Wp + nt * nb * C * thb * self.Wp,   # H pass + its temps
            "v": a * a * tiles * C + nt * a * tiles * C,                     # W pass + its temps
            "m": a * a * tiles * K,
            "z": m * a * tiles * K + PROGRAMS[m][3] * a * tiles * K,         # out passes + temps
        }
        if p.out_dtype != F32 or (p.layout == "nchw" and not self.native):
            bufs["y"] = nb * K * thb * m * self.TW * m        # whole tiles: one output region
        return bufs

    def workspace_bytes(self) -> int:
        per = sum(_aligned(n) for n in self.buffers().values())
        return (sum(_aligned(n) for n in self.shared().values()) + self.workers * per) * 4


def _aligned(n: int) -> int:
    return -(-n // 16) * 16     # 64-byte aligned f32 buffers


def fuses(p: ConvProblem, m: int) -> bool:
    """Whether the fused native pass serves p at F(m): its GEMM tile needs K % 16 == 0 and U
    (three of them for a 3-D problem's depth taps) within FUSED_U_BYTES (larger filters
    amortise U over the blocked passes' thousands of tiles)."""
    a = m + 2
    taps = 3 if p.ndim == 3 else 1
    return USE_FUSED and p.K % 16 == 0 and taps * a * a * p.C * p.K * 4 <= FUSED_U_BYTES and native.expected()


def make_plan(p: ConvProblem, m: int, block_bytes: int | None = None, workers: int = 1,
              min_tiles: int | None = None) -> WinoPlan:
    """Blocks of whole images, or of tile rows of one image, each with at most
    `block_bytes` of f32 transform buffers (T, V, M, Z; None: from BLOCK_BYTES and torch's threads)
    and at least one per worker where the tile rows allow."""
    workers = max(1, workers)
    if block_bytes is None:
        threads = torch.get_num_threads()
        block_bytes = BLOCK_BYTES if threads <= 1 else 2 * BLOCK_BYTES * threads
    a = m + 2
    OH, OW = p.out_size
    TH, TW = -(-OH // m), -(-OW // m)
    Wp = TW * m + 2
    row = 4 * (a * p.C * Wp + TW * (a * a * p.C + a * a * p.K + m * a * p.K))   # one tile row
    # the bmm wants tall operands: at least min_tiles tiles per block (up to 4x the bytes)
    min_tiles = MIN_TILES if min_tiles is None else min_tiles
    budget = max(block_bytes, min(4 * block_bytes, -(-min_tiles // TW) * row))
    rows = max(1, min(TH, budget // max(1, row)))
    if p.N < workers:                    # split the images' tile rows between the workers
        rows = min(rows, -(-TH // -(-workers // p.N)))
    blocks = []
    if rows < TH:                        # tile rows of one image per block
        nb, thb = 1, rows
        per = -(-TH // -(-TH // rows))   # even split
        thb = per
        for n in range(p.N):
            blocks += [WinoBlock(n, n + 1, t, min(TH, t + per)) for t in range(0, TH, per)]
    else:
        nb = max(1, min(p.N, budget // max(1, row * TH), -(-p.N // workers)))
        nb = -(-p.N // -(-p.N // nb))    # even split
        thb = TH
        blocks = [WinoBlock(n, min(p.N, n + nb), 0, TH) for n in range(0, p.N, nb)]
    return WinoPlan(p, m, TH, TW, tuple(blocks), nb, thb, min(workers, len(blocks)), native.expected(),
                    fuses(p, m) and workers == 1)


# ---- invoker --------------------------------------------------------------------------------
NHWC = (0, 2, 3, 1)              # physical order of the staged images and y blocks
TILE_ORDER = (0, 1, 2, 4, 5, 3)  # (., ., n, C|K, th, tw) stored as (., ., n, th, tw, C|K)


def _phys_buffer(flat: torch.Tensor, logical_shape: tuple, phys_order: tuple) -> torch.Tensor:
    """A logical-shaped view of `flat`, stored with dims in `phys_order` (outermost first)."""
    phys = flat[:math.prod(logical_shape)].view([logical_shape[i] for i in phys_order])
    inv = [phys_order.index(i) for i in range(len(logical_shape))]
    return phys.permute(*inv)


def _carve(plan: WinoPlan, ws: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The shared buffers and each worker's."""
    f = ws.view(F32)
    off = 0

    def take(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        nonlocal off
        out = {}
        for k, n in sizes.items():
            out[k] = f[off:off + n]
            off += _aligned(n)
        return out
    shared = take(plan.shared())
    return shared, [take(plan.buffers()) for _ in range(plan.workers)]


@lru_cache(maxsize=4)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="nnprim-cpu-wino")


def _one_thread() -> None:
    """torch.set_num_threads(1) in a worker: OpenMP's and MKL's thread counts are
    per calling thread, so the caller's setting is untouched."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _stage(plan: WinoPlan, x: torch.Tensor, blk: WinoBlock, buf: torch.Tensor, zero_halo: bool) -> torch.Tensor:
    """Images [n0, n1) of x, zero-padded to (Hp, Wp) and converted to f32: logical
    (nb, C, Hp, Wp) in the layout's order. The halo sits at the same places for every
    block, so it is zeroed only once per call."""
    p = plan.p
    (pt, pl), (H, W) = p.pad_before, p.in_size
    P = _phys_buffer(buf, (plan.nb, p.C, plan.Hp, plan.Wp), NHWC)[:blk.nb]
    if zero_halo:
        P[:, :, :pt].zero_()
        P[:, :, pt + H:].zero_()
        P[:, :, :, :pl].zero_()
        P[:, :, :, pl + W:].zero_()
    _copy_in(P, x[blk.n0:blk.n1], pt, pl)
    return P


def _copy_in(P: torch.Tensor, x: torch.Tensor, pt: int, pl: int) -> None:
    """P[:, :, pt:pt + H, pl:pl + W] = x (nb, C, H, W) in f32; P is stored channels-last. An
    nchw x goes through the native blocked transpose (torch's strided copy: 2.4x the time of
    the nhwc one, 1.46 vs 0.62 ms on rn50_r2_3x3)."""
    H, W = x.shape[2:]
    nat = native.ops()
    if nat is not None and x.stride(3) == 1 and x.stride(1) != 1:
        nat.wino_stage(x, P.permute(0, 2, 3, 1), pt, pl)
    else:
        P[:, :, pt:pt + H, pl:pl + W].copy_(x)


def _regions(lo: int, hi: int, out: int, m: int) -> list[tuple[int, int, int]]:
    """Tile ranges [a, b) of [lo, hi) with the count of valid outputs per tile: full
    tiles, then the partial last tile of an output extent `out`."""
    full = min(hi, out // m)
    regs = [(lo, full, m)] if full > lo else []
    if out % m and lo <= out // m < hi:
        regs.append((out // m, out // m + 1, out % m))
    return regs


def wino_fwd(plan: WinoPlan, args: ConvArgs, ws: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """y = conv(x, w) of plan.p. transposed (backward data): args.w is the original (C, K, 3, 3)
    filter, used as w'[k, c] = w[c, k] rotated by 180 degrees (the rotation is folded into
    the filter matrix's columns, the transposition into the staging copy of w)."""
    p, m, a = plan.p, plan.m, plan.alpha
    C, K = p.C, p.K
    shared, bufs = _carve(plan, ws)
    x = to_layout(args.x, p.layout)
    w = args.w.transpose(0, 1) if transposed else args.w
    # U = G w G^T as (alpha^2, C, K): the GEMMs' right operands, K contiguous
    Ut = shared["u"].view(a * a, C, K)
    _filter_transform(m, w, transposed, shared["w"], Ut)
    bias = args.bias.to(F32) if args.bias is not None else None
    y = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    ops = list(args.post_ops)

    def worker(t: int) -> None:
        if plan.workers > 1:
            _one_thread()
        _blocks(plan, x, y, Ut, bias, ops, plan.work(t), bufs[t])

    if plan.workers == 1:
        worker(0)
    else:
        for _ in _pool(plan.workers).map(worker, range(plan.workers)):
            pass
    return y


def _input_transform(plan: WinoPlan, P: torch.Tensor, blk: WinoBlock, buf: dict[str, torch.Tensor]) -> torch.Tensor:
    """V = B^T d B of the block's tiles of the staged images P: (alpha^2, tiles, C), tiles
    ordered (n, th, tw), C contiguous."""
    p, m, a, TW = plan.p, plan.m, plan.alpha, plan.TW
    C, nb, thn = p.C, blk.nb, blk.th1 - blk.th0
    tiles = nb * thn * TW
    nat = native.ops()
    if nat is not None:          # both passes per tile in registers (cpu_wino_native.py)
        V = buf["v"][:a * a * tiles * C].view(a * a, tiles, C)
        nat.wino_input(P.permute(0, 2, 3, 1), V, m, m * blk.th0, thn, TW)
        return V
    bt, nt_in = PROGRAMS[m][0], PROGRAMS[m][2]
    # H pass: T[i] (nb, C, thn, Wp) from rows m*th + i
    T = _phys_buffer(buf["t"], (a + nt_in, nb, C, thn, plan.Wp), (0, 1, 3, 4, 2))
    r0 = m * blk.th0
    d = [P[:, :, r0 + i:r0 + i + m * thn:m] for i in range(a)]
    bt(d, list(T[:a]), list(T[a:]))
    # W pass: V[i, j] (nb, C, thn, TW) from columns m*tw + j of T[i]
    V = _phys_buffer(buf["v"], (a, a, nb, C, thn, TW), TILE_ORDER)
    Vt = _phys_buffer(buf["v"][a * a * tiles * C:], (nt_in, a, nb, C, thn, TW), TILE_ORDER)
    d = [T[:a, :, :, :, j:j + m * TW:m] for j in range(a)]
    bt(d, [V[:, j] for j in range(a)], [Vt[k] for k in range(nt_in)])
    return V.flatten(0, 1).permute(0, 1, 3, 4, 2).reshape(a * a, tiles, C)


def _blocks(plan: WinoPlan, x: torch.Tensor, y: torch.Tensor, Ut: torch.Tensor, bias: torch.Tensor | None,
            ops: list, blocks: tuple[WinoBlock, ...], buf: dict[str, torch.Tensor]) -> None:
    """One worker's blocks: stage, input transform, GEMMs, output transform, post-ops."""
    a, K = plan.alpha, plan.p.K
    staged = None
    for blk in blocks:
        tiles = blk.nb * (blk.th1 - blk.th0) * plan.TW
        if staged != (blk.n0, blk.n1):
            P = _stage(plan, x, blk, buf["stage"], staged is None)
            staged = (blk.n0, blk.n1)
        if plan.fused and native.ops() is not None:
            _fused_block(plan, P, blk, blk, y, Ut.unsqueeze(0), bias, ops, buf)
            continue
        # the alpha^2 GEMMs, M[e] logical (nb, K, thn, TW)
        Mp = buf["m"][:a * a * tiles * K].view(a * a, tiles, K)
        _gemms(_input_transform(plan, P, blk, buf), Ut, Mp, False)
        _output_transform(plan, Mp, blk, y, bias, ops, buf)


def _filter_transform(m: int, w: torch.Tensor, flipped: bool, buf: torch.Tensor, U: torch.Tensor) -> None:
    """U (alpha^2, C, K) = G w G^T of w (logical (K, C, 3, 3); flipped: rotated by 180
    degrees): natively (cpu_wino_native.wino_filter, 2x faster), else a transposing copy into
    buf (C K 9 f32) and one mm reading it as (9, C K)."""
    nat = native.ops()
    if nat is not None:
        nat.wino_filter(w, _g_matrix(m), U, flipped)
        return
    K, C = w.shape[:2]
    w9 = buf[:C * K * 9].view(C, K, 3, 3)
    w9.copy_(w.transpose(0, 1))
    torch.mm(filter_matrix(VARIANTS[m], flipped), w9.view(C * K, 9).t(), out=U.view(U.shape[0], C * K))


@lru_cache(maxsize=4)
def _g_matrix(m: int) -> torch.Tensor:
    return torch.tensor(VARIANTS[m].G, dtype=F32)


def _gemms(V: torch.Tensor, U: torch.Tensor, Mp: torch.Tensor, add: bool) -> None:
    """Mp (alpha^2, T, K) (+)= V (alpha^2, T, C) . U (alpha^2, C, K): the native register tile
    where K % 16 == 0 (no packing, no zero fill), else torch.bmm / baddbmm."""
    nat = native.ops()
    if nat is not None and U.shape[-1] % 16 == 0:
        nat.wino_gemm(V, U, Mp, add)
    elif add:
        Mp.baddbmm_(V, U)
    else:
        torch.bmm(V, U, out=Mp)


def _y_block(plan: WinoPlan, blk: WinoBlock, y: torch.Tensor, buf: dict[str, torch.Tensor]):
    """(what the native output writes, y's block, y's block as a Block): y's block itself, or
    (out_dtype != f32) the f32 block in y's order, whose cast is then a contiguous copy."""
    p, m = plan.p, plan.m
    OH, OW = p.out_size
    r0, r1 = m * blk.th0, min(m * blk.th1, OH)
    ydst = y[blk.n0:blk.n1, :, r0:r1]
    order = NHWC if p.layout == "nhwc" else (0, 1, 2, 3)
    Yb = _phys_buffer(buf["y"], (blk.nb, p.K, (blk.th1 - blk.th0) * m, plan.TW * m), order)[:, :, :r1 - r0, :OW] \
        if "y" in buf else ydst
    return Yb, ydst, Block(blk.n0, blk.n1, (r0, 0), (r1, OW))


def _fused_block(plan: WinoPlan, P: torch.Tensor, blk: WinoBlock, out: WinoBlock, y: torch.Tensor,
                 U: torch.Tensor, bias: torch.Tensor | None, ops: list, buf: dict[str, torch.Tensor]) -> None:
    """Input transform, GEMMs and output transform of the block's tile rows in one native pass
    over groups of tile rows (cpu_wino_native's wino_fused), then the post-ops on y's block
    `out`. U (taps, alpha^2, C, K): taps 3 sums a 3-D problem's depth taps (P's images are its
    depth slices, out's the output slices)."""
    p, a = plan.p, plan.alpha
    Yb, ydst, yblk = _y_block(plan, out, y, buf)
    rows = _group_rows(out.nb * (blk.th1 - blk.th0), plan.TW * a * a * (p.C + p.K) * 4)
    native.ops().wino_fused(P.permute(0, 2, 3, 1), U, None if bias is None else bias.contiguous(), Yb, plan.m,
                            plan.m * blk.th0, blk.th1 - blk.th0, plan.TW, rows, U.shape[0])
    _finish_block(p, Yb, ydst, yblk, ops)


def _group_rows(tile_rows: int, row_bytes: int) -> int:
    """Tile rows per group of the fused pass: V and M within FUSED_GROUP_BYTES, in a multiple
    of torch's threads of groups (each thread takes whole groups: rn50_r4 F(2x2) at 9 rows a
    group, 7 groups on 2 threads, ran 7.0 ms against 5.5 at 4 rows, 14 groups)."""
    rows = max(1, min(tile_rows, FUSED_GROUP_BYTES // row_bytes))
    threads = max(1, torch.get_num_threads())
    groups = math.ceil(math.ceil(tile_rows / rows) / threads) * threads
    return math.ceil(tile_rows / groups)


def _output_transform(plan: WinoPlan, Mp: torch.Tensor, blk: WinoBlock, y: torch.Tensor,
                      bias: torch.Tensor | None, ops: list, buf: dict[str, torch.Tensor]) -> None:
    """y's block (images [n0, n1), tile rows [th0, th1)) = A^T M A (+ bias, post-ops) of the
    GEMM output Mp (alpha^2, tiles, K)."""
    p, m, a = plan.p, plan.m, plan.alpha
    K, TW = p.K, plan.TW
    OH, OW = p.out_size
    at, nt_out = PROGRAMS[m][1], PROGRAMS[m][3]
    nb, thn = blk.nb, blk.th1 - blk.th0
    nat = native.ops()
    if nat is not None:          # A^T M A (+ bias) per tile in registers, tails cut (cpu_wino_native.py)
        Yb, ydst, yblk = _y_block(plan, blk, y, buf)
        nat.wino_output(Mp, None if bias is None else bias.contiguous(), Yb, m, thn, TW)
        _finish_block(p, Yb, ydst, yblk, ops)
        return
    r0 = m * blk.th0
    r1 = min(m * blk.th1, OH)
    ydst = y[blk.n0:blk.n1, :, r0:r1]
    M = Mp.view(a, a, nb, thn, TW, K).permute(0, 1, 2, 5, 3, 4)
    if bias is not None:
        M[1, 1].add_(bias.view(1, K, 1, 1))
    # output pass 1 (rows): Z[r, j] = sum_i A^T[r][i] M[i, j]
    Z = _phys_buffer(buf["z"], (m + nt_out, a, nb, K, thn, TW), TILE_ORDER)
    at([M[i] for i in range(a)], list(Z[:m]), list(Z[m:]))
    # output pass 2 (columns) into y's m x m tile views (or an f32 block)
    if "y" in buf:      # an f32 block of whole tiles: one region, the tails cut by the copy
        Yt = _phys_buffer(buf["y"], (nb, K, thn * m, TW * m), NHWC)
        Yb, rows, cols = Yt[:, :, :r1 - r0, :OW], [(blk.th0, blk.th1, m)], [(0, TW, m)]
    else:
        Yt = Yb = ydst
        rows, cols = _regions(blk.th0, blk.th1, OH, m), _regions(0, TW, OW, m)
    sn, sk, sh, sw = Yt.stride()
    for (ta, tb, ra) in rows:
        for (wa, wb, rb) in cols:
            zs = Z[:ra, :, :, :, ta - blk.th0:tb - blk.th0, wa:wb]
            tmp = [Z[m + k, :ra, :, :, ta - blk.th0:tb - blk.th0, wa:wb] for k in range(nt_out)]
            size = (ra, nb, K, tb - ta, wb - wa)
            stride = (sh, sn, sk, m * sh, m * sw)
            base = Yt.storage_offset() + (m * ta - r0) * sh + m * wa * sw
            dst = [Yt.as_strided(size, stride, base + b * sw) if b < rb else None for b in range(m)]
            at([zs[:, j] for j in range(a)], dst, tmp)
    _finish_block(p, Yb, ydst, Block(blk.n0, blk.n1, (r0, 0), (r1, OW)), ops)


def _finish_block(p: ConvProblem, Yb: torch.Tensor, ydst: torch.Tensor, yblk: Block, ops: list) -> None:
    """The chain on y's block in y's layout (f32 out: after the copy of an nchw block, so
    it runs on contiguous rows like its operands), else on the f32 block Yb before the cast."""
    post, rest = (Yb, ops) if p.out_dtype != F32 else (ydst, _copy_fused(Yb, ydst, ops, yblk))
    if rest:
        apply_post_ops_block(post.unsqueeze(1), yblk, 1, None, rest)
    if post is not ydst:
        ydst.copy_(Yb)


def _copy_fused(Yb: torch.Tensor, ydst: torch.Tensor, ops: list, blk: Block) -> list:
    """Copy the f32 block Yb into y's block (nothing when it is one), fusing a leading
    residual add (Sum / Binary add) into the copy; the rest of the chain is returned."""
    if Yb is ydst:
        return ops
    op = ops[0] if ops else None
    if isinstance(op, Sum) or (isinstance(op, Binary) and op.op == "add"):
        t = op.tensor[block_index(blk, op.tensor)]
        torch.add(Yb, t, alpha=op.scale if isinstance(op, Sum) else 1.0, out=ydst)
        return ops[1:]
    ydst.copy_(Yb)
    return ops


# ---- backward weights -----------------------------------------------------------------------
@lru_cache(maxsize=4)
def dy_matrix(tr: Transform) -> torch.Tensor:
    """(alpha^2, m^2): DY[(e1, e2)] = sum_{i,j} A[e1][i] A[e2][j] dy[i, j] (A = (A^T)^T)."""
    at = torch.tensor(tr.AT, dtype=torch.float64)           # (m, alpha)
    return torch.einsum("ia,jb->abij", at, at).reshape(tr.alpha ** 2, tr.m ** 2).to(F32).contiguous()


def _dy_tiles(plan: WinoPlan, dy: torch.Tensor, blk: WinoBlock, buf: torch.Tensor) -> torch.Tensor:
    """dy's m x m tiles of the block as (m^2, tiles*K) f32, zero past the output's edge."""
    p, m, TW = plan.p, plan.m, plan.TW
    K, nb, thn = p.K, blk.nb, blk.th1 - blk.th0
    OH, OW = p.out_size
    D = buf[:m * m * nb * thn * TW * K].view(m, m, nb, thn, TW, K)
    dst6 = D.permute(2, 5, 3, 0, 4, 1)                     # (nb, K, thn, m, TW, m)
    rows, cols = _regions(blk.th0, blk.th1, OH, m), _regions(0, TW, OW, m)
    if len(rows) * len(cols) > 1 or rows[0][2] < m or cols[0][2] < m:
        D.zero_()
    for ta, tb, ra in rows:
        for wa, wb, rb in cols:
            src = dy[blk.n0:blk.n1, :, m * ta:m * (tb - 1) + ra, m * wa:m * (wb - 1) + rb]
            if ra == m and rb == m:
                dst6[:, :, ta - blk.th0:tb - blk.th0, :, wa:wb, :].copy_(
                    src.unflatten(2, (tb - ta, m)).unflatten(4, (wb - wa, m)))
            else:   # one partial tile row or column: (nb, K, 1 or n, ra, n or 1, rb)
                dst6[:, :, ta - blk.th0:tb - blk.th0, :ra, wa:wb, :rb].copy_(
                    src.unflatten(2, (tb - ta, ra)).unflatten(4, (wb - wa, rb)))
    return D.view(m * m, -1)


def wino_bwd_weights(plan: WinoPlan, pw: ConvProblem, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    """dw = G^T [sum over tiles of (A dy A^T)^T (B^T x B)] G: the transpose of F(m x m, 3x3)
    is F(3x3, m x m) with the dy tile as the filter. Per block: V = B^T x B (the forward's
    input transform), DY = kron(A, A) . dy tiles (one mm), then ONE batched GEMM accumulates
    M[e] (K, C) += DY[e]^T (K, tiles) . V[e] (tiles, C) in f32 across blocks; finally
    dw (9, K*C) = Gk^T . M (one mm)."""
    p, m, a = plan.p, plan.m, plan.alpha
    C, K = p.C, p.K
    shared, bufs = _carve(plan, ws)
    buf = bufs[0]
    x, dy = to_layout(args.x, p.layout), to_layout(args.dy, p.layout)
    Macc = shared["u"].view(a * a, K, C)
    tr = VARIANTS[m]
    Ak = dy_matrix(tr)
    staged, first = None, True
    for blk in plan.blocks:
        nb, thn = blk.nb, blk.th1 - blk.th0
        tiles = nb * thn * plan.TW
        if staged != (blk.n0, blk.n1):
            P = _stage(plan, x, blk, buf["stage"], staged is None)
            staged = (blk.n0, blk.n1)
        V = _input_transform(plan, P, blk, buf)                       # (a^2, tiles, C)
        D = _dy_tiles(plan, dy, blk, buf["z"])                         # (m^2, tiles*K)
        DY = buf["m"][:a * a * tiles * K].view(a * a, tiles * K)
        torch.mm(Ak, D, out=DY)
        DYt = DY.view(a * a, tiles, K).transpose(1, 2)
        if first:
            torch.bmm(DYt, V, out=Macc)
            first = False
        else:
            Macc.baddbmm_(DYt, V)
    dw9 = torch.mm(filter_matrix(tr).t(), Macc.view(a * a, K * C))   # (9, K*C)
    dw = empty_in_layout(pw.w_shape, pw.layout, dtype=pw.out_dtype)
    dw.copy_(dw9.view(3, 3, K, C).permute(2, 3, 0, 1))
    return dw


def _fwd_of(p: ConvProblem) -> ConvProblem:
    """The forward problem with p's geometry (its plan serves p's backward weights)."""
    return ConvProblem.create("fwd", p.x_shape, p.w_shape, dtype=p.dtype, layout=p.layout,
                              stride=p.stride, padding=tuple(zip(p.pad_before, p.pad_after)),
                              dilation=p.dilation, groups=p.groups)


def prepare_bwd_weights_with(p: ConvProblem, m: int | None = None, block_bytes: int | None = None):
    """Invoker of the backward-weights problem p (m: None = choose_m of its forward)."""
    plan = plan_any(_fwd_of(p), m, block_bytes)
    nbytes = plan.workspace_bytes()
    fn = wino_bwd_weights3 if isinstance(plan, Wino3Plan) else wino_bwd_weights

    def invoke(args: ConvArgs) -> torch.Tensor:
        with workspace(nbytes) as ws:
            return fn(plan, p, args, ws)
    invoke.plan = plan
    return invoke


# ---- 3-D: 2-D Winograd over (H, W) per depth slice, the depth taps as accumulating GEMMs -----
@dataclass(frozen=True)
class Wino3Plan:
    """A 3-D 3x3x3 problem as 2-D Winograd over (H, W): the Dp zero-padded depth slices of
    one image are the pseudo-images of `plan` (a 2-D plan whose blocks are tile rows of all
    of them), so V is computed once per input slice, and output slice d sums the depth taps
    fd as f32 GEMMs accumulating in place: M[e] = sum_fd V_{d+fd}[e] . U_fd[e] (V's tiles
    of slices d + fd, d < Do, are one contiguous row range per fd)."""
    p: ConvProblem          # the 3-D problem (forward geometry)
    plan: WinoPlan          # 2-D plan over the Dp pseudo-images
    pd: int                 # depth padding before

    @property
    def Dp(self) -> int:
        return self.plan.nb

    @property
    def Do(self) -> int:
        return self.Dp - 2

    def workspace_bytes(self) -> int:
        K, C, a = self.plan.p.K, self.plan.p.C, self.plan.alpha
        return self.plan.workspace_bytes() + 4 * (_aligned(3 * K * C * 9) + _aligned(3 * a * a * K * C))


def make_plan3(p: ConvProblem, m: int, block_bytes: int | None = None) -> Wino3Plan:
    """Blocks of tile rows of all Dp depth slices of an image, at most `block_bytes` of f32
    transform buffers (None: as make_plan)."""
    if block_bytes is None:
        threads = torch.get_num_threads()
        block_bytes = BLOCK_BYTES if threads <= 1 else 2 * BLOCK_BYTES * threads
    Dp = p.in_size[0] + p.pad_before[0] + p.pad_after[0]
    p2 = ConvProblem.create("fwd", (Dp, p.C, *p.in_size[1:]), (p.K, p.C, 3, 3), dtype=p.dtype,
                            out_dtype=p.out_dtype, layout=p.layout,
                            padding=tuple(zip(p.pad_before[1:], p.pad_after[1:])))
    a = m + 2
    OH, OW = p2.out_size
    TH, TW = -(-OH // m), -(-OW // m)
    Wp = TW * m + 2
    row = 4 * Dp * (a * p.C * Wp + TW * (a * a * p.C + a * a * p.K + m * a * p.K))   # one tile row
    rows = max(1, min(TH, block_bytes // row))
    per = -(-TH // -(-TH // rows))       # even split
    blocks = tuple(WinoBlock(0, Dp, t, min(TH, t + per)) for t in range(0, TH, per))
    return Wino3Plan(p, WinoPlan(p2, m, TH, TW, blocks, Dp, per, 1, native.expected(), fuses(p, m)),
                     p.pad_before[0])


def _carve3(plan3: Wino3Plan, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(w staged f32 (3, K, C, 3, 3), U or the dw accumulator (3, alpha^2, K, C), the 2-D buffers)."""
    K, C, a = plan3.plan.p.K, plan3.plan.p.C, plan3.plan.alpha
    nw, nu = _aligned(3 * K * C * 9), _aligned(3 * a * a * K * C)
    f = ws[:4 * (nw + nu)].view(F32)
    _, bufs = _carve(plan3.plan, ws[4 * (nw + nu):])
    return f[:3 * K * C * 9].view(3, K, C, 3, 3), f[nw:nw + 3 * a * a * K * C].view(3, a * a, K, C), bufs[0]


def _stage3(plan3: Wino3Plan, xs: torch.Tensor, buf: torch.Tensor, first: bool) -> torch.Tensor:
    """One image's depth slices xs (D, C, H, W) zero-padded to (Dp, C, Hp, Wp) in f32; the
    padding slices and the halo are zeroed on the first image only (the buffer is reused)."""
    plan, pd = plan3.plan, plan3.pd
    p2 = plan.p
    (pt, pl), (H, W) = p2.pad_before, p2.in_size
    D = xs.shape[0]
    P = _phys_buffer(buf, (plan.nb, p2.C, plan.Hp, plan.Wp), NHWC)
    if first:
        P[:pd].zero_()
        P[pd + D:].zero_()
        P[:, :, :pt].zero_()
        P[:, :, pt + H:].zero_()
        P[:, :, :, :pl].zero_()
        P[:, :, :, pl + W:].zero_()
    _copy_in(P[pd:pd + D], xs, pt, pl)
    return P


def wino_fwd3(plan3: Wino3Plan, args: ConvArgs, ws: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """y = conv3d(x, w) of plan3.p (transposed: as wino_fwd, the depth taps reversed too)."""
    p, plan = plan3.p, plan3.plan
    m, a, C, K, Do = plan.m, plan.alpha, p.C, p.K, plan3.Do
    w9, U, buf = _carve3(plan3, ws)
    x = to_layout(args.x, p.layout)
    w = args.w.transpose(0, 1) if transposed else args.w
    Ut = U.view(3, a * a, C, K)                              # U_fd = G w_fd G^T, K contiguous
    for fd in range(3):
        _filter_transform(m, w[:, :, 2 - fd if transposed else fd], transposed, w9[fd], Ut[fd])
    bias = args.bias.to(F32) if args.bias is not None else None
    y = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    for n in range(p.N):
        P = _stage3(plan3, x[n].transpose(0, 1), buf["stage"], n == 0)
        ys = y[n].transpose(0, 1)                            # (Do, K, OH, OW) pseudo-images
        ops = _pseudo_image_ops(args.post_ops, n)
        for blk in plan.blocks:
            if plan.fused and native.ops() is not None:     # the depth taps summed in the fused pass
                _fused_block(plan, P, blk, WinoBlock(0, Do, blk.th0, blk.th1), ys, Ut, bias, ops, buf)
                continue
            T = (blk.th1 - blk.th0) * plan.TW
            V = _input_transform(plan, P, blk, buf)          # (alpha^2, Dp*T, C)
            Mp = buf["m"][:a * a * Do * T * K].view(a * a, Do * T, K)
            for fd in range(3):
                _gemms(V[:, fd * T:(fd + Do) * T], Ut[fd], Mp, fd > 0)
            _output_transform(plan, Mp, WinoBlock(0, Do, blk.th0, blk.th1), ys, bias, ops, buf)
    return y


def _pseudo_image_ops(post_ops, n: int) -> list:
    """Image n's view of the chain's 5-D operands as the 2-D pass sees y: (D, K, H, W)
    pseudo-images (a broadcast dim stays 1), so the chain runs on each block in cache."""
    out = []
    for op in post_ops:
        if isinstance(op, (Sum, Binary)):
            t = op.tensor
            t = t.reshape((1,) * (5 - t.dim()) + tuple(t.shape))
            t4 = t[n if t.shape[0] > 1 else 0].transpose(0, 1)
            op = Sum(t4, op.scale) if isinstance(op, Sum) else Binary(op.op, t4)
        out.append(op)
    return out


def wino_bwd_weights3(plan3: Wino3Plan, pw: ConvProblem, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    """dw[:, :, fd] = G^T [sum over images, output slices d, tiles of DY_d^T V_{d+fd}] G."""
    plan = plan3.plan
    m, a, C, K, Do = plan.m, plan.alpha, pw.C, pw.K, plan3.Do
    _, Macc, buf = _carve3(plan3, ws)
    x, dy = to_layout(args.x, pw.layout), to_layout(args.dy, pw.layout)
    Ak = dy_matrix(VARIANTS[m])
    first = True
    for n in range(pw.N):
        P = _stage3(plan3, x[n].transpose(0, 1), buf["stage"], n == 0)
        dys = dy[n].transpose(0, 1)                          # (Do, K, OH, OW)
        for blk in plan.blocks:
            T = (blk.th1 - blk.th0) * plan.TW
            V = _input_transform(plan, P, blk, buf)
            D = _dy_tiles(plan, dys, WinoBlock(0, Do, blk.th0, blk.th1), buf["z"])
            DY = buf["m"][:a * a * Do * T * K].view(a * a, Do * T * K)
            torch.mm(Ak, D, out=DY)
            DYt = DY.view(a * a, Do * T, K).transpose(1, 2)
            for fd in range(3):
                if first:
                    torch.bmm(DYt, V[:, fd * T:(fd + Do) * T], out=Macc[fd])
                else:
                    Macc[fd].baddbmm_(DYt, V[:, fd * T:(fd + Do) * T])
            first = False
    gt = filter_matrix(VARIANTS[m]).t()
    dw = empty_in_layout(pw.w_shape, pw.layout, dtype=pw.out_dtype)
    for fd in range(3):
        dw[:, :, fd].copy_(torch.mm(gt, Macc[fd].view(a * a, K * C)).view(3, 3, K, C).permute(2, 3, 0, 1))
    return dw


def estimate3_ms(p: ConvProblem, m: int) -> float:
    """N x the 2-D estimate of one image's Dp slices (transforms, one GEMM per block, calls)
    plus the two further depth-tap GEMMs."""
    plan3 = make_plan3(p, m)
    p2, a = plan3.plan.p, m + 2
    tiles = p.N * plan3.Do * plan3.plan.TH * plan3.plan.TW
    extra = 2 * 2.0 * a * a * tiles * p.C * p.K / (_GFLOPS_PER_CORE * 1e9 * max(1, torch.get_num_threads()))
    return p.N * estimate_ms(p2, m) + extra * 1e3


# ---- solver ---------------------------------------------------------------------------------
def estimate_ms(p: ConvProblem, m: int) -> float:
    """GEMM at _GFLOPS_PER_CORE, the transforms' planes at _ELEMS_PER_S_PER_CORE, per-op cost."""
    cores = max(1, torch.get_num_threads())
    plan = make_plan(p, m)
    a, (OH, OW) = m + 2, p.out_size
    tiles = p.N * plan.TH * plan.TW
    gemm = 2.0 * a * a * tiles * p.C * p.K / (_GFLOPS_PER_CORE * 1e9)
    ops_in, ops_out = OPS[m]
    # ops per pass / outputs per pass = element-ops per output element
    transforms = (ops_in / a) * (a * p.N * p.C * plan.TH * plan.Wp + a * a * tiles * p.C) \
        + (ops_out / m) * (m * a * tiles * p.K + m * m * tiles * p.K)
    elems = transforms / (NATIVE_SPEEDUP if native.expected() else 1.0) \
        + p.N * p.C * plan.Hp * plan.Wp + p.N * p.K * OH * OW * (1 + len(p.post_ops))
    calls = len(plan.blocks) * (2 * ops_in + 2 * ops_out + 4 + len(p.post_ops))
    u = 4.0 * a * a * p.K * p.C * (1 + len(plan.blocks)) / _U_BYTES_PER_S
    return ((gemm + elems / _ELEMS_PER_S_PER_CORE) / cores + u + calls * _OP_S) * 1e3


def choose_m(p: ConvProblem) -> int:
    """F(4x4) or F(2x2): the smaller estimate (m = 4 wastes work on small images' partial
    tiles); F(2x2) where F(4x4)'s U would pass MAX_U_BYTES."""
    if 4 * 36 * p.K * p.C * (3 if p.ndim == 3 else 1) > MAX_U_BYTES:
        return 2
    return min((4, 2), key=lambda m: _estimate_m(p, m))


def _estimate_m(p: ConvProblem, m: int) -> float:
    return estimate3_ms(p, m) if p.ndim == 3 else estimate_ms(p, m)


def plan_any(p: ConvProblem, m: int | None = None, block_bytes: int | None = None, workers: int = 1):
    """WinoPlan (2-D) or Wino3Plan (3-D) of the forward-geometry problem p."""
    m = m or choose_m(p)
    return make_plan3(p, m, block_bytes) if p.ndim == 3 else make_plan(p, m, block_bytes, workers)


def fwd_any(plan, args: ConvArgs, ws: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    if isinstance(plan, Wino3Plan):
        return wino_fwd3(plan, args, ws, transposed)
    return wino_fwd(plan, args, ws, transposed)


def prepare_with(p: ConvProblem, m: int | None = None, block_bytes: int | None = None, workers: int = 1):
    """Invoker of p with F(m x m, 3x3) (None: choose_m), blocks of `block_bytes` (None:
    make_plan's default) and `workers` Python workers, each running its share of the blocks
    on one thread (measured 1.5-2x slower than one worker on torch's 2 threads: kept for
    experiments)."""
    plan = plan_any(p, m, block_bytes, workers)
    nbytes = plan.workspace_bytes()

    def invoke(args: ConvArgs) -> torch.Tensor:
        with workspace(nbytes) as ws:
            return fwd_any(plan, args, ws)
    invoke.plan = plan
    return invoke


def _shape_reasons(p: ConvProblem) -> list[str]:
    """Why the forward-geometry problem p is not Winograd's (empty: it is)."""
    if p.ndim not in (2, 3):
        return [f"{p.ndim}-D problem: 2-D and 3-D only"]
    nd, reasons = p.ndim, []
    if p.filter != (3,) * nd:
        reasons.append(f"filter={p.filter}: 3x3 (3x3x3) only")
    if p.stride != (1,) * nd:
        reasons.append(f"stride={p.stride}: stride 1 only")
    if p.dilation != (1,) * nd:
        reasons.append(f"dilation={p.dilation}: dilation 1 only")
    if p.groups != 1:
        reasons.append(f"groups={p.groups}: ungrouped only (per-group GEMMs are too narrow to pay)")
    if max(*p.pad_before, *p.pad_after) > MAX_PAD:
        reasons.append(f"padding={p.padding}: at most {MAX_PAD} a side")
    u = 4 * 16 * p.K * p.C * (3 if nd == 3 else 1)          # U of F(2x2), the smaller one
    if u > MAX_U_BYTES:
        reasons.append(f"K={p.K}, C={p.C}: the filter transform U needs {u} bytes > {MAX_U_BYTES}")
    return reasons


def _estimate(p: ConvProblem) -> float:
    t = min(_estimate_m(p, 4), _estimate_m(p, 2))
    if p.dtype != F32 and cpu_has_native_bf16():
        # the im2col solver's native bf16 GEMM runs at ~2x the f32 rate this one keeps:
        # measured 0.54-0.68x torch in bf16 vs 0.70-0.74 for solver 10 (suite, 1 thread)
        t *= _NATIVE_BF16_PENALTY
    return t


class _CpuWinogradBase(Solver):
    """What solvers 14/15/16 share: CPU, f32/f16/bf16, deterministic, 3x3 stride-1 shapes."""
    family = "winograd"
    primitive = "conv"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    deterministic = True

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        return super().not_supported_reasons(p) + _shape_reasons(p)


@register
class CpuWinogradFwd(_CpuWinogradBase):
    id = 14
    name = "cpu_winograd_fwd"
    directions = frozenset({"fwd"})

    def workspace_size(self, p: ConvProblem) -> int:
        return plan_any(p).workspace_bytes()

    def estimate(self, p: ConvProblem) -> float:
        return _estimate(p)

    def prepare(self, p: ConvProblem):
        return prepare_with(p)


def prepare_bwd_data_with(p: ConvProblem, m: int | None = None, block_bytes: int | None = None):
    """Invoker of the backward-data problem p: dx = wino_fwd(dy, w rotated and transposed)."""
    plan = plan_any(transposed_fwd(p), m, block_bytes)
    nbytes = plan.workspace_bytes()

    def invoke(args: ConvArgs) -> torch.Tensor:
        with workspace(nbytes) as ws:
            return fwd_any(plan, ConvArgs(x=args.dy, w=args.w), ws, transposed=True)
    invoke.plan = plan
    return invoke


@register
class CpuWinogradBwdData(_CpuWinogradBase):
    """Backward data of stride-1 3x3 problems through the Winograd forward (solver 14's
    structure and numerics): dx = conv(dy, w'), w'[c, k] = w[k, c] rotated 180 degrees,
    padding 2 - pad a side (so pad <= 2)."""

    id = 15
    name = "cpu_winograd_bwd_data"
    directions = frozenset({"bwd_data"})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = Solver.not_supported_reasons(self, p)   # the shape reasons are the forward's it runs
        pf = transposed_fwd(p)
        if pf is None:
            shape = _shape_reasons(p)    # the original's stride / filter / dilation reasons
            return reasons + (shape or [f"padding={p.padding}: more than the filter span (2) a side"])
        return reasons + _shape_reasons(pf)

    def workspace_size(self, p: ConvProblem) -> int:
        return plan_any(transposed_fwd(p)).workspace_bytes()

    def estimate(self, p: ConvProblem) -> float:
        return _estimate(transposed_fwd(p))

    def prepare(self, p: ConvProblem):
        return prepare_bwd_data_with(p)


@register
class CpuWinogradBwdWeights(_CpuWinogradBase):
    """Backward weights of stride-1 3x3 problems as the transposed Winograd algorithm
    F(3x3, m x m) (wino_bwd_weights): the forward's input transform, a dy transform, one
    batched GEMM per block accumulating in f32, one filter-side mm at the end."""

    id = 16
    name = "cpu_winograd_bwd_weights"
    directions = frozenset({"bwd_weights"})

    def workspace_size(self, p: ConvProblem) -> int:
        return plan_any(_fwd_of(p)).workspace_bytes()

    def estimate(self, p: ConvProblem) -> float:
        # the forward's structure: input transform, alpha^2 GEMMs of the same size, a dy
        # transform (one small mm) in place of the output transform
        return _estimate(_fwd_of(p))

    def prepare(self, p: ConvProblem):
        return prepare_bwd_weights_with(p)


__all__ = ["Wino3Plan", "make_plan3", "plan_any",
           "CpuWinogradFwd", "CpuWinogradBwdData", "CpuWinogradBwdWeights", "prepare_bwd_data_with",
           "prepare_bwd_weights_with", "wino_bwd_weights",
           "WinoPlan", "make_plan", "prepare_with", "wino_fwd", "choose_m", "PROGRAMS"]
