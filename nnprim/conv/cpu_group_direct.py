"""CPU grouped convolution for narrow groups, direct in native f32 AVX-512 code (family
`direct`, ids 83 `cpu_group_direct_fwd`, 84 `cpu_group_direct_bwd_data`), issue 16.

With 16 channels per group (grouped_g8) every GEMM formulation is thin: 16-wide rows of a
batched GEMM (solver 17: 40 GFLOP/s per core) or 16-column brgemm calls (80). oneDNN's own
grouped kernel is direct, and so is this one (cpu_group_direct_src.cpp): a block of
8 output channels x 32 output positions of one row lives in 16 zmm accumulators while every
input channel and tap of its group streams through, one masked load of x per 16 positions
(the zero padding is the mask: no staged copy of x) and one broadcast weight per output
channel, 2 FMAs per broadcast. Weights are packed once per call as (G, Kg/8, Cg, KH, KW, 8).
Bias seeds the accumulators; post-ops run on the f32 output, per chunk of images while it is
in L2.

Math: y[n, g*Kg + k, oh, ow] = b + sum_{c, kh, kw} w[g*Kg + k, c, kh, kw] *
x[n, g*Cg + c, oh + kh*dh - ph, ow + kw*dw - pw] (zero outside x). Backward data at stride 1
is the forward of dy with the transposed, rotated filter (cpu_gemm.transposed_fwd).
Covers f32, 1D and 2D, stride 1, any dilation and padding, nchw (nhwc through one copy each
way), filter width <= 16, groups >= 2 with at most 64 channels per group (wider groups are
GEMM-shaped: solvers 10-17, 80). Needs AVX-512 and the native library (nnprim/native.py)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..args import ConvArgs
from ..native import NativeLibrary
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import Solver, register
from .cpu_gemm import apply_post_ops_block, cpu_flags, transposed_fwd
from .cpu_im2col import F32, Block

LIBRARY = NativeLibrary("nnprim_cpu_group", Path(__file__).with_name("cpu_group_direct_src.cpp").read_text(),
                        "native CPU grouped convolution")
KB = 8                    # output channels per register block
NV = 32                   # output positions per register block (two zmm)
MAX_GROUP = 64
# f32 per core at full blocks: grouped_g8 forward (8 x 16 channels, 28 x 28, 3 x 3), 2 threads: 49-72
# (1.02-1.18x torch in the same runs; the batched GEMMs of solver 17: 0.5-0.6x),
# AMX Xeon, 2026-12-01 (benchmarks/cpu_speed.py); scaled by the blocks' lane use in `estimate`
_GFLOPS_PER_CORE = 55.0
_GBS_PER_CORE = 8.0       # nhwc copies, post-op passes
_CALL_MS = 0.02
_CACHED_GBS_PER_CORE = 16.0   # a post-op pass over an L2-resident chunk of y (read + write)
POST_OP_CHUNK_BYTES = 2 << 20


def _four(t: torch.Tensor) -> torch.Tensor:
    """(N, C, W) -> (N, C, 1, W); 2D as is."""
    return t.unsqueeze(2) if t.dim() == 3 else t


def pack_weights(p: ConvProblem, w: torch.Tensor) -> torch.Tensor:
    """(K, Cg, [KH,] KW) -> (G, ceil(Kg/8), Cg, KH, KW, 8) f32, zero past Kg."""
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    nkb = -(-Kg // KB)
    w4 = _four(w.to(F32)).reshape(G, Kg, Cg, *_four(w).shape[2:])
    if nkb * KB != Kg:
        w4 = torch.cat([w4, w4.new_zeros(G, nkb * KB - Kg, *w4.shape[2:])], 1)
    return w4.view(G, nkb, KB, *w4.shape[2:]).permute(0, 1, 3, 4, 5, 2).contiguous()


def direct_fwd(p: ConvProblem, args: ConvArgs) -> torch.Tensor:
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    x = _four(args.x.to(F32).contiguous())
    y4 = empty_in_layout((p.N, p.K, *([1] if p.ndim == 1 else []), *p.out_size), "nchw", dtype=F32)
    pad = [0, *p.pad_before][-2:]
    dil = [1, *p.dilation][-2:]
    bias = args.bias.to(F32).contiguous() if args.bias is not None else None
    wp, ops = pack_weights(p, args.w), LIBRARY.ops()
    y = y4.view(p.N, p.K, *p.out_size)
    # with post-ops, chunks of images whose output stays in L2 until the chain has run over it
    nb = max(1, POST_OP_CHUNK_BYTES // max(1, y[0].numel() * 4)) if args.post_ops else p.N
    for n0 in range(0, p.N, nb):
        n1 = min(p.N, n0 + nb)
        ops.group_direct_fwd(x[n0:n1], wp, bias, y4[n0:n1], G, Cg, Kg, pad, dil)
        if args.post_ops:
            blk = Block(n0, n1, (0,) * p.ndim, tuple(p.out_size))
            apply_post_ops_block(y[n0:n1].unflatten(1, (G, Kg)), blk, G, None, args.post_ops)
    if p.layout == "nchw" and p.out_dtype == F32:
        return y
    out = empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype)
    out.copy_(y)
    return out


def direct_bwd_data(p: ConvProblem, args: ConvArgs) -> torch.Tensor:
    pf = transposed_fwd(p)
    G, Kg, nd = p.groups, p.K // p.groups, p.ndim
    wt = args.w.unflatten(0, (G, Kg)).transpose(1, 2).flip(list(range(3, 3 + nd)))
    return direct_fwd(pf, ConvArgs(x=args.dy, w=wt.reshape(p.C, Kg, *p.filter)))


_RUN = {"fwd": direct_fwd, "bwd_data": direct_bwd_data}


class _CpuGroupDirectBase(Solver):
    family = "direct"
    primitive = "conv"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        q = transposed_fwd(p) if p.direction == "bwd_data" else p
        if p.groups < 2 or max(p.C, p.K) // p.groups > MAX_GROUP:
            reasons.append(f"groups={p.groups} with {p.C // p.groups} x {p.K // p.groups} channels per group: "
                           f"narrow groups (2+ groups of <= {MAX_GROUP} channels) only")
        if p.ndim > 2:
            reasons.append(f"{p.ndim}D: 1D and 2D only")
        if any(s != 1 for s in p.stride):
            reasons.append(f"stride={p.stride}: stride 1 only")
        if p.filter[-1] > 16:
            reasons.append(f"filter width {p.filter[-1]} > 16")
        if p.direction == "bwd_data" and q is None:
            reasons.append("bwd_data: padding <= dilation*(filter-1) only (the transposed forward)")
        if "avx512f" not in cpu_flags():
            reasons.append("no AVX-512 on this CPU")
        if not LIBRARY.expected():
            reasons.append("the native CPU library cannot be built here (no C++ compiler, not Linux, "
                           "or NNPRIM_CPU_NATIVE=0)")
        return reasons

    def estimate(self, p: ConvProblem) -> float:
        q = transposed_fwd(p) if p.direction == "bwd_data" else p
        cores = max(1, torch.get_num_threads())
        Kg, ow = q.K // q.groups, q.out_size[-1]
        # lanes the blocks compute / lanes kept: 8-channel blocks, 32 (or a last 16) positions
        blocks = ow // NV * NV + (NV if ow % NV > 16 else 16 if ow % NV else 0)
        waste = (-(-Kg // KB) * KB / Kg) * (blocks / ow)
        compute = q.flops() * waste / (_GFLOPS_PER_CORE * 1e9 * cores)
        y_bytes = 4.0 * q.N * q.K * math.prod(q.out_size)
        moved = 4.0 * q.N * q.C * math.prod(q.in_size) + y_bytes
        copies = (p.layout != "nchw") + (p.out_dtype != F32)
        post = 2 * len(p.post_ops) * y_bytes / (_CACHED_GBS_PER_CORE * 1e9 * cores)
        return (compute + post + copies * moved / (_GBS_PER_CORE * 1e9 * cores)) * 1e3 + _CALL_MS

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


__all__ = ["CpuGroupDirectFwd", "CpuGroupDirectBwdData", "direct_fwd", "direct_bwd_data", "pack_weights"]
