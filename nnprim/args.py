"""Runtime arguments of an invoker: the tensors and per-call values that are not part
of the problem key (seed, offset, scale value)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import BadParameterError
from .post_ops import PostOp
from .quant import KVQuant


@dataclass
class ConvArgs:
    x: torch.Tensor | None = None    # fwd, bwd_weights
    w: torch.Tensor | None = None    # fwd, bwd_data
    dy: torch.Tensor | None = None   # bwd_data, bwd_weights
    bias: torch.Tensor | None = None
    post_ops: tuple[PostOp, ...] = field(default_factory=tuple)


@dataclass
class AttnArgs:
    q: torch.Tensor
    k: torch.Tensor | KVQuant
    v: torch.Tensor | KVQuant
    attn_mask: torch.Tensor | None = None
    scale: float | torch.Tensor | None = None  # raw user value; see effective_scale()
    seed: int = 0
    offset: int = 0
    kv_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None  # paged K/V: k, v are page pools (nnprim.paged)
    # FP8 inputs only (nnprim.fp8): None, a float or an f32 tensor (one element or (B, H))
    q_descale: float | torch.Tensor | None = None
    k_descale: float | torch.Tensor | None = None
    v_descale: float | torch.Tensor | None = None
    # backward only
    do: torch.Tensor | None = None
    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def effective_scale(self, invert: bool) -> float | torch.Tensor:
        """The multiplier applied to q.k: 1/sqrt(D) by default, scale or 1/scale."""
        D = self.q.shape[-1]
        if self.scale is None:
            return D ** -0.5
        return 1.0 / self.scale if invert else self.scale

    def scale_value(self, invert: bool) -> float:
        """The multiplier applied to q.k as a Python float (a tensor scale read once, in float64,
        and inverted there); a zero or non-finite value of a tensor scale raises, as a float
        scale's does when the problem is made."""
        if self.scale is None:
            return self.q.shape[-1] ** -0.5
        s = float(self.scale.to(torch.float64).reshape(())) if isinstance(self.scale, torch.Tensor) else float(self.scale)
        if not math.isfinite(s) or s == 0:
            raise BadParameterError(f"scale={s!r} (a tensor's value) must be finite and non-zero")
        return 1.0 / s if invert else s
