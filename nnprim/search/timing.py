"""Timing of invokers for find and the benchmarks: CUDA events on a GPU, perf_counter on CPU.

- `once_ms` runs a callable once between device synchronisations (find's checked first run).
- `interleaved_ms` times several candidates in rounds, one run of each per round, so that
  clock and thermal drift and other processes' load fall on all of them alike. On a GPU a
  round enqueues every candidate between its own pair of events and synchronises once at
  the round's end (no per-run sync whose host gap would land inside the next measurement).
  Each candidate's time is `robust_ms` of its runs: the median for few samples, the
  20%-trimmed mean from 5 on (a stray slow run, a preempted launch, does not move it, and
  it is less noisy than the median).
- L2 policy (`l2_policy`): a problem whose working set (inputs + outputs + workspace) fits
  in the GPU's L2 (`L2_cache_size`, 50 MB on an H200) is timed warm, as back-to-back use
  in a model sees it (the previous layer just wrote its input); a larger one gets an L2
  flush (a write of twice the L2) before each run, outside its events, so that the order
  of candidates inside a round cannot leave one of them the other's cached data.
- The clock is injectable (`timer=`): tests rank fake candidates with a fake clock."""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

DEFAULT_L2_BYTES = 50 * 2**20  # H200; used when the device does not say
TRIM = 0.2  # share of samples dropped at each end by the trimmed mean

Timer = Callable[[Sequence[Callable[[], object]], Callable[[], None] | None], list[float]]
"""A timer runs each callable once (the flush, when given, before each) and returns each one's ms."""


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


def robust_ms(samples: Sequence[float]) -> float:
    """Median of fewer than 5 samples, else the mean after dropping TRIM of them at each end."""
    if not samples:
        raise ValueError("no samples")
    if len(samples) < 5:
        return statistics.median(samples)
    s = sorted(samples)
    cut = int(len(s) * TRIM)
    return statistics.fmean(s[cut:len(s) - cut])


# ---- L2 ------------------------------------------------------------------------------------------
def l2_bytes(device: str = "cuda") -> int:
    """The current CUDA device's L2 size in bytes (0 on CPU)."""
    if device != "cuda":
        return 0
    import torch
    try:
        return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)) \
            or DEFAULT_L2_BYTES
    except Exception:
        return DEFAULT_L2_BYTES


def working_set_bytes(problem, workspace: int = 0) -> float:
    """Bytes a run touches at least once: its inputs, outputs (problem.bytes()) and workspace."""
    try:
        return float(problem.bytes()) + float(workspace)
    except Exception:
        return 0.0


def l2_policy(problem, workspace: int = 0, l2: int | None = None) -> str:
    """"warm" when the working set fits in L2 (repeated use keeps it there), else "cold"
    (flush between runs); always "warm" on CPU (no flush: caches are the OS's)."""
    if problem.device != "cuda":
        return "warm"
    l2 = l2_bytes("cuda") if l2 is None else l2
    return "warm" if working_set_bytes(problem, workspace) <= l2 else "cold"


_FLUSH_BUFFERS: dict[int, object] = {}


def l2_flusher(device: str = "cuda") -> Callable[[], None] | None:
    """A callable that evicts the current GPU's L2 (writes 2x its size); None on CPU."""
    if device != "cuda":
        return None
    import torch
    idx = torch.cuda.current_device()
    buf = _FLUSH_BUFFERS.get(idx)
    if buf is None:
        buf = _FLUSH_BUFFERS[idx] = torch.empty(2 * l2_bytes("cuda"), dtype=torch.int8, device=f"cuda:{idx}")
    return buf.zero_


# ---- clocks ----------------------------------------------------------------------------------------
SLEEP_CYCLES_PER_MS = 2.0e6  # torch.cuda._sleep spins cycles; ~2 GHz SM clock (H100/H200 boost 1.98)
MAX_LEAD_MS = 20.0


def _cuda_round(fns: Sequence[Callable[[], object]], flush: Callable[[], None] | None,
                leads_ms: Sequence[float] = ()) -> list[float]:
    """One run of each of `fns`, each between its own pair of events, one sync at the end.
    Before each run a spin kernel of that run's lead (1.5x its measured host time) keeps the
    GPU busy while the host enqueues the run, so that its events enclose its device work
    only: never the GPU idling for the host, whatever ran before it (a run behind a
    host-heavy neighbour would otherwise pay its own launch latency, and a candidate's time
    would depend on its place in the list). Each run's time is max(its event time, its
    host enqueue time): what it costs per call when called back to back, bound by whichever
    of host and device is slower."""
    import torch
    evs, host = [], []
    for i, fn in enumerate(fns):
        if flush is not None:
            flush()
        lead = leads_ms[i] if i < len(leads_ms) else 0.0
        if lead > 0:
            torch.cuda._sleep(int(min(lead, MAX_LEAD_MS) * SLEEP_CYCLES_PER_MS))
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        evs.append((a, b))
    evs[-1][1].synchronize()
    return [max(a.elapsed_time(b), h) for (a, b), h in zip(evs, host)]


def _cpu_round(fns: Sequence[Callable[[], object]], flush: Callable[[], None] | None) -> list[float]:
    out = []
    for fn in fns:
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def default_timer(device: str, leads_ms: Sequence[float] = ()) -> Timer:
    """The clock of one device; on a GPU `leads_ms[i]` is the spin before the i-th callable
    of a round (callers rotating the round pass the leads in the round's order)."""
    if device != "cuda":
        return _cpu_round
    return lambda fns, flush: _cuda_round(fns, flush, leads_ms)


def _host_ms_each(fns: Sequence[Callable[[], object]], flush: Callable[[], None] | None) -> list[float]:
    """Host time to enqueue each callable (its flush excluded): how long the GPU must be
    kept busy in front of it."""
    out = []
    for fn in fns:
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def interleaved_samples(fns: Sequence[Callable[[], object]], device: str, *, rounds: int, warmup: int = 1,
                        budget_ms: float | None = None, first_ms: Sequence[float] | None = None,
                        flush: Callable[[], None] | None = None, timer: Timer | None = None) -> list[list[float]]:
    """Every run's ms of each of `fns` over `rounds` rounds (one run of each per round) after
    `warmup` runs of each. The order within a round rotates from round to round, so that no
    candidate always runs first; every n rounds (n candidates, each first once) the cycle is
    reshuffled (seeded), so that no candidate always runs after the same neighbour either: a
    rotation alone keeps neighbours, and a run right after the same kernel on the same data
    (warm L2, warm caches) beat its twin that always followed a workspace-heavy candidate
    by 2-9 us on the H200 (results/regret_2026-12-01_run2.json: the default call against
    forcing the solver it chose). With a budget and the
    candidates' first times, rounds are cut so that about `budget_ms` is spent (at least one
    round)."""
    if not fns:
        return []
    if budget_ms is not None and first_ms:
        per_round = max(sum(first_ms), 1e-3)
        fit = int(budget_ms // per_round)
        warmup = min(warmup, max(0, fit - 1))
        rounds = max(1, min(rounds, fit - warmup))
    n = len(fns)
    leads: list[float] = []
    if timer is None:
        # each run's lead covers its host enqueue: measured on the last warm-up round
        # (compiled, allocated), else bounded by its first run's wall time (host + device)
        host = list(first_ms) if first_ms and len(first_ms) == n else [1.0] * n
        t0 = time.perf_counter()
        for _ in range(warmup):
            _sync(device)
            host = _host_ms_each(fns, flush)
        _sync(device)
        leads = [1.5 * h + 0.02 for h in host]
        if device == "cuda" and budget_ms is not None and first_ms and len(first_ms) == n:
            # the GPU runs each lead before its run: a round costs the leads too
            left = budget_ms - (time.perf_counter() - t0) * 1e3
            per_round = max(sum(first_ms) + sum(leads), 1e-3)
            rounds = max(1, min(rounds, int(left // per_round)))
    elif warmup:
        timer(fns, flush)  # a fake clock sees the warm-up too, and discards it
    times: list[list[float]] = [[] for _ in fns]
    base, rng = list(range(n)), random.Random(n)
    for r in range(rounds):
        if r and r % n == 0 and n > 2:
            rng.shuffle(base)  # a new cycle of neighbours (see the docstring)
        order = [base[(r + i) % n] for i in range(n)]
        clock = timer or default_timer(device, [leads[i] for i in order])
        for i, t in zip(order, clock([fns[i] for i in order], flush)):
            times[i].append(t)
    return times


def interleaved_ms(fns: Sequence[Callable[[], object]], device: str, *, rounds: int, warmup: int = 1,
                   budget_ms: float | None = None, first_ms: Sequence[float] | None = None,
                   flush: Callable[[], None] | None = None, timer: Timer | None = None) -> list[float]:
    """`robust_ms` of each of `fns` (see interleaved_samples)."""
    return [robust_ms(t) for t in interleaved_samples(fns, device, rounds=rounds, warmup=warmup, budget_ms=budget_ms,
                                                      first_ms=first_ms, flush=flush, timer=timer)]


def median_ms(fn: Callable[[], object], device: str, *, repeats: int = 3, warmup: int = 1,
              budget_ms: float | None = None, first_ms: float | None = None) -> float:
    """Median time of one callable."""
    return statistics.median(interleaved_samples([fn], device, rounds=repeats, warmup=warmup, budget_ms=budget_ms,
                                                 first_ms=None if first_ms is None else [first_ms])[0])


def bench_ms(fn: Callable[[], object], device: str, *, repeats: int = 30, warmup: int = 3) -> float:
    """What the benchmarks report: warm-up, then the median of `repeats` runs, each timed
    with device events on a GPU (perf_counter on CPU)."""
    return median_ms(fn, device, repeats=repeats, warmup=warmup)
