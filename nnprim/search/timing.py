"""Timing of invokers for find: CUDA events on a GPU, perf_counter on CPU.

`once_ms` runs a callable once between device synchronisations (the checked first run);
`interleaved_ms` times several candidates in rounds, one run of each per round, so that
clock and thermal drift and other processes' load fall on all of them alike, and
returns each one's median (robust to a stray slow run). The number of rounds shrinks
to fit the time budget."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


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


def _one_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import torch
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_ms(fns: Sequence[Callable[[], object]], device: str, *, rounds: int, warmup: int = 1,
                   budget_ms: float | None = None, first_ms: Sequence[float] | None = None) -> list[float]:
    """Median ms of each of `fns` over `rounds` rounds (one run of each per round) after
    `warmup` runs of each. With a budget and the candidates' first times, rounds are cut
    so that about `budget_ms` is spent (at least one round)."""
    if budget_ms is not None and first_ms:
        per_round = max(sum(first_ms), 1e-3)
        fit = int(budget_ms // per_round)
        warmup = min(warmup, max(0, fit - 1))
        rounds = max(1, min(rounds, fit - warmup))
    for _ in range(warmup):
        for fn in fns:
            fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(_one_ms(fn, device))
    return [statistics.median(t) for t in times]


def median_ms(fn: Callable[[], object], device: str, *, repeats: int = 3, warmup: int = 1,
              budget_ms: float | None = None, first_ms: float | None = None) -> float:
    """Median time of one callable (interleaved_ms of a single candidate)."""
    return interleaved_ms([fn], device, rounds=repeats, warmup=warmup, budget_ms=budget_ms,
                          first_ms=None if first_ms is None else [first_ms])[0]


def bench_ms(fn: Callable[[], object], device: str, *, repeats: int = 30, warmup: int = 3) -> float:
    """What the benchmarks report: warm-up, then the median of `repeats` runs, each timed
    with device events on a GPU (perf_counter on CPU)."""
    return interleaved_ms([fn], device, rounds=repeats, warmup=warmup)[0]
