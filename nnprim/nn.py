"""torch.nn modules over nnprim's primitives."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .api import conv_forward, sdpa
from .errors import BadParameterError
from .problems.attention import normalize_causal
from .problems.conv import _named_padding, _padding


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise BadParameterError(f"{name}={v!r} must be a positive int")
    return v


class _ConvNd(nn.Module):
    ndim: int

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros", post_ops=(),
                 device=None, dtype=None) -> None:
        super().__init__()
        try:
            ks = (kernel_size,) * self.ndim if isinstance(kernel_size, int) else tuple(kernel_size)
        except TypeError:
            raise BadParameterError(f"kernel_size={kernel_size!r} must be a positive int or {self.ndim} of them") from None
        if padding_mode not in _PAD_MODES:
            raise BadParameterError(f"padding_mode={padding_mode!r} is not one of {_PAD_MODES}")
        self.padding_mode = padding_mode
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, ks
        # torch.nn.ConvNd's checks, as nnprim errors (the rest, stride / padding / dilation,
        # conv_forward checks against the input)
        _positive("in_channels", in_channels)
        _positive("out_channels", out_channels)
        _positive("groups", groups)
        if len(ks) != self.ndim or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in ks):
            raise BadParameterError(f"kernel_size={kernel_size!r} must be a positive int or {self.ndim} of them")
        for name, c in (("in_channels", in_channels), ("out_channels", out_channels)):
            if c % groups:
                raise BadParameterError(f"{name}={c} must be divisible by groups={groups}")
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        # padding_mode pads with F.pad: torch's strings resolve to pairs here ('same': stride 1)
        self._mode_pads = None
        if padding_mode != "zeros":
            pads = (_named_padding(padding, _per_dim("stride", stride, self.ndim),
                                   _per_dim("dilation", dilation, self.ndim), list(ks))
                    if isinstance(padding, str) else padding)
            self._mode_pads = _pad_pairs(pads, self.ndim)
        self.post_ops = tuple(post_ops)
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *ks, **kw))
        self.bias = nn.Parameter(torch.empty(out_channels, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch's default: kaiming-uniform weights, bias in +-1/sqrt(fan_in)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight[0].numel()
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros":    # as torch.nn.ConvNd: pad in that mode, then no padding
            try:
                x = F.pad(x, self._mode_pads, mode=self.padding_mode)
            except RuntimeError as e:      # e.g. reflect: a pad as large as the input
                raise BadParameterError(f"padding={self.padding!r} with padding_mode={self.padding_mode!r} on an "
                                        f"input of shape {tuple(x.shape)}: {e}") from None
            return conv_forward(x, self.weight, self.bias, stride=self.stride, padding=0, dilation=self.dilation,
                                groups=self.groups, post_ops=self.post_ops)
        return conv_forward(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                            dilation=self.dilation, groups=self.groups, post_ops=self.post_ops)

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}")
        if self.dilation != 1:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        if self.post_ops:
            s += f", post_ops={self.post_ops!r}"
        return s


_PAD_MODES = ("zeros", "reflect", "replicate", "circular")


def _per_dim(name: str, v, nd: int) -> tuple[int, ...]:
    t = (v,) * nd if isinstance(v, int) and not isinstance(v, bool) else tuple(v) if isinstance(v, (tuple, list)) else ()
    if len(t) != nd or not all(isinstance(e, int) and not isinstance(e, bool) and e > 0 for e in t):
        raise BadParameterError(f"{name}={v!r} must be a positive int or {nd} of them")
    return t


def _pad_pairs(padding, nd: int) -> list[int]:
    """F.pad's list (last dim first, before then after) of conv padding: an int, one int per
    dim, or a (before, after) pair per dim."""
    if isinstance(padding, int) and padding == 0:      # 'valid'
        return [0] * (2 * nd)
    before, after = _padding(padding, nd)       # validated as conv_forward's padding
    if min(before + after) < 0:
        raise BadParameterError(f"padding={padding!r} must not be negative")
    return [e for pair in reversed(list(zip(before, after))) for e in pair]


class Conv1d(_ConvNd):
    ndim = 1


class Conv2d(_ConvNd):
    ndim = 2


class Conv3d(_ConvNd):
    ndim = 3


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads: x (B, S, E) -> (B, S, E).
    q/k/v/o projections, then nnprim.sdpa."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = True, causal=None, dropout: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        _positive("embed_dim", embed_dim)
        _positive("num_heads", num_heads)
        self.num_heads = num_heads
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads or num_heads)
        if num_heads % self.num_kv_heads:
            raise BadParameterError(f"num_heads={num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if head_dim is None and embed_dim % num_heads:
            raise BadParameterError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads} "
                                    "(or give head_dim)")
        self.head_dim = _positive("head_dim", head_dim or embed_dim // num_heads)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise BadParameterError(f"dropout={dropout!r} must be a float in [0, 1)")
        normalize_causal(causal)     # raises for a bad value now, not at the first forward
        self.embed_dim = embed_dim
        self.causal, self.dropout = causal, dropout
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(embed_dim, self.num_kv_heads * self.head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * self.head_dim, embed_dim, **kw)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        mem = x if memory is None else memory
        for name, t in (("x", x), ("memory", mem)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != self.embed_dim or \
                    t.shape[0] != x.shape[0]:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BadParameterError(f"{name} {got} must be (B, S, embed_dim={self.embed_dim})"
                                        + (f" with x's B={x.shape[0]}" if name == "memory" else ""))
        B, S, _ = x.shape
        Sk = mem.shape[1]
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(mem).view(B, Sk, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(mem).view(B, Sk, self.num_kv_heads, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        seed = 0
        if p:
            # a fresh dropout pattern per call, reproducible under torch.manual_seed. On a GPU
            # and under torch.compile a device seed (nnprim.dropout) drawn on x's device: each
            # replay of a captured CUDA graph draws anew (as torch's dropout does) and a compiled
            # graph needs no break for a host value; in eager CPU calls an int
            if x.is_cuda or torch.compiler.is_compiling():
                seed = torch.randint(0, 2**62, (1,), device=x.device)
            else:
                seed = int(torch.randint(0, 2**62, (1,)).item())
        o = sdpa(q, k, v, attn_mask=attn_mask, causal=self.causal, dropout_p=p, seed=seed)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))
