"""Convolution ops: nnprim::conv_forward, conv_backward_data, conv_backward_weights.

Schema conventions: `padding` is flat, the before-pads of every spatial dim then the
after-pads; `post_ops` is a text spec of the chain (`post_op_spec`) whose Sum / Binary
tensors come in order in `post_tensors`; `solver` is a name or an id as text.
Autograd of conv_forward: dx = conv_backward_data(dy, w), dw = conv_backward_weights(dy,
x), dbias = the sum of dy over all but the channel dim (f32 accumulation)."""
from __future__ import annotations

import functools

import torch

from ..args import ConvArgs
from ..errors import BadParameterError, NotSupportedError
from ..post_ops import Binary, Eltwise, PostOp, Sum
from ..problems.common import check_float_dtype
from ..problems.conv import ConvProblem, empty_in_layout, layout_of, to_layout
from ..search.context import context
from ..warmup import note
from . import LIB, c_apply, transforms_active, unwrap
from . import TAGS as _TAGS

LIB.define("conv_forward(Tensor x, Tensor w, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
           "int groups, str post_ops, Tensor[] post_tensors, ScalarType? out_dtype, str? solver) -> Tensor", tags=_TAGS)
LIB.define("conv_backward_data(Tensor dy, Tensor w, int[] x_shape, int[] stride, int[] padding, "
           "int[] dilation, int groups, ScalarType? out_dtype, str? solver) -> Tensor", tags=_TAGS)
LIB.define("conv_backward_weights(Tensor dy, Tensor x, int[] w_shape, int[] stride, int[] padding, "
           "int[] dilation, int groups, ScalarType? out_dtype, str? solver) -> Tensor", tags=_TAGS)


# ---- post-op chains as text ------------------------------------------------------------------
def post_op_spec(ops: tuple[PostOp, ...]) -> tuple[str, list[torch.Tensor]]:
    """(text spec, tensors) of a post-op chain: "sum,1.0;eltwise,relu,0.0,0.0;binary,add"."""
    parts, tensors = [], []
    for op in ops:
        if isinstance(op, Sum):
            parts.append(f"sum,{float(op.scale)!r}")
            tensors.append(op.tensor)
        elif isinstance(op, Eltwise):
            parts.append(f"eltwise,{op.kind},{float(op.alpha)!r},{float(op.beta)!r}")
        else:
            parts.append(f"binary,{op.op}")
            tensors.append(op.tensor)
    return ";".join(parts), tensors


@functools.lru_cache(maxsize=1024)
def _parse_spec(spec: str) -> tuple:
    out = []
    for item in filter(None, spec.split(";")):
        kind, *vals = item.split(",")
        try:
            if kind == "sum" and len(vals) == 1:
                out.append(("sum", float(vals[0])))
            elif kind == "eltwise" and len(vals) == 3:
                out.append(Eltwise(vals[0], float(vals[1]), float(vals[2])))
            elif kind == "binary" and len(vals) == 1:
                out.append(("binary", vals[0]))
            else:
                raise ValueError
        except ValueError:
            raise BadParameterError(f"post_ops spec item {item!r} is not 'sum,SCALE', 'eltwise,KIND,A,B' "
                                    "or 'binary,OP'") from None
    return tuple(out)


def decode_post_ops(spec: str, tensors) -> tuple[PostOp, ...]:
    """The chain of a spec, its Sum / Binary ops bound to `tensors` in order."""
    if not spec:
        if tensors:
            raise BadParameterError(f"post_tensors has {len(tensors)} tensors but post_ops is empty")
        return ()
    items = _parse_spec(spec)
    it = iter(tensors)
    out: list[PostOp] = []
    try:
        for item in items:
            if isinstance(item, Eltwise):
                out.append(item)
            elif item[0] == "sum":
                out.append(Sum(next(it), item[1]))
            else:
                out.append(Binary(item[1], next(it)))
    except StopIteration:
        raise BadParameterError(f"post_ops {spec!r} needs more than the {len(tensors)} post_tensors given") from None
    if next(it, None) is not None:
        raise BadParameterError(f"post_tensors has more tensors than post_ops {spec!r} uses")
    return tuple(out)


# ---- problems (validation) -------------------------------------------------------------------
def _pairs(padding, nd: int) -> tuple[tuple[int, int], ...]:
    padding = tuple(padding)
    if len(padding) == nd:
        return tuple((p, p) for p in padding)
    if len(padding) != 2 * nd:
        raise BadParameterError(f"padding={list(padding)} must hold {nd} or {2 * nd} ints (before..., after...)")
    return tuple(zip(padding[:nd], padding[nd:]))


def _check_on(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise BadParameterError(f"{name} is on {t.device} but x is on {device}")


def fwd_problem(x, w, bias, stride, padding, dilation, groups, post_spec, post_tensors, out_dtype) -> ConvProblem:
    """Validate a conv_forward call; its ConvProblem."""
    nd = x.dim() - 2
    ops = decode_post_ops(post_spec, post_tensors)
    p = ConvProblem.from_tensors(x, w, "fwd", stride=tuple(stride), padding=_pairs(padding, nd),
                                 dilation=tuple(dilation), groups=groups, bias=bias, post_ops=ops,
                                 out_dtype=out_dtype)
    if bias is not None:
        if tuple(bias.shape) != (p.K,):
            raise BadParameterError(f"bias shape {tuple(bias.shape)} must be (K,)=({p.K},)")
        _check_on("bias", bias, x.device)
        check_float_dtype("bias", bias)
    for i, op in enumerate(ops):
        t = getattr(op, "tensor", None)
        if t is None:
            continue
        _check_on(f"post_ops[{i}].tensor", t, x.device)
        if not t.is_floating_point():
            raise BadParameterError(f"post_ops[{i}].tensor dtype={t.dtype} must be floating point")
        shape = tuple(t.shape)
        if isinstance(op, Sum):
            if shape != p.y_shape:
                raise BadParameterError(f"post_ops[{i}] Sum tensor shape {shape} must equal y shape {p.y_shape}")
        elif len(shape) != len(p.y_shape) or any(a not in (1, b) for a, b in zip(shape, p.y_shape)):
            raise BadParameterError(f"post_ops[{i}] Binary tensor shape {shape} is not broadcastable to y "
                                    f"{p.y_shape} (give it y's rank)")
    note(p)
    return p


def _bwd_problem(direction: str, dy, t, shape, stride, padding, dilation, groups, out_dtype) -> ConvProblem:
    """bwd_data (t = w, shape = x's) or bwd_weights (t = x, shape = w's)."""
    other = "w" if direction == "bwd_data" else "x"
    check_float_dtype("dy", dy)
    check_float_dtype(other, t)
    if dy.dtype != t.dtype:
        raise BadParameterError(f"dy.dtype={dy.dtype} and {other}.dtype={t.dtype} must match")
    if dy.device != t.device:
        raise BadParameterError(f"dy is on {dy.device} but {other} is on {t.device}")
    try:
        shape = tuple(int(v) for v in shape)
    except (TypeError, ValueError):
        raise BadParameterError(f"{'x' if other == 'w' else 'w'}_shape={shape!r} must be a sequence of ints") from None
    if len(shape) != dy.dim():
        raise BadParameterError(f"{'x' if other == 'w' else 'w'}_shape={shape} has {len(shape)} dims but dy has "
                                f"{dy.dim()} (shape {tuple(dy.shape)})")
    x_shape, w_shape = (shape, tuple(t.shape)) if direction == "bwd_data" else (tuple(t.shape), shape)
    layout = layout_of(dy) if direction == "bwd_data" else layout_of(t)
    p = ConvProblem.create(direction, x_shape, w_shape, dtype=dy.dtype, layout=layout, device=dy.device.type,
                           stride=tuple(stride), padding=_pairs(padding, len(x_shape) - 2),
                           dilation=tuple(dilation), groups=groups, out_dtype=out_dtype)
    if tuple(dy.shape) != p.y_shape:
        raise BadParameterError(f"dy shape {tuple(dy.shape)} must be the output shape {p.y_shape}")
    note(p)
    return p


def _tkey(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


# ---- implementations -----------------------------------------------------------------------
@torch.library.impl(LIB, "conv_forward", "CompositeExplicitAutograd")
def _conv_forward(x, w, bias, stride, padding, dilation, groups, post_ops, post_tensors, out_dtype, solver):
    ops = decode_post_ops(post_ops, post_tensors)
    key = ("fwd", x.shape, x.stride(), x.dtype, (w.shape, w.stride(), w.dtype, w.device), _tkey(bias),
           tuple(stride), tuple(padding), tuple(dilation), groups, post_ops,
           tuple(map(_tkey, post_tensors)) if post_tensors else (), out_dtype, solver)
    return context(x.device).call(
        key, lambda: fwd_problem(x, w, bias, stride, padding, dilation, groups, post_ops, post_tensors, out_dtype),
        ConvArgs(x=x, w=w, bias=bias, post_ops=ops), solver)


@torch.library.register_fake("nnprim::conv_forward", lib=LIB)
def _conv_forward_fake(x, w, bias, stride, padding, dilation, groups, post_ops, post_tensors, out_dtype, solver):
    p = fwd_problem(x, w, bias, stride, padding, dilation, groups, post_ops, post_tensors, out_dtype)
    return empty_in_layout(p.y_shape, p.layout, dtype=p.out_dtype, device=x.device)


@torch.library.impl(LIB, "conv_backward_data", "CompositeExplicitAutograd")
def _conv_backward_data(dy, w, x_shape, stride, padding, dilation, groups, out_dtype, solver):
    key = ("bwd_data", dy.shape, dy.stride(), dy.dtype, (w.shape, w.stride(), w.dtype, w.device), tuple(x_shape),
           tuple(stride), tuple(padding), tuple(dilation), groups, out_dtype, solver)
    return context(dy.device).call(
        key, lambda: _bwd_problem("bwd_data", dy, w, x_shape, stride, padding, dilation, groups, out_dtype),
        ConvArgs(dy=dy, w=w), solver)


@torch.library.register_fake("nnprim::conv_backward_data", lib=LIB)
def _conv_backward_data_fake(dy, w, x_shape, stride, padding, dilation, groups, out_dtype, solver):
    p = _bwd_problem("bwd_data", dy, w, x_shape, stride, padding, dilation, groups, out_dtype)
    return empty_in_layout(p.x_shape, p.layout, dtype=p.out_dtype, device=dy.device)


@torch.library.impl(LIB, "conv_backward_weights", "CompositeExplicitAutograd")
def _conv_backward_weights(dy, x, w_shape, stride, padding, dilation, groups, out_dtype, solver):
    key = ("bwd_weights", dy.shape, dy.stride(), dy.dtype, (x.shape, x.stride(), x.dtype, x.device),
           tuple(w_shape), tuple(stride),
           tuple(padding), tuple(dilation), groups, out_dtype, solver)
    return context(dy.device).call(
        key, lambda: _bwd_problem("bwd_weights", dy, x, w_shape, stride, padding, dilation, groups, out_dtype),
        ConvArgs(dy=dy, x=x), solver)


@torch.library.register_fake("nnprim::conv_backward_weights", lib=LIB)
def _conv_backward_weights_fake(dy, x, w_shape, stride, padding, dilation, groups, out_dtype, solver):
    p = _bwd_problem("bwd_weights", dy, x, w_shape, stride, padding, dilation, groups, out_dtype)
    return empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype, device=dy.device)


# ---- autograd -----------------------------------------------------------------------------
def _save(ctx, x, w, conf) -> None:
    """conf: (stride, padding, dilation, groups) as lists and an int."""
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ctx.save_for_backward(x if need_w else None, w if need_x else None)
    ctx.x_meta = (tuple(x.shape), x.dtype, layout_of(x))
    ctx.w_shape = tuple(w.shape)
    ctx.conf = conf


def _grads(ctx, dy, bwd_data, bwd_weights):
    """(dx, dw, db) of conv_forward given dy (in the forward's out_dtype)."""
    x, w = ctx.saved_tensors
    x_shape, dtype, layout = ctx.x_meta
    stride, padding, dilation, groups = ctx.conf
    dy = to_layout(dy if dy.dtype == dtype else dy.to(dtype), layout)
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = bwd_data(dy, w, list(x_shape), stride, padding, dilation, groups, None, None)
    if ctx.needs_input_grad[1]:
        dw = bwd_weights(dy, x, list(ctx.w_shape), stride, padding, dilation, groups, None, None)
    if ctx.needs_input_grad[2]:
        db = bias_grad(dy)
    return dx, dw, db


def _setup_fwd(ctx, inputs, output) -> None:
    x, w, bias, stride, padding, dilation, groups, post_ops, post_tensors, out_dtype, solver = inputs
    if post_ops and any(ctx.needs_input_grad[:3]):
        raise NotSupportedError("nnprim::conv_forward with fused post_ops has no gradient; call "
                                "nnprim.conv_forward, which applies the chain in torch when gradients are needed")
    _save(ctx, x, w, (list(stride), list(padding), list(dilation), groups))
    ctx.n_post = len(post_tensors)


def _backward_fwd(ctx, dy):
    dx, dw, db = _grads(ctx, dy, torch.ops.nnprim.conv_backward_data, torch.ops.nnprim.conv_backward_weights)
    return dx, dw, db, None, None, None, None, None, [None] * ctx.n_post, None, None


class ConvFunction(torch.autograd.Function):
    """The eager path's autograd (no dispatcher): conv_forward's formulas with the
    implementations called directly."""

    @staticmethod
    def forward(ctx, x, w, bias, conf):
        """conf: (stride, padding, dilation, groups, out_dtype, solver[, signature]), one
        argument so that Function.apply has fewer to walk (the lists are never mutated).
        The public call's raw signature, when given, is the context's memo key."""
        stride, padding, dilation, groups, out_dtype, solver = conf[:6]
        _save(ctx, x, w, conf[:4])
        ctx.key = conf[6] if len(conf) > 6 else None
        if len(conf) > 6:
            return context(x.device).call(
                conf[6], lambda: fwd_problem(x, w, bias, stride, padding, dilation, groups, "", [], out_dtype),
                ConvArgs(x=x, w=w, bias=bias), solver)
        return _conv_forward(x, w, bias, stride, padding, dilation, groups, "", (), out_dtype, solver)

    @staticmethod
    def backward(ctx, dy):
        if ctx.key is None:
            dx, dw, db = _grads(ctx, dy, _conv_backward_data, _conv_backward_weights)
        else:
            dx, dw, db = _grads(ctx, dy, functools.partial(_keyed_backward, "bwd_data", ctx.key),
                                functools.partial(_keyed_backward, "bwd_weights", ctx.key))
        if torch.is_grad_enabled():     # create_graph=True
            check_double_backward("nnprim.conv_forward", (dx, dw), (dy, *ctx.saved_tensors))
        return dx, dw, db, None


def check_double_backward(name: str, grads, sources) -> None:
    """In a backward under create_graph=True (grad mode on): a solver built of torch ops gives
    gradients with a graph (a second derivative works); a native kernel's have none, and the
    second derivative would be silently missing, so that raises."""
    if any(t is not None and t.requires_grad for t in sources) and \
            any(g is not None and g.grad_fn is None for g in grads):
        raise NotSupportedError(f"double backward (create_graph=True) through {name} is not supported by "
                                "the solver that ran; a float64 call (the reference solvers) supports it")


_CONV_APPLY = c_apply(ConvFunction)


def conv_function(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, conf: tuple) -> torch.Tensor:
    """ConvFunction.apply(x, w, bias, conf), straight to C++ outside functorch transforms."""
    if transforms_active():
        return ConvFunction.apply(x, w, bias, conf)
    return _CONV_APPLY(unwrap(x), unwrap(w), None if bias is None else unwrap(bias), conf)


def _keyed_backward(direction: str, key, dy, t, shape, stride, padding, dilation, groups, out_dtype, solver):
    """A backward call (as _conv_backward_data / _weights) of a forward memoised under `key`
    (the public call's signature, validated when new): that key and dy's strides fix the
    problem (dy comes in y's shape, cast to x's dtype and layout), so they key the memo entry
    and a call skips building the 12-field key (the backward runs on autograd's device
    thread, where Python runs cold; a ResNet-50 step under autocast spent ~0.3 ms of host a
    conv, forward and backward together, beyond torch's on the H200, 2026-12-04)."""
    args = ConvArgs(dy=dy, w=t) if direction == "bwd_data" else ConvArgs(dy=dy, x=t)
    return context(dy.device).call(
        ("of", direction, key, dy.stride()),
        lambda: _bwd_problem(direction, dy, t, shape, stride, padding, dilation, groups, out_dtype), args, solver)


_SUM_DIMS = {3: [0, 2], 4: [0, 2, 3], 5: [0, 2, 3, 4]}


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """db[k] = the sum of dy over every dim but the channel dim (torch's reductions of
    f16/bf16 accumulate in f32: one kernel)."""
    return dy.sum(dim=_SUM_DIMS[dy.dim()])


torch.library.register_autograd("nnprim::conv_forward", _backward_fwd, setup_context=_setup_fwd, lib=LIB)
