"""Which solver serves a problem when none is forced: the find modes as one policy
(MIOpen's FindMode). It returns a solver and never keeps state; the per-device context
(context.py) caches what it returns.

  fast            immediate mode: user db, system db, the learned model (learned.py),
                  nearest record of the same class, else the heuristic (estimate)
                  ranking; never benchmarks
  hybrid          user or system db hit, else find (the default); a record missing
                  solvers added since its find gets those timed (find.missing; a system
                  record is copied into the user db first, find.adopt_system_record)
  dynamic_hybrid  like hybrid, but a find skips solvers with long compilation
  normal          find (the user db answers a repeated find, adding missing solvers)

While a CUDA graph is being captured nothing may be benchmarked: every mode answers as
`fast` does, and `Decision.would_find` tells the caller that a find was skipped.
When every candidate would run in the Triton interpreter (CPU tests), selection takes
the heuristic order instead of timing them. With NNPRIM_STRICT=1 a selection that ends
at the reference solver raises NotSupportedError listing why nothing else applies."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from . import finddb
from .find import Prepare, adopt_system_record, find, missing
from .immediate import Constraints, db_solutions, get_solutions
from .modes import SETTINGS
from .ranking import heuristic_order, interpreter_only, not_applicable_error
from .solver import REGISTRY, Solver

log = logging.getLogger("nnprim.search")


@dataclass(frozen=True)
class Decision:
    solver: Solver
    source: str               # "user-db", "system-db", "model", "model-heuristic", "nearest-db", "heuristic", "find"
    would_find: bool = False  # a find was due but could not run (CUDA graph capture)


def _immediate(problem, c: Constraints) -> tuple[Solver, str] | None:
    sols = get_solutions(problem, 1, constraints=c)
    if sols:
        return REGISTRY.get(sols[0].solver_id), sols[0].source
    order = heuristic_order(problem, workspace_limit=c.workspace_limit, deterministic=c.deterministic,
                            exclude=c.exclude)
    return (order[0], "heuristic") if order else None


def select(problem, c: Constraints, prepare: Prepare, *, args=None, capturing: bool = False) -> Decision:
    """Pick the solver for `problem` by the find mode. `args` (the caller's tensors) become
    find's inputs when a find runs; `prepare` compiles a solver's invoker for find."""
    mode = SETTINGS.find_mode
    pick: tuple[Solver, str] | None = None
    would_find = False
    if mode == "fast" or capturing:
        if capturing and mode != "fast":
            sols = db_solutions(problem, c)
            would_find = not sols and not interpreter_only(problem, deterministic=c.deterministic)
        pick = _immediate(problem, c)
    else:
        if mode in ("hybrid", "dynamic_hybrid"):
            sols = db_solutions(problem, c)
            dyn = mode == "dynamic_hybrid"
            # a record missing solvers added since its find: find times those alone (a system
            # record is first copied into the user db, where the merged record then lives)
            if sols and sols[0].source == "system-db" and missing(problem, c, dyn, db=finddb.system_db()):
                if not adopt_system_record(problem, c):
                    sols = []
            elif sols and not (sols[0].source == "user-db" and missing(problem, c, dynamic_only=dyn)):
                pick = REGISTRY.get(sols[0].solver_id), sols[0].source
        if pick is None and interpreter_only(problem, workspace_limit=c.workspace_limit,
                                             deterministic=c.deterministic, exclude=c.exclude):
            pick = heuristic_order(problem, workspace_limit=c.workspace_limit, deterministic=c.deterministic,
                                   exclude=c.exclude)[0], "heuristic"
        if pick is None:
            res = find(problem, prepare, c, tensors=args, dynamic_only=mode == "dynamic_hybrid")
            pick = REGISTRY.get(res[0].solver_id), "find"
    if pick is None:
        raise not_applicable_error(problem, workspace_limit=c.workspace_limit, deterministic=c.deterministic)
    s, source = pick
    log.debug("select(%s): %s from %s", mode, s.name, source)
    if s.family == "reference" and SETTINGS.strict:
        others = [o for o in REGISTRY.for_problem(problem) if o.family != "reference"]
        raise not_applicable_error(problem, others, workspace_limit=c.workspace_limit, deterministic=c.deterministic,
                                   header=f"NNPRIM_STRICT=1: only the reference solver would run {problem.key()}; "
                                          "no other solver applies:")
    return Decision(s, source, would_find)
