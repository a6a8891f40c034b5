"""Random invoker inputs for a problem (find's inputs when the caller gives none).

Values are drawn from a seeded generator on the CPU and moved to the problem's device,
in the problem's dtype and layout; nothing is zero: dense tensors are standard normal,
Binary "div" divisors are kept away from zero, quantized K/V get random codes with
positive scales, FP8 descales are positive, kv_lens lie in [1, Sk], a boolean mask keeps key 0 of every row.
Attention backward gets do plus o and lse from the reference forward when one is
registered (random o/lse otherwise: still the same inputs for every candidate)."""
from __future__ import annotations

import torch

from ..args import AttnArgs, ConvArgs
from ..post_ops import Binary, Eltwise, Sum
from ..problems.conv import to_layout
from ..quant import KVQuant

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _away_from_zero(shape, dtype, device, gen) -> torch.Tensor:
    mag = 0.5 + torch.rand(tuple(shape), generator=gen)
    sign = torch.where(torch.rand(tuple(shape), generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).to(device=device, dtype=dtype)


def conv_args(p, seed: int = 0) -> ConvArgs:
    gen = torch.Generator().manual_seed(seed)
    dev, dt = p.device, p.dtype
    x = to_layout(_randn(p.x_shape, dt, dev, gen), p.layout)
    w = to_layout(_randn(p.w_shape, dt, dev, gen), p.layout)
    dy = to_layout(_randn(p.y_shape, dt, dev, gen), p.layout)
    if p.direction == "fwd":
        a = ConvArgs(x=x, w=w)
    elif p.direction == "bwd_data":
        a = ConvArgs(dy=dy, w=w)
    else:
        a = ConvArgs(dy=dy, x=x)
    if p.has_bias:
        a.bias = _randn((p.K,), dt, dev, gen)
    ops = []
    for sig in p.post_ops:
        if sig[0] == "sum":
            ops.append(Sum(to_layout(_randn(p.y_shape, dt, dev, gen), p.layout), float(sig[1])))
        elif sig[0] == "eltwise":
            ops.append(Eltwise(sig[1], float(sig[2]), float(sig[3])))
        elif sig[0] == "binary":
            ops.append(Binary(sig[1], _away_from_zero(sig[2], dt, dev, gen)))
        else:
            raise ValueError(f"unknown post-op signature {sig!r}")
    a.post_ops = tuple(ops)
    return a


def _kv_quant(sig: tuple, shape, device, gen) -> KVQuant:
    """A KVQuant whose signature() equals `sig` = (dtype, group, scales t|h|g, scale dtype, zp[, layout][, "keys"])."""
    qdt, group, sc, sdt, zp = sig[:5]
    layout = next((x for x in sig[5:] if isinstance(x, int)), 0)
    B, H, S, D = shape
    group = int(group)
    if qdt == "fp8_e4m3":
        data = (torch.randn((B, H, S, D), generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    elif qdt == "s8":
        data = torch.randint(-128, 128, (B, H, S, D), generator=gen, dtype=torch.int32).to(torch.int8)
    elif qdt == "u8":
        data = torch.randint(0, 256, (B, H, S, D), generator=gen, dtype=torch.int32).to(torch.uint8)
    else:
        data = torch.randint(0, 256, (B, H, S, D // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    gshape = (B, H, S, D // group)
    sdtype = _SCALE_DTYPES.get(sdt, torch.float32)
    span = {"s8": 127.0, "u8": 127.0, "s4": 7.0, "u4": 7.0, "fp8_e4m3": 448.0}[qdt]
    # per-head values shared by the batch entries: a static per-head cache's (a paged pool holds
    # one per head, and to_pages refused (B, H) values that differ between entries: find failed)
    kshape = {"g": gshape, "h": (1, H), "t": (1,)}

    def full(t: torch.Tensor, kind: str) -> torch.Tensor:
        return t.expand(B, H).contiguous() if kind == "h" else t

    scales = full(((0.5 + torch.rand(kshape[sc], generator=gen)) / span).to(sdtype), sc)
    zps = None
    if zp is not None:
        mid = {"s8": 0.0, "u8": 128.0, "s4": 0.0, "u4": 8.0}[qdt]
        zps = full((mid + torch.randint(-2, 3, kshape[zp], generator=gen)).to(torch.float32), zp)
    if "keys" in sig[5:]:   # keys-contiguous codes, as quantize_kv(..., order="keys") stores them
        data = data.transpose(-1, -2).contiguous().transpose(-1, -2)
    return KVQuant(data.to(device), scales.to(device), None if zps is None else zps.to(device), qdt,
                   None if group == D else group, layout)


def attn_args(p, seed: int = 0) -> AttnArgs:
    gen = torch.Generator().manual_seed(seed)
    dev, dt = p.device, p.dtype
    q = _randn((p.B, p.Hq, p.Sq, p.D), dt, dev, gen)
    k = _kv_quant(p.k_quant, (p.B, p.Hkv, p.Sk, p.D), dev, gen) if p.k_quant else \
        _randn((p.B, p.Hkv, p.Sk, p.D), dt, dev, gen)
    v = _kv_quant(p.v_quant, (p.B, p.Hkv, p.Sk, p.Dv), dev, gen) if p.v_quant else \
        _randn((p.B, p.Hkv, p.Sk, p.Dv), dt, dev, gen)
    mask = None
    if p.mask == "bool":
        keep = torch.rand(p.mask_shape, generator=gen) < 0.8
        keep[..., 0] = True
        mask = keep.to(dev)
    elif p.mask == "additive":
        mask = _randn(p.mask_shape, dt, dev, gen)
    scale = {"default": None, "float": 0.3, "tensor": torch.tensor(0.3, device=dev)}[p.scale]
    kv_lens = None
    if p.has_kv_lens:
        kv_lens = torch.randint(1, p.Sk + 1, (p.B,), generator=gen, dtype=torch.int32).to(dev)
    block_table = None
    if p.page_size:  # the caches cut into shuffled pages of a pool with one spare page
        from ..paged import to_pages
        n = p.B * (p.Sk // p.page_size)
        block_table = torch.randperm(n + 1, generator=gen)[:n].reshape(p.B, -1).to(torch.int32).to(dev)
        k, v = to_pages(k, block_table, n + 1), to_pages(v, block_table, n + 1)
    a = AttnArgs(q=q, k=k, v=v, attn_mask=mask, scale=scale, seed=1234 + seed, offset=7, kv_lens=kv_lens,
                 block_table=block_table)
    for name, kind, H in zip(("q_descale", "k_descale", "v_descale"), p.descale or "", (p.Hq, p.Hkv, p.Hkv)):
        if kind != "n":     # FP8 descales: positive, per tensor or per (b, head)
            shape = (p.B, H) if kind == "h" else ()
            setattr(a, name, (0.5 + torch.rand(shape, generator=gen)).to(dev))
    if p.direction == "bwd":
        a.do = _randn((p.B, p.Hq, p.Sq, p.Dv), dt, dev, gen)
        a.o, a.lse = _forward_outputs(p, a, gen)
    return a


def _forward_outputs(p, a: AttnArgs, gen) -> tuple[torch.Tensor, torch.Tensor]:
    from .solver import REGISTRY
    fp = p.with_direction("fwd")
    fp = type(fp)(**{**vars(fp), "return_lse": True})
    for s in REGISTRY.for_problem(fp):
        if s.family == "reference" and s.is_applicable(fp):
            o, lse = s.prepare(fp)(a)
            return o, lse
    o = _randn((p.B, p.Hq, p.Sq, p.Dv), p.dtype, p.device, gen)
    lse = (torch.rand((p.B, p.Hq, p.Sq), generator=gen) + 1.0).to(p.device)
    return o, lse


def random_args(problem, seed: int = 0):
    """ConvArgs or AttnArgs for `problem` on its device (see the module docstring)."""
    if type(problem).__name__ == "ConvProblem":
        return conv_args(problem, seed)
    return attn_args(problem, seed)
