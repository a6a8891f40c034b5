"""Immediate mode (db, heuristic, nearest record, unknown ids) and every find mode."""
import time

import pytest
import torch
from search_helpers import PROBLEM, resolve, run

import nnprim
from nnprim.problems.conv import ConvProblem
from nnprim.search import context, finddb, modes
from nnprim.search.random_args import random_args


def _record(problem, sid, name, t, status="ok", ws=0):
    fp = finddb.device_fingerprint(problem.device)
    return finddb.Record(fp, finddb.SOLVER_SET_VERSION, problem.key(), problem.class_key(), sid, name, "t_a", t, ws,
                         status, time.time())


def test_immediate_from_db_sorted_and_filtered(solvers):
    solvers.add(1000, "t_a")
    solvers.add(1001, "t_b")
    solvers.add(1002, "t_c", family="t_off")
    solvers.add(1003, "t_bwd", directions=("bwd_data",))
    finddb.user_db().write([_record(PROBLEM, 1000, "t_a", 3.0, ws=64), _record(PROBLEM, 1001, "t_b", 1.0),
                            _record(PROBLEM, 1002, "t_c", 0.5), _record(PROBLEM, 1003, "t_bwd", 0.1),
                            _record(PROBLEM, 99999, "gone", 0.01),                       # unknown id
                            _record(PROBLEM, 1004, "t_wrong", 0.02, status="wrong")])
    nnprim.disable_families("t_off")
    sols = nnprim.get_solutions(PROBLEM)
    assert [(s.solver, s.source) for s in sols] == [("t_b", "user-db"), ("t_a", "user-db")]
    assert sols[1].workspace_bytes == 64 and sols[0].time_ms == 1.0
    assert isinstance(sols[0], nnprim.Solution)
    assert len(nnprim.get_solutions(PROBLEM, max_count=1)) == 1
    with pytest.raises(nnprim.BadParameterError):
        nnprim.get_solutions(PROBLEM, max_count=0)


def test_unknown_id_only_falls_back_to_heuristic(solvers, caplog):
    solvers.add(1000, "t_a", estimate=2.0)
    finddb.user_db().write([_record(PROBLEM, 99999, "gone", 0.01)])
    with caplog.at_level("DEBUG", logger="nnprim"):
        sols = nnprim.get_solutions(PROBLEM)
    assert [(s.solver, s.source) for s in sols] == [("t_a", "heuristic")]
    assert any("unknown solver id 99999" in m for m in caplog.messages)


def test_heuristic_order_as_solution_sort_wrapper(solvers):
    solvers.add(1000, "t_coarse_small", estimate=-1.0)
    solvers.add(1001, "t_coarse_big", estimate=-5.0)
    solvers.add(1002, "t_slow", estimate=3.0)
    solvers.add(1003, "t_fast", estimate=0.5)
    solvers.add(1004, "t_unknown", estimate=None)
    sols = nnprim.get_solutions(PROBLEM)
    assert [s.solver for s in sols] == ["t_fast", "t_slow", "t_coarse_small", "t_coarse_big"]
    assert {s.source for s in sols} == {"heuristic"}


def test_nearest_records_of_same_class(solvers):
    solvers.add(1000, "t_a", estimate=1.0)
    solvers.add(1001, "t_b", estimate=2.0)
    near = ConvProblem.create("fwd", (1, 2, 6, 6), (3, 2, 3, 3), dtype=torch.float32, padding=1)
    far = ConvProblem.create("fwd", (8, 2, 64, 64), (3, 2, 3, 3), dtype=torch.float32, padding=1)
    other_class = ConvProblem.create("fwd", (1, 2, 5, 5), (3, 2, 1, 1), dtype=torch.float32)
    assert near.class_key() == PROBLEM.class_key() == far.class_key() != other_class.class_key()
    finddb.user_db().write([_record(near, 1001, "t_b", 0.3), _record(near, 1000, "t_a", 0.6),
                            _record(far, 1000, "t_a", 0.1), _record(far, 1001, "t_b", 0.9),
                            _record(other_class, 1000, "t_a", 0.1)])
    sols = nnprim.get_solutions(PROBLEM)
    # the learned model (k nearest records, the nearest weighing most) ranks them as the near record does
    assert [(s.solver, s.source) for s in sols] == [("t_b", "model"), ("t_a", "model")]
    # fast mode uses it, without benchmarking
    nnprim.set_find_mode("fast")
    assert resolve(PROBLEM).name == "t_b"
    assert nnprim.get_solutions(PROBLEM, nearest=False)[0].source == "heuristic"


def test_mode_fast_never_benchmarks(solvers):
    a = solvers.add(1000, "t_a", estimate=5.0)
    b = solvers.add(1001, "t_b", estimate=1.0, sleep_ms=5)
    nnprim.set_find_mode("fast")
    y = run(PROBLEM, random_args(PROBLEM))
    assert y.shape == PROBLEM.y_shape
    assert resolve(PROBLEM).name == "t_b"
    assert a.calls == 0 and b.calls == 1  # only the real call
    assert finddb.user_db().count() == 0


def test_mode_hybrid_finds_once_then_reuses_db(solvers):
    assert nnprim.get_find_mode() == "hybrid"
    a = solvers.add(1000, "t_a", estimate=1.0, sleep_ms=8)
    b = solvers.add(1001, "t_b", estimate=5.0)
    args = random_args(PROBLEM)
    run(PROBLEM, args)
    assert resolve(PROBLEM).name == "t_b"  # measured, not estimated
    assert a.calls >= 1 and finddb.user_db().count() == 2
    calls = (a.calls, b.calls)
    context.reset()  # like a new process: the db answers
    run(PROBLEM, args)
    assert (a.calls, b.calls) == (calls[0], calls[1] + 1)


def test_mode_normal_finds_on_miss_and_uses_user_db(solvers, clean, monkeypatch):
    a = solvers.add(1000, "t_a", sleep_ms=5)
    solvers.add(1001, "t_b")
    nnprim.set_find_mode("normal")
    assert resolve(PROBLEM).name == "t_b"
    n = a.calls
    context.reset()
    assert resolve(PROBLEM).name == "t_b" and a.calls == n


def test_mode_normal_ignores_system_db_hybrid_uses_it(solvers, clean, monkeypatch):
    solvers.add(1000, "t_a")
    b = solvers.add(1001, "t_b", sleep_ms=5)
    sys_path = clean / "system.sqlite"
    w = finddb.FindDb(sys_path)
    # both candidates recorded (a system record lacking one gets it timed: test_incremental_find)
    w.write([_record(PROBLEM, 1001, "t_b", 0.001), _record(PROBLEM, 1000, "t_a", 0.01)])
    w._connection().execute("PRAGMA journal_mode=DELETE")
    w.close()
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", str(sys_path))
    finddb.forget_dbs()
    assert resolve(PROBLEM).name == "t_b" and b.calls == 0  # hybrid: system db hit
    nnprim.set_find_mode("normal")
    assert resolve(PROBLEM).name == "t_a"  # normal: benchmarked


def test_mode_dynamic_hybrid_skips_long_compile(solvers):
    slow_compile = solvers.add(1000, "t_long", long_compile=True)
    solvers.add(1001, "t_dyn", sleep_ms=4)
    nnprim.set_find_mode("dynamic_hybrid")
    assert resolve(PROBLEM).name == "t_dyn"
    assert slow_compile.prepares == 0
    nnprim.set_find_mode("hybrid")
    res = nnprim.find(PROBLEM, refind=True)
    assert res[0].solver == "t_long"


def test_find_mode_from_env_and_validation(clean, monkeypatch):
    monkeypatch.setenv("NNPRIM_FIND_MODE", "FAST")
    modes.SETTINGS.reload()
    assert nnprim.get_find_mode() == "fast"
    monkeypatch.setenv("NNPRIM_FIND_MODE", "dynamic-hybrid")
    modes.SETTINGS.reload()
    assert nnprim.get_find_mode() == "dynamic_hybrid"
    monkeypatch.setenv("NNPRIM_FIND_MODE", "bogus")
    with pytest.raises(nnprim.BadParameterError, match="NNPRIM_FIND_MODE"):
        modes.SETTINGS.reload()
    with pytest.raises(nnprim.BadParameterError):
        nnprim.set_find_mode("quick")
    monkeypatch.setenv("NNPRIM_FIND_MODE", "normal")
    monkeypatch.setenv("NNPRIM_FIND_BUDGET_MS", "250")
    monkeypatch.setenv("NNPRIM_FIND_MAX_CANDIDATES", "3")
    monkeypatch.setenv("NNPRIM_STRICT", "1")
    monkeypatch.setenv("NNPRIM_CHECK_NUMERICS", "1")
    s = modes.SETTINGS.reload()
    assert (s.find_mode, s.find_budget_ms, s.find_max_candidates, s.strict, s.check_numerics) == \
        ("normal", 250.0, 3, True, True)


def test_mode_change_drops_choices(solvers):
    solvers.add(1000, "t_a", estimate=1.0, sleep_ms=6)
    solvers.add(1001, "t_b", estimate=2.0)
    nnprim.set_find_mode("fast")
    assert resolve(PROBLEM).name == "t_a"
    nnprim.set_find_mode("hybrid")
    assert resolve(PROBLEM).name == "t_b"


def test_workspace_size_and_compile(solvers):
    s = solvers.add(1000, "t_a", workspace=4096)
    solvers.add(1001, "t_bwd", directions=("bwd_data",))
    assert nnprim.workspace_size(PROBLEM, "t_a") == 4096
    assert nnprim.workspace_size(PROBLEM, 1000) == 4096
    with pytest.raises(nnprim.NotSupportedError, match="direction"):
        nnprim.workspace_size(PROBLEM, "t_bwd")
    with pytest.raises(nnprim.BadParameterError):
        nnprim.workspace_size(PROBLEM, "no_such_solver")
    inv = nnprim.compile(PROBLEM, "t_a")
    assert s.prepares == 1 and callable(inv)
    args = random_args(PROBLEM)
    run(PROBLEM, args, solver="t_a")  # immediate execution: no new prepare
    run(PROBLEM, args, solver=1000)
    assert s.prepares == 1 and s.calls == 2
    with pytest.raises(nnprim.NotSupportedError):
        nnprim.compile(PROBLEM, "t_bwd")


def test_log_level_from_env_and_find_logs_per_solver(solvers, monkeypatch, caplog):
    import logging
    monkeypatch.setenv("NNPRIM_LOG_LEVEL", "INFO")
    modes.SETTINGS.reload()
    modes.set_disabled(("gemm", "direct", "implicit_gemm", "winograd", "flash", "decode"))
    try:
        assert logging.getLogger("nnprim").level == logging.INFO
        solvers.add(1000, "t_a")
        with caplog.at_level(logging.INFO, logger="nnprim"):
            nnprim.find(PROBLEM)
        assert any(m.startswith("find: t_a (id 1000, t_a):") for m in caplog.messages)
        assert any(m.startswith("find: selected t_a") for m in caplog.messages)
    finally:
        lg = logging.getLogger("nnprim")
        lg.setLevel(logging.NOTSET)
        for h in [h for h in lg.handlers if getattr(h, "_nnprim", False)]:
            lg.removeHandler(h)
