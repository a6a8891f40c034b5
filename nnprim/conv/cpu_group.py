"""CPU grouped convolution as per-tap batched GEMMs over the groups (family `gemm`, ids
17 `cpu_group_tap_fwd`, 18 `cpu_group_tap_bwd_data`), issue 16: no im2col, the group is
the batch dimension of every GEMM.

Math (groups G, Kg = K/G, Cg = C/G, taps f of the filter; the phase grid of cpu_tap:
U = ceil(P / stride) per spatial dim, flattened per image, junk positions o_i >= out_i):
  x phase rho, channel-major:  X_rho[g, c, n*prod(U) + u] = x_pad[n, g*Cg + c, u*s + rho]
  tap f reads X_{rho_f} at q + off_f (cpu_tap.tap_offsets), so on the phase grid
  fwd          Y[g] (Kg, q)  = sum_f W_f[g] (Kg, Cg) . X_{rho_f}[g][:, q + off_f]
               ONE batched GEMM per tap (torch.bmm / baddbmm_ with G as the batch),
               accumulating in an f32 (G, Kg, positions) block; then bias, the post-op
               chain on the valid positions, one copy (and cast) into y.
  bwd_data     stride 1: the forward of dy with the transposed filter rotated by 180
               degrees (cpu_gemm.transposed_fwd).
Backward weights is not served: its per-tap GEMMs dW_f[g] (Kg, Cg) = dY[g] (Kg, q) .
X_{rho_f}[g][:, q + off_f]^T (a 16 x 16 output, a reduction over all positions) ran at
20-30 GFLOP/s per core on grouped_g8 (f32 and bf16: 2x slower than solvers 12/13).
Both GEMM operands are plain strided views of the staged buffers (row stride = a phase
row), so each tap costs one GEMM call and no copy. Every input dtype is staged in f32 and
every GEMM is f32 (bf16/f16 converted in the staging copy): a bf16 GEMM would round each
tap's partial sum, not the contract's f32 accumulation.

Against the im2col solvers (10-12): no column buffer (F x the input, written and read
once per call: on grouped_g8 the im2col copy costs as much as the GEMM), for Cg-deep
GEMMs instead of Cg*F-deep ones (slower per flop: 16 x 16 x positions runs at 70-110
GFLOP/s per core vs 100-110 for 16 x 144). Extra work: the junk positions
((prod(U) - prod(out)) / prod(out), 15 % on 28x28 3x3 pad 1).
Supported: 1D/2D/3D, any stride (phases; bwd_data stride 1 only), dilation, asymmetric
padding, nchw and nhwc (staged channel-major: nhwc pays transposing copies), f32 / bf16 /
f16, groups >= 2. Chunks of whole images keep the staged block and accumulator within
CHUNK_BYTES per thread."""
from __future__ import annotations

import math

import torch

from ..args import ConvArgs
from ..problems.conv import ConvProblem, empty_in_layout, to_layout
from ..search.solver import Solver, register
from .cpu_gemm import apply_post_ops_block, cpu_has_native_bf16, transposed_fwd, workspace
from .cpu_im2col import F32, Block
from .cpu_tap import phase_copy, phase_list, tap_grid, tap_offsets

CHUNK_BYTES = 8 << 20     # f32 staged x (+ dy) and accumulator per chunk, per thread
_ALIGN = 64
_GFLOPS_PER_CORE = 75.0   # f32 bmm of (Kg x Cg) . (Cg x positions), Cg = Kg = 16 (measured 70-110)
_GBS_PER_CORE = 8.0       # staging / output copies
_CACHED_GBS_PER_CORE = 16.0   # a post-op pass over the accumulator block in cache (read + write)
_CALL_MS = 0.01           # per torch op
_NATIVE_BF16_PENALTY = 2.0  # bf16 on avx512_bf16/amx CPUs: the im2col solvers' native bf16 GEMM
                            # wins there (grouped_g8 fwd bf16: 0.54x torch vs 0.48-0.51x here)


def _images_per_chunk(p: ConvProblem) -> int:
    _, _, ut = tap_grid(p)
    nph = len(phase_list(p))
    per_image = ut * 4 * (nph * p.C + p.K)       # staged x, accumulator
    threads = max(1, torch.get_num_threads())
    return max(1, min(p.N, CHUNK_BYTES * threads // per_image))


def _layout(p: ConvProblem, nb: int) -> tuple[int, int, int]:
    """(positions m of a chunk of nb images, phase row length, f32 elements of the staged x)."""
    _, _, ut = tap_grid(p)
    m = nb * ut
    row = m + max(o for _, o in tap_offsets(p))
    return m, row, len(phase_list(p)) * p.C * row


def _nbytes(n: int) -> int:
    return -(-n * 4 // _ALIGN) * _ALIGN


def workspace_bytes(p: ConvProblem) -> int:
    """Staged x phases and the accumulator, f32."""
    if p.direction == "bwd_data":
        pf = transposed_fwd(p)
        return workspace_bytes(pf) if pf is not None else 0
    m, _, nx = _layout(p, _images_per_chunk(p))
    return _nbytes(nx) + _nbytes(p.K * m)


def _stage_x(p: ConvProblem, x: torch.Tensor, xp: torch.Tensor, n0: int, n1: int) -> None:
    """Images [n0, n1) of x into the (phases, C, row) f32 buffer (halo left as is: zeroed
    once per call, the copies write interiors only)."""
    U, _, ut = tap_grid(p)
    xs = x[n0:n1].transpose(0, 1)                     # (C, nb, sp..)
    m = (n1 - n0) * ut
    for i, ph in enumerate(phase_list(p)):
        cp = phase_copy(p, ph)
        if cp is None:
            continue
        dst, src = cp
        xp[i, :, :m].view(p.C, n1 - n0, *U)[(slice(None), slice(None), *dst)].copy_(
            xs[(slice(None), slice(None), *src)])


def _tap_weights(p: ConvProblem, w: torch.Tensor) -> torch.Tensor:
    """(F, G, Kg, Cg) f32: the per-tap GEMM operands."""
    G = p.groups
    wf = w.reshape(G, p.K // G, p.C // G, -1).to(F32)
    return wf.permute(3, 0, 1, 2).contiguous()


def _valid(p: ConvProblem, t: torch.Tensor, nb: int) -> torch.Tensor:
    """(K, nb*prod(U)) on the phase grid (any row stride) -> logical (nb, K, out..) view of
    its valid positions."""
    U, _, _ = tap_grid(p)
    v = t.unflatten(1, (nb, *U))[(slice(None), slice(None), *(slice(0, o) for o in p.out_size))]
    return v.transpose(0, 1)


def group_fwd(p: ConvProblem, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    x = to_layout(args.x, p.layout)
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    taps = tap_offsets(p)
    wt = _tap_weights(p, args.w)
    bias = args.bias.to(F32) if args.bias is not None else None
    nbk = _images_per_chunk(p)
    m_full, row, nx = _layout(p, nbk)
    xp = ws[:nx * 4].view(F32).view(-1, p.C, row)
    off = _nbytes(nx)
    acc_buf = ws[off:off + p.K * m_full * 4].view(F32)
    xp.zero_()
    y = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    _, _, ut = tap_grid(p)
    for n0 in range(0, p.N, nbk):
        n1 = min(p.N, n0 + nbk)
        m = (n1 - n0) * ut
        _stage_x(p, x, xp, n0, n1)
        acc = acc_buf[:p.K * m].view(G, Kg, m)
        for t, (ph, o) in enumerate(taps):
            xs = xp[ph].view(G, Cg, row)[:, :, o:o + m]
            if t == 0:
                torch.bmm(wt[t], xs, out=acc)
            else:
                acc.baddbmm_(wt[t], xs)
        a = _valid(p, acc.view(p.K, m), n1 - n0)            # (nb, K, out..)
        if bias is not None or args.post_ops:
            blk = Block(n0, n1, (0,) * p.ndim, tuple(p.out_size))
            apply_post_ops_block(a.unflatten(1, (G, Kg)), blk, G, bias, args.post_ops)
        y[n0:n1].copy_(a)
    return y


def group_bwd_data(p: ConvProblem, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    pf = transposed_fwd(p)
    G, Kg, nd = p.groups, p.K // p.groups, p.ndim
    wt = args.w.unflatten(0, (G, Kg)).transpose(1, 2).flip(list(range(3, 3 + nd)))
    wt = wt.reshape(p.C, Kg, *p.filter)
    return group_fwd(pf, ConvArgs(x=args.dy, w=wt), ws)


_RUN = {"fwd": group_fwd, "bwd_data": group_bwd_data}


class _CpuGroupBase(Solver):
    family = "gemm"
    primitive = "conv"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        if p.groups < 2:
            reasons.append("groups=1: ungrouped problems have deeper GEMMs in solvers 10-16")
        if math.prod(p.stride) > 16:
            reasons.append(f"stride={p.stride}: more than 16 input phases")
        if p.direction == "bwd_data" and transposed_fwd(p) is None:
            reasons.append("bwd_data: stride 1 with padding <= dilation*(filter-1), not 1x1 unpadded")
        return reasons

    def workspace_size(self, p: ConvProblem) -> int:
        return workspace_bytes(p)

    def estimate(self, p: ConvProblem) -> float:
        q = transposed_fwd(p) if p.direction == "bwd_data" else p
        cores = max(1, torch.get_num_threads())
        _, _, ut = tap_grid(q)
        junk = ut / max(1, math.prod(q.out_size))
        Cg, Kg = q.C // q.groups, q.K // q.groups
        # the bmm slows down below 16 deep / wide (one zmm of f32); measured forced against
        # solver 10 (f32, 1 thread): Cg = Kg = 8 (g32) 3.1 vs 4.0 ms, 4 (g4) 3.1 vs 3.6,
        # depthwise 56x56 11.1 vs 14.7, Cg = Kg = 32 (g2) 13.5 vs 19.3
        eff = max(0.125, math.sqrt(min(1.0, Cg / 16) * min(1.0, Kg / 16)))
        gemm = q.flops() * junk / (_GFLOPS_PER_CORE * 1e9 * eff * cores)
        moved = 4.0 * q.N * ut * (q.C * len(phase_list(q)) + 2 * q.K)   # stage, acc/dy, output
        calls = -(-q.N // _images_per_chunk(q)) * (len(tap_offsets(q)) + 4)
        post = 2 * len(p.post_ops) * 4.0 * q.N * q.K * ut / (_CACHED_GBS_PER_CORE * 1e9 * cores)  # chain passes
        t = (gemm + post + moved / (_GBS_PER_CORE * 1e9 * cores)) * 1e3 + _CALL_MS * calls
        if p.dtype == torch.bfloat16 and cpu_has_native_bf16():
            t *= _NATIVE_BF16_PENALTY
        return t

    def prepare(self, p: ConvProblem):
        nbytes = workspace_bytes(p)
        fn = _RUN[p.direction]

        def invoke(args: ConvArgs) -> torch.Tensor:
            with workspace(nbytes) as ws:
                return fn(p, args, ws)
        return invoke


@register
class CpuGroupTapFwd(_CpuGroupBase):
    id = 17
    name = "cpu_group_tap_fwd"
    directions = frozenset({"fwd"})


@register
class CpuGroupTapBwdData(_CpuGroupBase):
    id = 18
    name = "cpu_group_tap_bwd_data"
    directions = frozenset({"bwd_data"})


__all__ = ["CpuGroupTapFwd", "CpuGroupTapBwdData", "group_fwd", "group_bwd_data", "workspace_bytes"]
