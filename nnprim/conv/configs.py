"""Tile configurations of the GPU convolution kernels, chosen by problem class.

The table is what `benchmarks/conv.py` measured on an H200 (its `tune` section times
the candidates below per class and prints the winners); a class with no measured
entry falls back to the heuristic in `pick`. `NNPRIM_CONV_CONFIG="BM,BN,BK,warps,stages"`
overrides the choice for the implicit-GEMM kernels (validated)."""
from __future__ import annotations

import os
from dataclasses import dataclass

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


# problem class -> tile; measured on H200 2026-11-29 (benchmarks/results/conv_quick_2026-11-29.json:
# rn50_r3_3x3, rn50_r3_3x3s2, rn50_r2_1x1b, rn50_conv1). Narrow classes reuse the wide
# tile: `fit` clamps BN to the GEMM's N side.
TABLE: dict[tuple[str, str], GemmTile] = {
    ("fwd", "1x1"): GemmTile(128, 256, 64, 8, 3),
    ("fwd", "small_c"): GemmTile(128, 128, 64, 8, 3),
    ("fwd", "generic"): GemmTile(128, 256, 64, 8, 3),
    ("bwd_data", "1x1"): GemmTile(128, 128, 64, 4, 4),
    ("bwd_data", "generic"): GemmTile(128, 128, 64, 8, 3),
    ("bwd_weights", "1x1"): GemmTile(64, 128, 64, 4, 3),
    ("bwd_weights", "generic"): GemmTile(128, 128, 64, 8, 3),
}

DIRECT_TABLE: dict[str, DirectTile] = {
    "fwd": DirectTile(128, 32, 4),
    "bwd_data": DirectTile(128, 32, 4),
    "bwd_weights": DirectTile(128, 64, 4),
}


def shape_class(p: ConvProblem) -> str:
    """1x1 (a plain GEMM), small_c (forward with C/groups < 32 and a filter: the flat-K
    gather), or generic."""
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


def pick(p: ConvProblem) -> GemmTile:
    env = os.environ.get("NNPRIM_CONV_CONFIG")
    if env:
        return parse_override(env)
    return TABLE.get((p.direction, shape_class(p)), GemmTile(128, 128, 64, 8, 3))


def pick_direct(p: ConvProblem) -> DirectTile:
    return DIRECT_TABLE[p.direction]
