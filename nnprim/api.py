"""Public functions: validate -> problem descriptor -> dispatch -> invoker.

Differentiable entry points (conv_forward, sdpa) route through the autograd
Functions in `autograd.py` when a gradient is needed."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .args import AttnArgs, ConvArgs
from .errors import BadParameterError
from .post_ops import Binary, Eltwise, PostOp, Sum
from .problems.attention import AttentionProblem
from .problems.common import check_tensor
from .problems.conv import ConvProblem, layout_of
from .search import dispatch


# ---- convolution ------------------------------------------------------------------
def _normalize_post_ops(post_ops, y_shape: tuple[int, ...], device) -> tuple[PostOp, ...]:
    """Check the post-op chain against y and give Binary tensors y's rank:
    a 1-element tensor is per tensor, a (K,) tensor per channel, else torch broadcasting."""
    if isinstance(post_ops, (Sum, Eltwise, Binary)):
        post_ops = (post_ops,)
    try:
        ops = tuple(post_ops)
    except TypeError:
        raise BadParameterError(f"post_ops={post_ops!r} must be a sequence of Sum, Eltwise, Binary") from None
    out: list[PostOp] = []
    nd = len(y_shape)
    for i, op in enumerate(ops):
        if isinstance(op, Eltwise):
            out.append(op)
            continue
        if not isinstance(op, (Sum, Binary)):
            raise BadParameterError(f"post_ops[{i}]={op!r} is not a Sum, Eltwise or Binary")
        t = check_tensor(f"post_ops[{i}].tensor", op.tensor)
        if t.device != device:
            raise BadParameterError(f"post_ops[{i}].tensor is on {t.device} but x is on {device}")
        if not (t.is_floating_point()):
            raise BadParameterError(f"post_ops[{i}].tensor dtype={t.dtype} must be floating point")
        if isinstance(op, Sum):
            if tuple(t.shape) != y_shape:
                raise BadParameterError(f"post_ops[{i}] Sum tensor shape {tuple(t.shape)} must equal y shape {y_shape}")
            out.append(op)
            continue
        if t.numel() == 1:
            t = t.reshape((1,) * nd)
        elif t.dim() == 1 and t.shape[0] == y_shape[1]:
            t = t.reshape(1, -1, *([1] * (nd - 2)))
        else:
            if t.dim() > nd:
                raise BadParameterError(f"post_ops[{i}] Binary tensor shape {tuple(t.shape)} has more dims than y {y_shape}")
            shp = (1,) * (nd - t.dim()) + tuple(t.shape)
            if any(a not in (1, b) for a, b in zip(shp, y_shape)):
                raise BadParameterError(
                    f"post_ops[{i}] Binary tensor shape {tuple(op.tensor.shape)} is not broadcastable to y {y_shape}")
            t = t.reshape(shp)
        out.append(Binary(op.op, t))
    return tuple(out)


def _check_bias(bias, K: int, device) -> None:
    if bias is None:
        return
    check_tensor("bias", bias)
    if tuple(bias.shape) != (K,):
        raise BadParameterError(f"bias shape {tuple(bias.shape)} must be (K,)=({K},)")
    if bias.device != device:
        raise BadParameterError(f"bias is on {bias.device} but x is on {device}")
    if not bias.is_floating_point():
        raise BadParameterError(f"bias dtype={bias.dtype} must be floating point")


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


_FWD_PROBLEMS: dict[tuple, ConvProblem] = {}


def _plain(v) -> bool:
    """An int, or a tuple of ints / (int, int) pairs (exact types)."""
    if type(v) is int:
        return True
    return type(v) is tuple and all(type(e) is int or (type(e) is tuple and all(type(f) is int for f in e))
                                    for e in v)


def _fwd_problem(x, w, bias, stride, padding, dilation, groups, out_dtype) -> ConvProblem:
    """ConvProblem.from_tensors, cached by a cheap tuple of everything it depends on (the
    hot path's main cost). Only plain ints / tuples of ints are cached: 1.0 or True
    compare equal to 1 but must still be rejected by validation."""
    key = p = None
    if _plain(stride) and _plain(padding) and _plain(dilation) and type(groups) is int:
        key = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.dtype, w.device, stride, padding, dilation,
               groups, bias is None, out_dtype)
        p = _FWD_PROBLEMS.get(key)
    if p is None:
        p = ConvProblem.from_tensors(x, w, "fwd", stride=stride, padding=padding, dilation=dilation,
                                     groups=groups, bias=bias, out_dtype=out_dtype)
        if key is not None:
            if len(_FWD_PROBLEMS) >= 4096:
                _FWD_PROBLEMS.clear()
            _FWD_PROBLEMS[key] = p
    return p


_WITH_POST_OPS: dict[tuple, ConvProblem] = {}


def _with_post_ops(p: ConvProblem, sigs: tuple) -> ConvProblem:
    """p with the post-op chain's signatures, memoised: the hot path looks it up instead of
    building a new descriptor on every call."""
    key = (p, sigs)
    q = _WITH_POST_OPS.get(key)
    if q is None:
        if len(_WITH_POST_OPS) >= 4096:
            _WITH_POST_OPS.clear()
        q = _WITH_POST_OPS[key] = replace(p, post_ops=sigs)
    return q


def conv_forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 stride=1, padding=0, dilation=1, groups: int = 1, post_ops=(),
                 out_dtype: torch.dtype | None = None, solver=None) -> torch.Tensor:
    """y = post_ops(conv(x, w) + bias), cast to out_dtype, in x's layout."""
    check_tensor("x", x)
    check_tensor("w", w)
    p = _fwd_problem(x, w, bias, stride, padding, dilation, groups, out_dtype)
    _check_bias(bias, p.K, x.device)
    ops = _normalize_post_ops(post_ops, p.y_shape, x.device)
    if ops:
        p = _with_post_ops(p, tuple(op.signature() for op in ops))
    if _needs_grad(x, w, bias, *[getattr(o, "tensor", None) for o in ops]):
        from .autograd import conv_forward_autograd
        return conv_forward_autograd(p, x, w, bias, ops, solver)
    return dispatch.run(p, ConvArgs(x=x, w=w, bias=bias, post_ops=ops), solver)


def _shape(name: str, s) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in s)
    except (TypeError, ValueError):
        raise BadParameterError(f"{name}={s!r} must be a sequence of ints") from None


def conv_backward_data(dy: torch.Tensor, w: torch.Tensor, x_shape: Sequence[int], *, stride=1,
                       padding=0, dilation=1, groups: int = 1, solver=None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dx = the gradient of conv(x, w) with respect to x, given dy (x's layout = dy's)."""
    check_tensor("dy", dy)
    check_tensor("w", w)
    if dy.dtype != w.dtype:
        raise BadParameterError(f"dy.dtype={dy.dtype} and w.dtype={w.dtype} must match")
    if dy.device != w.device:
        raise BadParameterError(f"dy is on {dy.device} but w is on {w.device}")
    p = ConvProblem.create("bwd_data", _shape("x_shape", x_shape), w.shape, dtype=dy.dtype,
                           layout=layout_of(dy), device=dy.device.type, stride=stride,
                           padding=padding, dilation=dilation, groups=groups, out_dtype=out_dtype)
    if tuple(dy.shape) != p.y_shape:
        raise BadParameterError(f"dy shape {tuple(dy.shape)} must be the output shape {p.y_shape}")
    return dispatch.run(p, ConvArgs(dy=dy, w=w), solver)


def conv_backward_weights(dy: torch.Tensor, x: torch.Tensor, w_shape: Sequence[int], *, stride=1,
                          padding=0, dilation=1, groups: int = 1, solver=None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dw = the gradient of conv(x, w) with respect to w, given dy."""
    check_tensor("dy", dy)
    check_tensor("x", x)
    if dy.dtype != x.dtype:
        raise BadParameterError(f"dy.dtype={dy.dtype} and x.dtype={x.dtype} must match")
    if dy.device != x.device:
        raise BadParameterError(f"dy is on {dy.device} but x is on {x.device}")
    p = ConvProblem.create("bwd_weights", x.shape, _shape("w_shape", w_shape), dtype=x.dtype,
                           layout=layout_of(x), device=x.device.type, stride=stride,
                           padding=padding, dilation=dilation, groups=groups, out_dtype=out_dtype)
    if tuple(dy.shape) != p.y_shape:
        raise BadParameterError(f"dy shape {tuple(dy.shape)} must be the output shape {p.y_shape}")
    return dispatch.run(p, ConvArgs(dy=dy, x=x), solver)


def conv_backward_bias(dy: torch.Tensor) -> torch.Tensor:
    """db[k] = sum of dy over every dim but the channel dim (f32 accumulation)."""
    check_tensor("dy", dy)
    if dy.dim() not in (3, 4, 5):
        raise BadParameterError(f"dy has {dy.dim()} dims (shape {tuple(dy.shape)}); expected 3, 4 or 5")
    if not dy.is_floating_point():
        raise BadParameterError(f"dy.dtype={dy.dtype} must be floating point")
    dims = [0, *range(2, dy.dim())]
    acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
    return dy.sum(dim=dims, dtype=acc).to(dy.dtype)


# ---- attention ----------------------------------------------------------------------
def _attn_problem(q, k, v, direction: str, attn_mask, causal, scale, invert_scale, dropout_p,
                  seed, offset, kv_lens, softmax_inf_as_zero, return_lse) -> AttentionProblem:
    return AttentionProblem.from_tensors(
        q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, invert_scale=invert_scale,
        dropout_p=dropout_p, kv_lens=kv_lens, softmax_inf_as_zero=softmax_inf_as_zero,
        return_lse=return_lse, direction=direction, seed=seed, offset=offset)


def sdpa(q: torch.Tensor, k, v, *, attn_mask: torch.Tensor | None = None, causal=None, scale=None,
         invert_scale: bool = False, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
         kv_lens: torch.Tensor | None = None, softmax_inf_as_zero: bool = False,
         return_lse: bool = False, solver=None):
    """o = softmax(scale * q k^T + mask) v  (with GQA, dropout, quantized K/V...);
    returns o, or (o, lse) when return_lse."""
    check_tensor("q", q)
    grad = _needs_grad(q, k, v)
    p = _attn_problem(q, k, v, "fwd", attn_mask, causal, scale, invert_scale, dropout_p, seed,
                      offset, kv_lens, softmax_inf_as_zero, return_lse or grad)
    args = AttnArgs(q=q, k=k, v=v, attn_mask=attn_mask, scale=scale, seed=seed, offset=offset,
                    kv_lens=kv_lens)
    if grad:
        from .autograd import sdpa_autograd
        o, lse = sdpa_autograd(p, args, solver)
    else:
        o, lse = dispatch.run(p, args, solver)
    return (o, lse) if return_lse else o


def sdpa_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, lse: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                  causal=None, scale=None, invert_scale: bool = False, dropout_p: float = 0.0,
                  seed: int = 0, offset: int = 0, kv_lens: torch.Tensor | None = None,
                  softmax_inf_as_zero: bool = False, return_lse: bool = False, solver=None):
    """(dq, dk, dv) of sdpa given do, the forward output o and its lse."""
    for name, t in (("do", do), ("q", q), ("o", o), ("lse", lse)):
        check_tensor(name, t)
    p = _attn_problem(q, k, v, "bwd", attn_mask, causal, scale, invert_scale, dropout_p, seed,
                      offset, kv_lens, softmax_inf_as_zero, True)
    want = (p.B, p.Hq, p.Sq, p.Dv)
    for name, t in (("do", do), ("o", o)):
        if tuple(t.shape) != want:
            raise BadParameterError(f"{name} shape {tuple(t.shape)} must be (B, Hq, Sq, Dv)={want}")
        if t.device != q.device:
            raise BadParameterError(f"{name} is on {t.device} but q is on {q.device}")
    if tuple(lse.shape) != want[:3]:
        raise BadParameterError(f"lse shape {tuple(lse.shape)} must be (B, Hq, Sq)={want[:3]}")
    if lse.dtype != torch.float32 and lse.dtype != torch.float64:
        raise BadParameterError(f"lse.dtype={lse.dtype} must be float32")
    args = AttnArgs(q=q, k=k, v=v, attn_mask=attn_mask, scale=scale, seed=seed, offset=offset,
                    kv_lens=kv_lens, do=do, o=o, lse=lse)
    return dispatch.run(p, args, solver)
