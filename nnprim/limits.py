"""Index and launch limits shared by the GPU (Triton) solvers.

Triton computes with 32-bit integers unless told otherwise: program ids, `tl.arange`
and integer arguments below 2**31 are int32, and a product of int32 values wraps
silently. A wrapped element offset is an out-of-bounds access (an illegal address
that kills the CUDA context), and a wrapped index compared with a bound (`rows < M`)
turns a masked lane into a live one. So a kernel either computes an offset in int64
(its per-program base, e.g. `n.to(tl.int64) * stride_n`) or the solver refuses the
problem with a reason naming the count that does not fit (`int32_reasons`).

Tiles overshoot the end of what they index by up to a block; the int32 rule keeps
`TILE_HEADROOM` of slack so that an index one tile past a bound still compares right.

CUDA grids: axis 0 may have 2**31 - 1 programs, axes 1 and 2 at most 65535
(`grid_reasons`); a launch beyond them fails ("invalid argument")."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

INT32_MAX = 2 ** 31 - 1
TILE_HEADROOM = 2 ** 16
GRID_AXIS_MAX = (2 ** 31 - 1, 65535, 65535)


def fits_int32(count: int) -> bool:
    """Whether indices and element offsets below `count` (plus a tile's overshoot) are
    exact in int32."""
    return count + TILE_HEADROOM <= INT32_MAX


def int32_reasons(counts: Iterable[tuple[str, int]]) -> list[str]:
    """One reason per (what, count) whose count does not fit int32 indexing."""
    return [f"{what} = {count} elements; its int32 indexing needs <= {INT32_MAX - TILE_HEADROOM}"
            for what, count in counts if not fits_int32(count)]


def grid_reasons(axes: Iterable[tuple[int, str, int]]) -> list[str]:
    """Reasons for grid axes (axis, what, programs) beyond CUDA's limits."""
    return [f"grid axis {axis} ({what}) = {n} programs exceeds CUDA's limit {GRID_AXIS_MAX[axis]}"
            for axis, what, n in axes if n > GRID_AXIS_MAX[axis]]


def span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from the first to one past the last element of a strided tensor (its
    storage extent; the element count for a contiguous one)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(shape, strides))


def bytes_of(shape: Sequence[int], element_size: int) -> int:
    return math.prod(shape) * element_size
