"""The hot path: problem -> (solver, invoker).

Two caches keep repeated calls cheap (no planning, no db access):
- `_INVOKERS[(problem key, solver id)]`: prepared invokers (compile once);
- `_CHOSEN[problem]`: the chosen (solver, invoker) of a problem when none is forced,
  `_FORCED[(problem, solver)]` the same for `solver=` calls. Problems are frozen
  dataclasses, so the problem itself is the key.
A miss goes through `select`, the find-mode logic (see modes.py): fast = immediate
mode, hybrid / dynamic_hybrid = db hit else find, normal = find (the user db answers
a repeated find). When every candidate would run in the Triton interpreter (CPU
tests), selection takes the heuristic order instead of timing them.
With NNPRIM_STRICT=1 a selection that ends at the reference solver raises
NotSupportedError listing why nothing else applies. With
NNPRIM_CHECK_NUMERICS=1 every call scans its inputs and outputs for NaN/Inf."""
from __future__ import annotations

import logging

from ..errors import NotSupportedError
from . import numerics
from .modes import SETTINGS
from .solver import REGISTRY, Invoker, Solver

log = logging.getLogger("nnprim.search")

_INVOKERS: dict[tuple[str, int], Invoker] = {}
_CHOSEN: dict[object, tuple[Solver, Invoker]] = {}
_FORCED: dict[tuple[object, object], tuple[Solver, Invoker]] = {}


def not_applicable_error(problem, solvers=None, *, workspace_limit: int | None = None,
                         header: str | None = None) -> NotSupportedError:
    """NotSupportedError listing every solver and why it cannot serve `problem`."""
    lines = [header or f"no solver applies to {problem.key()}:"]
    for s in solvers if solvers is not None else REGISTRY.for_problem(problem):
        reasons = list(s.not_supported_reasons(problem))
        if not reasons:
            if SETTINGS.is_disabled(s.family):
                reasons.append(f"family {s.family} is disabled (NNPRIM_DISABLE / nnprim.disable_families)")
            elif workspace_limit is not None and s.workspace_size(problem) > workspace_limit:
                reasons.append(f"workspace {s.workspace_size(problem)} B exceeds the limit {workspace_limit} B")
            elif s.family == "reference":
                reasons.append("reference solver (used only as a fallback)")
            else:
                reasons.append("applicable, but failed or disagreed with the reference in find")
        lines.append(f"  {s.name} (id {s.id}, {s.family}): {'; '.join(reasons)}")
    return NotSupportedError("\n".join(lines))


def interpreted(solver: Solver, problem) -> bool:
    """A Triton solver on a CPU problem runs in the Triton interpreter (tests only): it is
    ranked after every native solver and find benchmarks it only when nothing else applies."""
    return solver.uses_triton and problem.device == "cpu"


def heuristic_order(problem, include_disabled: bool = False) -> list[Solver]:
    """Applicable (and, unless asked, enabled) solvers ranked by estimate: known estimates
    ascending (coarse negative ones after, by magnitude), unknown ones next; interpreted
    Triton solvers after native ones, the reference family last."""
    cands = [s for s in REGISTRY.for_problem(problem)
             if (include_disabled or not SETTINGS.is_disabled(s.family)) and s.is_applicable(problem)]

    def rank(s: Solver):
        est = s.estimate(problem)
        last = (s.family == "reference", interpreted(s, problem))
        if est is None:
            return (*last, 2, 0.0, s.id)
        return (*last, 0 if est >= 0 else 1, abs(est), s.id)

    return sorted(cands, key=rank)


def _interpreter_only(problem) -> bool:
    """Every enabled non-reference candidate would run in the Triton interpreter (CPU tests):
    timing them means nothing, so selection skips the find."""
    cands = [c for c in heuristic_order(problem) if c.family != "reference"]
    return bool(cands) and all(interpreted(c, problem) for c in cands)


def _db_first(problem) -> Solver | None:
    from .immediate import db_solutions
    sols = db_solutions(problem)
    return REGISTRY.get(sols[0].solver_id) if sols else None


def select(problem, args=None) -> Solver:
    """Pick the solver for `problem` when none is forced, by the find mode. `args` (the
    caller's tensors) become find's inputs when a find runs."""
    mode = SETTINGS.find_mode
    s: Solver | None = None
    if mode == "fast":
        from .immediate import get_solutions
        sols = get_solutions(problem, 1)
        if sols:
            s = REGISTRY.get(sols[0].solver_id)
            log.debug("select(fast): %s from %s", s.name, sols[0].source)
        else:
            order = heuristic_order(problem)
            s = order[0] if order else None
    else:
        if mode in ("hybrid", "dynamic_hybrid"):
            s = _db_first(problem)
        if s is None and _interpreter_only(problem):
            s = heuristic_order(problem)[0]
            log.debug("select(%s): %s by heuristic (Triton interpreter: not benchmarked)", mode, s.name)
        if s is None:
            from .find import find
            res = find(problem, tensors=args, dynamic_only=mode == "dynamic_hybrid")
            s = REGISTRY.get(res[0].solver_id)
    if s is None:
        raise not_applicable_error(problem)
    if s.family == "reference" and SETTINGS.strict:
        others = [o for o in REGISTRY.for_problem(problem) if o.family != "reference"]
        raise not_applicable_error(problem, others, header=(
            f"NNPRIM_STRICT=1: only the reference solver would run {problem.key()}; no other solver applies:"))
    return s


def invoker_for(problem, solver: Solver) -> Invoker:
    key = (problem.key(), solver.id)
    inv = _INVOKERS.get(key)
    if inv is None:
        inv = solver.prepare(problem)
        _INVOKERS[key] = inv
    return inv


def set_choice(problem, solver: Solver) -> None:
    """Register `solver` as the choice for `problem` (find's winner) in the hot-path cache."""
    _CHOSEN[problem] = (solver, invoker_for(problem, solver))


def _forced(problem, solver) -> tuple[Solver, Invoker]:
    s = REGISTRY.get(solver)
    reasons = s.not_supported_reasons(problem)
    if reasons:
        raise NotSupportedError(f"solver {s.name} (id {s.id}) cannot run {problem.key()}: " + "; ".join(reasons))
    hit = (s, invoker_for(problem, s))
    try:
        _FORCED[(problem, solver)] = hit
    except TypeError:  # an unhashable solver argument: no caching
        pass
    return hit


def _chosen(problem, args=None) -> tuple[Solver, Invoker]:
    hit = _CHOSEN.get(problem)
    if hit is None:
        s = select(problem, args)
        hit = _CHOSEN.get(problem)  # find registers its winner
        if hit is None or hit[0] is not s:
            hit = (s, invoker_for(problem, s))
            _CHOSEN[problem] = hit
    return hit


def resolve(problem, solver=None) -> Solver:
    if solver is not None:
        hit = _FORCED.get((problem, solver)) if isinstance(solver, (int, str)) else None
        return (hit or _forced(problem, solver))[0]
    return _chosen(problem)[0]


def run(problem, args, solver=None):
    """Run `problem` on `args` with the forced or chosen solver."""
    if solver is None:
        hit = _CHOSEN.get(problem)
        if hit is None:
            hit = _chosen(problem, args)
    else:
        try:
            hit = _FORCED.get((problem, solver))
        except TypeError:
            hit = None
        if hit is None:
            hit = _forced(problem, solver)
    if SETTINGS.check_numerics:
        numerics.check_args(args)
        out = hit[1](args)
        numerics.check_outputs(out)
        return out
    return hit[1](args)


def clear_choices() -> None:
    """Forget which solver each problem uses (after a settings change); invokers stay."""
    _CHOSEN.clear()


def clear_caches() -> None:
    _INVOKERS.clear()
    _CHOSEN.clear()
    _FORCED.clear()
