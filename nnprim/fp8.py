"""FP8 attention inputs: `sdpa(q, k, v, q_descale=, k_descale=, v_descale=, out_dtype=)` with
q, k, v all `torch.float8_e4m3fn` (as FA3's and cuDNN's FP8 forward).

The attention computed is that of the dequantised inputs (q * dq, k * dk, v * dv). A descale
factor is None (= 1), a positive finite float, a 0-d / 1-element f32 tensor (per tensor), or a
(B, H) f32 tensor (per head; H = Hq for q, Hkv for k and v). Its granularity is a letter of the
problem key: "n" none, "t" per tensor, "h" per head. The output is bf16 unless `out_dtype`
(bf16, f16, f32) says otherwise; nothing is differentiable.

Helpers: `check_inputs` (are q, k, v an FP8 triple? mixing is an error), `descale_kind`
(validation of one factor), `dequantize` (x * descale in f32 / f64, for the reference and the
CPU solver), `descale_tensor` (a factor as an f32 tensor on the data's device: kernels load
it), `check_descale_values` (positivity, a device sync: first call of a signature, CPU
tensors, NNPRIM_CHECK_NUMERICS)."""
from __future__ import annotations

import math

import torch

from .errors import BadParameterError, NotSupportedError

FP8 = torch.float8_e4m3fn
_FP8_ANY = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n))
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8(dtype) -> bool:
    return dtype in _FP8_ANY


def check_inputs(q, k, v) -> bool:
    """True when q, k, v are an FP8 (e4m3) triple, False when none is FP8. Mixing FP8 with
    other dtypes (or with quantized K/V) is a BadParameterError; other FP8 formats are not
    supported."""
    named = (("q", q), ("k", k), ("v", v))
    fp8 = [(n, t.dtype) for n, t in named if isinstance(t, torch.Tensor) and is_fp8(t.dtype)]
    if not fp8:
        return False
    if len(fp8) != 3:
        other = next((n, getattr(t, "dtype", type(t).__name__)) for n, t in named
                     if not (isinstance(t, torch.Tensor) and is_fp8(t.dtype)))
        raise BadParameterError(
            f"{fp8[0][0]}.dtype={fp8[0][1]} but {other[0]} is {other[1]}: FP8 attention needs q, k and v all "
            f"torch.float8_e4m3fn")
    for n, dt in fp8:
        if dt != FP8:
            raise NotSupportedError(f"{n}.dtype={dt} is not supported: FP8 attention takes torch.float8_e4m3fn")
    return True


def descale_kind(name: str, d, B: int, H: int, device: torch.device) -> str:
    """'n' (None), 't' (per tensor: float or one-element tensor) or 'h' ((B, H) tensor) after
    validating `d` (f32, on `device`)."""
    if d is None:
        return "n"
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        if not (math.isfinite(d) and d > 0):
            raise BadParameterError(f"{name}={d!r} must be a positive finite float")
        return "t"
    if not isinstance(d, torch.Tensor):
        raise BadParameterError(f"{name} must be None, a float or an f32 tensor, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise BadParameterError(f"{name}.dtype={d.dtype} must be torch.float32")
    if d.device != device:
        raise BadParameterError(f"{name} is on {d.device} but q is on {device}")
    if d.requires_grad and torch.is_grad_enabled():
        raise NotSupportedError(f"{name} requires grad: FP8 attention is not differentiable")
    if d.numel() == 1 and d.dim() <= 1:
        return "t"
    if tuple(d.shape) == (B, H):
        return "h"
    raise BadParameterError(f"{name} shape {tuple(d.shape)} must be () or (1,) (per tensor) or (B, H)=({B}, {H}) "
                            "(per head)")


def check_descale_values(name: str, d) -> None:
    """Descale factors must be positive and finite (the kernel folds them into the softmax
    scale and the output); reads the values (a device sync on a GPU)."""
    if isinstance(d, torch.Tensor) and d.numel():
        bad = ~(torch.isfinite(d) & (d > 0))
        if bool(bad.any()):
            raise BadParameterError(f"{name} must hold positive finite values, got {d.flatten()[bad.flatten()][:4].tolist()}")


def descale_tensor(d, device: torch.device) -> torch.Tensor | None:
    """A descale factor as an f32 tensor (None stays None): what the kernels load."""
    if d is None or isinstance(d, torch.Tensor):
        return d
    return torch.full((), float(d), dtype=torch.float32, device=device)


def dequantize(x: torch.Tensor, d, dtype: torch.dtype) -> torch.Tensor:
    """x * descale in `dtype` (per tensor or per (b, h) over a (B, H, S, D) tensor)."""
    out = x.to(dtype)
    if d is None:
        return out
    if isinstance(d, torch.Tensor):
        d = d.to(dtype)
        d = d.reshape(()) if d.numel() == 1 else d[:, :, None, None]
    return out * d
