"""NCHW convolutions through the NHWC tensor-memory-access kernels: solvers 23/24/25,
family `implicit_gemm`.

The TMA implicit-GEMM kernels need channels contiguous (16-byte channel rows); NCHW
problems otherwise run the pointer-gather kernels at 0.3-0.4x cuDNN (NCHW rn50_r3_3x3,
2026-11-30). These solvers change the layout once on the way in (x / dy / w and any
full-size post-op tensor) and once on the way out, and run the NHWC solver (Gluon 27 / 28 / 29
where they apply, else 20 / 21 / 22) in between: two extra passes over the activations, which pays when the NHWC kernel is
more than that much faster; find measures both and keeps the faster.

Workspace: the NHWC copies of the inputs and of the output (temporaries of one call)."""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..args import ConvArgs
from ..post_ops import Binary, Sum
from ..problems.conv import ConvProblem
from ..search.solver import REGISTRY, Solver, register
from . import configs
from .layout_copy import Transpose

COPY_BYTES_PER_S = 2.8e12   # transposing NCHW <-> NHWC copies on the H200 (layout_copy.py; see estimate)
COPY_LAUNCH_S = 1.5e-5     # per copy kernel

_INNER = {"fwd": "implicit_gemm_fwd", "bwd_data": "implicit_gemm_bwd_data",
          "bwd_weights": "implicit_gemm_bwd_weights"}
# the Gluon kernels where they run the twin (forward: 0.57-0.62x solver 20's time on the
# ResNet-50 / UNet layers of the H200 probe, benchmarks/gluon_conv_probe.py)
_GLUON = {"fwd": "gluon_implicit_gemm_fwd", "bwd_data": "gluon_implicit_gemm_bwd_data",
          "bwd_weights": "gluon_implicit_gemm_bwd_weights"}


def inner_solver(p: ConvProblem) -> Solver:
    """The NHWC solver that runs p's twin."""
    twin = nhwc_twin(p)
    if p.direction in _GLUON:
        gluon = REGISTRY.get(_GLUON[p.direction])
        if gluon.is_applicable(twin):
            return gluon
    return REGISTRY.get(_INNER[p.direction])


def nhwc_twin(p: ConvProblem) -> ConvProblem:
    """The same problem with channels-last tensors."""
    return replace(p, layout="nhwc")


def _fast_path(twin: ConvProblem) -> bool:
    """Whether the NHWC twin runs a TMA kernel (else the change buys nothing)."""
    return configs.plain_gemm_eligible(twin) or configs.tma_conv_eligible(twin)


class LayoutChangePlan:
    """Invoker: NCHW in, NHWC solver, NCHW out."""

    def __init__(self, p: ConvProblem):
        self.p = p
        self.inner = inner_solver(p).prepare(nhwc_twin(p))
        self.copies: dict[tuple, Transpose] = {}     # planned copies per (shape, target layout, dtype)

    def _copy(self, t: torch.Tensor | None, to: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        if t is None:
            return None
        key = (tuple(t.shape), to, t.dtype)    # a planned launch is compiled for one dtype
        tr = self.copies.get(key)
        if tr is None:
            tr = self.copies[key] = Transpose(key[0], to)
        return tr(t, out)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        nhwc = lambda t: self._copy(t, "nhwc")  # noqa: E731
        post = tuple(Sum(nhwc(o.tensor), o.scale) if isinstance(o, Sum) else
                     Binary(o.op, nhwc(o.tensor)) if isinstance(o, Binary) and o.tensor.dim() == args.x.dim()
                     else o for o in args.post_ops)
        inner_args = ConvArgs(x=nhwc(args.x), w=nhwc(args.w), dy=nhwc(args.dy), bias=args.bias, post_ops=post)
        res = self.inner(inner_args)
        if out is not None:
            return self._copy(res, "nchw", out) if out.is_contiguous() else out.copy_(res)
        return self._copy(res, "nchw")


class _LayoutChangeBase(Solver):
    family = "implicit_gemm"
    primitive = "conv"
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        if problem.layout != "nchw":
            reasons.append("serves NCHW problems (NHWC ones run the NHWC solvers directly)")
            return reasons
        twin = nhwc_twin(problem)
        if not _fast_path(twin) and inner_solver(problem).name not in _GLUON.values():
            reasons.append("the NHWC twin has no TMA kernel (f16/bf16, groups 1, 16-byte channel rows, "
                           "stride 1 with a filter or an unpadded 1x1)")
        reasons += [f"NHWC solver: {r}" for r in inner_solver(problem).not_supported_reasons(twin)]
        return reasons

    def workspace_size(self, problem) -> int:
        """The NHWC copies of the two inputs the direction reads, and the NHWC solver's own
        workspace (measured on the H200 by tests/gpu/test_workspace.py)."""
        e = torch.tensor([], dtype=problem.dtype).element_size()
        reads = {"fwd": (problem.x_shape, problem.w_shape), "bwd_data": (problem.y_shape, problem.w_shape),
                 "bwd_weights": (problem.y_shape, problem.x_shape)}[problem.direction]
        return sum(map(math.prod, reads)) * e + inner_solver(problem).workspace_size(nhwc_twin(problem))

    def estimate(self, problem) -> float | None:
        inner = inner_solver(problem).estimate(nhwc_twin(problem))
        if inner is None:
            return None
        # one read and one write of every tensor in the layout changes: the Triton transposes
        # ran 2.7-2.9 TB/s on the H200 (2026-12-02, benchmarks/nchw_probe.py; torch's copies
        # 0.6-0.8 TB/s), plus a launch per copy
        return inner + (2 * problem.bytes() / COPY_BYTES_PER_S + 3 * COPY_LAUNCH_S) * 1e3

    def prepare(self, problem):
        return LayoutChangePlan(problem)


@register
class LayoutChangeFwd(_LayoutChangeBase):
    id = 23
    name = "nchw_via_nhwc_fwd"
    directions = frozenset({"fwd"})


@register
class LayoutChangeBwdData(_LayoutChangeBase):
    id = 24
    name = "nchw_via_nhwc_bwd_data"
    directions = frozenset({"bwd_data"})


@register
class LayoutChangeBwdWeights(_LayoutChangeBase):
    id = 25
    name = "nchw_via_nhwc_bwd_weights"
    directions = frozenset({"bwd_weights"})
