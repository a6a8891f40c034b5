"""Public functions: normalise the Python arguments into the ops' schema and call the
`nnprim::` custom ops (nnprim/ops), which validate, choose a solver and run it.

Everything here is plain Python that torch.compile traces without a graph break;
nothing here touches data pointers or caches. Gradients come from the autograd
registered on the ops. In eager mode (`ops.eager`) the same implementations run without
the dispatcher, through autograd Functions sharing the ops' formulas: the host cost of a
call stays at torch's own. A fused post-op chain has no gradient formula in the kernels:
when gradients are needed the convolution (+ bias) runs as the op with an f32 result
and the chain is applied in torch, so its gradient is exact."""
from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from . import fp8 as _fp8
from .args import AttnArgs, ConvArgs
from .errors import BadParameterError, NotSupportedError
from .ops import _PLAIN, eager
from .ops import attention as attn_ops
from .ops import check_transforms as _check_transforms
from .ops import conv as conv_ops
from .ops import forward_ad_level as _forward_ad_level
from .ops import tracing_state as _tracing_state
from .ops import transforms_active as _transforms_active
from .ops.attention import quant_parts
from .ops.conv import bias_grad, post_op_spec
from .paged import contiguous_table
from .post_ops import Binary, Eltwise, PostOp, Sum, apply_post_ops
from .problems.attention import normalize_causal
from .problems.common import check_tensor
from .problems.conv import ConvProblem, _named_padding, _padding, empty_in_layout, layout_of, to_layout
from .quant import KVQuant
from .search import numerics
from .search.context import context
from .search.modes import SETTINGS
from .search.solver import Solver

_ops = torch.ops.nnprim


# ---- argument normalisation ----------------------------------------------------------------
def _solver(solver) -> str | None:
    """A solver name, id or Solver as the ops' text argument."""
    if solver is None or isinstance(solver, str):
        return solver
    if isinstance(solver, Solver):
        return solver.name
    if isinstance(solver, int) and not isinstance(solver, bool):
        return str(solver)
    raise BadParameterError(f"solver={solver!r} must be a solver name, id or None")


def _ints(name: str, v, nd: int) -> list[int]:
    if type(v) is int:
        return [v] * nd
    try:
        out = [operator.index(e) for e in v] if not isinstance(v, (bool, str)) else None
    except TypeError:
        out = None
    if out is None:
        raise BadParameterError(f"{name}={v!r} must be an int or {nd} ints")
    if len(out) != nd:
        raise BadParameterError(f"{name}={v!r} must have {nd} entries for a {nd}D convolution")
    return out


def _flat_padding(padding, nd: int, stride: list[int], dilation: list[int], filt) -> list[int]:
    """Padding as the ops take it: every dim's before-pad, then every dim's after-pad."""
    if type(padding) is int:
        return [padding] * (2 * nd)
    if isinstance(padding, str):
        padding = _named_padding(padding, tuple(stride), tuple(dilation), list(filt))
    before, after = _padding(padding, nd)
    return [*before, *after]


def _nd(x: torch.Tensor) -> int:
    if x.dim() not in (3, 4, 5):
        raise BadParameterError(f"x has {x.dim()} dims (shape {tuple(x.shape)}); expected 3 (1D), 4 (2D) or 5 (3D)")
    return x.dim() - 2


def _conv_args(x_like: torch.Tensor, filt, stride, padding, dilation) -> tuple[list[int], list[int], list[int]]:
    nd = _nd(x_like)
    st, dl = _ints("stride", stride, nd), _ints("dilation", dilation, nd)
    return st, _flat_padding(padding, nd, st, dl, filt), dl


def _post_ops(post_ops, rank: int, K: int) -> tuple[PostOp, ...]:
    """The chain as a tuple, Binary tensors given y's rank: a 1-element tensor is per
    tensor, a (K,) tensor per channel, else torch broadcasting (leading 1s)."""
    if isinstance(post_ops, (Sum, Eltwise, Binary)):
        post_ops = (post_ops,)
    try:
        ops = tuple(post_ops)
    except TypeError:
        raise BadParameterError(f"post_ops={post_ops!r} must be a sequence of Sum, Eltwise, Binary") from None
    out: list[PostOp] = []
    for i, op in enumerate(ops):
        if isinstance(op, Sum):
            check_tensor(f"post_ops[{i}].tensor", op.tensor)
            if isinstance(op.scale, bool) or not isinstance(op.scale, (int, float)):
                raise BadParameterError(f"post_ops[{i}].scale={op.scale!r} must be a real number")
        if isinstance(op, Eltwise):
            for name in ("alpha", "beta"):
                a = getattr(op, name)
                if isinstance(a, bool) or not isinstance(a, (int, float)):
                    raise BadParameterError(f"post_ops[{i}].{name}={a!r} must be a real number")
        if isinstance(op, (Sum, Eltwise)):
            out.append(op)
            continue
        if not isinstance(op, Binary):
            raise BadParameterError(f"post_ops[{i}]={op!r} is not a Sum, Eltwise or Binary")
        t = check_tensor(f"post_ops[{i}].tensor", op.tensor)
        if t.dim() > rank:
            raise BadParameterError(f"post_ops[{i}] Binary tensor shape {tuple(t.shape)} has more dims than y "
                                    f"({rank})")
        if t.numel() == 1:
            t = t.reshape((1,) * rank)
        elif t.dim() == 1 and t.shape[0] == K:
            t = t.reshape(1, K, *([1] * (rank - 2)))
        else:
            t = t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
        out.append(Binary(op.op, t))
    return tuple(out)


def _autocast(device_type: str, *ts):
    """Inside torch.autocast, floating tensors in the autocast dtype, as torch casts them for
    its own convolution and attention (both run in lower precision there); anything else
    (None, a KVQuant cache) as it is."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):    # meta: no autocast key
        return ts
    dt = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype != dt and t.is_floating_point() else t
                 for t in ts)


def _needs_grad(*ts) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False


# ---- convolution ------------------------------------------------------------------------------
def _plain(t) -> bool:
    return type(t) in _PLAIN or t is None


def _fast_path_open() -> bool:
    """Whether a call may take its memoised signature straight to the bound solver: eager
    (no compiler tracing, no dispatch mode). Under autocast the forward calls cast their
    inputs first (_autocast), as the general path does, and key the cast tensors."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or _transforms_active()
                or _tracing_state() is not None or _forward_ad_level() >= 0)


def conv_forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 stride=1, padding=0, dilation=1, groups: int = 1, post_ops=(),
                 out_dtype: torch.dtype | None = None, solver=None) -> torch.Tensor:
    """y = post_ops(conv(x, w) + bias), cast to out_dtype, in x's layout."""
    fast = type(x) in _PLAIN and type(w) in _PLAIN and _plain(bias) and _fast_path_open() and not x.is_meta
    if fast and torch._C._is_any_autocast_enabled():  # the cast inputs are what the signature keys
        # (a ResNet under autocast took the general path, ~2x the host time of the memoised call)
        x, w, bias = _autocast(x.device.type, x, w, bias)
    try:
        if post_ops and fast:
            y = _fused_fast(x, w, bias, stride, padding, dilation, groups, post_ops, out_dtype, solver)
            if y is not None:
                return y
        if not post_ops and fast:
            # the hot path: the raw call signature is the context's memo key (the arguments are
            # normalised and validated once, when the signature is new)
            try:
                sig = ("conv_forward", x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device,
                       None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                       stride, padding, dilation, groups, out_dtype, solver,
                       type(stride), type(padding), type(dilation), type(groups))     # see _arg_types
                hash(sig)
            except TypeError:   # unhashable arguments (lists): the general path
                sig = None
            if sig is not None:
                if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                or (bias is not None and bias.requires_grad)):
                    conf = _GRAD_CONFS.get(sig)
                    if conf is None:
                        st, pad, dl = _conv_args(x, w.shape[2:], stride, padding, dilation)
                        conf = (st, pad, dl, groups, out_dtype, _solver(solver), sig)
                        if len(_GRAD_CONFS) < 4096:
                            _GRAD_CONFS[sig] = conf
                    return conv_ops.conv_function(x, w, bias, conf)
                return context(x.device).call(sig, lambda: _raw_fwd_problem(x, w, bias, stride, padding, dilation, groups,
                                                                        out_dtype),
                                              ConvArgs(x=x, w=w, bias=bias), _solver(solver))
    except BadParameterError:
        if not _empty_batch(x):     # an empty batch is validated and served below
            raise
    check_tensor("x", x)
    check_tensor("w", w)
    if bias is not None:
        check_tensor("bias", bias)
    _check_transforms("nnprim.conv_forward", x, w, bias, *(getattr(op, "tensor", None) for op in post_ops or ()))
    x, w, bias = _autocast(x.device.type, x, w, bias)
    st, pad, dl = _conv_args(x, w.shape[2:], stride, padding, dilation)
    ops = _post_ops(post_ops, x.dim(), w.shape[0]) if post_ops else ()
    spec, post_tensors = post_op_spec(ops) if ops else ("", [])
    solver = _solver(solver)
    if _empty_batch(x):
        return _empty_batch_forward(x, w, bias, st, pad, dl, groups, ops, post_tensors, out_dtype)
    direct = eager(x, w, bias, *post_tensors)
    if _needs_grad(x, w, bias, *post_tensors):
        if ops:  # the chain in torch on the f32 (f64) accumulator, so that its gradient is exact
            return _chain_with_grad(x, w, bias, st, pad, dl, groups, ops, spec, post_tensors, out_dtype, solver,
                                    direct)
        if direct:
            return conv_ops.conv_function(x, w, bias, (st, pad, dl, groups, out_dtype, solver))
    fn = conv_ops._conv_forward if direct else _ops.conv_forward
    return fn(x, w, bias, st, pad, dl, groups, spec, post_tensors, out_dtype, solver)


def _chain_with_grad(x, w, bias, st, pad, dl, groups, ops, spec, post_tensors, out_dtype, solver,
                     direct: bool) -> torch.Tensor:
    """conv_forward with post-ops when a gradient is needed: the conv to the f32 (f64)
    accumulator through autograd, the chain in torch on it; validated (post-op tensors, out_dtype)
    and scanned (NNPRIM_CHECK_NUMERICS) as the fused call is."""
    compiling = torch.compiler.is_compiling()
    if compiling:       # the ops' fake kernels check what they take; fwd_problem notes the problem
        odt = out_dtype or x.dtype      # for explain (a ContextVar, which dynamo does not trace)
    else:
        odt = conv_ops.fwd_problem(x, w, bias, st, pad, dl, groups, spec, post_tensors, out_dtype).out_dtype
    checks = SETTINGS.check_numerics and not compiling      # the scans read values
    if checks:
        for i, t in enumerate(post_tensors):
            numerics.check_tensor(f"post_ops[{i}].tensor", t, "input")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = (conv_ops.conv_function(x, w, bias, (st, pad, dl, groups, acc, solver)) if direct else
         _ops.conv_forward(x, w, bias, st, pad, dl, groups, "", [], acc, solver))
    y = apply_post_ops(y, ops).to(odt)
    if checks:
        numerics.check_tensor("out", y, "output")
    return y


def _empty_batch(t) -> bool:
    """A conv operand with no images (N = 0), which torch serves with an empty result."""
    return isinstance(t, torch.Tensor) and t.dim() in (3, 4, 5) and t.shape[0] == 0


def _one_image(t: torch.Tensor) -> tuple[int, ...]:
    return (1, *t.shape[1:])


def _joined(out: torch.Tensor, *inputs) -> torch.Tensor:
    """out, joined to the inputs that need gradients (which get zeros: out has no elements)."""
    need = [t for t in inputs if t is not None and t.requires_grad]
    if not (need and torch.is_grad_enabled()):
        return out
    return out + sum(t.sum() for t in need) * 0


def _empty_batch_problem(direction: str, dy, t, shape, st, pad, dl, groups, out_dtype, n: int) -> ConvProblem:
    """The problem of a backward call with no image, validated as one image's (dy given one)."""
    if n != 0:
        raise BadParameterError(f"{'x' if direction == 'bwd_data' else 'w'}_shape has N={n} but dy has none")
    dy1 = dy.new_empty(_one_image(dy))
    return conv_ops._bwd_problem(direction, to_layout(dy1, layout_of(dy)), t, shape, st, pad, dl, groups, out_dtype)


def _empty_batch_forward(x, w, bias, st, pad, dl, groups, ops, post_tensors, out_dtype) -> torch.Tensor:
    """conv_forward of an empty batch: validated as one image would be (shapes, bias, post-ops),
    y empty in x's layout, joined to x, w, bias and the post-op tensors for autograd."""
    nd = x.dim() - 2
    p = ConvProblem.create("fwd", _one_image(x), tuple(w.shape), dtype=x.dtype, layout=layout_of(x),
                           device=x.device.type, stride=st, padding=conv_ops._pairs(pad, nd), dilation=dl,
                           groups=groups, out_dtype=out_dtype, has_bias=bias is not None)
    if bias is not None and tuple(bias.shape) != (p.K,):
        raise BadParameterError(f"bias shape {tuple(bias.shape)} must be (K,)=({p.K},)")
    y = empty_in_layout((0, *p.y_shape[1:]), p.layout, dtype=p.out_dtype, device=x.device)
    y = _joined(y, x, w, bias, *post_tensors)
    return apply_post_ops(y, ops).to(p.out_dtype) if ops else y


_NUMBERS = (float, int)


def _chain_sig(post_ops, rank: int) -> tuple | None:
    """The hot path's key of a post-op chain (each op's parameters and its tensor's metadata),
    None where the general path must take it: not a tuple or list of ops, a tensor that is not
    plain or needs a gradient, a Binary tensor below y's rank (`_post_ops` reshapes those)."""
    if type(post_ops) not in (tuple, list):
        return None
    sig = []
    for op in post_ops:
        tp = type(op)
        if tp is Eltwise:
            if type(op.alpha) not in _NUMBERS or type(op.beta) not in _NUMBERS:
                return None
            sig.append(op)   # frozen, compared by value
            continue
        if (tp is not Sum or type(op.scale) not in _NUMBERS) and tp is not Binary:
            return None
        t = op.tensor
        if type(t) not in _PLAIN or t.requires_grad or (tp is Binary and t.dim() != rank):
            return None
        sig.append((op.scale if tp is Sum else op.op, t.shape, t.stride(), t.dtype, t.device))
    return tuple(sig)


def _fused_fast(x, w, bias, stride, padding, dilation, groups, post_ops, out_dtype, solver):
    """A conv_forward with post-ops on the hot path (memoised signature, as the plain call's),
    None where the general path must run it (autograd, a chain to normalise, unhashable args).
    The general path's validation and chain normalisation cost ~30 us a call: a fused conv of
    a ResNet layer on the H200 ran 0.089 ms where the same conv without post-ops took 0.054."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    chain = _chain_sig(post_ops, x.dim())
    if chain is None:
        return None
    sig = ("conv_forward_post", x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
           chain, stride, padding, dilation, groups, out_dtype, solver, *_arg_types(stride, padding, dilation, groups))
    try:
        hash(sig)
    except TypeError:   # unhashable arguments (lists): the general path
        return None
    ops = tuple(post_ops)

    def problem():
        st, pad, dl = _conv_args(x, w.shape[2:], stride, padding, dilation)
        spec, tensors = post_op_spec(ops)
        return conv_ops.fwd_problem(x, w, bias, st, pad, dl, groups, spec, tensors, out_dtype)
    return context(x.device).call(sig, problem, ConvArgs(x=x, w=w, bias=bias, post_ops=ops), _solver(solver))


# a conv_forward signature's normalised (stride, padding, dilation, groups, out_dtype, solver,
# signature) for its autograd Function (bounded: a memo, not state)
_GRAD_CONFS: dict[tuple, tuple] = {}


def _raw_fwd_problem(x, w, bias, stride, padding, dilation, groups, out_dtype):
    """The validated problem of a post-op-free conv_forward call from its raw arguments."""
    st, pad, dl = _conv_args(x, w.shape[2:], stride, padding, dilation)
    return conv_ops.fwd_problem(x, w, bias, st, pad, dl, groups, "", [], out_dtype)


def _shape(name: str, s) -> list[int]:
    try:
        return [operator.index(v) for v in s]
    except TypeError:
        raise BadParameterError(f"{name}={s!r} must be a sequence of ints") from None


def _bwd_sig(name: str, dy, t, shape, stride, padding, dilation, groups, out_dtype, solver) -> tuple | None:
    """The raw signature of a backward call (the context's memo key), None when an
    argument is unhashable (a list: the general path)."""
    try:
        sig = (name, dy.shape, dy.stride(), dy.dtype, dy.device, t.shape, t.stride(), t.dtype, t.device,
               shape, stride, padding, dilation, groups, out_dtype, solver, *_arg_types(stride, padding, dilation, groups))
        hash(sig)
    except TypeError:
        return None
    return sig


def _arg_types(stride, padding, dilation, groups) -> tuple:
    """What a memo key adds to the raw arguments: their types (True == 1 == 1.0 hash alike,
    and a call with groups=True must be validated, not served as groups=1's)."""
    return type(stride), type(padding), type(dilation), type(groups)


def _raw_bwd_problem(direction: str, dy, t, shape, stride, padding, dilation, groups, out_dtype):
    """The validated problem of a backward call from its raw arguments."""
    shape = _shape("x_shape" if direction == "bwd_data" else "w_shape", shape)
    filt = t.shape[2:] if direction == "bwd_data" else shape[2:]
    nd_like = dy if direction == "bwd_data" else t
    st, pad, dl = _conv_args(nd_like, filt, stride, padding, dilation)
    return conv_ops._bwd_problem(direction, dy, t, shape, st, pad, dl, groups, out_dtype)


def _bwd_hot(direction: str, dy, t, shape, stride, padding, dilation, groups, out_dtype, solver):
    """A backward call on its memoised signature; None where the general path takes it
    (unhashable arguments, or an empty batch, which the memo's validation refuses)."""
    sig = _bwd_sig("conv_backward_data" if direction == "bwd_data" else "conv_backward_weights", dy, t, shape,
                   stride, padding, dilation, groups, out_dtype, solver)
    if sig is None:
        return None
    args = ConvArgs(dy=dy, w=t) if direction == "bwd_data" else ConvArgs(dy=dy, x=t)
    try:
        return context(dy.device).call(
            sig, lambda: _raw_bwd_problem(direction, dy, t, shape, stride, padding, dilation, groups, out_dtype), args,
            _solver(solver))
    except BadParameterError:
        if not _empty_batch(dy):
            raise
    return None


def conv_backward_data(dy: torch.Tensor, w: torch.Tensor, x_shape: Sequence[int], *, stride=1,
                       padding=0, dilation=1, groups: int = 1, solver=None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dx = the gradient of conv(x, w) with respect to x, given dy (x's layout = dy's)."""
    if type(dy) in _PLAIN and type(w) in _PLAIN and _fast_path_open() and not dy.is_meta:
        out = _bwd_hot("bwd_data", dy, w, x_shape, stride, padding, dilation, groups, out_dtype, solver)
        if out is not None:
            return out
    check_tensor("dy", dy)
    check_tensor("w", w)
    _check_transforms("nnprim.conv_backward_data", dy, w)
    st, pad, dl = _conv_args(dy, w.shape[2:], stride, padding, dilation)
    if _empty_batch(dy):
        xs = _shape("x_shape", x_shape)
        p = _empty_batch_problem("bwd_data", dy, w, [1, *xs[1:]], st, pad, dl, groups, out_dtype, xs[0])
        return _joined(empty_in_layout((0, *p.x_shape[1:]), p.layout, dtype=p.out_dtype, device=dy.device), dy, w)
    fn = conv_ops._conv_backward_data if eager(dy, w) else _ops.conv_backward_data
    return fn(dy, w, _shape("x_shape", x_shape), st, pad, dl, groups, out_dtype, _solver(solver))


def conv_backward_weights(dy: torch.Tensor, x: torch.Tensor, w_shape: Sequence[int], *, stride=1,
                          padding=0, dilation=1, groups: int = 1, solver=None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dw = the gradient of conv(x, w) with respect to w, given dy."""
    if type(dy) in _PLAIN and type(x) in _PLAIN and _fast_path_open() and not dy.is_meta:
        out = _bwd_hot("bwd_weights", dy, x, w_shape, stride, padding, dilation, groups, out_dtype, solver)
        if out is not None:
            return out
    check_tensor("dy", dy)
    check_tensor("x", x)
    _check_transforms("nnprim.conv_backward_weights", dy, x)
    ws = _shape("w_shape", w_shape)
    st, pad, dl = _conv_args(x, ws[2:], stride, padding, dilation)
    if _empty_batch(dy) and _empty_batch(x):    # no image: a zero gradient
        x1 = to_layout(x.new_empty(_one_image(x)), layout_of(x))
        p = _empty_batch_problem("bwd_weights", dy, x1, ws, st, pad, dl, groups, out_dtype, 0)
        return _joined(empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype, device=dy.device).zero_(), dy, x)
    fn = conv_ops._conv_backward_weights if eager(dy, x) else _ops.conv_backward_weights
    return fn(dy, x, ws, st, pad, dl, groups, out_dtype, _solver(solver))


def conv_backward_bias(dy: torch.Tensor) -> torch.Tensor:
    """db[k] = sum of dy over every dim but the channel dim (f32 accumulation)."""
    check_tensor("dy", dy)
    if dy.dim() not in (3, 4, 5):
        raise BadParameterError(f"dy has {dy.dim()} dims (shape {tuple(dy.shape)}); expected 3, 4 or 5")
    if not dy.is_floating_point():
        raise BadParameterError(f"dy.dtype={dy.dtype} must be floating point")
    if SETTINGS.check_numerics:
        numerics.check_tensor("dy", dy, "input")
    return bias_grad(dy)


# ---- attention ------------------------------------------------------------------------------
def _kv(name: str, t):
    if not isinstance(t, (torch.Tensor, KVQuant)):
        raise BadParameterError(f"{name} must be a torch.Tensor or KVQuant, got {type(t).__name__}")
    return quant_parts(t)


def _scale(scale) -> tuple[float | None, torch.Tensor | None]:
    if scale is None or isinstance(scale, torch.Tensor):
        return None, scale
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale), None
    raise BadParameterError(f"scale={scale!r} must be None, a float or a one-element tensor")


def _counter(name: str, v) -> int | torch.Tensor:
    if name == "seed" and isinstance(v, torch.Tensor):
        return v            # a device seed (nnprim.dropout): checked against q's device by the problem
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
        raise BadParameterError(f"{name}={v!r} must be a non-negative int below 2**63"
                                + (" or a one-element int64 tensor on q's device" if name == "seed" else ""))
    return v


def _options(attn_mask, causal, scale, invert_scale, dropout_p, seed, offset, kv_lens, softmax_inf_as_zero):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise BadParameterError(f"dropout_p={dropout_p!r} must be a float in [0, 1)")
    sc, sct = _scale(scale)
    for name, t in (("attn_mask", attn_mask), ("kv_lens", kv_lens)):
        if t is not None:
            check_tensor(name, t)
    return (attn_mask, sct, kv_lens, normalize_causal(causal) or "", sc, bool(invert_scale), float(dropout_p),
            _counter("seed", seed), _counter("offset", offset), bool(softmax_inf_as_zero))


def _fp8_args(q: torch.Tensor, descales, out_dtype) -> tuple:
    """The FP8 arguments as the op takes them: descales as f32 tensors (floats moved to q's
    device), out_dtype checked to be a dtype; () when none is given."""
    if descales[0] is None and descales[1] is None and descales[2] is None and out_dtype is None:
        return ()
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise BadParameterError(f"out_dtype={out_dtype!r} must be a torch.dtype or None")
    for name, d in zip(_fp8.DESCALE_NAMES, descales):
        if d is not None and not isinstance(d, torch.Tensor):
            _fp8.descale_kind(name, d, 0, 0, q.device)      # a float: positive and finite
    return (*(_fp8.descale_tensor(d, q.device) for d in descales), out_dtype)


# an sdpa signature's normalised options and its forward's memo key, for its autograd
# Function (a bounded memo)
_SDPA_OPTS: dict[tuple, tuple] = {}


def _tsig(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


# K / V types the memoised hot path takes: tensors and quantized caches (a KVQuant is frozen
# and validated when built; its parts' shapes, strides and dtypes are in the signature)
_KV_FAST = (*_PLAIN, KVQuant)


def _kvsig(t) -> tuple:
    """The part of an sdpa call's memo key that a K or V argument fixes."""
    if type(t) is KVQuant:
        return (t.dtype, t.group_size, t.layout, _tsig(t.data), _tsig(t.scales), _tsig(t.zero_points))
    return (t.shape, t.stride(), t.dtype, t.device)


def _sdpa_fast(q, k, v, attn_mask, causal, scale, invert_scale, seed, offset, kv_lens, softmax_inf_as_zero,
               return_lse, solver, block_table):
    """The hot path of a plain sdpa call (tensors or KVQuant caches; no dropout or FP8): the raw
    signature is the context's memo key, the options are normalised and validated when it
    is new (kv_lens values too: CPU kv_lens take the general path, checked on every call).
    None when an argument is unhashable (the general path)."""
    quant = type(k) is KVQuant or type(v) is KVQuant
    if quant and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v) if type(t) is not KVQuant):
        return None              # the general path: quantized K/V take the op's gradient rules
    try:
        sig = ("sdpa", q.shape, q.stride(), q.dtype, q.device, *_kvsig(k), *_kvsig(v), _tsig(attn_mask), causal,
               scale, invert_scale, seed, offset, _tsig(kv_lens), softmax_inf_as_zero, return_lse, solver,
               _tsig(block_table), type(causal), type(offset))
        hash(sig)
    except TypeError:
        return None
    sv = _solver(solver)
    if not quant and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if block_table is not None:
            return None          # the general path raises its error
        opts = _SDPA_OPTS.get(sig)
        if opts is None:
            opts = _options(attn_mask, causal, scale, invert_scale, 0.0, seed, offset, kv_lens, softmax_inf_as_zero)
            # the memo holds the options the signature fixes, never this call's tensors: the
            # mask and kv_lens go with each call (the same shapes, other values)
            opts = (None, opts[1], None, *opts[3:], ("sdpa_grad", sig))    # the forward's memo key
            if len(_SDPA_OPTS) < 4096:
                _SDPA_OPTS[sig] = opts
        o, lse = attn_ops.sdpa_function(q, k, v, attn_mask, opts[1], kv_lens, opts[3:10], sv, opts[10])
        return (o, lse) if return_lse else o

    def make():
        opts = _options(attn_mask, causal, scale, invert_scale, 0.0, seed, offset, kv_lens, softmax_inf_as_zero)
        attn_ops._check_counters(seed, offset, q.device)
        attn_ops._check_lens(kv_lens, k.data if type(k) is KVQuant else k, block_table)
        return attn_ops.problem("fwd", q, k, v, *opts, return_lse, block_table=block_table)

    args = AttnArgs(q=q, k=k, v=v, attn_mask=attn_mask, scale=None if scale is None else float(scale), seed=seed,
                    offset=offset, kv_lens=kv_lens, block_table=contiguous_table(block_table))
    o, lse = context(q.device).call(sig, make, args, sv)
    return (o, lse) if return_lse else o


def _no_queries(q) -> bool:
    """An sdpa call with no query rows (B = 0 or Sq = 0), which torch serves with an empty o."""
    return isinstance(q, torch.Tensor) and q.dim() == 4 and (q.shape[0] == 0 or q.shape[2] == 0)


def _no_queries_sdpa(q, k, v, attn_mask, kv_lens, return_lse):
    """o (and lse) with no rows, after the shape checks that do not need a row; joined to q,
    k, v for autograd."""
    if k.dim() != 4 or v.dim() != 4:
        raise BadParameterError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be 4-D (B, H, S, D)")
    (B, Hq, Sq, D), (Bk, Hkv, Sk, Dk), (Bv, Hv, Skv, Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv) or Hkv != Hv or Sk != Skv or D != Dk or Hkv == 0 or Hq % Hkv:
        raise BadParameterError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree: "
                                "equal B, k and v of equal heads and keys, Hq a multiple of Hkv, equal D")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise BadParameterError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be one floating dtype")
    for name, t in (("attn_mask", attn_mask), ("kv_lens", kv_lens)):
        if t is not None:
            check_tensor(name, t)
    if attn_mask is not None:
        try:
            torch.broadcast_shapes(tuple(attn_mask.shape), (B, Hq, Sq, Sk))
        except RuntimeError:
            raise BadParameterError(f"attn_mask shape {tuple(attn_mask.shape)} is not broadcastable to "
                                    f"(B, Hq, Sq, Sk)={(B, Hq, Sq, Sk)}") from None
    o = _joined(q.new_empty((B, Hq, Sq, Dv)), q, k, v)
    return (o, q.new_empty((B, Hq, Sq), dtype=torch.float32)) if return_lse else o


def sdpa(q: torch.Tensor, k, v, *, attn_mask: torch.Tensor | None = None, causal=None, scale=None,
         invert_scale: bool = False, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
         kv_lens: torch.Tensor | None = None, softmax_inf_as_zero: bool = False,
         return_lse: bool = False, solver=None, block_table: torch.Tensor | None = None, q_descale=None,
         k_descale=None, v_descale=None, out_dtype: torch.dtype | None = None):
    """o = softmax(scale * q k^T + mask) v  (with GQA, dropout, quantized K/V...);
    returns o, or (o, lse) when return_lse. With `block_table` (B, max_pages) int32, k and
    v are page pools (num_pages, Hkv, page_size, D) and kv_lens is required (nnprim.paged).
    FP8 (float8_e4m3fn) q, k, v: the attention of (q * q_descale, k * k_descale,
    v * v_descale), o in out_dtype (default bf16); see nnprim.fp8."""
    if (type(q) in _PLAIN and type(k) in _KV_FAST and type(v) in _KV_FAST and _plain(attn_mask) and _plain(kv_lens)
            and _plain(block_table) and q_descale is None and k_descale is None and v_descale is None
            and out_dtype is None and not _fp8.is_fp8(q.dtype)
            and (kv_lens is None or (kv_lens.is_cuda and not SETTINGS.check_numerics))
            and (scale is None or type(scale) in (int, float)) and type(dropout_p) in (int, float)
            and dropout_p == 0 and type(seed) is int and (attn_mask is None or not attn_mask.requires_grad)
            and _fast_path_open() and not q.is_meta):
        if torch._C._is_any_autocast_enabled():
            q, k, v = _autocast(q.device.type, q, k, v)
        try:
            out = _sdpa_fast(q, k, v, attn_mask, causal, scale, invert_scale, seed, offset, kv_lens,
                             softmax_inf_as_zero, return_lse, solver, block_table)
        except BadParameterError:
            if not _no_queries(q):        # validated and served below
                raise
            out = None
        if out is not None:
            return out
    check_tensor("q", q)
    kd, ks, kz, kspec = _kv("k", k)
    vd, vs, vz, vspec = _kv("v", v)
    _check_transforms("nnprim.sdpa", q, kd, vd, vmap_ok=True)
    if _no_queries(q) and not (kspec or vspec) and block_table is None:
        return _no_queries_sdpa(q, kd, vd, attn_mask, kv_lens, return_lse)
    fp8 = _fp8_args(q, (q_descale, k_descale, v_descale), out_dtype)
    q_fp8 = _fp8.is_fp8(q.dtype)
    if not fp8 and q_fp8:
        fp8 = (None, None, None, None)      # FP8 inputs always take the op's FP8 arguments
    if not q_fp8:
        q, kd, vd = _autocast(q.device.type, q, kd, vd)
    opts = _options(attn_mask, causal, scale, invert_scale, dropout_p, seed, offset, kv_lens, softmax_inf_as_zero)
    solver = _solver(solver)
    if torch.is_grad_enabled():
        attn_ops.no_grad_through(opts[0], opts[1])
    grad = _needs_grad(q, kd, vd, *fp8[:3])
    if fp8 and grad:
        if _fp8.is_fp8(q.dtype) or _fp8.is_fp8(kd.dtype) or _fp8.is_fp8(vd.dtype):
            raise attn_ops.fp8_grad_error(
                (n, t is not None and t.requires_grad) for n, t in zip(("q", "k", "v", *_fp8.DESCALE_NAMES),
                                                                      (q, kd, vd, *fp8[:3])))
        grad = _needs_grad(q, kd, vd)       # descales on non-FP8 inputs: the op reports them
    if block_table is not None:
        check_tensor("block_table", block_table)
        if grad:
            raise NotSupportedError("gradients through paged K/V (block_table) are not supported: paged caches "
                                    "serve inference; call sdpa under torch.no_grad()")
    if fp8 or block_table is not None:
        # the op's trailing optional arguments: block_table, then the FP8 ones
        extra = (block_table, *fp8) if fp8 else (block_table,)
        fn = attn_ops.sdpa_forward if eager(q, kd, vd, ks, kz, vs, vz, attn_mask, opts[1], kv_lens, block_table,
                                            *fp8[:3]) else _ops.sdpa_forward
        opts, kw = attn_ops.split_seed(opts, 7)     # a device seed: the op's seed_tensor
        o, lse = fn(q, kd, vd, ks, kz, vs, vz, kspec, vspec, *opts, return_lse, solver, *extra, **kw)
        return (o, lse) if return_lse else o
    direct = eager(q, kd, vd, ks, kz, vs, vz, attn_mask, opts[1], kv_lens)
    if direct and grad and not (kspec or vspec):
        o, lse = attn_ops.sdpa_function(q, kd, vd, opts[0], opts[1], opts[2], opts[3:], solver)
    else:
        fn = attn_ops.sdpa_forward if direct and not grad else _ops.sdpa_forward
        opts, kw = attn_ops.split_seed(opts, 7)
        o, lse = fn(q, kd, vd, ks, kz, vs, vz, kspec, vspec, *opts, return_lse or grad, solver, **kw)
    return (o, lse) if return_lse else o


def sdpa_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, lse: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                  causal=None, scale=None, invert_scale: bool = False, dropout_p: float = 0.0,
                  seed: int = 0, offset: int = 0, kv_lens: torch.Tensor | None = None,
                  softmax_inf_as_zero: bool = False, return_lse: bool = False, solver=None):
    """(dq, dk, dv) of sdpa given do, the forward output o and its lse."""
    for name, t in (("do", do), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        if isinstance(t, KVQuant):
            raise NotSupportedError("sdpa_backward with quantized K/V is not supported: "
                                    "quantized K/V have no gradient; dequantize first")
        check_tensor(name, t)
    _check_transforms("nnprim.sdpa_backward", do, q, k, v, vmap_ok=True)
    opts = _options(attn_mask, causal, scale, invert_scale, dropout_p, seed, offset, kv_lens, softmax_inf_as_zero)
    fn = attn_ops._sdpa_backward if eager(do, q, k, v, o, lse, attn_mask, opts[1], kv_lens) else _ops.sdpa_backward
    opts, kw = attn_ops.split_seed(opts, 7)
    return tuple(fn(do, q, k, v, o, lse, *opts, _solver(solver), **kw))
