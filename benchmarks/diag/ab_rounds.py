"""The A/B clock the CPU diag scripts share: a solver with a change switched on ("new") and off
("old") against torch ("torch"), alternated call by call in one process so that load from
other processes falls on all three alike."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(fns: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """(median ms of each of "new", "old", "torch"; x of "new" and "old" = the median over rounds
    of torch's time / theirs). The order flips every round (new, torch, old / old, torch, new)."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(rounds):
        for k in (("new", "torch", "old") if i % 2 == 0 else ("old", "torch", "new")):
            t0 = time.perf_counter()
            fns[k]()
            ts[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    x = {k: statistics.median(p / o for p, o in zip(ts["torch"], ts[k])) for k in ("new", "old")}
    return med, x
