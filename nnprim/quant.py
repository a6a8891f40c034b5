"""Quantized K/V format (the seed's KV quantization: s8/u8/s4/u4, scales and zero
points per tensor or grouped along the head dimension).

Layout of `KVQuant.data` for a logical (B, H, S, D) tensor:
- s8: int8 (B, H, S, D); u8: uint8 (B, H, S, D)
- s4 / u4: uint8 (B, H, S, D // 2), two values per byte along D: element 2i in the
  low nibble, 2i+1 in the high nibble; s4 nibbles are two's complement.
`scales` (f16/bf16/f32) and optional `zero_points` (any real dtype) are either per
tensor (one element) or grouped: (B, H, S, D // group_size).
Dequantized value = (q - zero_point) * scale, computed in f32 (or f64 for the reference).
Per-tensor and grouped scales / zero points may be mixed (e.g. grouped scales with one
zero point). `group_size=None` means one group per token row (group = D).

`quantize_kv` guarantees |dequantize(quantize(x)) - x| <= scale / 2 per element (half a
quantization step of the stored scale, up to f32 rounding): the stored (f16/bf16/f32)
scale is rounded up, never down, and the asymmetric range always contains 0 so the
integer zero point lies in the code range.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BadParameterError

QUANT_DTYPES = ("s8", "u8", "s4", "u4")
_RANGE = {"s8": (-128, 127), "u8": (0, 255), "s4": (-8, 7), "u4": (0, 15)}
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class KVQuant:
    data: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None = None
    dtype: str = "s8"
    group_size: int | None = None  # None = D (one group per token row)

    def __post_init__(self) -> None:
        if self.dtype not in QUANT_DTYPES:
            raise BadParameterError(f"KVQuant dtype={self.dtype!r} is not one of {QUANT_DTYPES}")
        want = torch.int8 if self.dtype == "s8" else torch.uint8
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != want:
            got = getattr(self.data, "dtype", type(self.data).__name__)
            raise BadParameterError(f"KVQuant data dtype={got} must be {want} for dtype={self.dtype!r}")
        if self.data.dim() != 4:
            raise BadParameterError(f"KVQuant data must be 4-D (B, H, S, D'), got shape {tuple(self.data.shape)}")
        D = self.head_dim
        g = self.group
        if g < 1 or D % g:
            raise BadParameterError(f"KVQuant group_size={self.group_size} must divide head dim D={D}")
        if self.is_4bit and g % 2:
            raise BadParameterError(f"KVQuant group_size={g} must be even for 4-bit dtype {self.dtype!r}")
        B, H, S, _ = self.data.shape
        grouped = (B, H, S, D // g)
        for name, t in (("scales", self.scales), ("zero_points", self.zero_points)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise BadParameterError(f"KVQuant {name} must be a tensor, got {type(t).__name__}")
            if t.numel() != 1 and tuple(t.shape) != grouped:
                raise BadParameterError(
                    f"KVQuant {name} shape {tuple(t.shape)} must have one element (per tensor) or be "
                    f"{grouped} (B, H, S, D // group_size)")
            if t.device != self.data.device:
                raise BadParameterError(f"KVQuant {name} is on {t.device} but data is on {self.data.device}")
        if self.scales.dtype not in _SCALE_DTYPES:
            raise BadParameterError(f"KVQuant scales dtype={self.scales.dtype} must be f16, bf16, f32 or f64")
        zp = self.zero_points
        if zp is not None and (zp.dtype == torch.bool or zp.is_complex()):
            raise BadParameterError(f"KVQuant zero_points dtype={zp.dtype} must be a real number type")

    @classmethod
    def trusted(cls, data: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, dtype: str,
                group_size: int | None) -> KVQuant:
        """Rebuild an already validated KVQuant from its parts without checking them again
        (the ops' hot path; the problem validates on its first call)."""
        obj = object.__new__(cls)
        for name, val in (("data", data), ("scales", scales), ("zero_points", zero_points), ("dtype", dtype),
                          ("group_size", group_size)):
            object.__setattr__(obj, name, val)
        return obj

    @property
    def is_4bit(self) -> bool:
        return self.dtype in ("s4", "u4")

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.is_4bit else 1)

    @property
    def group(self) -> int:
        return self.head_dim if self.group_size is None else int(self.group_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, S, _ = self.data.shape
        return (B, H, S, self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def signature(self) -> tuple:
        zp = None if self.zero_points is None else ("t" if self.zero_points.numel() == 1 else "g")
        sc = "t" if self.scales.numel() == 1 else "g"
        return (self.dtype, self.group, sc, str(self.scales.dtype).replace("torch.", ""), zp)

    def unpack(self) -> torch.Tensor:
        """Integer codes as int32, logical (B, H, S, D)."""
        d = self.data
        if not self.is_4bit:
            return d.to(torch.int32)
        lo = (d & 0x0F).to(torch.int32)
        hi = ((d >> 4) & 0x0F).to(torch.int32)
        if self.dtype == "s4":
            lo = torch.where(lo >= 8, lo - 16, lo)
            hi = torch.where(hi >= 8, hi - 16, hi)
        return torch.stack((lo, hi), dim=-1).flatten(-2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(q - zero_point) * scale in `dtype`, logical (B, H, S, D)."""
        q = self.unpack().to(dtype)
        g = self.group

        def expand(t: torch.Tensor) -> torch.Tensor:
            t = t.to(dtype)
            if t.numel() == 1:
                return t.reshape(1, 1, 1, 1)
            return t.repeat_interleave(g, dim=-1)

        if self.zero_points is not None:
            q = q - expand(self.zero_points)
        return q * expand(self.scales)


def _round_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` (f32) stored in `dtype`, rounded up so codes never saturate early; also kept
    at or above the smallest normal number of `dtype` (no zero / subnormal scales)."""
    s = scale.to(dtype)
    low = s.to(scale.dtype) < scale
    s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    return s.clamp(min=torch.finfo(dtype).tiny)


def quantize_kv(k: torch.Tensor, dtype: str = "s4", group_size: int | None = 64,
                symmetric: bool = True, scale_dtype: torch.dtype | None = None) -> KVQuant:
    """Quantize a (B, H, S, D) tensor per (b, h, token, group of `group_size` along D).

    symmetric: zero point 0 for signed dtypes (scale = absmax / qmax); for unsigned dtypes
    symmetric means a fixed mid-range zero point. Asymmetric: min/max affine with a
    rounded per-group zero point."""
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise BadParameterError(f"quantize_kv: k must be a 4-D tensor (B, H, S, D), got {getattr(k, 'shape', k)!r}")
    if not k.is_floating_point():
        raise BadParameterError(f"quantize_kv: k.dtype={k.dtype} must be floating point")
    if dtype not in QUANT_DTYPES:
        raise BadParameterError(f"quantize_kv: dtype={dtype!r} is not one of {QUANT_DTYPES}")
    D = k.shape[-1]
    g = D if group_size is None else int(group_size)
    if g < 1 or D % g:
        raise BadParameterError(f"quantize_kv: group_size={group_size} must divide head dim D={D}")
    if dtype in ("s4", "u4") and (D % 2 or g % 2):
        raise BadParameterError(f"quantize_kv: 4-bit dtype {dtype!r} needs even D and group_size (D={D}, group_size={g})")
    lo, hi = _RANGE[dtype]
    sdt = scale_dtype or (k.dtype if k.dtype in (torch.float16, torch.bfloat16) else torch.float32)
    x = k.to(torch.float32).reshape(*k.shape[:-1], D // g, g)
    zp = None
    if symmetric:
        amax = x.abs().amax(dim=-1)
        if dtype in ("s8", "s4"):
            scale = amax / hi
            zpv = torch.zeros_like(scale)
        else:
            mid = (hi + 1) // 2
            scale = amax / (hi - mid)
            zpv = torch.full_like(scale, float(mid))
            zp = zpv
    else:
        # the range includes 0 so the rounded zero point lies in [lo, hi]
        mn, mx = x.amin(dim=-1).clamp(max=0), x.amax(dim=-1).clamp(min=0)
        scale = (mx - mn) / (hi - lo)
    scale = _round_up(torch.where(scale > 0, scale, torch.ones_like(scale)), sdt)
    sf = scale.to(torch.float32)
    if not symmetric:
        zpv = torch.round(lo - mn / sf).clamp(lo, hi)
        zp = zpv
    q = torch.round(x / sf.unsqueeze(-1) + zpv.unsqueeze(-1)).clamp(lo, hi).to(torch.int32)
    q = q.reshape(k.shape)
    if dtype == "s8":
        data = q.to(torch.int8)
    elif dtype == "u8":
        data = q.to(torch.uint8)
    else:
        nib = q & 0x0F
        data = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    zp_t = None if zp is None else zp.to(torch.float32).contiguous()
    return KVQuant(data.contiguous(), scale.contiguous(), zp_t, dtype, g)
