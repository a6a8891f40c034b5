"""CPU grouped convolution for narrow groups, direct in native AVX-512 code (family `direct`,
ids 83 `cpu_group_direct_fwd`, 84 `cpu_group_direct_bwd_data`, 85 `cpu_group_direct_bwd_weights`),
issue 16.

With 16 channels per group (grouped_g8) every GEMM formulation is thin: 16-wide rows of a
batched GEMM (solver 17: 40 GFLOP/s per core) or 16-column brgemm calls (80). oneDNN's own
grouped kernel is direct, and so is this one (cpu_group_direct_src.cpp): a block of
8 output channels x 32 output positions of one row (4 x 48 for groups of 4 output channels,
1 x 64 for depthwise: `channel_block`) lives in zmm accumulators while every
input channel and tap of its group streams through, one masked load of x per 16 positions
(the zero padding is the mask: no staged copy of x) and one broadcast weight per output
channel feeding an FMA per vector. Weights are packed per call as (G, Kg/KB, Cg, KH, KW, KB),
in C++ into the calling thread's buffer.
Groups of 16 or 32 output channels take the channel-vector kernel instead (`vector_block`, f32 and
bf16; oneDNN's blocked-format scheme on nchw): a zmm holds 16 output channels of one position, a block
of up to 28 (12) positions of a row keeps 28 (24) accumulators, and per input channel and tap a
weight vector (or two) meets one broadcast of x per position as the FMA's memory operand: no lane
masks, no lanes lost to a 28-wide row (the row kernel computes 32 for 28). x comes from a
zero-padded copy of the work item's rows (a group's planes or a band of rows, in L2), the block
is transposed 16 positions at a time into y's channel rows (bf16: x staged as channel pairs, one
vdpbf16ps per position and vector).
bf16 (on AVX512-BF16) takes a channel pair per step: rows c and c + 1 are interleaved in
registers (each 32-bit lane a position's pair) and `vdpbf16ps` against the broadcast weight
pair does 32 multiply-adds into f32 where an FMA does 16; bf16 y is rounded once from f32.
Bias seeds the accumulators; a residual (Sum / Binary add, y-shaped nchw f32) and relu run on each
output block in registers before its store (`epilogue`; the residual's lines prefetched while the
block computes), any other chain on the f32 output per chunk of images while it is in L2.

Math: y[n, g*Kg + k, oh, ow] = b + sum_{c, kh, kw} w[g*Kg + k, c, kh, kw] *
x[n, g*Cg + c, oh + kh*dh - ph, ow + kw*dw - pw] (zero outside x). Backward data at stride 1
is the forward of dy with the transposed, rotated filter (cpu_gemm.transposed_fwd), which the
native packing reads from w itself (twin). Backward
weights (f32) sums dy[k] * x[c] shifted per tap over every output row: a work item (2 output
channels, an input channel, up to 3 x 3 taps) keeps 18 vectors of lane partials, reduced at the end.
Covers f32 and bf16, 1D and 2D, stride 1 (forward: any stride across rows, 2 along a row in f32:
32 inputs loaded and the even ones kept by one permute), any dilation and padding, nchw (nhwc through one
copy each way), filters up to 64 x 16 (widths 1, 3, 5, 7 compiled as constants), groups >= 2
with at most 64 channels per group (wider groups are GEMM-shaped: solvers 10-17, 80). Needs
AVX-512 (bf16: AVX512-BF16) and the native library (nnprim/native.py)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..args import ConvArgs
from ..native import NATIVE_HELPERS, NativeLibrary
from ..post_ops import Binary, Eltwise, Sum
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import Solver, register
from .cpu_gemm import apply_post_ops_block, cpu_flags, cpu_has_amx, transposed_fwd
from .cpu_im2col import F32, Block

BF16 = torch.bfloat16
LIBRARY = NativeLibrary("nnprim_cpu_group", NATIVE_HELPERS + Path(__file__).with_name("cpu_group_direct_src.cpp").read_text(),
                        "native CPU grouped convolution")
_LOAD_BOUND = {8: 1.0, 4: 1.0, 1: 1.25}   # 1-channel blocks: a load of x per NV FMAs


def channel_block(Kg: int) -> int:
    """Output channels per register block: the fewest computed lanes (padded to whole blocks),
    with one-channel blocks (depthwise) bound by their x loads."""
    return min((8, 4, 1), key=lambda kb: (-(-Kg // kb) * kb * _LOAD_BOUND[kb], -kb))


MAX_GROUP = 64
# per core at full blocks through the solver: grouped_g8 forward (8 x 16 channels, 28 x 28, 3 x 3),
# 2 threads, AMX Xeon, 2026-12-01: f32 49-72 (the kernel alone 88-102: torch's speed; solver 17's
# batched GEMMs 0.5-0.6x of torch); bf16 by AVX512-BF16 pairs ran at half that (the kernel alone
# 2.0-2.7 ms against f32's 1.2-1.3; not profiled: the pair interleave adds 6 instructions per 16
# positions; the AMX path of solver 80 is faster on this CPU). Scaled by the blocks' lane use.
# On an AMD EPYC without AMX (2 threads, 2026-12-03) the same bf16 forward ran 1.2-1.5 ms
# (backward data 1.1-1.8; torch 0.8-1.3), faster than solver 80's VNNI brgemm there (2.0-2.2 ms).
_GFLOPS_PER_CORE = {torch.float32: 55.0, torch.bfloat16: 27.0}
# the channel-vector kernel (vector_block), AMD EPYC 2026-12-03, grouped_g8 forward, kernel alone,
# alternated with torch: f32 69-83 GFLOP/s on 1 thread, 100-150 on 2 (torch 54-76 / 80-118; the
# row kernel 52-58 / 82-112); bf16 186 / 302 (torch 148 / 248, the row kernel 126 / 225)
_VECTOR_GFLOPS_PER_CORE = {torch.float32: 70.0, torch.bfloat16: 150.0}
_BF16_GFLOPS_PER_CORE_NO_AMX = 80.0
_GBS_PER_CORE = 8.0       # nhwc copies, post-op passes
_CALL_MS = 0.02
_WGRAD_GFLOPS_PER_CORE = 60.0   # grouped_g8, 2 threads: 2.04-2.13 ms (torch 1.16-1.18; im2col + GEMM 3.9)
MAX_WGRAD_WIDTH = 1024
_CACHED_GBS_PER_CORE = 16.0   # a post-op pass over an L2-resident chunk of y (read + write)
POST_OP_CHUNK_BYTES = 2 << 20
USE_VECTOR_KERNEL = True   # groups of 16 / 32 output channels: the channel-vector kernel


def _four(t: torch.Tensor) -> torch.Tensor:
    """(N, C, W) -> (N, C, 1, W); 2D as is."""
    return t.unsqueeze(2) if t.dim() == 3 else t


def _y_dtype(p: ConvProblem) -> torch.dtype:
    """What the kernel writes: bf16 straight into y unless post-ops need the f32 result (one
    rounding either way)."""
    return BF16 if p.dtype == BF16 and p.out_dtype == BF16 and not p.post_ops else F32


def vector_block(p: ConvProblem) -> int:
    """The channel-vector kernel's block (all Kg output channels of a group as one or two zmm,
    positions of a row as broadcasts: no lane masks) for groups of 16 or 32 output channels (f32,
    or bf16 channel pairs on AVX512-BF16), else 0 (the row kernel)."""
    Kg = p.K // p.groups
    return Kg if USE_VECTOR_KERNEL and Kg in (16, 32) else 0


def epilogue(p: ConvProblem, post_ops) -> dict | None:
    """The chain as the kernel's block epilogue (res, res_scale, relu, relu_slope): a y-shaped
    contiguous nchw f32 residual (Sum, or Binary add), then relu, either optional and in that
    order, on an f32 nchw output; None for any other chain (it runs per chunk of images)."""
    ops = list(post_ops)
    out: dict = dict(res=None, res_scale=1.0, relu=False, relu_slope=0.0)
    if p.layout != "nchw" or p.out_dtype != F32:
        return None
    if ops and isinstance(ops[0], (Sum, Binary)):
        op = ops.pop(0)
        t = op.tensor
        if (isinstance(op, Binary) and op.op != "add") or tuple(t.shape) != tuple(p.y_shape) \
                or t.dtype != F32 or t.device.type != "cpu" or not t.is_contiguous():
            return None
        out.update(res=_four(t), res_scale=float(op.scale) if isinstance(op, Sum) else 1.0)
    if ops and isinstance(ops[0], Eltwise) and ops[0].kind == "relu":
        out.update(relu=True, relu_slope=float(ops.pop(0).alpha))
    return None if ops else out


def direct_fwd(p: ConvProblem, args: ConvArgs, twin: bool = False) -> torch.Tensor:
    """twin: p is the backward data's forward (transposed_fwd) and args.w the original filter,
    packed transposed and rotated by the native packing."""
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    x = _four(args.x.to(p.dtype).contiguous())
    ydt = _y_dtype(p)
    y4 = empty_in_layout((p.N, p.K, *([1] if p.ndim == 1 else []), *p.out_size), "nchw", dtype=ydt)
    pad = [0, *p.pad_before][-2:]
    dil = [1, *p.dilation][-2:]
    stride = [1, *p.stride][-2:]
    bias = args.bias.to(F32).contiguous() if args.bias is not None else None
    ops, w = LIBRARY.required(), _four(args.w.to(p.dtype)).contiguous()
    kb = vector_block(p) or channel_block(Kg)
    y = y4.view(p.N, p.K, *p.out_size)
    epi = epilogue(p, args.post_ops) if args.post_ops else None
    if epi is not None or not args.post_ops:
        ops.group_direct_fwd_w(x, w, bias, y4, G, Cg, Kg, kb, twin, pad, dil, stride, **(epi or {}))
    else:
        # chunks of images whose output stays in L2 until the chain has run over it
        nb = max(1, POST_OP_CHUNK_BYTES // max(1, y[0].numel() * 4))
        for n0 in range(0, p.N, nb):
            n1 = min(p.N, n0 + nb)
            ops.group_direct_fwd_w(x[n0:n1], w, bias, y4[n0:n1], G, Cg, Kg, kb, twin, pad, dil, stride)
            blk = Block(n0, n1, (0,) * p.ndim, tuple(p.out_size))
            apply_post_ops_block(y[n0:n1].unflatten(1, (G, Kg)), blk, G, None, args.post_ops)
    if p.layout == "nchw" and p.out_dtype == ydt:
        return y
    out = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    out.copy_(y)
    return out


def direct_bwd_data(p: ConvProblem, args: ConvArgs) -> torch.Tensor:
    return direct_fwd(transposed_fwd(p), ConvArgs(x=args.dy, w=args.w), twin=True)


def direct_bwd_weights(p: ConvProblem, args: ConvArgs) -> torch.Tensor:
    x = _four(args.x.to(F32).contiguous())
    dy = _four(args.dy.to(F32).contiguous())
    dw4 = empty_in_layout((p.K, p.C // p.groups, *([1] if p.ndim == 1 else []), *p.filter), "nchw", dtype=F32)
    LIBRARY.required().group_direct_wgrad(x, dy, dw4, p.groups, [0, *p.pad_before][-2:], [1, *p.dilation][-2:])
    dw = dw4.view(p.w_shape)
    if p.layout == "nchw" and p.out_dtype == F32:
        return dw
    out = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
    out.copy_(dw)
    return out


_RUN = {"fwd": direct_fwd, "bwd_data": direct_bwd_data, "bwd_weights": direct_bwd_weights}


class _CpuGroupDirectBase(Solver):
    family = "direct"
    primitive = "conv"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.bfloat16})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        q = transposed_fwd(p) if p.direction == "bwd_data" else p
        if p.groups < 2 or max(p.C, p.K) // p.groups > MAX_GROUP:
            reasons.append(f"groups={p.groups} with {p.C // p.groups} x {p.K // p.groups} channels per group: "
                           f"narrow groups (2+ groups of <= {MAX_GROUP} channels) only")
        if p.ndim > 2:
            reasons.append(f"{p.ndim}D: 1D and 2D only")
        if p.direction != "fwd" and any(s != 1 for s in p.stride):
            reasons.append(f"stride={p.stride}: backward directions at stride 1 only")
        elif p.stride[-1] > (2 if p.dtype == F32 or vector_block(p) else 1):
            reasons.append(f"stride={p.stride}: along a row 1 (or 2 in f32 or groups of 16 / 32 outputs) only")
        if p.filter[-1] > 16 or (p.ndim == 2 and p.filter[0] > 64):
            reasons.append(f"filter {p.filter}: at most 64 rows x 16 columns")
        if p.direction == "bwd_data" and q is None:
            reasons.append("bwd_data: padding <= dilation*(filter-1) only (the transposed forward)")
        if "avx512f" not in cpu_flags():
            reasons.append("no AVX-512 on this CPU")
        if p.direction == "bwd_weights":
            if p.dtype != F32:
                reasons.append(f"bwd_weights: f32 only, got {p.dtype}")
            if p.post_ops:
                reasons.append("post_ops apply to forward only")
            if p.out_size[-1] > MAX_WGRAD_WIDTH:
                reasons.append(f"bwd_weights: output width {p.out_size[-1]} > {MAX_WGRAD_WIDTH}")
        if p.dtype == BF16 and "avx512_bf16" not in cpu_flags():
            reasons.append("bf16 needs AVX512-BF16 (its pairwise dot product, f32 accumulation)")
        reasons += LIBRARY.missing_reasons()
        return reasons

    def estimate(self, p: ConvProblem) -> float:
        if p.direction == "bwd_weights":
            return self._estimate_wgrad(p)
        q = transposed_fwd(p) if p.direction == "bwd_data" else p
        cores = max(1, torch.get_num_threads())
        Kg, ow = q.K // q.groups, q.out_size[-1]
        kb = channel_block(Kg)
        # lanes the blocks compute / lanes kept: whole channel blocks, whole 16-position vectors
        waste = (-(-Kg // kb) * kb / Kg) * (-(-ow // 16) * 16 / ow) * _LOAD_BOUND[kb]
        if q.dtype == BF16:     # channel pairs: an odd group width wastes its last pair's half
            waste *= -(-q.C // q.groups // 2) * 2 / (q.C // q.groups)
        rate = _BF16_GFLOPS_PER_CORE_NO_AMX if q.dtype == BF16 and not cpu_has_amx() else _GFLOPS_PER_CORE[q.dtype]
        if vector_block(q):     # row blocks of a multiple of 4 positions (cv_per), odd pairs
            urm = 28 if Kg == 16 else 12
            nb = -(-ow // urm)
            waste = nb * ((-(-ow // nb) + 3) // 4 * 4) / ow
            if q.dtype == BF16:
                waste *= -(-q.C // q.groups // 2) * 2 / (q.C // q.groups)
            # bf16 measured without AMX only: on AMX CPUs the row kernel's rate (solver 80 ahead)
            rate = _VECTOR_GFLOPS_PER_CORE[q.dtype] if q.dtype == F32 or not cpu_has_amx() else rate
        compute = q.flops() * waste / (rate * 1e9 * cores)
        y_bytes = 4.0 * q.N * q.K * math.prod(q.out_size)
        moved = q.dtype.itemsize * q.N * q.C * math.prod(q.in_size) + y_bytes
        # depthwise and other thin groups stream x and y at memory speed (8 x 128 x 56 x 56
        # depthwise f32: 1.9 ms measured, 1.6 ms of traffic at 8 GB/s per core)
        stream = moved / (_GBS_PER_CORE * 1e9 * cores)
        copies = (p.layout != "nchw") + (p.out_dtype != _y_dtype(q))
        post = 2 * len(p.post_ops) * y_bytes / (_CACHED_GBS_PER_CORE * 1e9 * cores)
        return (max(compute, stream) + post + copies * stream) * 1e3 + _CALL_MS

    @staticmethod
    def _estimate_wgrad(p: ConvProblem) -> float:
        """Blocks of 4 output channels x 3 filter columns over whole 16-position vectors."""
        cores = max(1, torch.get_num_threads())
        Kg, ow, kw = p.K // p.groups, p.out_size[-1], p.filter[-1]
        waste = (-(-Kg // 4) * 4 / Kg) * (-(-ow // 16) * 16 / ow) * (-(-kw // 3) * 3 / kw)
        compute = p.flops() * waste / (_WGRAD_GFLOPS_PER_CORE * 1e9 * cores)
        copies = (p.layout != "nchw") * 4.0 * p.N * (p.C * math.prod(p.in_size) + p.K * math.prod(p.out_size))
        return (compute + copies / (_GBS_PER_CORE * 1e9 * cores)) * 1e3 + _CALL_MS

    def prepare(self, p: ConvProblem):
        fn = _RUN[p.direction]
        return lambda args: fn(p, args)


@register
class CpuGroupDirectFwd(_CpuGroupDirectBase):
    id = 83
    name = "cpu_group_direct_fwd"
    directions = frozenset({"fwd"})


@register
class CpuGroupDirectBwdData(_CpuGroupDirectBase):
    id = 84
    name = "cpu_group_direct_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class CpuGroupDirectBwdWeights(_CpuGroupDirectBase):
    id = 85
    name = "cpu_group_direct_bwd_weights"
    directions = frozenset({"bwd_weights"})


__all__ = ["CpuGroupDirectFwd", "CpuGroupDirectBwdData", "CpuGroupDirectBwdWeights", "channel_block", "direct_bwd_data",
           "direct_bwd_weights", "direct_fwd", "epilogue", "vector_block"]
