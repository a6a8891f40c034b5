"""Tile configurations of the GPU convolution kernels, chosen by problem class.

The table is what `benchmarks/conv.py` measured on an H200 (it times the candidates
of each problem; results in benchmarks/results/); a class with no measured entry
falls back to a default in `pick`. `NNPRIM_CONV_CONFIG="BM,BN,BK,warps,stages"`
overrides the choice for the implicit-GEMM kernels (validated)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..errors import BadParameterError
from ..problems.conv import ConvProblem


@dataclass(frozen=True)
class GemmTile:
    BM: int       # 16..256, power of two: output rows (fwd/bwd_data) or channels (bwd_weights)
    BN: int       # 16..256, power of two
    BK: int       # 16..128, power of two: reduction step
    warps: int    # 2, 4 or 8
    stages: int   # 1..6 software-pipelining depth
    group_m: int = 8  # L2 swizzle: M tiles walked together

    def valid(self) -> bool:
        p2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
        return (p2(self.BM) and p2(self.BN) and p2(self.BK) and self.BM <= 256 and self.BN <= 256
                and self.BK <= 128 and self.warps in (2, 4, 8) and 1 <= self.stages <= 6)


@dataclass(frozen=True)
class DirectTile:
    BP: int       # output pixels per program: 16..256, power of two
    BC: int       # channels per program: 16..128, power of two
    warps: int    # 1..8
    BW: int = 0   # pixel-tile width (power of two <= BP; the tile is BP/BW rows): 0 = auto


# problem class -> tile; measured on H200 2026-11-29 (benchmarks/results/conv_2026-11-29.json,
# the variant with the best geometric mean over the suite's problems of the class).
# tma_1x1: 1x1 stride-1 NHWC half (the TMA GEMM; bwd_weights: the TMA split reduction);
# tma_conv: stride-1 NHWC half, larger filters (the TMA convolution kernels);
# the other classes run the pointer-gather implicit GEMM. Narrow problems reuse the
# wide tiles: `fit` clamps blocks to the GEMM's sides.
TABLE: dict[tuple[str, str], GemmTile] = {
    ("fwd", "tma_1x1"): GemmTile(128, 128, 64, 8, 3),
    ("fwd", "tma_conv"): GemmTile(128, 128, 64, 4, 4),
    ("fwd", "1x1"): GemmTile(128, 256, 64, 8, 3),
    ("fwd", "small_c"): GemmTile(128, 128, 64, 8, 3),
    ("fwd", "generic"): GemmTile(128, 256, 64, 8, 3),
    ("bwd_data", "tma_1x1"): GemmTile(128, 128, 64, 8, 3),
    ("bwd_data", "tma_conv"): GemmTile(128, 128, 64, 4, 4),
    ("bwd_data", "1x1"): GemmTile(128, 128, 64, 4, 4),
    ("bwd_data", "generic"): GemmTile(128, 128, 64, 8, 3),
    ("bwd_weights", "tma_1x1"): GemmTile(128, 128, 64, 8, 3),     # BK = pixels per step
    ("bwd_weights", "tma_conv"): GemmTile(128, 128, 128, 8, 3),
    ("bwd_weights", "1x1"): GemmTile(64, 128, 64, 4, 3),
    ("bwd_weights", "generic"): GemmTile(128, 128, 64, 8, 3),
}

DIRECT_TABLE: dict[str, DirectTile] = {
    "fwd": DirectTile(256, 16, 4),
    "bwd_data": DirectTile(128, 32, 4),
    "bwd_weights": DirectTile(128, 64, 4),
    "bwd_weights_tiles": DirectTile(128, 16, 4),   # C/groups == 1 (depthwise): the 2-D-tile kernel
}

# directions whose stride-1 NHWC problems use the TMA kernels (the TMA convolution; for
# backward weights also the 1x1 TMA split reduction) instead of pointer gathers
TMA_CONV_DIRECTIONS: frozenset[str] = frozenset({"fwd", "bwd_data", "bwd_weights"})


def plain_gemm_eligible(p: ConvProblem) -> bool:
    """1x1, stride 1, unpadded, ungrouped NHWC f16/bf16 with 16-byte channel rows."""
    return (p.dtype in (torch.float16, torch.bfloat16) and p.layout == "nhwc" and p.groups == 1
            and all(f == 1 for f in p.filter) and all(s == 1 for s in p.stride)
            and not any(p.pad_before) and not any(p.pad_after) and p.C % 8 == 0 and p.K % 8 == 0)


def tma_conv_eligible(p: ConvProblem) -> bool:
    """Stride 1, ungrouped NHWC f16/bf16 with 16-byte channel rows, filter beyond 1x1."""
    return (p.dtype in (torch.float16, torch.bfloat16) and p.layout == "nhwc" and p.groups == 1
            and all(s == 1 for s in p.stride) and not all(f == 1 for f in p.filter)
            and p.C % 8 == 0 and p.K % 8 == 0)


def use_tma_conv(p: ConvProblem) -> bool:
    return p.direction in TMA_CONV_DIRECTIONS


def shape_class(p: ConvProblem) -> str:
    """tma_1x1 / tma_conv (a TMA kernel serves it), 1x1 (a plain GEMM through pointer
    loads), small_c (forward with C/groups < 32 and a filter: the flat-K gather), or
    generic."""
    if plain_gemm_eligible(p) and (p.direction != "bwd_weights" or use_tma_conv(p)):
        return "tma_1x1"
    if tma_conv_eligible(p) and use_tma_conv(p):
        return "tma_conv"
    if all(f == 1 for f in p.filter):
        return "1x1"
    if p.direction == "fwd" and p.C // p.groups < 32:
        return "small_c"
    return "generic"


def parse_override(text: str) -> GemmTile:
    try:
        vals = [int(v) for v in text.split(",")]
        tile = GemmTile(*vals)
    except (TypeError, ValueError):
        raise BadParameterError(
            f"NNPRIM_CONV_CONFIG={text!r} must be 'BM,BN,BK,warps,stages[,group_m]'") from None
    if not tile.valid():
        raise BadParameterError(f"NNPRIM_CONV_CONFIG={text!r} is out of range: {GemmTile.__doc__ or ''}"
                                "BM/BN 16..256, BK 16..128 (powers of two), warps 2/4/8, stages 1..6")
    return tile


# TMA convolution tiles by direction and size, measured on H200 2026-11-30
# (benchmarks/results/conv_tiles_2026-11-30.json, CUDA-graph times, every stride-1 3x3
# layer of the suite): forward and backward data gain 5-28% from 256-row tiles except at
# C = 64, where one K step per tap leaves 128x128 with 3 stages best; backward weights
# over large images (BK = pixels per step) prefers 4 warps and 4 stages (+5-55%).
def _tma_conv_tile(p: ConvProblem) -> GemmTile:
    if p.direction == "fwd":
        return GemmTile(128, 128, 64, 4, 3) if p.C <= 64 else GemmTile(256, 128, 64, 8, 3)
    if p.direction == "bwd_data":
        return GemmTile(256, 128, 64, 8, 3)
    pixels = math.prod(p.out_size)
    return GemmTile(128, 128, 64, 4, 4) if pixels >= 2048 else TABLE[("bwd_weights", "tma_conv")]


def pick(p: ConvProblem) -> GemmTile:
    env = os.environ.get("NNPRIM_CONV_CONFIG")
    if env:
        return parse_override(env)
    cls = shape_class(p)
    if cls == "tma_conv":
        return _tma_conv_tile(p)
    return TABLE.get((p.direction, cls), GemmTile(128, 128, 64, 8, 3))


def pick_direct(p: ConvProblem) -> DirectTile:
    if p.direction == "bwd_weights" and direct_bwd_w_tiles(p):
        return DIRECT_TABLE["bwd_weights_tiles"]
    return DIRECT_TABLE[p.direction]


def direct_bwd_w_tiles(p: ConvProblem) -> bool:
    """Backward weights of depthwise-like problems (C/groups == 1) run the 2-D-tile kernel,
    and so do problems with more than 512 (tap, channel) columns per group: the other
    kernel holds all of them in one [columns, channels] register accumulator."""
    return p.C // p.groups == 1 or (p.C // p.groups) * math.prod(p.filter) > 512
