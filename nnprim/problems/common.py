"""Helpers shared by the problem descriptors."""
from __future__ import annotations

import torch

from ..errors import BadParameterError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
               torch.float64: "f64"}


def dtype_name(dt: torch.dtype) -> str:
    return DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))


def check_float_dtype(name: str, t: torch.Tensor, allow_f64: bool = True) -> None:
    ok = FLOAT_DTYPES + ((torch.float64,) if allow_f64 else ())
    if t.dtype not in ok:
        raise BadParameterError(
            f"{name}.dtype={t.dtype} is not supported; expected one of "
            f"{', '.join(str(d) for d in ok)}")


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BadParameterError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def device_kind(t: torch.Tensor) -> str:
    return t.device.type


def check_same_device(named: dict[str, torch.Tensor | None]) -> None:
    devs = {n: t.device for n, t in named.items() if t is not None}
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devs.items())
        raise BadParameterError(f"tensors must be on one device: {desc}")
