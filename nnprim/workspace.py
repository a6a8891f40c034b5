"""Workspace allocation of the GPU conv invokers: every temporary buffer an invoker keeps
beyond its outputs is allocated through `empty`, so that tests can record them and check
each solver's `workspace_size` against what it really allocates."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import alloc


def empty(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    return alloc.empty(shape, dtype, device)
