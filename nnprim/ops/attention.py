"""Attention ops: nnprim::sdpa_forward -> (o, lse) and nnprim::sdpa_backward -> (dq, dk, dv).

Schema conventions: a quantized K or V comes as its codes (`k` / `v`), scales and zero
points plus a spec "dtype:group" (group 0 = the head dim); plain tensors have spec "".
`causal` is "", "top_left" or "bottom_right"; a float scale is `scale`, a tensor scale
`scale_tensor`. lse is (B, Hq, Sq) f32 when `return_lse`, else an empty tensor.
FP8 q/k/v (nnprim.fp8) take `q_descale`, `k_descale`, `v_descale` (f32 tensors: one element
or (B, H)) and `out_dtype` (None = bf16), the schema's last arguments; they have no gradient.
Autograd of sdpa_forward: (dq, dk, dv) = sdpa_backward(do, q, k, v, o, lse) with the
same options; lse is not differentiable."""
from __future__ import annotations

import math

import torch

from .. import fp8 as _fp8
from ..args import AttnArgs
from ..dropout import check_device_seed
from ..errors import BadParameterError, NotSupportedError
from ..paged import check_page_values, contiguous_table
from ..problems.attention import AttentionProblem, check_kv_lens_values
from ..quant import KVQuant
from ..search.capture import capturing
from ..search.context import context
from ..search.modes import SETTINGS
from ..warmup import note
from . import LIB, c_apply, transforms_active, unwrap
from . import TAGS as _TAGS

_OPTIONS = ("Tensor? attn_mask, Tensor? scale_tensor, Tensor? kv_lens, str causal, float? scale, "
            "bool invert_scale, float dropout_p, int seed, int offset, bool softmax_inf_as_zero")
LIB.define("sdpa_forward(Tensor q, Tensor k, Tensor v, Tensor? k_scales, Tensor? k_zero_points, "
           "Tensor? v_scales, Tensor? v_zero_points, str k_quant, str v_quant, " + _OPTIONS +
           ", bool return_lse, str? solver, Tensor? block_table=None, Tensor? q_descale=None, "
           "Tensor? k_descale=None, Tensor? v_descale=None, ScalarType? out_dtype=None, Tensor? seed_tensor=None) "
           "-> (Tensor, Tensor)",
           tags=_TAGS)
LIB.define("sdpa_backward(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, " + _OPTIONS +
           ", str? solver, Tensor? seed_tensor=None) -> (Tensor, Tensor, Tensor)", tags=_TAGS)


# ---- quantized K/V as op arguments --------------------------------------------------------
def quant_parts(t) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, str]:
    """(codes or tensor, scales, zero points, spec) of a K/V argument."""
    if isinstance(t, KVQuant):
        return t.data, t.scales, t.zero_points, f"{t.dtype}:{t.group_size or 0}" + (f":{t.layout}" if t.layout else "")
    return t, None, None, ""


def _kv(data, scales, zps, spec: str, *, checked: bool):
    if not spec:
        return data
    dtype, _, rest = spec.partition(":")
    group, _, layout = rest.partition(":")
    try:
        g, lay = int(group) or None, int(layout or 0)
    except ValueError:
        raise BadParameterError(f"K/V quant spec {spec!r} must be 'dtype:group_size[:layout]'") from None
    if checked:
        if scales is None:
            raise BadParameterError(f"quantized K/V ({spec!r}) needs scales")
        return KVQuant(data, scales, zps, dtype, g, lay)
    return KVQuant.trusted(data, scales, zps, dtype, g, lay)


def _scale_arg(scale, scale_tensor):
    return scale_tensor if scale_tensor is not None else scale


def problem(direction: str, q, k, v, attn_mask, scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p,
            seed, offset, softmax_inf_as_zero, return_lse, *, check_values: bool = True,
            block_table=None, descales=(None,) * 3, out_dtype=None) -> AttentionProblem:
    """Validate an sdpa call (k, v: tensors or KVQuant, page pools with block_table); its
    AttentionProblem."""
    if scale_tensor is not None and scale is not None:
        raise BadParameterError("give the scale as a float or as a tensor, not both")
    p = AttentionProblem.from_tensors(
        q, k, v, attn_mask=attn_mask, causal=causal or None, scale=_scale_arg(scale, scale_tensor),
        invert_scale=invert_scale, dropout_p=dropout_p, kv_lens=kv_lens, softmax_inf_as_zero=softmax_inf_as_zero,
        return_lse=return_lse, direction=direction, seed=seed, offset=offset, check_values=check_values,
        block_table=block_table, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
        out_dtype=out_dtype)
    note(p)
    return p


def _tkey(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _check_counters(seed, offset: int, device: torch.device) -> None:
    """Every call (the memo skips the problem's checks): an int seed must be >= 0; a device
    seed one int64 element on q's device (its value is the caller's: reading it would sync)."""
    if isinstance(seed, torch.Tensor):
        check_device_seed(seed, device)
    elif seed < 0:
        raise BadParameterError(f"seed={seed} must be non-negative")
    if offset < 0:
        raise BadParameterError(f"offset={offset} must be non-negative")


def _check_lens(kv_lens, k: torch.Tensor, block_table=None) -> None:
    """kv_lens (and the pages they use) values are checked on a call signature's first
    call; after that on CPU tensors (no device sync) and with NNPRIM_CHECK_NUMERICS=1. The
    kernels clamp kv_lens to [0, Sk] either way, so a stale value never reads past the
    keys (a page id out of the pool is the caller's to avoid, as for any index). Never while
    a CUDA graph is captured: no value can be read there."""
    if kv_lens is not None and (kv_lens.device.type == "cpu"
                                or SETTINGS.check_numerics and not capturing(kv_lens.device)):
        if block_table is None:
            check_kv_lens_values(kv_lens, k.shape[2])
        elif isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and k.dim() == 4:
            for name, t in (("kv_lens", kv_lens), ("block_table", block_table)):
                if t.device != k.device:     # before the page check reads them together
                    raise BadParameterError(f"{name} is on {t.device} but the page pools are on {k.device}")
            check_kv_lens_values(kv_lens, block_table.shape[1] * k.shape[2])
            check_page_values(block_table, kv_lens, k.shape[0], k.shape[2])


def _check_descales(descales) -> None:
    """Descale values (positive, finite) as kv_lens: every call on CPU tensors and with
    NNPRIM_CHECK_NUMERICS=1, else on a call signature's first call."""
    for name, d in zip(_fp8.DESCALE_NAMES, descales):
        if d is not None and (d.device.type == "cpu" or SETTINGS.check_numerics and not capturing(d.device)):
            _fp8.check_descale_values(name, d)


# ---- forward -----------------------------------------------------------------------------------
def sdpa_forward(q, k, v, k_scales, k_zero_points, v_scales, v_zero_points, k_quant, v_quant, attn_mask,
                 scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p, seed, offset, softmax_inf_as_zero,
                 return_lse, solver, block_table=None, q_descale=None, k_descale=None, v_descale=None,
                 out_dtype=None, seed_tensor=None):
    """The forward's implementation (the op's arguments): (o, lse or None). `seed_tensor`: a
    device seed (nnprim.dropout) in place of the int `seed`."""
    if seed_tensor is not None:
        seed = seed_tensor
    _check_counters(seed, offset, q.device)
    _check_lens(kv_lens, k, block_table)
    descales = (q_descale, k_descale, v_descale)
    quant = (None if k_quant == "" and v_quant == "" and k_scales is None and k_zero_points is None
             and v_scales is None and v_zero_points is None else
             (_tkey(k_scales), _tkey(k_zero_points), _tkey(v_scales), _tkey(v_zero_points), k_quant, v_quant))
    key = ("fwd", q.shape, q.stride(), q.dtype, (k.shape, k.stride(), k.dtype, k.device),
           (v.shape, v.stride(), v.dtype, v.device), quant, _tkey(attn_mask), _tkey(scale_tensor),
           _tkey(kv_lens), causal, scale, invert_scale, dropout_p, softmax_inf_as_zero, return_lse, solver,
           _tkey(block_table))
    if q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None:
        _check_descales(descales)
        key = key + (_tkey(q_descale), _tkey(k_descale), _tkey(v_descale), out_dtype)
    kk = _kv(k, k_scales, k_zero_points, k_quant, checked=False)
    vv = _kv(v, v_scales, v_zero_points, v_quant, checked=False)

    def make() -> AttentionProblem:
        return problem("fwd", q, _kv(k, k_scales, k_zero_points, k_quant, checked=True),
                       _kv(v, v_scales, v_zero_points, v_quant, checked=True), attn_mask, scale_tensor, kv_lens,
                       causal, scale, invert_scale, dropout_p, seed, offset, softmax_inf_as_zero, return_lse,
                       block_table=block_table, descales=descales, out_dtype=out_dtype)

    args = AttnArgs(q=q, k=kk, v=vv, attn_mask=attn_mask, scale=_scale_arg(scale, scale_tensor), seed=seed,
                    offset=offset, kv_lens=kv_lens, block_table=contiguous_table(block_table), q_descale=q_descale,
                    k_descale=k_descale, v_descale=v_descale)
    return context(q.device).call(key, make, args, solver)


@torch.library.impl(LIB, "sdpa_forward", "CompositeExplicitAutograd")
def _sdpa_forward(*args):
    o, lse = sdpa_forward(*args)
    return o, (lse if lse is not None else o.new_empty((0,), dtype=torch.float32))


@torch.library.register_fake("nnprim::sdpa_forward", lib=LIB)
def _sdpa_forward_fake(q, k, v, k_scales, k_zero_points, v_scales, v_zero_points, k_quant, v_quant, attn_mask,
                       scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p, seed, offset,
                       softmax_inf_as_zero, return_lse, solver, block_table=None, q_descale=None, k_descale=None,
                       v_descale=None, out_dtype=None, seed_tensor=None):
    p = problem("fwd", q, _kv(k, k_scales, k_zero_points, k_quant, checked=True),
                _kv(v, v_scales, v_zero_points, v_quant, checked=True), attn_mask, scale_tensor, kv_lens, causal,
                scale, invert_scale, dropout_p, seed if seed_tensor is None else seed_tensor, offset,
                softmax_inf_as_zero, return_lse, check_values=False,
                block_table=block_table, descales=(q_descale, k_descale, v_descale), out_dtype=out_dtype)
    o = q.new_empty((p.B, p.Hq, p.Sq, p.Dv), dtype=p.result_dtype)
    lse = q.new_empty((p.B, p.Hq, p.Sq) if return_lse else (0,), dtype=torch.float32)
    return o, lse


# ---- backward ----------------------------------------------------------------------------------
def _bwd_problem(do, q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p,
                 seed, offset, softmax_inf_as_zero, *, check_values: bool = True) -> AttentionProblem:
    p = problem("bwd", q, k, v, attn_mask, scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p, seed,
                offset, softmax_inf_as_zero, True, check_values=check_values)
    want = (p.B, p.Hq, p.Sq, p.Dv)
    for name, t in (("do", do), ("o", o)):
        if tuple(t.shape) != want:
            raise BadParameterError(f"{name} shape {tuple(t.shape)} must be (B, Hq, Sq, Dv)={want}")
        if t.device != q.device:
            raise BadParameterError(f"{name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise BadParameterError(f"{name}.dtype={t.dtype} must be q's dtype ({q.dtype})")
    if tuple(lse.shape) != want[:3]:
        raise BadParameterError(f"lse shape {tuple(lse.shape)} must be (B, Hq, Sq)={want[:3]}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise BadParameterError(f"lse.dtype={lse.dtype} must be float32")
    if lse.device != q.device:
        raise BadParameterError(f"lse is on {lse.device} but q is on {q.device}")
    return p


@torch.library.impl(LIB, "sdpa_backward", "CompositeExplicitAutograd")
def _sdpa_backward(do, q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p,
                   seed, offset, softmax_inf_as_zero, solver, seed_tensor=None):
    if seed_tensor is not None:
        seed = seed_tensor
    _check_counters(seed, offset, q.device)
    _check_lens(kv_lens, k)
    key = ("bwd", q.shape, q.stride(), q.dtype, (k.shape, k.stride(), k.dtype, k.device),
           (v.shape, v.stride(), v.dtype, v.device), (do.shape, do.stride(), do.dtype, do.device),
           (o.shape, o.stride(), o.dtype, o.device), (lse.shape, lse.stride(), lse.dtype, lse.device),
           _tkey(attn_mask), _tkey(scale_tensor), _tkey(kv_lens), causal, scale, invert_scale, dropout_p,
           softmax_inf_as_zero, solver)
    args = AttnArgs(q=q, k=k, v=v, attn_mask=attn_mask, scale=_scale_arg(scale, scale_tensor), seed=seed,
                    offset=offset, kv_lens=kv_lens, do=do, o=o, lse=lse)
    return tuple(context(q.device).call(
        key, lambda: _bwd_problem(do, q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, causal, scale,
                                  invert_scale, dropout_p, seed, offset, softmax_inf_as_zero),
        args, solver))


@torch.library.register_fake("nnprim::sdpa_backward", lib=LIB)
def _sdpa_backward_fake(do, q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, causal, scale, invert_scale,
                        dropout_p, seed, offset, softmax_inf_as_zero, solver, seed_tensor=None):
    _bwd_problem(do, q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, causal, scale, invert_scale, dropout_p,
                 seed if seed_tensor is None else seed_tensor, offset, softmax_inf_as_zero, check_values=False)
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)


# ---- autograd -------------------------------------------------------------------------------
def fp8_grad_error(named) -> NotSupportedError:
    """The error for gradients asked through FP8 inputs (`named`: (name, needs grad) pairs)."""
    names = [n for n, need in named if need]
    return NotSupportedError(f"{', '.join(names)} requires grad: FP8 attention (float8_e4m3fn q/k/v) is not "
                             "differentiable; call sdpa under torch.no_grad() or use bf16/f16/f32 inputs")


def no_grad_through(attn_mask, scale_tensor) -> None:
    """Gradients are q's, k's and v's: a mask or scale that asks for one gets an error, not None."""
    for name, t in (("attn_mask", attn_mask), ("scale", scale_tensor)):
        if t is not None and t.requires_grad:
            raise NotSupportedError(f"{name} requires grad: sdpa's gradients are q's, k's and v's (detach "
                                    f"{name}, or compute the scores in torch to learn it)")


def _save(ctx, q, k, v, o, lse, quantized: bool, attn_mask, scale_tensor, kv_lens, options,
          paged: bool = False) -> None:
    no_grad_through(attn_mask, scale_tensor)     # (autograd saves only when gradients are wanted)
    # an output nothing used gets None, not a zero tensor (an allocation and a kernel launch,
    # ~35 us of host on the H200's machine for the lse a training step never uses)
    ctx.set_materialize_grads(False)
    if lse.numel() == 0:
        ctx.mark_non_differentiable(lse)
    if not any(ctx.needs_input_grad[:3]):
        return
    if _fp8.is_fp8(q.dtype):
        raise fp8_grad_error(zip("qkv", ctx.needs_input_grad[:3]))
    if quantized:
        raise NotSupportedError("gradients through quantized K/V are not supported; "
                                "call sdpa under torch.no_grad() or dequantize K/V first")
    if paged:
        raise NotSupportedError("gradients through paged K/V (block_table) are not supported: paged caches "
                                "serve inference; call sdpa under torch.no_grad()")
    if lse.numel() == 0:
        raise NotSupportedError("nnprim::sdpa_forward needs return_lse=True when gradients are needed "
                                "(nnprim.sdpa asks for it)")
    ctx.save_for_backward(q, k, v, o, lse, attn_mask, scale_tensor, kv_lens)
    ctx.options = options


def split_seed(options: tuple, at: int) -> tuple[tuple, dict]:
    """(options with an int seed at `at`, the op's keyword for a device seed): the op schema's
    `seed` is an int, a device seed travels as `seed_tensor`."""
    seed = options[at]
    if isinstance(seed, torch.Tensor):
        return options[:at] + (0,) + options[at + 1:], {"seed_tensor": seed}
    return options, {}


def _grads(ctx, do, backward):
    if do is None:               # o's gradient unmaterialised: nothing flowed into it
        return None, None, None
    q, k, v, o, lse, attn_mask, scale_tensor, kv_lens = ctx.saved_tensors
    options, kw = split_seed(ctx.options, 4)
    return backward(do.contiguous(), q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, *options, None, **kw)


def with_lse_grads(ctx, grads, dlse):
    """(dq, dk, dv) plus the gradient that flows in through lse (None: none did).

    lse_i = logsumexp_j S_ij with S = s q k^T + mask, so d lse_i / d S_ij = P_ij (the softmax
    before dropout): dq_i += s dlse_i sum_j P_ij k_j, which is attention with k as the values,
    and dk_j += s sum_i P_ij dlse_i q_i, the P^T dO product a backward computes as dv, here
    with dO = dlse q and k as the values (its dq and dk are not used). An extra forward and
    backward, run only when lse's gradient is wanted (merging partial attentions)."""
    if dlse is None:
        return grads
    q, k, v, o, lse, attn_mask, scale_tensor, kv_lens = ctx.saved_tensors
    causal, scale, invert, _p, seed, offset, _inf_zero = ctx.options
    opts = (attn_mask, scale_tensor, kv_lens, causal, scale, invert, 0.0, 0, 0, True)
    if scale_tensor is not None:
        s = scale_tensor.float().reshape(())
    else:
        s = torch.tensor(scale if scale is not None else q.shape[-1] ** -0.5, dtype=torch.float32,
                         device=q.device)
    if invert:
        s = 1.0 / s
    dlse = dlse.float().masked_fill(lse == -math.inf, 0.0)        # rows with no key: no gradient
    ops = torch.ops.nnprim
    pk, _ = ops.sdpa_forward(q, k, k, None, None, None, None, "", "", *opts, False, None)
    dq_lse = (s * dlse).unsqueeze(-1) * pk.float()
    do_lse = ((s * dlse).unsqueeze(-1) * q.float()).to(q.dtype).contiguous()
    o0 = torch.zeros(q.shape, dtype=q.dtype, device=q.device)      # contiguous, as a forward's o
    _, _, dk_lse = ops.sdpa_backward(do_lse, q, k, k, o0, lse, *opts, None)
    dq, dk, dv = grads
    dq = dq_lse.to(q.dtype) if dq is None else (dq.float() + dq_lse).to(dq.dtype)
    dk = dk_lse.to(k.dtype) if dk is None else (dk.float() + dk_lse.float()).to(dk.dtype)
    return dq, dk, dv


def _setup(ctx, inputs, output) -> None:
    (q, k, v, k_scales, k_zero_points, v_scales, v_zero_points, k_quant, v_quant, attn_mask, scale_tensor, kv_lens,
     causal, scale, invert_scale, dropout_p, seed, offset, softmax_inf_as_zero, return_lse, solver,
     *rest) = inputs
    if len(rest) > 5 and rest[5] is not None:   # (block_table, the FP8 arguments, seed_tensor)
        seed = rest[5]
    _save(ctx, q, k, v, *output, bool(k_quant or v_quant), attn_mask, scale_tensor, kv_lens,
          (causal, scale, invert_scale, dropout_p, seed, offset, softmax_inf_as_zero),
          paged=bool(rest) and rest[0] is not None)


def _backward(ctx, do, dlse):
    return tuple(with_lse_grads(ctx, _grads(ctx, do, torch.ops.nnprim.sdpa_backward), dlse)) + (None,) * 24


torch.library.register_autograd("nnprim::sdpa_forward", _backward, setup_context=_setup, lib=LIB)


class SdpaFunction(torch.autograd.Function):
    """The eager path's autograd (no dispatcher): sdpa_forward's formulas with the
    implementations called directly; plain (unquantized) K/V; returns (o, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale_tensor, kv_lens, options, solver, key=None):
        """options: (causal, scale, invert_scale, dropout_p, seed, offset, softmax_inf_as_zero),
        one argument so that Function.apply has fewer to walk. `key`: the public call's
        memo key (its raw signature, options validated when it was new), or None."""
        if key is None:
            o, lse = sdpa_forward(q, k, v, None, None, None, None, "", "", attn_mask, scale_tensor, kv_lens,
                                   *options, True, solver)
        else:
            def make() -> AttentionProblem:
                _check_lens(kv_lens, k)
                return problem("fwd", q, k, v, attn_mask, scale_tensor, kv_lens, *options, True)
            o, lse = context(q.device).call(key, make, AttnArgs(
                q=q, k=k, v=v, attn_mask=attn_mask, scale=_scale_arg(options[1], scale_tensor), seed=options[4],
                offset=options[5], kv_lens=kv_lens), solver)
        _save(ctx, q, k, v, o, lse, False, attn_mask, scale_tensor, kv_lens, options)
        ctx.key = key
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        grads = _grads(ctx, do, _sdpa_backward) if ctx.key is None or do is None else _keyed_grads(ctx, do)
        grads = with_lse_grads(ctx, grads, dlse)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (do, dlse, *ctx.saved_tensors[:3])):
            # create_graph=True: even a torch-op solver's gradients leave out lse's and o's
            # dependence on q, k, v (saved detached), so a second derivative would be wrong
            raise NotSupportedError("double backward (create_graph=True) through nnprim.sdpa is not supported")
        return (*grads, None, None, None, None, None, None)


_SDPA_APPLY = c_apply(SdpaFunction)


def sdpa_function(q, k, v, attn_mask, scale_tensor, kv_lens, options, solver, key=None):
    """SdpaFunction.apply(...), straight to C++ outside functorch transforms."""
    if transforms_active():
        return SdpaFunction.apply(q, k, v, attn_mask, scale_tensor, kv_lens, options, solver, key)
    return _SDPA_APPLY(unwrap(q), unwrap(k), unwrap(v), None if attn_mask is None else unwrap(attn_mask),
                       None if scale_tensor is None else unwrap(scale_tensor),
                       None if kv_lens is None else unwrap(kv_lens), options, solver, key)


def _keyed_grads(ctx, do):
    """The backward of a forward memoised under `ctx.key`: that key (the call's signature,
    validated when new) and what the forward returned fix the backward problem (autograd
    hands `do` in o's shape, dtype and device), so it keys the backward's memo entry, and a
    call skips building the 20-field key of `_sdpa_backward` and its checks (the host time
    of a backward on autograd's device thread, where Python runs cold)."""
    q, k, v, o, lse, attn_mask, scale_tensor, kv_lens = ctx.saved_tensors
    do = do.contiguous()
    opts = ctx.options
    args = AttnArgs(q=q, k=k, v=v, attn_mask=attn_mask, scale=_scale_arg(opts[1], scale_tensor), seed=opts[4],
                    offset=opts[5], kv_lens=kv_lens, do=do, o=o, lse=lse)
    return context(q.device).call(
        ("bwd_of", ctx.key, do.stride(), o.stride(), lse.stride(), lse.dtype),
        lambda: _bwd_problem(do, q, k, v, o, lse, attn_mask, scale_tensor, kv_lens, *opts), args)
