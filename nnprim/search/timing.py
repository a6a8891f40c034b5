"""Timing of one invoker for find: CUDA events on a GPU, perf_counter on CPU; warm-up
first, then the median of the repeats. The number of repeats shrinks to fit the time
left in find's budget (a slow CPU solver is run once or twice, not ten times)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def once_ms(fn: Callable[[], object], device: str) -> tuple[float, object]:
    """Run fn once; return (wall ms, its result). Synchronises the device around it."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def median_ms(fn: Callable[[], object], device: str, *, repeats: int = 3, warmup: int = 1,
              budget_ms: float | None = None, first_ms: float | None = None) -> float:
    """Median time of fn in ms over `repeats` runs after `warmup` runs.

    `first_ms` is a time already measured (e.g. the checked first call); with a budget,
    warm-up and repeats are cut so that about `budget_ms` is spent (at least one run)."""
    est = first_ms
    if budget_ms is not None and est is not None and est > 0:
        fit = int(budget_ms // est)
        warmup = min(warmup, max(0, fit - 1))
        repeats = max(1, min(repeats, fit - warmup))
    for _ in range(warmup):
        fn()
    if device == "cuda":
        import torch
        _sync(device)
        times = []
        for _ in range(repeats):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
