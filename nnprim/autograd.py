"""autograd.Functions: conv (x, w, bias) and sdpa (q, k, v). Backward calls the
library's own backward primitives, never kernels directly."""
from __future__ import annotations

from dataclasses import replace

import torch

from .args import AttnArgs, ConvArgs
from .post_ops import apply_post_ops
from .problems.attention import AttentionProblem
from .problems.conv import ConvProblem, layout_of, to_layout
from .search import dispatch


class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, p: ConvProblem, solver):
        ctx.p = p
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return dispatch.run(p, ConvArgs(x=x, w=w, bias=bias), solver)

    @staticmethod
    def backward(ctx, dy):
        from .api import conv_backward_bias, conv_backward_data, conv_backward_weights
        x, w = ctx.saved_tensors
        p: ConvProblem = ctx.p
        dy = to_layout(dy.to(x.dtype), layout_of(x))
        kw = dict(stride=p.stride, padding=p.padding, dilation=p.dilation, groups=p.groups)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = conv_backward_data(dy, w, x.shape, **kw)
        if ctx.needs_input_grad[1]:
            dw = conv_backward_weights(dy, x, w.shape, **kw)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = conv_backward_bias(dy)
        return dx, dw, db, None, None


def conv_forward_autograd(p: ConvProblem, x, w, bias, post_ops, solver):
    """Differentiable conv. With post-ops, the conv (+bias) runs as one primitive with an
    f32 result and the chain is applied in torch so its gradient is exact."""
    if not post_ops:
        return _ConvFunction.apply(x, w, bias, p, solver)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    base = replace(p, post_ops=(), out_dtype=acc_dtype if x.dtype != torch.float32 else x.dtype)
    y = _ConvFunction.apply(x, w, bias, base, None if solver is None else solver)
    return apply_post_ops(y, tuple(post_ops)).to(p.out_dtype)


class _SdpaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p: AttentionProblem, args: AttnArgs, solver):
        o, lse = dispatch.run(p, args, solver)
        ctx.p, ctx.args = p, args
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        a: AttnArgs = ctx.args
        bp = ctx.p.with_direction("bwd")
        bargs = replace(a, q=q, k=k, v=v, do=do.contiguous(), o=o, lse=lse)
        dq, dk, dv = dispatch.run(bp, bargs, None)
        return dq, dk, dv, None, None, None


def sdpa_autograd(p: AttentionProblem, args: AttnArgs, solver):
    if p.quantized:
        # quantized K/V carry no gradient: only q is differentiable
        from .errors import NotSupportedError
        raise NotSupportedError("gradients through quantized K/V are not supported; "
                                "call sdpa under torch.no_grad() or dequantize K/V first")
    return _SdpaFunction.apply(args.q, args.k, args.v, p, args, solver)
