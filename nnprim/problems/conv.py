"""ConvProblem: the descriptor of one convolution (MIOpen's ProblemDescription).

Logical shapes are always N, C, *spatial (x), K, C/groups, *filter (w) and
N, K, *out (y); `layout` says how they sit in memory ("nchw" = contiguous,
"nhwc" = channels last, for 1D/2D/3D alike)."""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import alloc
from ..errors import BadParameterError
from .common import check_float_dtype, dtype_name

DIRECTIONS = ("fwd", "bwd_data", "bwd_weights")
IntOrSeq = int | Sequence[int]


def layout_of(t: torch.Tensor) -> str:
    """"nhwc" when the tensor is channels-last in memory and not plainly contiguous."""
    if t.dim() < 3 or t.is_contiguous():
        return "nchw"
    fmt = _CHANNELS_LAST.get(t.dim())
    if fmt is not None:  # the same test as the permuted view's, without making the view
        return "nhwc" if t.is_contiguous(memory_format=fmt) else "nchw"
    perm = (0, *range(2, t.dim()), 1)
    return "nhwc" if t.permute(*perm).is_contiguous() else "nchw"


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Return t stored in `layout` (a copy only when needed)."""
    if layout == "nchw":
        return t.contiguous()
    fmt = _CHANNELS_LAST.get(t.dim())
    if fmt is not None:
        return t.contiguous(memory_format=fmt)
    if layout_of(t) == "nhwc":
        return t
    perm = (0, *range(2, t.dim()), 1)
    inv = (0, t.dim() - 1, *range(1, t.dim() - 1))
    return t.permute(*perm).contiguous().permute(*inv)


def empty_in_layout(shape: Sequence[int], layout: str, **kw) -> torch.Tensor:
    """Allocate a logical N,C,*spatial tensor stored in `layout`."""
    shape = tuple(shape)
    dtype, device = kw.get("dtype", torch.get_default_dtype()), kw.get("device", "cpu")
    if layout == "nchw":
        return alloc.empty(shape, dtype, device)
    phys = (shape[0], *shape[2:], shape[1])
    nd = len(shape)
    return alloc.empty(phys, dtype, device).permute(0, nd - 1, *range(1, nd - 1))


def _tuple(name: str, v: IntOrSeq, nd: int) -> tuple[int, ...]:
    if isinstance(v, bool):
        raise BadParameterError(f"{name}={v!r} must be an int or {nd} ints")
    if isinstance(v, int):
        return (v,) * nd
    try:
        t = tuple(int(e) for e in v)
    except (TypeError, ValueError):
        raise BadParameterError(f"{name}={v!r} must be an int or {nd} ints") from None
    if len(t) != nd:
        raise BadParameterError(f"{name}={v!r} must have {nd} entries for a {nd}D convolution")
    return t


def _is_index(v) -> bool:
    """An integer (int, numpy / torch integer scalars), not a bool, float or string."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def _padding(v, nd: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return (v,) * nd, (v,) * nd
    try:
        items = list(v)
    except TypeError:
        raise BadParameterError(f"padding={v!r} must be an int, {nd} ints or {nd} pairs") from None
    if len(items) != nd:
        raise BadParameterError(f"padding={v!r} must have {nd} entries for a {nd}D convolution")
    before, after = [], []
    for e in items:
        if isinstance(e, int) and not isinstance(e, bool):
            before.append(e)
            after.append(e)
        elif isinstance(e, (tuple, list)) and len(e) == 2 and all(_is_index(v) for v in e):
            before.append(operator.index(e[0]))
            after.append(operator.index(e[1]))
        else:
            raise BadParameterError(f"padding={v!r}: entry {e!r} must be an int or a (before, after) pair of ints")
    return tuple(before), tuple(after)


def _named_padding(name: str, stride: tuple[int, ...], dilation: tuple[int, ...],
                   filt: list[int]) -> tuple[tuple[int, int], ...] | int:
    """torch's padding strings: "valid" = none; "same" = output size equals input size
    (stride 1 only), the odd extra element after, as torch pads."""
    if name == "valid":
        return 0
    if name != "same":
        raise BadParameterError(f"padding={name!r} must be 'same', 'valid', an int, ints or (before, after) pairs")
    if any(s != 1 for s in stride):
        raise BadParameterError(f"padding='same' needs stride 1, got stride={stride}")
    total = [d * (k - 1) for d, k in zip(dilation, filt)]
    return tuple((t // 2, t - t // 2) for t in total)


@dataclass(frozen=True)
class ConvProblem:
    direction: str
    N: int
    C: int
    K: int
    groups: int
    in_size: tuple[int, ...]
    filter: tuple[int, ...]
    out_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    pad_before: tuple[int, ...]
    pad_after: tuple[int, ...]
    layout: str
    dtype: torch.dtype
    out_dtype: torch.dtype
    device: str
    has_bias: bool = False
    post_ops: tuple = ()  # signatures: ("sum", scale) | ("eltwise", kind, a, b) | ("binary", op, shape)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def create(cls, direction: str, x_shape: Sequence[int], w_shape: Sequence[int], *,
               dtype: torch.dtype, layout: str = "nchw", device: str = "cpu",
               stride: IntOrSeq = 1, padding=0, dilation: IntOrSeq = 1, groups: int = 1,
               out_dtype: torch.dtype | None = None, has_bias: bool = False,
               post_ops: tuple = ()) -> ConvProblem:
        if direction not in DIRECTIONS:
            raise BadParameterError(f"direction={direction!r} is not one of {DIRECTIONS}")
        x_shape, w_shape = tuple(int(s) for s in x_shape), tuple(int(s) for s in w_shape)
        if len(x_shape) not in (3, 4, 5):
            raise BadParameterError(
                f"x has {len(x_shape)} dims (shape {x_shape}); expected 3 (1D), 4 (2D) or 5 (3D)")
        if len(w_shape) != len(x_shape):
            raise BadParameterError(
                f"w has {len(w_shape)} dims (shape {w_shape}) but x has {len(x_shape)} (shape {x_shape})")
        nd = len(x_shape) - 2
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise BadParameterError(f"groups={groups!r} must be a positive int")
        N, C, *spatial = x_shape
        K, Cg, *filt = w_shape
        if min(x_shape) < 1:
            raise BadParameterError(f"x shape {x_shape} has a zero or negative size")
        if min(w_shape) < 1:
            raise BadParameterError(f"w shape {w_shape} has a zero or negative size")
        if C % groups:
            raise BadParameterError(f"groups={groups} does not divide input channels C={C}")
        if K % groups:
            raise BadParameterError(f"groups={groups} does not divide output channels K={K}")
        if Cg * groups != C:
            raise BadParameterError(
                f"w.shape[1]={Cg} times groups={groups} must equal x channels C={C}")
        st = _tuple("stride", stride, nd)
        dl = _tuple("dilation", dilation, nd)
        if isinstance(padding, str):
            padding = _named_padding(padding, st, dl, filt)
        pb, pa = _padding(padding, nd)
        if min(st) < 1:
            raise BadParameterError(f"stride={stride!r} must be >= 1")
        if min(dl) < 1:
            raise BadParameterError(f"dilation={dilation!r} must be >= 1")
        if min(pb + pa) < 0:
            raise BadParameterError(f"padding={padding!r} must be >= 0")
        out = tuple((spatial[i] + pb[i] + pa[i] - dl[i] * (filt[i] - 1) - 1) // st[i] + 1
                    for i in range(nd))
        if min(out) < 1:
            raise BadParameterError(
                f"output size {out} is not positive for input {tuple(spatial)}, filter {tuple(filt)}, "
                f"stride {st}, padding {pb}/{pa}, dilation {dl}")
        if layout not in ("nchw", "nhwc"):
            raise BadParameterError(f"layout={layout!r} is not 'nchw' or 'nhwc'")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise BadParameterError(f"dtype={dtype} is not supported (f32, f16, bf16, f64)")
        if out_dtype is None:
            out_dtype = dtype
        if out_dtype != dtype and not (out_dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16)) \
                and not (direction == "fwd" and out_dtype in (torch.float16, torch.bfloat16)
                         and dtype == torch.float32):
            raise BadParameterError(f"out_dtype={out_dtype} is not supported for dtype={dtype}")
        return cls(direction=direction, N=N, C=C, K=K, groups=groups, in_size=tuple(spatial),
                   filter=tuple(filt), out_size=out, stride=st, dilation=dl, pad_before=pb,
                   pad_after=pa, layout=layout, dtype=dtype, out_dtype=out_dtype, device=device,
                   has_bias=has_bias, post_ops=tuple(post_ops))

    @classmethod
    def from_tensors(cls, x: torch.Tensor, w: torch.Tensor, direction: str = "fwd", *,
                     stride: IntOrSeq = 1, padding=0, dilation: IntOrSeq = 1, groups: int = 1,
                     bias: torch.Tensor | None = None, post_ops: tuple = (),
                     out_dtype: torch.dtype | None = None) -> ConvProblem:
        """Problem of running `direction` on tensors shaped like x and w."""
        check_float_dtype("x", x)
        check_float_dtype("w", w)
        if x.dtype != w.dtype:
            raise BadParameterError(f"x.dtype={x.dtype} and w.dtype={w.dtype} must match")
        if x.device != w.device:
            raise BadParameterError(f"x is on {x.device} but w is on {w.device}")
        return cls.create(direction, x.shape, w.shape, dtype=x.dtype, layout=layout_of(x),
                          device=x.device.type, stride=stride, padding=padding,
                          dilation=dilation, groups=groups, out_dtype=out_dtype,
                          has_bias=bias is not None,
                          post_ops=tuple(op.signature() for op in post_ops))

    # ---- derived -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.in_size)

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.N, self.C, *self.in_size)

    @property
    def w_shape(self) -> tuple[int, ...]:
        return (self.K, self.C // self.groups, *self.filter)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.N, self.K, *self.out_size)

    @property
    def padding(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.pad_before, self.pad_after))

    @property
    def symmetric_padding(self) -> bool:
        return self.pad_before == self.pad_after

    def flops(self) -> float:
        """2 * MACs, the same for all three directions."""
        return 2.0 * self.N * self.K * math.prod(self.out_size) * (self.C // self.groups) * math.prod(self.filter)

    def bytes(self) -> float:
        """Minimum bytes moved: read inputs once, write the output once."""
        e = torch.tensor([], dtype=self.dtype).element_size()
        eo = torch.tensor([], dtype=self.out_dtype).element_size()
        nx, nw, ny = math.prod(self.x_shape), math.prod(self.w_shape), math.prod(self.y_shape)
        outs = {"fwd": ny, "bwd_data": nx, "bwd_weights": nw}[self.direction]
        ins = nx + nw + ny - outs
        extra = sum(ny for s in self.post_ops if s[0] in ("sum", "binary"))
        return e * ins + eo * outs + e * extra

    def key(self) -> str:
        """Stable network-config string (MIOpen's BuildConfKey): identifies the problem
        for the find-db and the invoker cache."""
        j = "x".join
        s = lambda t: j(str(v) for v in t)  # noqa: E731
        parts = [f"conv{self.ndim}d", self.direction,
                 f"n{self.N}c{self.C}i{s(self.in_size)}", f"k{self.K}f{s(self.filter)}",
                 f"o{s(self.out_size)}", f"s{s(self.stride)}", f"p{s(self.pad_before)}_{s(self.pad_after)}",
                 f"d{s(self.dilation)}", f"g{self.groups}", self.layout,
                 f"{dtype_name(self.dtype)}{dtype_name(self.out_dtype)}", self.device]
        if self.has_bias:
            parts.append("bias")
        for sig in self.post_ops:
            parts.append(":".join(str(v).replace(" ", "") for v in sig))
        return "-".join(parts)

    def class_key(self) -> str:
        """The key with sizes removed: problems of one class differ only in N/C/K/spatial."""
        parts = [f"conv{self.ndim}d", self.direction, f"f{'x'.join(map(str, self.filter))}",
                 f"s{'x'.join(map(str, self.stride))}", f"d{'x'.join(map(str, self.dilation))}",
                 "g1" if self.groups == 1 else ("dw" if self.groups == self.C == self.K else "g"),
                 self.layout, dtype_name(self.dtype) + dtype_name(self.out_dtype), self.device,
                 "bias" if self.has_bias else "nobias",
                 ",".join(str(sig[:2]) for sig in self.post_ops)]
        return "-".join(parts)

    def with_direction(self, direction: str) -> ConvProblem:
        from dataclasses import replace
        out = self.dtype if direction != "fwd" else self.out_dtype
        return replace(self, direction=direction, out_dtype=out, has_bias=False, post_ops=())
