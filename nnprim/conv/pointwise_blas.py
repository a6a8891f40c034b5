"""Pointwise convolution as one cuBLAS GEMM straight into the output (family `gemm`,
solvers 33/34/35), MIOpen's GemmFwd1x1_0_1 in torch terms.

A 1x1, stride-1, unpadded, ungrouped NHWC convolution is a matrix product of the pixel
rows of x (dy) with the filter matrix:
  fwd:       y[m, k]  = sum_c x[m, c] * w[k, c]   (+ bias[k])   -> addmm / mm, out=y rows
  bwd_data:  dx[m, c] = sum_k dy[m, k] * w[k, c]                -> mm, out=dx rows
  bwd_w:     dw[k, c] = sum_m dy[m, k] * x[m, c]                -> mm into f32, cast
where m runs over N * pixels. Solvers 30/31 serve these too, but write an f32 result and
cast it in a second kernel (3x the output bytes): on the memory-bound ResNet 1x1 layers
(e.g. C = K = 64 at 56x56, 102 MB moved) that costs 2x. Here cuBLAS accumulates in f32 and
rounds once into the output, as cuDNN does; the bias rides cuBLASLt's bias epilogue.
Backward weights reduces over all N * pixels rows (400k on the rn50 layers): cuBLAS
splits that reduction, and its result goes to an f32 buffer (out_dtype) so that the
split partial sums are added in f32 whatever torch's reduced-precision switches say; a
(K, C) cast follows.
Precision is torch.mm's: f32 accumulation, and where cuBLAS splits the reduction its partial
sums follow torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction, as in
nn.Linear.

Not supported: groups, post-ops (the f32-result solvers and the implicit-GEMM solvers fuse
them), f32 inputs (torch's TF32 switch would change their precision), NCHW (a pixel's
channels are not one row there)."""
from __future__ import annotations

import math

import torch

from .. import workspace
from ..args import ConvArgs
from ..problems.conv import ConvProblem
from ..search.solver import Solver, register
from .im2col_gemm import is_pointwise
from .implicit_gemm import HOST_FLOOR_MS, HOST_PER_LAUNCH_MS, layout_strides, roofline_ms

# host per call on find's clock: a Triton solver's floor plus what torch.mm's dispatch and
# cuBLAS's heuristic cost beyond a Triton launch (public call 58-68 us against 51-60 for
# implicit_gemm_fwd, results/pointwise_host_2026-12-01_s8.txt); backward weights adds the
# f32 buffer and the cast launch
HOST_MS = HOST_FLOOR_MS + 0.010
HOST_MS_BWD_WEIGHTS = HOST_MS + HOST_PER_LAUNCH_MS


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (f32) = a @ b for bf16/f16 a, b (CPU, for the tests: no out_dtype kernels there)."""
    if a.is_cuda:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


class Plan:
    """The invoker: one GEMM per call. Tensors with the layout's own strides take the
    fast path (the row matrices as `as_strided` views: these layers are host-bound near
    30 us, and movedim + view cost ~3 us each); others are viewed or copied, and an output
    that is not one row matrix is written through a temporary."""

    def __init__(self, p: ConvProblem):
        self.p = p
        d = p.direction
        self.out_shape = {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weights": p.w_shape}[d]
        self.out_strides = layout_strides(self.out_shape, p.layout)
        rows = p.N * math.prod(p.in_size)
        # w (K, C, 1.., 1) is the (K, C) matrix (C, 1) in either layout
        self.kc = ((p.K, p.C), (p.C, 1))
        if d == "bwd_weights":
            self.srcs = ((p.y_shape, ((p.K, rows), (1, p.K))), (p.x_shape, ((rows, p.C), (p.C, 1))))
            self.o_geom = self.kc
        else:
            src = p.x_shape if d == "fwd" else p.y_shape
            b = ((p.C, p.K), (1, p.C)) if d == "fwd" else self.kc
            self.srcs = ((src, ((rows, src[1]), (src[1], 1))), (p.w_shape, b))
            self.o_geom = ((rows, self.out_shape[1]), (self.out_shape[1], 1))
        self.src_strides = tuple(layout_strides(s, p.layout) for s, _ in self.srcs)
        # bf16/f16 inputs, f32 output; backward weights always reduces into f32 first
        self.f32_out = p.out_dtype != p.dtype
        self.workspace = p.K * p.C * 4 if d == "bwd_weights" and not self.f32_out else 0

    def _operand(self, i: int, t: torch.Tensor) -> torch.Tensor:
        geom, p = self.srcs[i][1], self.p
        w_in = i == 1 and p.direction != "bwd_weights"
        if t.stride() == self.src_strides[i] or (w_in and t.stride()[:2] == (p.C, 1)):
            return t.as_strided(*geom, t.storage_offset())
        if w_in:                                                       # w: other (K, C) strides
            w = t.reshape(p.K, p.C)
            return w.t() if p.direction == "fwd" else w
        rows = t.movedim(1, -1).reshape(-1, t.shape[1])
        return rows.t() if geom[1] == (1, p.K) else rows

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.p
        d = p.direction
        ins = (args.x, args.w) if d == "fwd" else (args.dy, args.w) if d == "bwd_data" else (args.dy, args.x)
        dev = ins[0].device
        if out is None:
            out = torch.empty_strided(self.out_shape, self.out_strides, dtype=p.out_dtype, device=dev)
        a, b = self._operand(0, ins[0]), self._operand(1, ins[1])
        direct = out.stride() == self.out_strides or (d == "bwd_weights" and out.stride()[:2] == (p.C, 1))
        o = out.as_strided(*self.o_geom, out.storage_offset()) if direct else \
            torch.empty(self.o_geom[0], dtype=out.dtype, device=dev)
        if self.workspace:                               # bwd_weights into f32, then the cast
            acc = workspace.empty(self.o_geom[0], torch.float32, dev)
            _mm_f32(a, b, acc)
            o.copy_(acc)
        elif self.f32_out:
            _mm_f32(a, b, o)
            if p.has_bias:
                o.add_(args.bias.to(o.dtype))
        elif p.has_bias:
            torch.addmm(args.bias.to(o.dtype), a, b, out=o)
        else:
            torch.mm(a, b, out=o)
        if not direct:
            if d == "bwd_weights":
                out.copy_(o.view(out.shape))
            else:
                out.copy_(o.view(out.shape[0], *out.shape[2:], out.shape[1]).movedim(-1, 1))
        return out


class _PointwiseBase(Solver):
    family = "gemm"
    primitive = "conv"
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16})

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        if not is_pointwise(problem):
            reasons.append("needs a 1x1, stride-1, unpadded NHWC convolution (one GEMM over pixel rows)")
        if problem.groups != 1:
            reasons.append(f"groups={problem.groups}: one GEMM serves ungrouped convolutions only")
        if problem.post_ops:
            reasons.append("post-ops are fused by the f32-result gemm and implicit-GEMM solvers, not here")
        rows = problem.N * math.prod(problem.in_size)
        if rows >= 2 ** 31:
            reasons.append(f"{rows} pixel rows exceed cuBLAS's 32-bit dimensions")
        return reasons

    def estimate(self, problem) -> float | None:
        # cuBLAS on these tall, thin products: ~80% of the copy bandwidth where memory bound
        # (rn50 1x1 layers), 70% of the bf16 peak where compute bound
        extra = 2 * math.prod(problem.y_shape) * 4 if problem.out_dtype != problem.dtype and problem.has_bias else 0
        host = HOST_MS_BWD_WEIGHTS if problem.direction == "bwd_weights" else HOST_MS
        return max(roofline_ms(problem.flops(), problem.bytes() + extra, problem.dtype, 0.75), host)

    def workspace_size(self, problem) -> int:
        return Plan(problem).workspace

    def prepare(self, problem):
        return Plan(problem)


@register
class Gemm1x1Fwd(_PointwiseBase):
    id = 33
    name = "gemm_1x1_fwd"
    directions = frozenset({"fwd"})


@register
class Gemm1x1BwdData(_PointwiseBase):
    id = 34
    name = "gemm_1x1_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class Gemm1x1BwdWeights(_PointwiseBase):
    id = 35
    name = "gemm_1x1_bwd_weights"
    directions = frozenset({"bwd_weights"})
