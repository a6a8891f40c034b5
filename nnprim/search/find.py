"""Find: benchmark every applicable, enabled solver of a problem and keep the fastest
(MIOpen's FindConvFwdAlgorithm / EvaluateInvokers).

1. A user find-db hit answers without benchmarking (unless `refind=True`).
2. Candidates: applicable solvers whose family is not disabled; the reference family
   only when nothing else remains; `dynamic_only` drops long-compile solvers; a solver
   whose workspace exceeds `workspace_limit` is skipped with the reason logged.
   Candidates are ordered by their estimate so a budget cut keeps the likely winners.
3. Inputs: `tensors` (ConvArgs / AttnArgs) or random ones (random_args).
4. Every candidate is prepared (compiled) first; then each runs once and its output is
   compared with the reference solver's on the same inputs (relative norm; f32 1e-4,
   f16/bf16 2e-2). A disagreeing candidate is recorded "wrong", logged at WARNING and
   never chosen. Any exception (MemoryError, torch.cuda.OutOfMemoryError, ...) records
   it "failed" and find goes on. Then it is timed: median of repeats after warm-up,
   CUDA events on a GPU, perf_counter on CPU, cut to fit the budget
   (NNPRIM_FIND_BUDGET_MS, NNPRIM_FIND_MAX_CANDIDATES).
5. Results go to the user find-db in one transaction; the fastest invoker is
   registered in the hot-path cache; PerfResults are returned fastest first."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import BadParameterError, NotSupportedError
from . import dispatch, finddb
from .modes import SETTINGS
from .numerics import rel_error, tolerance
from .random_args import random_args
from .solver import REGISTRY, Solver
from .timing import median_ms, once_ms

log = logging.getLogger("nnprim.search")


@dataclass(frozen=True)
class PerfResult:
    """One benchmarked solver; `solver` is its name (usable as solver=)."""
    solver: str
    family: str
    time_ms: float
    workspace_bytes: int
    solver_id: int = 0


Progress = Callable[[int, int, str, str], None]  # (index, total, solver name, outcome)


def _check_limit(workspace_limit) -> int | None:
    if workspace_limit is None:
        return None
    if isinstance(workspace_limit, bool) or not isinstance(workspace_limit, int) or workspace_limit < 0:
        raise BadParameterError(f"workspace_limit={workspace_limit!r} must be None or a non-negative int (bytes)")
    return workspace_limit


def reference_solver(problem) -> Solver | None:
    for s in REGISTRY.for_problem(problem):
        if s.family == "reference" and s.is_applicable(problem):
            return s
    return None


def _from_db(problem, workspace_limit, dynamic_only) -> list[PerfResult]:
    from .immediate import _usable
    fp = finddb.device_fingerprint(problem.device)
    out = []
    for r in finddb.user_db().lookup(fp, finddb.SOLVER_SET_VERSION, problem.key()):
        if r.status != "ok" or r.time_ms is None:
            continue
        s = _usable(problem, r.solver_id, "find-db")
        if s is None or (dynamic_only and s.long_compile):
            continue
        if workspace_limit is not None and r.workspace > workspace_limit:
            continue
        out.append(PerfResult(s.name, s.family, float(r.time_ms), int(r.workspace), s.id))
    out.sort(key=lambda x: (x.time_ms, x.solver_id))
    return out


def candidates(problem, *, workspace_limit: int | None = None, dynamic_only: bool = False,
               ) -> tuple[list[Solver], Solver | None]:
    """(solvers to benchmark, the reference oracle). Raises NotSupportedError when nothing
    applicable and enabled remains, listing every solver with its reasons."""
    ref = reference_solver(problem)
    cands: list[Solver] = []
    for s in dispatch.heuristic_order(problem, include_disabled=True):
        if SETTINGS.is_disabled(s.family):
            log.info("find: skipping %s: family %s disabled", s.name, s.family)
            continue
        if dynamic_only and s.long_compile:
            log.info("find: skipping %s: long compilation (dynamic_hybrid)", s.name)
            continue
        if workspace_limit is not None:
            ws = s.workspace_size(problem)
            if ws > workspace_limit:
                log.info("find: skipping %s: workspace %d B exceeds the limit %d B", s.name, ws, workspace_limit)
                continue
        cands.append(s)
    real = [s for s in cands if s.family != "reference"]
    native = [s for s in real if not dispatch.interpreted(s, problem)]
    if native and len(native) < len(real):
        log.info("find: not benchmarking %s: Triton interpreter on CPU (testing only)",
                 ", ".join(s.name for s in real if dispatch.interpreted(s, problem)))
    if native:
        return native, ref
    if real:
        return real, ref
    if cands:
        return cands[:1], None
    raise dispatch.not_applicable_error(problem, workspace_limit=workspace_limit)


def find(problem, tensors=None, workspace_limit: int | None = None, exhaustive: bool = False,
         count: int | None = None, *, refind: bool = False, dynamic_only: bool = False,
         record: bool = True, progress: Progress | None = None) -> list[PerfResult]:
    """Benchmark the applicable solvers of `problem`; PerfResults fastest first (see module doc).

    exhaustive: benchmark every candidate (no NNPRIM_FIND_MAX_CANDIDATES cut) with more
    repeats. count: return at most this many results."""
    limit = _check_limit(workspace_limit)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise BadParameterError(f"count={count!r} must be None or a positive int")
    if not refind:
        hit = _from_db(problem, limit, dynamic_only)
        if hit:
            log.info("find: find-db hit for %s: %s %.4f ms", problem.key(), hit[0].solver, hit[0].time_ms)
            dispatch.set_choice(problem, REGISTRY.get(hit[0].solver_id))
            return hit if count is None else hit[:count]
    results, records = _benchmark(problem, tensors, limit, exhaustive, dynamic_only, progress)
    if record and records:
        try:
            fp = finddb.device_fingerprint(problem.device)
            finddb.user_db().replace_problem(fp, finddb.SOLVER_SET_VERSION, problem.key(), records)
        except Exception as e:  # the db is a cache: a failure to record must not fail find
            log.warning("find: could not record results for %s: %s", problem.key(), e)
    best = REGISTRY.get(results[0].solver_id)
    dispatch.set_choice(problem, best)
    log.info("find: selected %s: %.4f ms, workspace %d B", best.name, results[0].time_ms, results[0].workspace_bytes)
    return results if count is None else results[:count]


def _benchmark(problem, tensors, limit, exhaustive, dynamic_only, progress):
    t_start = time.perf_counter()
    cands, ref = candidates(problem, workspace_limit=limit, dynamic_only=dynamic_only)
    if SETTINGS.find_max_candidates is not None and not exhaustive and len(cands) > SETTINGS.find_max_candidates:
        log.info("find: benchmarking the first %d of %d candidates (NNPRIM_FIND_MAX_CANDIDATES)",
                 SETTINGS.find_max_candidates, len(cands))
        cands = cands[:SETTINGS.find_max_candidates]
    dev = problem.device
    budget = SETTINGS.budget_ms(dev) * (4 if exhaustive else 1)
    repeats = SETTINGS.repeats(dev) * (3 if exhaustive else 1)
    tol = tolerance(problem.dtype)
    args = tensors if tensors is not None else random_args(problem)
    fp = finddb.device_fingerprint(dev)
    key, ckey, now = problem.key(), problem.class_key(), time.time()

    def rec(s: Solver, t: float | None, status: str) -> finddb.Record:
        ws = _workspace(s, problem)
        return finddb.Record(fp, finddb.SOLVER_SET_VERSION, key, ckey, s.id, s.name, s.family, t, ws, status, now)

    ref_out = None
    if ref is not None and any(s is not ref for s in cands):
        ref_out = dispatch.invoker_for(problem, ref)(args)

    records: list[finddb.Record] = []
    invokers = {}
    for s in cands:  # prepare (compile) everything first
        try:
            invokers[s.id] = dispatch.invoker_for(problem, s)
        except Exception as e:
            log.warning("find: %s failed to prepare for %s: %s: %s", s.name, key, type(e).__name__, e)
            records.append(rec(s, None, "failed"))

    results: list[PerfResult] = []
    best = float("inf")
    todo = [s for s in cands if s.id in invokers]
    for i, s in enumerate(todo):
        elapsed = (time.perf_counter() - t_start) * 1e3
        if results and elapsed >= budget:
            log.info("find: budget of %.0f ms spent; %d candidates not benchmarked", budget, len(todo) - i)
            break
        share = max((budget - elapsed) / (len(todo) - i), 1.0)
        inv = invokers[s.id]
        outcome = "ok"
        try:
            t1, out = once_ms(lambda inv=inv: inv(args), dev)
            if ref_out is not None:
                err = rel_error(out, ref_out)
                if not err <= tol:
                    del out
                    log.warning("find: %s disagrees with the reference on %s: relative error %.3g > %.0e; "
                                "recorded as wrong, never selected", s.name, key, err, tol)
                    records.append(rec(s, t1, "wrong"))
                    outcome = "wrong"
                    continue
            del out
            if t1 >= share / 2:  # slow: one more run (the first included JIT compilation)
                t, out = once_ms(lambda inv=inv: inv(args), dev)
                del out
            else:
                t = median_ms(lambda inv=inv: inv(args), dev, repeats=repeats, warmup=1,
                              budget_ms=share - t1, first_ms=t1)
        except (MemoryError, torch.cuda.OutOfMemoryError) as e:
            outcome = "failed"
            log.warning("find: %s ran out of memory on %s (%s); skipped", s.name, key, type(e).__name__)
            records.append(rec(s, None, "failed"))
            if dev == "cuda":
                torch.cuda.empty_cache()
            continue
        except Exception as e:
            outcome = "failed"
            log.warning("find: %s failed on %s: %s: %s; skipped", s.name, key, type(e).__name__, e)
            records.append(rec(s, None, "failed"))
            continue
        finally:
            if progress is not None:
                progress(i + 1, len(todo), s.name, outcome)
        log.info("find: %s (id %d, %s): %.4f ms %s %.4f", s.name, s.id, s.family, t, "<" if t < best else ">=", best)
        best = min(best, t)
        records.append(rec(s, t, "ok"))
        results.append(PerfResult(s.name, s.family, t, _workspace(s, problem), s.id))

    if not results and ref is not None and not SETTINGS.is_disabled(ref.family) and ref not in todo:
        log.warning("find: no candidate succeeded for %s; falling back to the reference %s", key, ref.name)
        t, _ = once_ms(lambda: dispatch.invoker_for(problem, ref)(args), dev)
        records.append(rec(ref, t, "ok"))
        results.append(PerfResult(ref.name, ref.family, t, _workspace(ref, problem), ref.id))
    if not results:
        lines = [f"find: no solver succeeded for {key}:"]
        lines += [f"  {r.solver_name} (id {r.solver_id}, {r.family}): {r.status}" for r in records]
        raise NotSupportedError("\n".join(lines))
    results.sort(key=lambda r: (r.time_ms, r.solver_id))
    return results, records


def _workspace(s: Solver, problem) -> int:
    try:
        return int(s.workspace_size(problem))
    except Exception:
        return 0
