"""Output and scratch allocation of the invokers (GPU, and the CPU attention kernels).

Under `torch.use_deterministic_algorithms(True)` torch fills every `torch.empty` with NaN (or
the integer maximum) so that a kernel reading uninitialised memory shows
(`torch.utils.deterministic.fill_uninitialized_memory`). nnprim's kernels write every element
of the buffers they allocate (outputs are poisoned in the tests, accumulators zeroed by the
kernels' own preprocess), so the fill would only cost time: 62-92 us per call of the attention
backward at d128 s1024 (three outputs and the f32 accumulator; 2026-12-02,
benchmarks/diag/attn_autograd_trace.py). `empty` allocates from the same caching allocator
(and a CUDA graph's pool while capturing) without the fill; with the fill off it is
`torch.empty` / `torch.empty_strided`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode
except ImportError:  # a torch without it: FakeTensorMode (torch.compile's) is the mode that matters
    def _current_dispatch_mode():
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _fill_to_skip(device) -> bool:
    """torch would fill a real tensor here: deterministic mode with the fill on, outside a
    Python dispatch mode (the ops' fake impls run under torch.compile's FakeTensorMode, whose
    tensors have no storage to set and no memory to fill) and off the meta device."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        return False
    return torch.device(device).type != "meta" and _current_dispatch_mode() is None


def empty(shape: Sequence[int], dtype: torch.dtype, device, strides: Sequence[int] | None = None) -> torch.Tensor:
    """An uninitialised tensor (contiguous, or with `strides`) that torch's deterministic mode
    does not fill."""
    shape = tuple(shape)
    if not _fill_to_skip(device):
        if strides is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty_strided(shape, tuple(strides), dtype=dtype, device=device)
    strides = _contiguous_strides(shape) if strides is None else tuple(strides)
    numel = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    storage = torch.UntypedStorage(numel * dtype.itemsize, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, strides)
