"""Which solvers may serve a problem, in what order, and why not (no benchmarking, no state).

`heuristic_order` ranks the applicable, enabled solvers by their estimates (MIOpen's
heuristic fallback); `candidates` is what find benchmarks; `not_applicable_error` lists
every solver with its reasons when nothing can run."""
from __future__ import annotations

import logging

from ..errors import NotSupportedError
from .modes import SETTINGS
from .solver import REGISTRY, Solver

log = logging.getLogger("nnprim.search")


def interpreted(solver: Solver, problem) -> bool:
    """A Triton solver on a CPU problem runs in the Triton interpreter (tests only): it is
    ranked after every native solver and find benchmarks it only when nothing else applies."""
    return solver.uses_triton and problem.device == "cpu"


def over_limit(solver: Solver, problem, workspace_limit: int | None) -> int | None:
    """The solver's workspace in bytes when it exceeds `workspace_limit`, else None."""
    if workspace_limit is None:
        return None
    ws = solver.workspace_size(problem)
    return ws if ws > workspace_limit else None


def skip_reason(solver: Solver, problem, *, workspace_limit: int | None = None,
                deterministic: bool = False) -> str | None:
    """Why an applicable solver is not a candidate under the current settings, or None."""
    if SETTINGS.is_disabled(solver.family):
        return f"family {solver.family} is disabled (NNPRIM_DISABLE / nnprim.disable_families)"
    if deterministic and not solver.deterministic:
        return "not deterministic (torch.use_deterministic_algorithms / NNPRIM_DETERMINISTIC)"
    ws = over_limit(solver, problem, workspace_limit)
    if ws is not None:
        return f"workspace {ws} B exceeds the limit {workspace_limit} B (NNPRIM_WORKSPACE_LIMIT)"
    return None


def heuristic_order(problem, *, include_disabled: bool = False, workspace_limit: int | None = None,
                    deterministic: bool = False, exclude: frozenset[int] = frozenset()) -> list[Solver]:
    """Applicable (and, unless asked, enabled) solvers ranked by estimate: known estimates
    ascending (coarse negative ones after, by magnitude), unknown ones next; interpreted
    Triton solvers after native ones, the reference family last. Solvers over the
    workspace limit, non-deterministic ones when determinism is asked, and `exclude`d ids
    are left out."""
    cands = []
    for s in REGISTRY.for_problem(problem):
        if s.id in exclude or not s.is_applicable(problem):
            continue
        why = skip_reason(s, problem, workspace_limit=workspace_limit, deterministic=deterministic)
        if why is None or (include_disabled and why.startswith("family")):
            cands.append(s)

    def rank(s: Solver):
        est = s.estimate(problem)
        last = (s.family == "reference", interpreted(s, problem))
        if est is None:
            return (*last, 2, 0.0, s.id)
        return (*last, 0 if est >= 0 else 1, abs(est), s.id)

    return sorted(cands, key=rank)


def interpreter_only(problem, **kw) -> bool:
    """Every enabled non-reference candidate would run in the Triton interpreter (CPU tests):
    timing them means nothing, so selection skips the find."""
    cands = [c for c in heuristic_order(problem, **kw) if c.family != "reference"]
    return bool(cands) and all(interpreted(c, problem) for c in cands)


def reference_solver(problem) -> Solver | None:
    for s in REGISTRY.for_problem(problem):
        if s.family == "reference" and s.is_applicable(problem):
            return s
    return None


def not_applicable_error(problem, solvers=None, *, workspace_limit: int | None = None,
                         deterministic: bool = False, header: str | None = None) -> NotSupportedError:
    """NotSupportedError listing every solver and why it cannot serve `problem`."""
    lines = [header or f"no solver applies to {problem.key()}:"]
    for s in solvers if solvers is not None else REGISTRY.for_problem(problem):
        reasons = list(s.not_supported_reasons(problem))
        if not reasons:
            why = skip_reason(s, problem, workspace_limit=workspace_limit, deterministic=deterministic)
            if why is not None:
                reasons.append(why)
            elif s.family == "reference":
                reasons.append("reference solver (used only as a fallback)")
            else:
                reasons.append("applicable, but failed or disagreed with the reference in find")
        lines.append(f"  {s.name} (id {s.id}, {s.family}): {'; '.join(reasons)}")
    return NotSupportedError("\n".join(lines))
