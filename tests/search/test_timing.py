"""Find timing with a fake clock: interleaving cancels drift, a robust statistic ignores
outliers, close calls are measured again, the L2 policy, the call path is what is timed."""
from types import SimpleNamespace

import pytest
from search_helpers import PROBLEM

import nnprim
from nnprim.search import context, timing
from nnprim.search.find import CLOSE_CALL, _rounds


def test_robust_ms_ignores_outliers():
    assert timing.robust_ms([1.0, 1.1, 50.0]) == 1.1
    assert timing.robust_ms([1.0] * 8 + [100.0, 0.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        timing.robust_ms([])


class DriftClock:
    """Fake timer: each callable returns its cost; every run adds `drift` ms to the clock
    (a GPU warming up), and the first run of each round is `spike` ms slower."""

    def __init__(self, drift=0.0, spike=0.0):
        self.t, self.drift, self.spike, self.rounds, self.flushes = 0.0, drift, spike, 0, 0

    def __call__(self, fns, flush):
        out = []
        for j, fn in enumerate(fns):
            if flush is not None:
                flush()
                self.flushes += 1
            out.append(fn() + self.t + (self.spike if j == 0 and self.rounds % 7 == 3 else 0.0))
            self.t += self.drift
        self.rounds += 1
        return out


def test_interleaving_cancels_drift_and_spikes():
    clock = DriftClock(drift=0.01, spike=5.0)
    a, b = (lambda: 1.00), (lambda: 1.03)
    tb, ta = timing.interleaved_ms([b, a], "cpu", rounds=15, timer=clock)
    assert ta < tb  # b runs first in each round: it takes the spikes
    assert ta < 1.00 + 15 * 2 * 0.01


def test_order_rotates_so_no_candidate_always_runs_first():
    def clock(fns, flush):  # the first run of every round pays a launch latency of 1 ms
        return [fn() + (1.0 if j == 0 else 0.0) for j, fn in enumerate(fns)]

    same = [lambda: 2.0, lambda: 2.0, lambda: 2.0]
    samples = timing.interleaved_samples(same, "cpu", rounds=9, warmup=0, timer=clock)
    assert [sum(s) for s in samples] == [9 * 2.0 + 3.0] * 3  # each ran first in 3 of the 9 rounds


def test_interleaved_budget_cuts_rounds():
    clock = DriftClock()
    samples = timing.interleaved_samples([lambda: 1.0, lambda: 1.0], "cpu", rounds=100, warmup=1, budget_ms=10.0,
                                         first_ms=[1.0, 1.0], timer=clock)
    assert len(samples[0]) == 4 and clock.rounds == 5  # 10 ms / 2 ms per round, one of them warm-up


def test_close_calls_are_measured_again():
    seen = []

    def clock(fns, flush):
        seen.append(len(fns))
        return [fn() for fn in fns]

    live = [(SimpleNamespace(id=i), 1.0) for i in range(4)]
    costs = {0: 1.00, 1: 1.02, 2: 1.04, 3: 2.0}  # 1 and 2 within CLOSE_CALL of 0, 3 not
    invokers = {i: (lambda args, c=c: c) for i, c in costs.items()}
    times = _rounds(live, invokers, None, "cpu", 5, 1e9, timer=clock)
    assert times == pytest.approx([1.0, 1.02, 1.04, 2.0])
    assert seen.count(4) == 6 and seen.count(3) == 15  # warm-up + 5 rounds of all; 3x rounds of the close ones
    assert 1.04 <= 1.0 * (1 + CLOSE_CALL)


def test_lone_or_clear_winner_is_not_remeasured():
    seen = []

    def clock(fns, flush):
        seen.append(len(fns))
        return [fn() for fn in fns]

    live = [(SimpleNamespace(id=i), 1.0) for i in range(2)]
    invokers = {0: lambda a: 1.0, 1: lambda a: 1.5}
    _rounds(live, invokers, None, "cpu", 3, 1e9, timer=clock)
    assert seen == [2, 2, 2, 2]
    assert _rounds(live[:1], invokers, None, "cpu", 3, 1e9, timer=clock) == [1.0]


def test_l2_policy():
    small = SimpleNamespace(device="cuda", bytes=lambda: 10e6)
    big = SimpleNamespace(device="cuda", bytes=lambda: 200e6)
    cpu = SimpleNamespace(device="cpu", bytes=lambda: 1e12)
    l2 = 50 * 2**20
    assert timing.l2_policy(small, l2=l2) == "warm"
    assert timing.l2_policy(small, workspace=100 << 20, l2=l2) == "cold"
    assert timing.l2_policy(big, l2=l2) == "cold"
    assert timing.l2_policy(cpu) == "warm"
    assert timing.l2_bytes("cpu") == 0 and timing.l2_flusher("cpu") is None


def test_flush_runs_before_every_timed_run():
    clock = DriftClock()
    timing.interleaved_ms([lambda: 1.0, lambda: 2.0], "cpu", rounds=3, warmup=0, flush=lambda: None, timer=clock)
    assert clock.flushes == 6


def test_find_ranks_with_a_fake_clock_through_the_call_path(solvers, monkeypatch):
    """find's ranking is the fake clock's, and what it times is Context.run_bound (the call path)."""
    a = solvers.add(1000, "t_a")
    b = solvers.add(1001, "t_b")
    cost = {1000: 2.0, 1001: 1.0}
    ran = []
    real = context.Context.run_bound

    def spy(self, bound, args):
        ran.append(bound.solver.id)
        return real(self, bound, args)
    monkeypatch.setattr(context.Context, "run_bound", spy)

    def clock(fns, flush):
        out = []
        for fn in fns:
            n = len(ran)
            fn()
            out.append(cost[ran[n]])
        return out

    res = nnprim.find(PROBLEM, timer=clock)
    assert [r.solver for r in res] == ["t_b", "t_a"]
    assert [r.time_ms for r in res] == [1.0, 2.0]
    assert a.calls > 0 and b.calls > 0


def test_neighbours_vary_so_no_candidate_always_follows_the_same_one():
    """A run right after candidate 0 (the same kernel on the same data: warm caches) is 1 ms
    faster; with a rotation alone candidate 1 would always follow 0 and always gain."""
    def clock(fns, flush):
        out, prev = [], None
        for fn in fns:
            out.append(fn() - (1.0 if prev is fns_[0] else 0.0))
            prev = fn
        return out

    fns_ = [lambda: 5.0, lambda: 5.0, lambda: 5.0, lambda: 5.0]
    samples = timing.interleaved_samples(fns_, "cpu", rounds=24, warmup=0, timer=clock)
    gains = [sum(5.0 - t for t in s) for s in samples]
    assert gains[0] == 0.0 and max(gains[1:]) < 24 * 0.75  # nobody follows candidate 0 every round
    assert [sum(1 for t in s) for s in samples] == [24] * 4
