"""Find: fastest first, workspace limit, failures skipped, wrong results never chosen,
disabled families never run, budget, and the clear error when nothing applies."""
import dataclasses
import logging
import time

import pytest
import torch
from search_helpers import PROBLEM, chosen, resolve, run

import nnprim
from nnprim.args import ConvArgs
from nnprim.problems.conv import ConvProblem
from nnprim.search import context, finddb
from nnprim.search.random_args import random_args


def _db_records(problem=PROBLEM):
    fp = finddb.device_fingerprint(problem.device)
    return {r.solver_name: r for r in finddb.user_db().lookup(fp, finddb.SOLVER_SET_VERSION, problem.key())}


def test_find_picks_fastest_and_orders_the_rest(solvers):
    solvers.add(1002, "t_slow", sleep_ms=30)
    solvers.add(1000, "t_fast", sleep_ms=0)
    solvers.add(1001, "t_medium", sleep_ms=10, family="t_b")
    res = nnprim.find(PROBLEM)
    assert [r.solver for r in res] == ["t_fast", "t_medium", "t_slow"]
    assert all(isinstance(r, nnprim.PerfResult) for r in res)
    assert res[0].time_ms < res[1].time_ms < res[2].time_ms
    assert res[1].family == "t_b" and res[2].time_ms >= 10
    assert [r.solver for r in nnprim.find(PROBLEM, count=2)] == ["t_fast", "t_medium"]
    # recorded in the user db, the winner registered on the hot path
    recs = _db_records()
    assert {n: r.status for n, r in recs.items()} == {"t_fast": "ok", "t_medium": "ok", "t_slow": "ok"}
    assert chosen(PROBLEM).solver.name == "t_fast"


def test_find_db_hit_does_not_benchmark_unless_refind(solvers):
    fast = solvers.add(1000, "t_fast")
    nnprim.find(PROBLEM)
    calls = fast.calls
    res = nnprim.find(PROBLEM)
    assert res[0].solver == "t_fast" and fast.calls == calls
    nnprim.find(PROBLEM, refind=True)
    assert fast.calls > calls


def test_workspace_limit_skips_with_reason(solvers, caplog):
    solvers.add(1000, "t_big_ws", workspace=1 << 40)
    solvers.add(1001, "t_small_ws", sleep_ms=3, workspace=1024)
    with caplog.at_level(logging.INFO, logger="nnprim"):
        res = nnprim.find(PROBLEM, workspace_limit=1 << 20)
    assert [r.solver for r in res] == ["t_small_ws"]
    assert res[0].workspace_bytes == 1024
    assert any("t_big_ws" in m and "exceeds the limit" in m for m in caplog.messages)
    with pytest.raises(nnprim.BadParameterError):
        nnprim.find(PROBLEM, workspace_limit=-1)


def test_a_find_under_a_tighter_limit_keeps_the_record_and_the_choice(solvers):
    """A one-off find with a small workspace_limit: the solvers it skipped for the limit keep
    their records, and the default calls' choice stays (it once erased both: the default call
    then ran a solver 130x slower)."""
    solvers.add(1000, "t_fast_big_ws", workspace=1 << 30)
    assert nnprim.find(PROBLEM)[0].solver == "t_fast_big_ws"
    solvers.add(1001, "t_slow_no_ws", sleep_ms=5, workspace=0)
    for refind in (False, True):      # nothing usable under the limit recorded: benchmarked either way
        assert [r.solver for r in nnprim.find(PROBLEM, workspace_limit=0, refind=refind)] == ["t_slow_no_ws"]
    assert set(_db_records()) == {"t_fast_big_ws", "t_slow_no_ws"}
    assert nnprim.get_solutions(PROBLEM)[0].solver == "t_fast_big_ws"
    assert PROBLEM not in context.for_problem(PROBLEM).chosen or chosen(PROBLEM).solver.name == "t_fast_big_ws"
    assert resolve(PROBLEM).name == "t_fast_big_ws"      # what a default call runs


def test_raising_and_memory_error_solvers_are_skipped(solvers, caplog):
    solvers.add(1000, "t_raises", behaviour="raise")
    oom = solvers.add(1001, "t_oom", behaviour="memory")
    solvers.add(1002, "t_prep", behaviour="prepare_fails")
    solvers.add(1003, "t_ok", sleep_ms=2)
    with caplog.at_level(logging.WARNING, logger="nnprim"):
        res = nnprim.find(PROBLEM)
    assert [r.solver for r in res] == ["t_ok"]
    recs = _db_records()
    assert recs["t_raises"].status == recs["t_prep"].status == "failed"
    # running out of memory says nothing lasting about the solver: no record, and the next
    # find times it again (incrementally: the record holds the others)
    assert "t_oom" not in recs
    text = "\n".join(caplog.messages)
    assert "t_raises" in text and "t_oom" in text and "out of memory" in text
    # the process stays healthy: the chosen solver runs
    a = random_args(PROBLEM)
    y = run(PROBLEM, a)
    torch.testing.assert_close(y, torch.nn.functional.conv2d(a.x, a.w, padding=1))
    before = oom.calls
    context.reset()
    nnprim.find(PROBLEM)
    assert oom.calls > before


def test_every_candidate_out_of_memory_raises_without_a_record(solvers):
    """A shortage of memory at find time must not make the float64 reference the problem's
    recorded choice: the call fails as torch's would, and nothing is recorded."""
    solvers.add(1000, "t_oom_a", behaviour="memory")
    solvers.add(1001, "t_oom_b", behaviour="memory")
    with pytest.raises(MemoryError):
        nnprim.find(PROBLEM)
    assert _db_records() == {}


def test_wrong_solver_is_never_selected(solvers, caplog):
    wrong = solvers.add(1000, "t_wrong", behaviour="wrong")      # fastest, but wrong
    solvers.add(1001, "t_right", sleep_ms=4)
    with caplog.at_level(logging.WARNING, logger="nnprim"):
        res = nnprim.find(PROBLEM)
    assert [r.solver for r in res] == ["t_right"]
    assert wrong.calls == 1  # checked once, never timed
    assert _db_records()["t_wrong"].status == "wrong"
    assert any("t_wrong" in m and "disagrees" in m for m in caplog.messages)
    # later processes / modes never pick it from the db either
    context.reset()
    assert [s.solver for s in nnprim.get_solutions(PROBLEM)] == ["t_right"]
    nnprim.set_find_mode("fast")
    assert resolve(PROBLEM).name == "t_right"


def test_wrong_solver_alone_falls_back_to_reference(solvers):
    solvers.add(1000, "t_wrong", behaviour="wrong")
    res = nnprim.find(PROBLEM)
    assert [r.family for r in res] == ["reference"]


def test_disabled_family_never_runs(solvers):
    off = solvers.add(1000, "t_off", family="t_off")
    solvers.add(1001, "t_on", sleep_ms=3)
    nnprim.disable_families("t_off")
    res = nnprim.find(PROBLEM)
    assert [r.solver for r in res] == ["t_on"] and off.calls == 0 and off.prepares == 0
    x = torch.randn(1, 2, 5, 5)
    w = torch.randn(3, 2, 3, 3)
    nnprim.conv_forward(x, w, padding=1)
    assert off.calls == 0
    nnprim.enable_families("t_off")
    assert "t_off" not in nnprim.get_disabled()
    res = nnprim.find(PROBLEM, refind=True)
    assert res[0].solver == "t_off"


def test_disabled_by_environment(solvers, monkeypatch):
    off = solvers.add(1000, "t_off", family="t_off")
    solvers.add(1001, "t_on", sleep_ms=1)
    monkeypatch.setenv("NNPRIM_DISABLE", "gemm,winograd,implicit_gemm,t_off")
    nnprim.search.modes.SETTINGS.reload()
    assert nnprim.get_disabled() == frozenset({"gemm", "winograd", "implicit_gemm", "t_off"})
    assert [r.solver for r in nnprim.find(PROBLEM)] == ["t_on"] and off.calls == 0


def test_nothing_applicable_gives_clear_error(solvers):
    solvers.add(1000, "t_bwd_only", directions=("bwd_data",))
    p = ConvProblem.create("fwd", (1, 2, 5, 5), (3, 2, 3, 3), dtype=torch.float32)
    nnprim.disable_families("reference")
    with pytest.raises(nnprim.NotSupportedError) as ei:
        nnprim.find(p)
    msg = str(ei.value)
    assert "no solver applies" in msg
    assert "t_bwd_only" in msg and "direction fwd not in ['bwd_data']" in msg
    assert "ConvReference" in msg and "disabled" in msg


def test_budget_and_max_candidates_bound_find(solvers):
    slow = [solvers.add(1000 + i, f"t_slow{i}", sleep_ms=40, estimate=1.0 + i) for i in range(5)]
    nnprim.set_find_budget(100)
    t0 = time.perf_counter()
    res = nnprim.find(PROBLEM)
    wall = time.perf_counter() - t0
    assert wall < 0.6, wall  # unbounded: about 5 x 5 calls x 40 ms
    # benchmarked in estimate order (best guess first) until the budget ran out
    assert 1 <= len(res) < 5
    assert {r.solver for r in res} == {f"t_slow{i}" for i in range(len(res))}
    assert sum(s.calls for s in slow) <= 6
    nnprim.set_find_budget(None, max_candidates=2)
    res = nnprim.find(PROBLEM, refind=True)
    assert {r.solver for r in res} <= {"t_slow0", "t_slow1"}
    with pytest.raises(nnprim.BadParameterError):
        nnprim.set_find_budget(-1)


def test_find_with_given_tensors_and_progress(solvers):
    solvers.add(1000, "t_fast")
    a = random_args(PROBLEM, seed=3)
    seen = []
    res = nnprim.find(PROBLEM, tensors=ConvArgs(x=a.x, w=a.w), progress=lambda i, n, name, o: seen.append((i, n, name, o)))
    assert res[0].solver == "t_fast" and seen == [(1, 1, "t_fast", "ok")]


def test_find_checks_on_random_inputs_not_the_callers(solvers):
    """The caller's tensors may hold anything (make_graphed_callables warms up backward on
    uninitialised gradients): a solver that overflows on them is still timed on them, but
    its correctness is judged on random inputs, so it is not recorded wrong."""
    solvers.add(1000, "t_overflows", behaviour="overflow")
    a = random_args(PROBLEM, seed=3)
    huge = ConvArgs(x=a.x * 1e30, w=a.w)
    res = nnprim.find(PROBLEM, tensors=huge)
    assert res[0].solver == "t_overflows"
    assert _db_records()["t_overflows"].status == "ok"


def test_builds_do_not_spend_the_budget(solvers):
    """A first call that builds (JIT, native library) for longer than the whole budget does not
    stop find from timing the next candidate (a cold cache recorded the first one alone)."""
    nnprim.set_find_budget(100)
    try:
        solvers.add(1000, "t_building", estimate=1.0, sleep_ms=5, build_ms=400)
        fast = solvers.add(1001, "t_fast_built", estimate=2.0, sleep_ms=1)
        res = nnprim.find(PROBLEM)
        assert res[0].solver == "t_fast_built" and fast.calls >= 2
    finally:
        nnprim.set_find_budget(None)


def test_find_budget_default_keeps_cpu_find_cheap(solvers):
    s = solvers.add(1000, "t_100ms", sleep_ms=100)
    res = nnprim.find(PROBLEM)
    assert res[0].solver == "t_100ms"
    assert s.calls <= 12  # default CPU repeats are small


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_find_low_precision_tolerance(solvers, dtype):
    solvers.add(1000, "t_fast")
    p = ConvProblem.create("fwd", (1, 3, 7, 6), (4, 3, 3, 3), dtype=dtype, layout="nhwc")
    assert nnprim.find(p)[0].solver == "t_fast"


def test_large_problems_skip_the_float64_check(solvers, monkeypatch):
    """Past REFERENCE_FLOPS find times the candidates without running the reference."""
    from nnprim.search import find as find_mod
    monkeypatch.setitem(find_mod.REFERENCE_FLOPS, "cpu", 0.0)
    wrong = solvers.add(1000, "t_unchecked", behaviour="wrong")
    res = nnprim.find(PROBLEM)
    assert [r.solver for r in res] == ["t_unchecked"] and wrong.calls >= 1


def test_reference_check_bounded_by_float64_memory():
    """Find's float64 check is skipped where its widened tensors would not fit (a cheap
    problem in FLOPs can still be gigabytes: 1x1 conv over 2^28 input elements)."""
    from nnprim.search.find import reference_affordable
    small = ConvProblem.create("fwd", (1, 64, 64, 64), (8, 64, 1, 1), dtype=torch.float32)
    wide = ConvProblem.create("fwd", (1, 64, 2048, 2048), (1, 64, 1, 1), dtype=torch.float32)
    assert wide.flops() < 2e10
    assert reference_affordable(small) and not reference_affordable(wide)


def test_reference_check_bounded_by_free_gpu_memory(monkeypatch):
    """On a GPU the float64 check takes at most a quarter of the free memory (a training step's
    first call finds beside the model's activations)."""
    from nnprim.search import find as find_mod
    p = ConvProblem.create("fwd", (8, 64, 64, 64), (64, 64, 3, 3), dtype=torch.float32)
    p = dataclasses.replace(p, device="cuda")
    need = find_mod._f64_bytes(p)
    monkeypatch.setattr(find_mod, "_free_bytes", lambda dev: 8 * need)
    assert find_mod.reference_affordable(p)
    monkeypatch.setattr(find_mod, "_free_bytes", lambda dev: 2 * need)
    assert not find_mod.reference_affordable(p)


def test_reference_out_of_memory_times_the_candidates_unchecked(solvers, monkeypatch, caplog):
    """The float64 check running out of memory is find's own shortage: the candidates are
    timed unchecked and the call goes on (it raised into the caller's call before)."""
    from nnprim.search.ranking import reference_solver
    ref = reference_solver(PROBLEM)

    def no_memory(self, p):
        def run(args):
            raise MemoryError("float64 check")
        return run
    monkeypatch.setattr(type(ref), "prepare", no_memory)
    solvers.add(1000, "t_fast")
    with caplog.at_level(logging.WARNING, logger="nnprim"):
        res = nnprim.find(PROBLEM)
    assert res[0].solver == "t_fast"
    assert any("float64 check" in m and "out of memory" in m for m in caplog.messages)
