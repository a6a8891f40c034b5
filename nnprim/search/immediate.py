"""Immediate mode (MIOpen's GetSolutions / GetSolutionsFallback / CompileSolution):
solutions for a problem without benchmarking.

Sources, first that has any usable record wins:
  "user-db"    records of this exact problem in the user find-db
  "system-db"  records of this exact problem in the shipped system db
  "model"      the learned model (learned.py: k nearest records in log-feature space of
               the user and system dbs, per solver, scaled by a roofline ratio); solvers
               it has no record for are placed by their heuristic estimate times the
               geometric mean of (prediction / estimate) over the predicted solvers
               ("model-heuristic"), or after them when they have no estimate
  "nearest-db" records of the nearest problem of the same class (same everything but
               sizes; distance = sum of |log2| differences of the sizes in the keys);
               reached only for problems the model has no features for
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

from ..errors import BadParameterError
from . import finddb, learned
from .modes import SETTINGS
from .ranking import interpreted, over_limit
from .solver import REGISTRY, Solver

log = logging.getLogger("nnprim.search")

SOURCES = ("user-db", "system-db", "model", "model-heuristic", "nearest-db", "heuristic")


@dataclass(frozen=True)
class Solution:
    """One immediate-mode solution; `solver` is the solver's name (usable as solver=)."""
    solver: str
    family: str
    time_ms: float | None
    workspace_bytes: int
    source: str
    solver_id: int = 0


@dataclass(frozen=True)
class Constraints:
    """What a solution must satisfy beyond applicability: the device's find-db
    fingerprint, the workspace limit, determinism, and solvers to leave out (ids that
    failed at run time)."""
    fingerprint: str
    workspace_limit: int | None = None
    deterministic: bool = False
    exclude: frozenset[int] = frozenset()

    @classmethod
    def default(cls, problem) -> Constraints:
        return cls(finddb.device_fingerprint(problem.device))


def usable(problem, solver_id: int, what: str, c: Constraints | None = None) -> Solver | None:
    s = REGISTRY.find_id(solver_id)
    if s is None:
        log.debug("%s: ignoring unknown solver id %d for %s", what, solver_id, problem.key())
        return None
    if SETTINGS.is_disabled(s.family):
        return None
    if not s.is_applicable(problem):
        log.debug("%s: solver %s no longer applies to %s", what, s.name, problem.key())
        return None
    if c is not None:
        if s.id in c.exclude or (c.deterministic and not s.deterministic):
            return None
        if over_limit(s, problem, c.workspace_limit) is not None:
            return None
    return s


def _from_records(problem, records, source: str, c: Constraints, *, own_workspace: bool) -> list[Solution]:
    out = []
    for r in records:
        if r.status != "ok" or r.time_ms is None:
            continue
        s = usable(problem, r.solver_id, source, c)
        if s is None:
            continue
        ws = r.workspace if own_workspace else s.workspace_size(problem)
        out.append(Solution(s.name, s.family, float(r.time_ms), int(ws), source, s.id))
    out.sort(key=lambda x: (x.family == "reference", x.time_ms, x.solver_id))    # as find.from_db
    return out


def _dbs() -> list[tuple[str, finddb.FindDb]]:
    dbs = [("user-db", finddb.user_db())]
    sdb = finddb.system_db()
    if sdb is not None:
        dbs.append(("system-db", sdb))
    return dbs


def db_solutions(problem, c: Constraints | None = None) -> list[Solution]:
    """Solutions recorded for exactly this problem: user db first, then the system db."""
    c = c or Constraints.default(problem)
    key = finddb.db_key(problem, c.deterministic)
    for source, db in _dbs():
        sols = _from_records(problem, db.lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, key), source, c,
                             own_workspace=True)
        if sols:
            return sols
    return []


def _sizes(key: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", key)]


def key_distance(a: str, b: str) -> float:
    """Distance between two problem keys of one class: sum of |log2| size differences."""
    sa, sb = _sizes(a), _sizes(b)
    if len(sa) != len(sb):
        return math.inf
    return sum(abs(math.log2(x + 1) - math.log2(y + 1)) for x, y in zip(sa, sb))


def nearest_solutions(problem, c: Constraints | None = None) -> list[Solution]:
    """Solutions of the nearest recorded problem of the same class (user db, then system db)."""
    c = c or Constraints.default(problem)
    key, ckey = finddb.db_key(problem, c.deterministic), problem.class_key()
    for _, db in _dbs():
        groups: dict[str, list] = {}
        for r in db.by_class(c.fingerprint, finddb.SOLVER_SET_VERSION, ckey):
            if r.problem_key != key and r.problem_key.endswith("|deterministic") == c.deterministic:
                groups.setdefault(r.problem_key, []).append(r)
        for other in sorted(groups, key=lambda k: (key_distance(key, k), k)):
            if key_distance(key, other) == math.inf:
                break
            sols = _from_records(problem, groups[other], "nearest-db", c, own_workspace=False)
            if sols:
                log.debug("nearest record of %s is %s", key, other)
                return sols
    return []


def model_solutions(problem, c: Constraints | None = None) -> list[Solution]:
    """The learned model's ranking of the usable solvers (see the module doc); empty when it
    predicts none of them."""
    c = c or Constraints.default(problem)
    m = learned.model_for(c.fingerprint)
    f = learned.features(problem.key()) if m is not None else None
    if f is None:
        return []
    cands = [s for s in REGISTRY.for_problem(problem)
             if s.family != "reference" and s.is_applicable(problem) and usable(problem, s.id, "model", c) is not None]
    # the reference serves only when nothing else does (the heuristic's last)
    preds = {sid: p and p.time_ms
             for sid, p in m.predict_many(problem.key(), [s.id for s in cands], feats=f, problem=problem).items()}
    if not any(t is not None for t in preds.values()):
        return []
    placed = learned.place(preds, {s.id: s.estimate(problem) for s in cands})
    rows = sorted(cands, key=lambda s: (math.isinf(placed[s.id][0]), interpreted(s, problem), placed[s.id][0], s.id))
    return [Solution(s.name, s.family, None if math.isinf(placed[s.id][0]) else float(placed[s.id][0]),
                     int(s.workspace_size(problem)), placed[s.id][1], s.id) for s in rows]


def _heuristic_rank(est: float) -> tuple[int, float]:
    # SolutionSortWrapper: positive (real) estimates first, ascending; negative (coarse)
    # estimates after them, the larger the magnitude the later.
    return (0, est) if est >= 0 else (1, -est)


def heuristic_solutions(problem, c: Constraints | None = None) -> list[Solution]:
    c = c or Constraints.default(problem)
    out = []
    for s in REGISTRY.for_problem(problem):
        if not s.is_applicable(problem) or usable(problem, s.id, "heuristic", c) is None:
            continue
        est = s.estimate(problem)
        if est is None:
            log.debug("heuristic: %s has no estimate for %s; skipped", s.name, problem.key())
            continue
        out.append((s, float(est)))
    out.sort(key=lambda se: (se[0].family == "reference", interpreted(se[0], problem), _heuristic_rank(se[1]), se[0].id))
    return [Solution(s.name, s.family, est, int(s.workspace_size(problem)), "heuristic", s.id) for s, est in out]


def get_solutions(problem, max_count: int | None = None, *, nearest: bool = True,
                  constraints: Constraints | None = None) -> list[Solution]:
    """Immediate mode: solutions from the find-db (exact), else the learned model's ranking,
    else the nearest record of the same class, else the heuristic ranking; best first, at
    most max_count. `nearest=False` leaves out the model and the nearest record."""
    if max_count is not None and (isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 1):
        raise BadParameterError(f"max_count={max_count!r} must be None or a positive int")
    c = constraints or Constraints.default(problem)
    sols = db_solutions(problem, c)
    if not sols and nearest:
        sols = model_solutions(problem, c)
    if not sols and nearest:
        sols = nearest_solutions(problem, c)
    if not sols:
        sols = heuristic_solutions(problem, c)
    return sols if max_count is None else sols[:max_count]
