"""The host clock of the host-time diagnostics: microseconds per call of calls issued back to
back without syncs (the GPU runs behind), the best of several repeats; and a cProfile of such
calls (own time first)."""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int = 100, repeats: int = 5, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        _sync()
        best = min(best, (t1 - t0) / calls * 1e6)
    return round(best, 1)


def profile_text(fn, calls: int = 50, top: int = 25, sort: str = "tottime") -> str:
    """pstats of `calls` calls of fn, by `sort` (own time), `top` rows."""
    pr = cProfile.Profile()
    _sync()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    _sync()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(top)
    return s.getvalue()
