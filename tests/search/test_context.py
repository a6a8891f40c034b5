"""The per-device search context: threads, loud fallback, strict mode, the workspace
limit, determinism, one reset."""
import threading
import warnings

import pytest
import torch
from search_helpers import PROBLEM, chosen, resolve, run

import nnprim
from nnprim.search import context
from nnprim.search.random_args import random_args


def test_one_context_per_device():
    a, b = context.context("cpu"), context.context(torch.device("cpu"))
    assert a is b and a.device == torch.device("cpu")
    context.reset()
    assert context.context("cpu") is not a


def test_calls_from_many_threads_share_one_find(solvers):
    s = solvers.add(1000, "t_a", sleep_ms=20)
    solvers.add(1001, "t_b", sleep_ms=1)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    outs, errors = [None] * 6, []

    def work(i):
        try:
            outs[i] = nnprim.conv_forward(x, w, padding=1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert s.prepares == 1  # one find (one prepare of each candidate), not one per thread
    assert resolve(PROBLEM).name == "t_b"


def test_failing_chosen_solver_warns_once_and_falls_back(solvers):
    solvers.add(1000, "t_fast", sleep_ms=0)
    solvers.add(1001, "t_slow", sleep_ms=5)
    args = random_args(PROBLEM)
    run(PROBLEM, args)
    b = chosen(PROBLEM)
    assert b.solver.name == "t_fast"

    def boom(a):
        raise RuntimeError("launch failed")
    b.invoker = boom
    with pytest.warns(RuntimeWarning, match=r"solver t_fast \(id 1000\) failed on conv2d.*launch failed.*t_slow"):
        y = run(PROBLEM, args)
    assert torch.allclose(y, chosen(PROBLEM).invoker(args))
    assert chosen(PROBLEM).solver.name == "t_slow"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(PROBLEM, args)
    assert "failed at run time" in nnprim.explain(PROBLEM, file=None)


def test_strict_raises_instead_of_falling_back(solvers):
    solvers.add(1000, "t_fast")
    solvers.add(1001, "t_slow", sleep_ms=5)
    args = random_args(PROBLEM)
    run(PROBLEM, args)

    def boom(a):
        raise RuntimeError("launch failed")
    chosen(PROBLEM).invoker = boom
    nnprim.set_strict(True)
    run(PROBLEM, args)  # the strict setting re-selects (choices dropped) and runs the fresh invoker
    chosen(PROBLEM).invoker = boom
    with pytest.raises(RuntimeError, match="launch failed"):
        run(PROBLEM, args)


def test_forced_solver_errors_propagate(solvers):
    solvers.add(1000, "t_bad", behaviour="raise")
    solvers.add(1001, "t_ok")
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        run(PROBLEM, random_args(PROBLEM), solver="t_bad")


def test_workspace_limit_skips_with_reason(solvers):
    solvers.add(1000, "t_big", workspace=1 << 20)
    solvers.add(1001, "t_small", workspace=1 << 10, sleep_ms=3)
    nnprim.set_workspace_limit("64K")
    assert nnprim.get_workspace_limit() == 65536
    assert resolve(PROBLEM).name == "t_small"
    text = nnprim.explain(PROBLEM, file=None)
    big = [ln for ln in text.splitlines() if "t_big" in ln][0]
    assert "skipped" in big and "exceeds the limit 65536" in big
    assert [s.solver for s in nnprim.find(PROBLEM, refind=True)] == ["t_small"]
    nnprim.set_workspace_limit(None)
    with pytest.raises(nnprim.BadParameterError):
        nnprim.set_workspace_limit("lots")


def test_default_workspace_limit_is_a_share_of_memory():
    limit = context.context("cpu").workspace_limit()
    assert limit > 1 << 20


def test_deterministic_choices_kept_apart(solvers, monkeypatch):
    fast = solvers.add(1000, "t_nondet")
    fast.deterministic = False
    solvers.add(1001, "t_det", sleep_ms=5)
    assert resolve(PROBLEM).name == "t_nondet"
    nnprim.set_deterministic(True)
    assert resolve(PROBLEM).name == "t_det"
    nnprim.set_deterministic(False)
    torch.use_deterministic_algorithms(True)
    try:
        assert resolve(PROBLEM).name == "t_det"  # torch's switch takes effect at once
    finally:
        torch.use_deterministic_algorithms(False)
    assert resolve(PROBLEM).name == "t_nondet"
    context.reset()
    nnprim.set_deterministic(True)
    assert resolve(PROBLEM).name == "t_det" and fast.prepares == 1  # both records in the db, kept apart


def test_chosen_solver_that_cannot_be_planned_is_excluded(solvers):
    """A plan that fails (e.g. a launch grid beyond CUDA's limits that the solver's
    applicability check missed) is not the user's error: the next choice runs, with a warning."""
    solvers.add(1000, "t_unplannable", behaviour="prepare_fails", estimate=1e-6)
    solvers.add(1001, "t_ok", estimate=1.0)
    nnprim.set_find_mode("fast")
    args = random_args(PROBLEM)
    with pytest.warns(RuntimeWarning, match=r"t_unplannable \(id 1000\) could not be planned.*cannot compile"):
        y = run(PROBLEM, args)
    assert chosen(PROBLEM).solver.name == "t_ok"
    assert torch.allclose(y, chosen(PROBLEM).invoker(args))
    context.reset()          # a fresh process: strict raises the plan's error
    nnprim.set_strict(True)
    with pytest.raises(RuntimeError, match="cannot compile"):
        run(PROBLEM, args)
