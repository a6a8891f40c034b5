"""Build runnable cases (tensors, the nnprim call, the float64 check, the torch peer)
from a problem spec: the `conv`/`attn` commands and `bench` suites share this."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..args import AttnArgs, ConvArgs
from ..errors import BadParameterError
from ..post_ops import Binary, Eltwise, Sum, apply_post_ops
from ..problems.attention import AttentionProblem
from ..problems.conv import ConvProblem, to_layout
from ..search.context import for_problem
from ..search.numerics import rel_error, tolerance  # noqa: F401  (the CLI uses find's comparison)


@dataclass
class Case:
    """One runnable problem: `call()` runs nnprim (solver chosen by dispatch or forced),
    `check()` returns the relative error against float64, `peer()` runs torch's own op."""
    name: str
    problem: object
    flops: float
    bytes: float
    call: Callable[..., object]  # call(solver=the case's): the nnprim call
    check: Callable[[], float]
    peer: Callable[[], object] | None = None
    extra: dict = field(default_factory=dict)

    def solver(self, forced=None):
        return for_problem(self.problem).resolve(self.problem, forced)

    def call_with(self, solver):
        """The same call on the same tensors with `solver` forced (None: chosen)."""
        return self.call(solver)


def _randn(shape, dtype, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def conv_case(spec: dict, *, dtype: torch.dtype, device: str, direction: str = "fwd",
              layout: str | None = None, bias: bool = False, post_ops: tuple[str, ...] = (),
              out_dtype: torch.dtype | None = None, solver=None, seed: int = 0) -> Case:
    """spec: {N, C, K, spatial, filter, stride, padding, dilation, groups, layout, name}."""
    gen = torch.Generator().manual_seed(seed)
    layout = layout or spec.get("layout", "nchw")
    N, C, K, G = int(spec["N"]), int(spec["C"]), int(spec["K"]), int(spec.get("groups", 1))
    spatial, filt = list(spec["spatial"]), list(spec["filter"])
    if len(spatial) != len(filt):
        raise BadParameterError(f"spatial={spatial} and filter={filt} must have the same length")
    kw = dict(stride=spec.get("stride", 1), padding=spec.get("padding", 0),
              dilation=spec.get("dilation", 1), groups=G)
    x = to_layout(_randn((N, C, *spatial), dtype, device, gen), layout)
    w = to_layout(_randn((K, C // G, *filt), dtype, device, gen), layout)
    b = _randn((K,), dtype, device, gen) if bias else None
    p = ConvProblem.from_tensors(x, w, "fwd", bias=b, out_dtype=out_dtype, **kw)
    y_shape = p.y_shape
    ops = []
    for name in post_ops:
        if name == "sum":
            ops.append(Sum(to_layout(_randn(y_shape, dtype, device, gen), layout), 1.0))
        elif name.startswith("binary_"):
            ops.append(Binary(name[7:], _randn((K,), dtype, device, gen)))
        else:
            ops.append(Eltwise(name))
    from .. import api
    from ..conv.reference import reference

    if direction == "fwd":
        nops = api._post_ops(ops, x.dim(), K)
        p = ConvProblem.from_tensors(x, w, "fwd", bias=b, out_dtype=out_dtype, post_ops=nops, **kw)
        args = ConvArgs(x=x, w=w, bias=b, post_ops=nops)

        def call(solver=solver):
            return api.conv_forward(x, w, b, post_ops=ops, out_dtype=out_dtype, solver=solver, **kw)

        def peer():
            conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(spatial)]
            pad = kw["padding"]
            y = conv(x, w, b, kw["stride"], pad, kw["dilation"], G)
            return apply_post_ops(y, nops)  # the chain as separate eager ops
    else:
        dy = to_layout(_randn(y_shape, dtype, device, gen), layout)
        p = ConvProblem.create(direction, x.shape, w.shape, dtype=dtype, layout=layout, device=device, **kw)
        if direction == "bwd_data":
            args = ConvArgs(dy=dy, w=w)

            def call(solver=solver):
                return api.conv_backward_data(dy, w, x.shape, solver=solver, **kw)
        else:
            args = ConvArgs(dy=dy, x=x)

            def call(solver=solver):
                return api.conv_backward_weights(dy, x, w.shape, solver=solver, **kw)
        # torch's own kernel for this one gradient (cuDNN on the GPU), as autograd calls it
        # for a conv whose other inputs need no gradient; not autograd.grad, whose graph
        # walk adds host time that is not the peer kernel's
        nd = len(spatial)
        bw_args = (list(p.stride), list(p.pad_before), list(p.dilation), False, [0] * nd, G,
                   [direction == "bwd_data", direction == "bwd_weights", False])

        def peer():
            return torch.ops.aten.convolution_backward(dy, x, w, None, *bw_args)

    def check() -> float:
        return rel_error(call(), reference(p, args))

    name = spec.get("name", p.key())
    return Case(name=name, problem=p, flops=p.flops(), bytes=p.bytes(), call=call, check=check,
                peer=peer if not any(isinstance(e, (list, tuple)) for e in _as_list(kw["padding"])) else None)


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def attn_case(spec: dict, *, dtype: torch.dtype, device: str, direction: str = "fwd",
              causal=None, mask: str | None = None, dropout_p: float = 0.0, kv_quant: str | None = None,
              group_size: int | None = None, solver=None, seed: int = 0) -> Case:
    """spec: {B, Hq, Hkv, Sq, Sk, D, Dv?, causal?, name} and optionally the K/V format of
    problem_args.attn_problem (kv_quant and quantize_kv's options, page_size: k and v in
    shuffled page pools with full kv_lens). A quantized or paged case's peer is torch's SDPA on
    the bf16 cache before quantization (the reference decode is measured against)."""
    from .. import api
    from ..paged import to_pages
    from ..quant import quantize_kv
    from .problem_args import quant_options
    B, Hq, Hkv, Sq, Sk, D = (int(spec[k]) for k in ("B", "Hq", "Hkv", "Sq", "Sk", "D"))
    Dv = int(spec.get("Dv", D))
    fmt = dict(spec, kv_quant=kv_quant, group_size=group_size) if kv_quant else spec
    kq_opts, vq_opts = quant_options(fmt, D), quant_options(fmt, Dv)
    page = int(spec.get("page_size") or 0)
    gen = torch.Generator().manual_seed(seed)
    if causal is None and spec.get("causal") not in (None, False, "none"):
        causal = "bottom_right" if Sq != Sk else "top_left"
    q = _randn((B, Hq, Sq, D), dtype, device, gen)
    k = _randn((B, Hkv, Sk, D), dtype, device, gen)
    v = _randn((B, Hkv, Sk, Dv), dtype, device, gen)
    plain_k, plain_v = k, v
    if kq_opts is not None:
        k = quantize_kv(k, kq_opts[0], **kq_opts[1])
        v = quantize_kv(v, vq_opts[0], **vq_opts[1])
    kv_lens = block_table = None
    if page:
        if Sk % page:
            raise BadParameterError(f"attention spec {spec!r}: page_size={page} must divide Sk={Sk}")
        n = B * Sk // page
        block_table = torch.randperm(n + 1, generator=gen)[:n].reshape(B, -1).to(torch.int32).to(device)
        k, v = to_pages(k, block_table, n + 1), to_pages(v, block_table, n + 1)
        kv_lens = torch.full((B,), Sk, dtype=torch.int32, device=device)
    m = None
    if mask == "bool":
        m = torch.rand((B, 1, Sq, Sk), generator=gen).to(device) > 0.2
    elif mask == "additive":
        m = _randn((1, Hq, Sq, Sk), dtype, device, gen)
    opts = dict(attn_mask=m, causal=causal, dropout_p=dropout_p, seed=seed)
    if page:
        opts.update(kv_lens=kv_lens, block_table=block_table)
    p = AttentionProblem.from_tensors(q, k, v, direction=direction, return_lse=direction == "bwd", **opts)
    if direction == "fwd":
        args = AttnArgs(q=q, k=k, v=v, attn_mask=m, seed=seed, kv_lens=kv_lens, block_table=block_table)

        def call(solver=solver):
            return api.sdpa(q, k, v, solver=solver, **opts)
    else:
        o, lse = api.sdpa(q, k, v, return_lse=True, **opts)
        do = _randn(o.shape, dtype, device, gen)
        args = AttnArgs(q=q, k=k, v=v, attn_mask=m, seed=seed, do=do, o=o, lse=lse)

        def call(solver=solver):
            return api.sdpa_backward(do, q, k, v, o, lse, solver=solver, **opts)

    def check() -> float:
        from ..attention import reference as aref
        if direction == "fwd":
            ref, _ = aref.reference_forward(p, args)
            return rel_error(call(), ref)
        refs = aref.reference_backward(p, args)
        outs = call()
        return max(rel_error(a, r) for a, r in zip(outs, refs))

    peer = None
    if m is None and not dropout_p and (direction == "fwd" or not (kq_opts or page)):
        peer = _sdpa_peer(q, plain_k, plain_v, causal, None if direction == "fwd" else args.do)
    return Case(name=spec.get("name", p.key()), problem=p, flops=p.flops(), bytes=p.bytes(),
                call=call, check=check, peer=peer, extra=dict(mode=spec.get("mode")))


def _sdpa_peer(q, k, v, causal, do=None) -> Callable[[], object]:
    """torch's SDPA on the same inputs: the forward, or (given do) its backward alone."""
    Sq, Sk = q.shape[2], k.shape[2]
    kw = dict(enable_gqa=q.shape[1] != k.shape[1])
    if causal == "bottom_right" and Sq != Sk:
        kw["attn_mask"] = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
    else:
        kw["is_causal"] = causal is not None
    if do is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)
    qt, kt, vt = (t.detach().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qt, kt, vt, **kw)
    return lambda: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True)


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9 if ms and math.isfinite(ms) else float("nan")
