"""Post-operations fused into convolution forward, applied in order to the f32
accumulator after the bias and before the cast to the output dtype (the seed's
post-processing: sum, eltwise, binary).

Supported eltwise kinds (alpha/beta meaning follows oneDNN):
relu (alpha = negative slope), gelu_tanh, gelu_erf, silu, sigmoid, tanh,
elu (alpha), clip (alpha = lower, beta = upper), linear (alpha*x + beta),
square, abs, sqrt, exp, log, hardswish, mish.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

from .errors import BadParameterError

ELTWISE_KINDS = (
    "relu", "gelu_tanh", "gelu_erf", "silu", "sigmoid", "tanh", "elu", "clip", "linear",
    "square", "abs", "sqrt", "exp", "log", "hardswish", "mish",
)
BINARY_OPS = ("add", "sub", "mul", "div", "max", "min")


@dataclass(frozen=True, eq=False)
class Sum:
    """y = acc + scale * tensor (tensor has y's full shape; the residual add)."""

    tensor: torch.Tensor
    scale: float = 1.0

    def signature(self) -> tuple:
        return ("sum", float(self.scale))


@dataclass(frozen=True)
class Eltwise:
    """y = f(acc; alpha, beta)."""

    kind: str
    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ELTWISE_KINDS:
            raise BadParameterError(
                f"Eltwise kind={self.kind!r} is not one of {', '.join(ELTWISE_KINDS)}")

    def signature(self) -> tuple:
        return ("eltwise", self.kind, float(self.alpha), float(self.beta))


@dataclass(frozen=True, eq=False)
class Binary:
    """y = acc <op> tensor, tensor broadcastable to y (per tensor, per channel, or full)."""

    op: str
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if self.op not in BINARY_OPS:
            raise BadParameterError(f"Binary op={self.op!r} is not one of {', '.join(BINARY_OPS)}")

    def signature(self) -> tuple:
        return ("binary", self.op, tuple(self.tensor.shape))


PostOp = Union[Sum, Eltwise, Binary]


def eltwise(kind: str, x: torch.Tensor, alpha: float = 0.0, beta: float = 0.0) -> torch.Tensor:
    """Reference eltwise on a float tensor (f32 or f64)."""
    if kind == "relu":
        return torch.where(x > 0, x, x * alpha)
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if kind == "gelu_erf":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "silu":
        return x * torch.sigmoid(x)
    if kind == "sigmoid":
        return torch.sigmoid(x)
    if kind == "tanh":
        return torch.tanh(x)
    if kind == "elu":
        return torch.where(x > 0, x, alpha * torch.expm1(x))
    if kind == "clip":
        return torch.clamp(x, alpha, beta)
    if kind == "linear":
        return alpha * x + beta
    if kind == "square":
        return x * x
    if kind == "abs":
        return x.abs()
    if kind == "sqrt":
        return torch.sqrt(x)
    if kind == "exp":
        return torch.exp(x)
    if kind == "log":
        return torch.log(x)
    if kind == "hardswish":
        return x * torch.clamp(x + 3.0, 0.0, 6.0) / 6.0
    if kind == "mish":
        return x * torch.tanh(torch.nn.functional.softplus(x))
    raise BadParameterError(f"Eltwise kind={kind!r} is not one of {', '.join(ELTWISE_KINDS)}")


def binary(op: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if op == "add":
        return x + t
    if op == "sub":
        return x - t
    if op == "mul":
        return x * t
    if op == "div":
        return x / t
    if op == "max":
        return torch.maximum(x, t)
    if op == "min":
        return torch.minimum(x, t)
    raise BadParameterError(f"Binary op={op!r} is not one of {', '.join(BINARY_OPS)}")


def apply_post_ops(acc: torch.Tensor, post_ops: tuple[PostOp, ...]) -> torch.Tensor:
    """Apply the chain to `acc` (logical NC<spatial> shape) in acc's dtype.
    Sum/Binary tensors are converted to acc's dtype (and broadcast)."""
    for op in post_ops:
        if isinstance(op, Sum):
            acc = acc + op.scale * op.tensor.to(acc.dtype)
        elif isinstance(op, Eltwise):
            acc = eltwise(op.kind, acc, op.alpha, op.beta)
        else:
            acc = binary(op.op, acc, op.tensor.to(acc.dtype))
    return acc
