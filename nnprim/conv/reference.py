"""Float64 reference convolution for all three directions (family `reference`).

Computes in float64 from first principles with torch's float64 convolution
primitives: asymmetric padding is an explicit zero pad, post-ops run on the float64
accumulator (bias first, then the chain in order), the result is cast to the output
dtype and stored in the problem's layout. Chosen only when nothing else applies or
when forced by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..args import ConvArgs
from ..post_ops import apply_post_ops
from ..problems.conv import ConvProblem, to_layout
from ..search.solver import Solver, register

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_GRAD_INPUT = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
_GRAD_WEIGHT = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}
F64 = torch.float64


def _pad_spec(p: ConvProblem) -> list[int]:
    # F.pad takes (last dim before, last dim after, ...) in reverse dim order
    spec: list[int] = []
    for b, a in reversed(p.padding):
        spec += [b, a]
    return spec


def _padded_size(p: ConvProblem) -> tuple[int, ...]:
    return tuple(s + b + a for s, b, a in zip(p.in_size, p.pad_before, p.pad_after))


def conv_fwd_f64(p: ConvProblem, x: torch.Tensor, w: torch.Tensor, bias=None, post_ops=()) -> torch.Tensor:
    """y = post_ops(conv(x, w) + bias) in float64 (logical NC<spatial>, contiguous)."""
    xp = F.pad(x.to(F64), _pad_spec(p))
    y = _CONV[p.ndim](xp, w.to(F64), None, p.stride, 0, p.dilation, p.groups)
    if bias is not None:
        y = y + bias.to(F64).reshape(1, -1, *([1] * p.ndim))
    return apply_post_ops(y, tuple(post_ops))


def conv_bwd_data_f64(p: ConvProblem, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    full = (p.N, p.C, *_padded_size(p))
    dxp = _GRAD_INPUT[p.ndim](full, w.to(F64), dy.to(F64), p.stride, 0, p.dilation, p.groups)
    idx = [slice(None), slice(None)] + [slice(b, b + s) for b, s in zip(p.pad_before, p.in_size)]
    return dxp[tuple(idx)]


def conv_bwd_weights_f64(p: ConvProblem, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    xp = F.pad(x.to(F64), _pad_spec(p))
    return _GRAD_WEIGHT[p.ndim](xp, p.w_shape, dy.to(F64), p.stride, 0, p.dilation, p.groups)


def reference(p: ConvProblem, args: ConvArgs) -> torch.Tensor:
    """The float64 result of `p` on `args` (logical shape, contiguous, float64)."""
    if p.direction == "fwd":
        return conv_fwd_f64(p, args.x, args.w, args.bias, args.post_ops)
    if p.direction == "bwd_data":
        return conv_bwd_data_f64(p, args.dy, args.w)
    return conv_bwd_weights_f64(p, args.dy, args.x)


@register
class ConvReference(Solver):
    id = 1
    name = "ConvReference"
    family = "reference"
    primitive = "conv"
    directions = frozenset({"fwd", "bwd_data", "bwd_weights"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})

    def prepare(self, p: ConvProblem):
        def invoke(args: ConvArgs) -> torch.Tensor:
            return to_layout(reference(p, args).to(p.out_dtype), p.layout)
        return invoke
