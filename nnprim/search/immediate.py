"""Immediate mode (MIOpen's GetSolutions / GetSolutionsFallback / CompileSolution):
solutions for a problem without benchmarking.

Sources, first that has any usable record wins:
  "user-db"    records of this exact problem in the user find-db
  "system-db"  records of this exact problem in the shipped system db
  "nearest-db" records of the nearest problem of the same class (same everything but
               sizes; distance = sum of |log2| differences of the sizes in the keys)
  "heuristic"  applicable solvers ranked by `estimate` (unknown estimates skipped;
               a negative estimate is a coarse guess: after every positive one, larger
               magnitude later, as the seed's SolutionSortWrapper orders them)
Records are filtered: unknown solver ids (logged at DEBUG and ignored), disabled
families, solvers no longer applicable, and status other than "ok"."""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from ..errors import BadParameterError, NotSupportedError
from . import finddb
from .modes import SETTINGS
from .solver import REGISTRY, Invoker, Solver

log = logging.getLogger("nnprim.search")

SOURCES = ("user-db", "system-db", "nearest-db", "heuristic")


@dataclass(frozen=True)
class Solution:
    """One immediate-mode solution; `solver` is the solver's name (usable as solver=)."""
    solver: str
    family: str
    time_ms: float | None
    workspace_bytes: int
    source: str
    solver_id: int = 0


def _usable(problem, solver_id: int, what: str) -> Solver | None:
    s = REGISTRY.find_id(solver_id)
    if s is None:
        log.debug("%s: ignoring unknown solver id %d for %s", what, solver_id, problem.key())
        return None
    if SETTINGS.is_disabled(s.family):
        return None
    if not s.is_applicable(problem):
        log.debug("%s: solver %s no longer applies to %s", what, s.name, problem.key())
        return None
    return s


def _from_records(problem, records, source: str, *, own_workspace: bool) -> list[Solution]:
    out = []
    for r in records:
        if r.status != "ok" or r.time_ms is None:
            continue
        s = _usable(problem, r.solver_id, source)
        if s is None:
            continue
        ws = r.workspace if own_workspace else s.workspace_size(problem)
        out.append(Solution(s.name, s.family, float(r.time_ms), int(ws), source, s.id))
    out.sort(key=lambda x: (x.time_ms, x.solver_id))
    return out


def db_solutions(problem) -> list[Solution]:
    """Solutions recorded for exactly this problem: user db first, then the system db."""
    fp = finddb.device_fingerprint(problem.device)
    key = problem.key()
    sols = _from_records(problem, finddb.user_db().lookup(fp, finddb.SOLVER_SET_VERSION, key), "user-db",
                         own_workspace=True)
    if sols:
        return sols
    sdb = finddb.system_db()
    if sdb is not None:
        return _from_records(problem, sdb.lookup(fp, finddb.SOLVER_SET_VERSION, key), "system-db",
                             own_workspace=True)
    return []


def _sizes(key: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", key)]


def key_distance(a: str, b: str) -> float:
    """Distance between two problem keys of one class: sum of |log2| size differences."""
    sa, sb = _sizes(a), _sizes(b)
    if len(sa) != len(sb):
        return math.inf
    return sum(abs(math.log2(x + 1) - math.log2(y + 1)) for x, y in zip(sa, sb))


def nearest_solutions(problem) -> list[Solution]:
    """Solutions of the nearest recorded problem of the same class (user db, then system db)."""
    fp = finddb.device_fingerprint(problem.device)
    key, ckey = problem.key(), problem.class_key()
    dbs = [finddb.user_db()]
    sdb = finddb.system_db()
    if sdb is not None:
        dbs.append(sdb)
    for db in dbs:
        groups: dict[str, list] = {}
        for r in db.by_class(fp, finddb.SOLVER_SET_VERSION, ckey):
            if r.problem_key != key:
                groups.setdefault(r.problem_key, []).append(r)
        for other in sorted(groups, key=lambda k: (key_distance(key, k), k)):
            if key_distance(key, other) == math.inf:
                break
            sols = _from_records(problem, groups[other], "nearest-db", own_workspace=False)
            if sols:
                log.debug("nearest record of %s is %s", key, other)
                return sols
    return []


def _heuristic_rank(est: float) -> tuple[int, float]:
    # SolutionSortWrapper: positive (real) estimates first, ascending; negative (coarse)
    # estimates after them, the larger the magnitude the later.
    return (0, est) if est >= 0 else (1, -est)


def heuristic_solutions(problem) -> list[Solution]:
    out = []
    for s in REGISTRY.for_problem(problem):
        if SETTINGS.is_disabled(s.family) or not s.is_applicable(problem):
            continue
        est = s.estimate(problem)
        if est is None:
            log.debug("heuristic: %s has no estimate for %s; skipped", s.name, problem.key())
            continue
        out.append((s, float(est)))
    from .dispatch import interpreted
    out.sort(key=lambda se: (se[0].family == "reference", interpreted(se[0], problem), _heuristic_rank(se[1]), se[0].id))
    return [Solution(s.name, s.family, est, int(s.workspace_size(problem)), "heuristic", s.id) for s, est in out]


def get_solutions(problem, max_count: int | None = None, *, nearest: bool = True) -> list[Solution]:
    """Immediate mode: solutions from the find-db (exact, then nearest of the same class),
    else the heuristic ranking; best first, at most max_count."""
    if max_count is not None and (isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 1):
        raise BadParameterError(f"max_count={max_count!r} must be None or a positive int")
    sols = db_solutions(problem)
    if not sols and nearest:
        sols = nearest_solutions(problem)
    if not sols:
        sols = heuristic_solutions(problem)
    return sols if max_count is None else sols[:max_count]


def _checked(problem, solver) -> Solver:
    s = REGISTRY.get(solver)
    reasons = s.not_supported_reasons(problem)
    if reasons:
        raise NotSupportedError(f"solver {s.name} (id {s.id}) cannot run {problem.key()}: " + "; ".join(reasons))
    return s


def workspace_size(problem, solver) -> int:
    """Workspace bytes `solver` (name, id or Solver) needs for `problem`; error if not applicable."""
    s = _checked(problem, solver)
    return int(s.workspace_size(problem))


def compile(problem, solver) -> Invoker:  # noqa: A001 - MIOpen's name (CompileSolution)
    """Prepare (compile) `solver` for `problem` ahead of time; returns the cached invoker."""
    from . import dispatch
    s = _checked(problem, solver)
    return dispatch.invoker_for(problem, s)
