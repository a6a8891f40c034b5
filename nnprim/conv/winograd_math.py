"""Winograd F(m, 3) transform matrices (Lavin & Gray), shared by the GPU kernels
(winograd.py: constexpr tuples, zero coefficients pruned at compile time) and the CPU
solver (cpu_winograd.py: explicit add/sub programs checked against these matrices).

Per tile of m outputs (alpha = m + 2 inputs): y = A^T [(G g) (.) (B^T d)], in 2D
y = A^T [(G w G^T) (.) (B^T d B)] A."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Transform:
    """F(m, 3): B^T (alpha x alpha), G (alpha x 3), A^T (m x alpha)."""
    m: int
    BT: tuple
    G: tuple
    AT: tuple

    @property
    def alpha(self) -> int:
        return len(self.BT)


F23 = Transform(2, ((1., 0., -1., 0.), (0., 1., 1., 0.), (0., -1., 1., 0.), (0., 1., 0., -1.)),
                ((1., 0., 0.), (.5, .5, .5), (.5, -.5, .5), (0., 0., 1.)),
                ((1., 1., 1., 0.), (0., 1., -1., -1.)))
F43 = Transform(4, ((4., 0., -5., 0., 1., 0.), (0., -4., -4., 1., 1., 0.), (0., 4., -4., -1., 1., 0.),
                    (0., -2., -1., 2., 1., 0.), (0., 2., -1., -2., 1., 0.), (0., 4., 0., -5., 0., 1.)),
                ((1 / 4, 0., 0.), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
                 (1 / 24, -1 / 12, 1 / 6), (0., 0., 1.)),
                ((1., 1., 1., 1., 1., 0.), (0., 1., -1., 2., -2., 0.), (0., 1., 1., 4., 4., 0.),
                 (0., 1., -1., 8., -8., 1.)))
IDENTITY = Transform(1, ((1.,),), ((1.,),), ((1.,),))          # the H direction of 1D problems
VARIANTS = {2: F23, 4: F43}


def matrix(rows: tuple, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A transform matrix (tuple of rows) as a tensor."""
    return torch.tensor(rows, dtype=dtype)


__all__ = ["Transform", "F23", "F43", "IDENTITY", "VARIANTS", "matrix"]
