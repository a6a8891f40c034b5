"""Wall time of a callable: device events on CUDA, perf_counter on CPU; warm-up, median."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_ms(fn: Callable[[], object], *, device: str = "cpu", reps: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
