"""Decode attention on 8-bit K/V codes with one scale per tensor or per head (solver 131):
fp8 e4m3 as `quantize_kv` stores it by default, and s8 / u8 with per-head or per-tensor scales.

Such a scale is constant along the keys, so it needs no per-element work at all: the
codes go to the mma as they are, exactly (every e4m3, s8 and u8 value is an f16), the K
scale multiplies the softmax scale and the V scale the output. The kernel is solver 120's
(`decode._decode_fwd_kernel` with K_FOLD / V_FOLD) with f16 mmas: e4m3 -> f16 is one
`cvt.rn.f16x2.e4m3x2` per two codes on sm_90, where 121 (code -> f32, scale, -> bf16) and
122 (e4m3 -> bf16 through f32) spend 3-4 instructions per code. bf16 q would leave f16's
range above 65504, so each query row enters the mma scaled by the power of two that puts
its largest |q| in [1, 2) (exact), and its scores take that factor back (Q_NORM).
The probabilities (in [0, 1]) are f16 too: 3 more mantissa bits than bf16.

Everything else is solver 120's: GQA rows per program, split-K with the LSE combine,
kv_lens, causal, masks, dropout, lse, paged K/V, Sq <= 16, D <= 256. Either of K / V may
stay a float tensor, except a bf16 one (f16 would not hold its range). Grouped or
per-token scales, zero points and 4-bit codes are 122's.

Reading order: the kernel in decode.py -> `plan` there (fold=True) -> this solver.
"""
from __future__ import annotations

from functools import partial

import torch

from ..search.solver import register
from . import decode as _dec
from .decode import DecodeConfig, _DecodeBase, foldable


def default_config(problem) -> DecodeConfig:
    """256 keys per step at D <= 128: the bytes of solver 120's 128 bf16 keys. H200 sweep
    (2026-12-02, `benchmarks/diag/decode_swap_sweep.py`, e4m3 per head, Hq 32, Hkv 8, D 128):
    b8 x 32k keys 0.220 ms against 0.238-0.282 with 64-128 keys or 8 warps; b64 x 8k 0.423
    against 0.419 with 128 keys. Above D = 128, 120's 32 keys."""
    if problem.device != "cuda":
        return DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)
    if max(problem.D, problem.Dv) > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=256, num_warps=4, num_stages=3)


choose_splits = _dec.choose_splits
plan = partial(_dec.plan, fold=True)


@register
class DecodeSplitKScaled(_DecodeBase):
    """Flash-decoding on 8-bit codes (fp8 e4m3, s8, u8) with per-tensor / per-head scales:
    f16 mmas on the codes, the scales folded into the softmax scale and the output."""
    id = 131
    name = "decode_split_k_scaled"
    paged = True  # as 120 (paging.py)

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if not problem.quantized:
            reasons.append("K/V not quantized: served by decode_split_k (120)")
        for name, qs in (("K", problem.k_quant), ("V", problem.v_quant)):
            if qs is None and problem.quantized and problem.dtype == torch.bfloat16:
                reasons.append(f"bf16 {name} beside 8-bit codes: the f16 mma would not hold its range (122 serves it)")
            elif not foldable(qs):
                what = ("4-bit codes" if qs[0] in ("s4", "u4") else "zero points" if qs[4] else
                        "scales per token or group")
                reasons.append(f"{name} quantized as {qs[0]} with {what}: needs 8-bit codes with one scale "
                               "per tensor or head (122 serves it)")
        return reasons

    def estimate(self, problem) -> float:
        """The bytes read at the bf16 kernel's bandwidth: the scales cost nothing per element."""
        t = problem.bytes() / _dec._BW * 1e3
        host = _dec.HOST_FLOOR_MS if problem.device == "cuda" else 0.0
        return max(t + _dec._LAUNCH_MS, host)

    def row_blocks(self, problem) -> int:
        return _dec.m_blocks(problem, default_config(problem))[1]

    def workspace_size(self, problem) -> int:
        return _dec.workspace_bytes(problem, default_config(problem))

    def prepare(self, problem):
        return _dec.DecodePlan(problem, default_config(problem), plan)


__all__ = ["DecodeSplitKScaled", "choose_splits", "default_config", "plan"]
