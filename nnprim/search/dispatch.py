"""The hot path: problem -> (solver, invoker), with the invoker cache keyed by
(problem key, solver id). Choosing a solver when none is forced is `select` (the
find-mode logic); everything here is kept cheap because it runs on every call."""
from __future__ import annotations

import logging

from ..errors import NotSupportedError
from .solver import REGISTRY, Invoker, Solver

log = logging.getLogger("nnprim.search")

_INVOKERS: dict[tuple[str, int], Invoker] = {}
_CHOSEN: dict[str, Solver] = {}


def not_applicable_error(problem, solvers=None) -> NotSupportedError:
    lines = [f"no solver applies to {problem.key()}:"]
    for s in solvers if solvers is not None else REGISTRY.for_problem(problem):
        reasons = s.not_supported_reasons(problem)
        if reasons:
            lines.append(f"  {s.name} (id {s.id}, {s.family}): {'; '.join(reasons)}")
    return NotSupportedError("\n".join(lines))


def heuristic_order(problem) -> list[Solver]:
    """Applicable solvers ranked by estimate (unknown estimates after known ones,
    the reference family last)."""
    cands = [s for s in REGISTRY.for_problem(problem) if s.is_applicable(problem)]

    def rank(s: Solver):
        est = s.estimate(problem)
        return (s.family == "reference", est is None, est if est is not None else 0.0, s.id)

    return sorted(cands, key=rank)


def select(problem) -> Solver:
    """Pick the solver for `problem` when none is forced."""
    order = heuristic_order(problem)
    if not order:
        raise not_applicable_error(problem)
    return order[0]


def invoker_for(problem, solver: Solver) -> Invoker:
    key = (problem.key(), solver.id)
    inv = _INVOKERS.get(key)
    if inv is None:
        inv = solver.prepare(problem)
        _INVOKERS[key] = inv
    return inv


def resolve(problem, solver=None) -> Solver:
    if solver is not None:
        s = REGISTRY.get(solver)
        reasons = s.not_supported_reasons(problem)
        if reasons:
            raise NotSupportedError(f"solver {s.name} (id {s.id}) cannot run {problem.key()}: "
                                    + "; ".join(reasons))
        return s
    key = problem.key()
    s = _CHOSEN.get(key)
    if s is None:
        s = select(problem)
        _CHOSEN[key] = s
    return s


def run(problem, args, solver=None):
    s = resolve(problem, solver)
    return invoker_for(problem, s)(args)


def clear_caches() -> None:
    _INVOKERS.clear()
    _CHOSEN.clear()
