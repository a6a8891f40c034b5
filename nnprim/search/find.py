"""Find: benchmark every applicable, enabled solver of a problem and keep the fastest
(MIOpen's FindConvFwdAlgorithm / EvaluateInvokers). A policy: it returns measurements
and records them in the find-db; the per-device context (context.py) prepares the
invokers (passed in as `prepare`) and remembers the winner.

1. A user find-db hit answers without benchmarking (unless `refind=True`), unless it is
   missing solvers (`missing`: applicable candidates now that its finds never considered,
   e.g. registered by a later nnprim, or enabled since): those alone are timed, on the
   same path and clock, interleaved with the record's fastest (so that the new times and
   the one they compete with come from one run), merged into the record
   (finddb.merge_problem) and the choice is made again over the merged record.
2. Candidates: applicable solvers whose family is not disabled; the reference family
   only when nothing else remains; `dynamic_only` drops long-compile solvers; a solver
   whose workspace exceeds `workspace_limit` is skipped with the reason logged;
   non-deterministic solvers are skipped when `deterministic`. Ordered by estimate so a
   budget cut keeps the likely winners.
3. Inputs: `tensors` (ConvArgs / AttnArgs) or random ones (random_args).
4. Every candidate is prepared (compiled) first; then each runs once and its output is
   compared with the reference solver's on the same inputs (problems up to REFERENCE_FLOPS
   and REFERENCE_F64_BYTES; larger ones are timed unchecked) (relative norm; f32 1e-4,
   f16 1e-2, bf16 2e-2). A disagreeing candidate is recorded "wrong", logged at WARNING and
   never chosen. Any other exception records it "failed" and find goes on; running out of
   memory (MemoryError, torch.cuda.OutOfMemoryError) records nothing (the candidate is timed
   again by the next find), and when every candidate ran out the error propagates (no
   reference fallback).
5. Timing (timing.py): the survivors run in interleaved rounds (one run of each per round,
   device events on a GPU) through `prepare`'s callable, which the context makes the call
   path itself (Context.run_bound around the cached invoker, as the default call runs it);
   each one's trimmed mean counts. Problems whose working set fits in L2 are timed warm,
   larger ones with an L2 flush before each run (timing.l2_policy). Every candidate within
   5% of the fastest gets 3x the rounds again, interleaved with the fastest, to settle the
   order. Everything is cut to fit the budget (NNPRIM_FIND_BUDGET_MS,
   NNPRIM_FIND_MAX_CANDIDATES).
6. Results go to the user find-db in one transaction, with the ids of every candidate
   considered, replacing the problem's records (but those of long-compile solvers that a
   dynamic_only find skipped); PerfResults come back fastest first."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from ..errors import BadParameterError, NotSupportedError
from . import finddb
from .immediate import Constraints, usable
from .modes import SETTINGS
from .numerics import rel_error, tolerance
from .random_args import random_args
from .ranking import heuristic_order, interpreted, not_applicable_error, over_limit, reference_solver
from .solver import REGISTRY, Invoker, Solver
from .timing import Timer, interleaved_ms, l2_flusher, l2_policy, once_ms

log = logging.getLogger("nnprim.search")

CLOSE_CALL = 0.05  # the two fastest within 5%: measure them again
# the float64 check of find's candidates runs up to this much work (FLOP): seconds on a GPU's
# float64 units, about as much as the tests' references; larger problems (a 16k-token attention,
# a 2^31-element convolution) would spend minutes and gigabytes on it at their first call
REFERENCE_FLOPS = {"cuda": 2e12, "cpu": 2e10}
# ... and this much float64 working set (inputs and outputs widened): a 2^31-element attention
# forward is "only" 5.5e11 FLOP, but its float64 q alone is a 16 GiB block, and its first call ran
# out of memory in find where 12 other processes shared the GPU (2026-12-04 GPU fuzz)
REFERENCE_F64_BYTES = {"cuda": 4 << 30, "cpu": 1 << 30}


def _f64_bytes(problem) -> int:
    """Bytes of the reference's float64 inputs and outputs (twice that for an attention
    backward: the gradients)."""
    if hasattr(problem, "x_shape"):
        elems = math.prod(problem.x_shape) + math.prod(problem.w_shape) + math.prod(problem.y_shape)
    else:
        p = problem
        elems = (p.B * p.Hq * p.Sq + p.B * p.Hkv * p.Sk) * (p.D + p.Dv) * (2 if p.direction == "bwd" else 1)
    return 8 * elems


# ... and at most this share of the GPU's free memory: a training step's first call runs find
# beside the model's activations (a ResNet-50 at batch 128 under autocast peaked at 10.9 GB in its
# first steps against torch's 6.3, 2026-12-04, H200): the check must not be what runs out
REFERENCE_FREE_SHARE = 0.25


def _free_bytes(device: str) -> int | None:
    if device != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.mem_get_info()[0]
    except Exception:  # a driver that cannot say: the fixed bound alone
        return None


def reference_affordable(problem) -> bool:
    dev = problem.device
    if problem.flops() > REFERENCE_FLOPS.get(dev, 2e10):
        return False
    need = _f64_bytes(problem)
    free = _free_bytes(dev)
    return need <= REFERENCE_F64_BYTES.get(dev, 1 << 30) and (free is None or need <= REFERENCE_FREE_SHARE * free)


@dataclass(frozen=True)
class PerfResult:
    """One benchmarked solver; `solver` is its name (usable as solver=)."""
    solver: str
    family: str
    time_ms: float
    workspace_bytes: int
    solver_id: int = 0


Progress = Callable[[int, int, str, str], None]  # (index, total, solver name, outcome)
Prepare = Callable[[Solver], Invoker]


def check_limit(workspace_limit) -> int | None:
    if workspace_limit is None:
        return None
    if isinstance(workspace_limit, bool) or not isinstance(workspace_limit, int) or workspace_limit < 0:
        raise BadParameterError(f"workspace_limit={workspace_limit!r} must be None or a non-negative int (bytes)")
    return workspace_limit


def from_db(problem, c: Constraints, dynamic_only: bool = False) -> list[PerfResult]:
    """The user find-db's usable "ok" records of `problem`, fastest first."""
    out = []
    for r in finddb.user_db().lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, finddb.db_key(problem, c.deterministic)):
        if r.status != "ok" or r.time_ms is None:
            continue
        s = usable(problem, r.solver_id, "find-db", c)
        if s is None or (dynamic_only and s.long_compile):
            continue
        out.append(PerfResult(s.name, s.family, float(r.time_ms), int(r.workspace), s.id))
    # the float64 reference, recorded where a find had nothing else under its limit, serves
    # last: another record's solver wins however fast the reference timed on a tiny problem
    out.sort(key=lambda x: (x.family == "reference", x.time_ms, x.solver_id))
    return out


def candidates(problem, c: Constraints, *, dynamic_only: bool = False) -> tuple[list[Solver], Solver | None]:
    """(solvers to benchmark, the reference oracle). Raises NotSupportedError when nothing
    applicable and enabled remains, listing every solver with its reasons."""
    ref = reference_solver(problem)
    cands: list[Solver] = []
    for s in heuristic_order(problem, include_disabled=True, deterministic=c.deterministic, exclude=c.exclude):
        if SETTINGS.is_disabled(s.family):
            log.info("find: skipping %s: family %s disabled", s.name, s.family)
            continue
        if dynamic_only and s.long_compile:
            log.info("find: skipping %s: long compilation (dynamic_hybrid)", s.name)
            continue
        ws = over_limit(s, problem, c.workspace_limit)
        if ws is not None:
            log.info("find: skipping %s: workspace %d B exceeds the limit %d B", s.name, ws, c.workspace_limit)
            continue
        cands.append(s)
    real = [s for s in cands if s.family != "reference"]
    native = [s for s in real if not interpreted(s, problem)]
    if native and len(native) < len(real):
        log.info("find: not benchmarking %s: Triton interpreter on CPU (testing only)",
                 ", ".join(s.name for s in real if interpreted(s, problem)))
    if native:
        return native, ref
    if real:
        return real, ref
    if cands:
        return cands[:1], None
    raise not_applicable_error(problem, workspace_limit=c.workspace_limit, deterministic=c.deterministic)


# When find's correctness check last changed: a "wrong" verdict recorded before it is checked
# again (2026-12-03: numerics.rel_error judges an output that vanishes in exact arithmetic at its
# siblings' scale; before, the CPU flash backward solvers were recorded wrong on dq = dk = 0 and
# the call fell back to the float64 reference for good)
CHECK_REVISED = datetime(2026, 12, 3, 13, 0, tzinfo=UTC).timestamp()


def missing(problem, c: Constraints, dynamic_only: bool = False, db: finddb.FindDb | None = None) -> list[Solver]:
    """Candidates of `problem` (find's, under `c`) that its find-db record (the user db's,
    or `db`'s) never considered: registered or enabled since its find, or recorded "wrong"
    by a check older than CHECK_REVISED. Solvers that are not
    candidates now (not applicable, disabled, over the workspace limit, not deterministic
    when asked, Triton in the interpreter, the reference) are never missing. Empty when the
    db holds no record of the problem (a full find is due then, not an incremental one)."""
    db, key = db or finddb.user_db(), finddb.db_key(problem, c.deterministic)
    try:
        recs = db.lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, key)
        if not recs:
            return []
        seen = db.considered(c.fingerprint, finddb.SOLVER_SET_VERSION, key)
    except Exception as e:  # the db is a cache: unreadable means nothing to add
        log.debug("find: cannot read the considered solvers of %s: %s", key, e)
        return []
    stale = {r.solver_id for r in recs if r.status == "wrong" and r.timestamp < CHECK_REVISED}
    seen = ((seen or frozenset()) | {r.solver_id for r in recs}) - stale
    try:
        cands, _ = candidates(problem, c, dynamic_only=dynamic_only)
    except NotSupportedError:
        return []
    return [s for s in cands if s.id not in seen and s.family != "reference" and not interpreted(s, problem)]


def adopt_system_record(problem, c: Constraints) -> bool:
    """Copy the system db's record of `problem` (its solvers' times and what its find
    considered) into the user db, so that an incremental find can add the solvers the
    shipped db predates (they are timed with the record's fastest, on this machine). False
    when there is no system record or the user db already has one."""
    sysdb, key = finddb.system_db(), finddb.db_key(problem, c.deterministic)
    if sysdb is None:
        return False
    user = finddb.user_db()
    try:
        if user.lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, key):
            return False
        recs = sysdb.lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, key)
        if not recs:
            return False
        seen = sysdb.considered(c.fingerprint, finddb.SOLVER_SET_VERSION, key) or frozenset()
        user.merge_problem(c.fingerprint, finddb.SOLVER_SET_VERSION, key, recs, seen)
    except Exception as e:  # the dbs are caches: then a full find runs instead
        log.warning("find: could not adopt the system record of %s: %s", problem.key(), e)
        return False
    return True


def find(problem, prepare: Prepare, c: Constraints, *, tensors=None, exhaustive: bool = False,
         refind: bool = False, dynamic_only: bool = False, record: bool = True,
         progress: Progress | None = None, timer: Timer | None = None) -> list[PerfResult]:
    """Benchmark the applicable solvers of `problem` under the constraints `c` (the device's
    find-db fingerprint, workspace limit, determinism, excluded solvers); PerfResults
    fastest first (see module doc). exhaustive: benchmark every candidate (no
    NNPRIM_FIND_MAX_CANDIDATES cut) with more repeats. `timer`: the clock of the timed
    rounds (tests pass a fake one; see timing.Timer)."""
    key = finddb.db_key(problem, c.deterministic)
    if not refind:
        hit = from_db(problem, c, dynamic_only)
        if hit:
            new = missing(problem, c, dynamic_only)
            if not new:
                log.info("find: find-db hit for %s: %s %.4f ms", problem.key(), hit[0].solver, hit[0].time_ms)
                return hit
            return _add_missing(problem, prepare, c, hit, new, tensors, exhaustive, dynamic_only, record,
                                progress, timer)
    results, records, considered = _benchmark(problem, prepare, c, tensors, exhaustive, dynamic_only, progress,
                                              timer)
    if record and records:
        try:
            db = finddb.user_db()
            redone = {r.solver_id for r in records}

            def skipped(r: finddb.Record) -> bool:
                """Recorded, and left out of this find by its own constraints: kept. The
                long-compile solvers dynamic_hybrid skips; those over a workspace limit
                tighter than the one they were timed under (a find with workspace_limit=0
                once erased the faster solvers' records and the default calls' choice)."""
                if dynamic_only and not refind and getattr(REGISTRY.find_id(r.solver_id), "long_compile", False):
                    return True
                return c.workspace_limit is not None and r.workspace > c.workspace_limit
            kept = [r for r in db.lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, key)
                    if r.solver_id not in redone and skipped(r)]
            records = records + kept
            considered = considered + [r.solver_id for r in kept]
            db.replace_problem(c.fingerprint, finddb.SOLVER_SET_VERSION, key, records, considered=considered)
        except Exception as e:  # the db is a cache: a failure to record must not fail find
            log.warning("find: could not record results for %s: %s", problem.key(), e)
    log.info("find: selected %s: %.4f ms, workspace %d B", results[0].solver, results[0].time_ms,
             results[0].workspace_bytes)
    return results


def _add_missing(problem, prepare: Prepare, c: Constraints, hit: list[PerfResult], new: list[Solver], tensors,
                 exhaustive, dynamic_only, record, progress, timer) -> list[PerfResult]:
    """Time the `new` solvers of a recorded problem with the record's fastest, merge them into
    the record, and rank the merged record (see the module doc, 1.)."""
    log.info("find: %s: timing %s, added since its record (with the recorded fastest %s)", problem.key(),
             ", ".join(s.name for s in new), hit[0].solver)
    only = {s.id for s in new} | {hit[0].solver_id}
    results, records, considered = _benchmark(problem, prepare, c, tensors, exhaustive, dynamic_only, progress,
                                              timer, only=only)
    if record:
        try:
            finddb.user_db().merge_problem(c.fingerprint, finddb.SOLVER_SET_VERSION,
                                           finddb.db_key(problem, c.deterministic), records, considered)
        except Exception as e:
            log.warning("find: could not record results for %s: %s", problem.key(), e)
    by_id = {r.solver_id: r for r in hit}
    for rec in records:  # this run's outcome replaces the recorded one (a failure drops it)
        by_id.pop(rec.solver_id, None)
    by_id.update({r.solver_id: r for r in results})
    # the reference last, as _from_records ranks it (a record left by a find under workspace_limit=0,
    # or with every family disabled, held only the reference: it won on time against the new)
    merged = sorted(by_id.values(), key=lambda r: (r.family == "reference", r.time_ms, r.solver_id))
    if not merged:  # the recorded fastest failed now and nothing new ran: the record as it was
        return hit
    log.info("find: selected %s after adding %d solver(s): %.4f ms", merged[0].solver, len(new), merged[0].time_ms)
    return merged


def _benchmark(problem, prepare: Prepare, c: Constraints, tensors, exhaustive, dynamic_only, progress, timer,
               only: set[int] | None = None):
    """(results fastest first, records, ids of every candidate considered). `only`: time just
    these of the candidates (an incremental find: no reference fallback, no error when none
    succeeds)."""
    t_start = time.perf_counter()
    cands, ref = candidates(problem, c, dynamic_only=dynamic_only)
    considered = [s.id for s in cands]
    if only is not None:
        cands = [s for s in cands if s.id in only]
    if SETTINGS.find_max_candidates is not None and not exhaustive and len(cands) > SETTINGS.find_max_candidates:
        log.info("find: benchmarking the first %d of %d candidates (NNPRIM_FIND_MAX_CANDIDATES)",
                 SETTINGS.find_max_candidates, len(cands))
        cands = cands[:SETTINGS.find_max_candidates]
    dev = problem.device
    budget = SETTINGS.budget_ms(dev) * (4 if exhaustive else 1)
    repeats = SETTINGS.repeats(dev) * (3 if exhaustive else 1)
    tol = tolerance(problem.dtype)
    args = tensors if tensors is not None else random_args(problem)
    key, ckey, now = finddb.db_key(problem, c.deterministic), problem.class_key(), time.time()

    def rec(s: Solver, t: float | None, status: str) -> finddb.Record:
        return finddb.Record(c.fingerprint, finddb.SOLVER_SET_VERSION, key, ckey, s.id, s.name, s.family, t,
                             _workspace(s, problem), status, now)

    ref_out, check_args = None, args
    if ref is not None and any(s is not ref for s in cands):
        if reference_affordable(problem):
            # the check runs on random inputs: the caller's tensors may hold anything (the
            # uninitialised gradients of make_graphed_callables' warm-up, huge values) where
            # a correct solver and the float64 reference part by overflow and look wrong
            try:
                check_args = args if tensors is None else random_args(problem)
                ref_out = prepare(ref)(check_args)
            except (MemoryError, torch.cuda.OutOfMemoryError) as e:
                # the check is find's own extra: without it the candidates are timed unchecked
                # (their tests check them), never the caller's call failing for it
                log.warning("find: the float64 check of %s ran out of memory (%s); candidates are timed "
                            "unchecked", key, type(e).__name__)
                ref_out, check_args = None, args
                if dev == "cuda":
                    torch.cuda.empty_cache()
        else:
            log.info("find: %s too large for the float64 check (%.3g FLOP); candidates are timed unchecked "
                     "(their tests check them)", key, problem.flops())

    records: list[finddb.Record] = []
    invokers: dict[int, Invoker] = {}
    out_of_memory: BaseException | None = None
    # the budget bounds the candidates' runs, not one-time builds: compiling (prepare, first
    # calls: JIT kernels, native libraries) is left out of it, or a cold cache would spend it on
    # the first candidate's build and record that one alone (the README's CPU run, 2026-12-02:
    # a native build took the 2 s budget and brgemm was chosen unmeasured against Winograd, 1.5x)
    t_prep = time.perf_counter()
    for s in cands:  # prepare (compile) everything first
        try:
            invokers[s.id] = prepare(s)
        except Exception as e:
            log.warning("find: %s failed to prepare for %s: %s: %s", s.name, key, type(e).__name__, e)
            records.append(rec(s, None, "failed"))

    builds_ms = (time.perf_counter() - t_prep) * 1e3

    def spent_ms() -> float:
        return (time.perf_counter() - t_start) * 1e3 - builds_ms

    # checked first runs: correctness against the reference, and a warm time for the budget
    live: list[tuple[Solver, float]] = []
    todo = [s for s in cands if s.id in invokers]
    for i, s in enumerate(todo):
        if live and spent_ms() >= budget:
            log.info("find: budget of %.0f ms spent; %d candidates not benchmarked", budget, len(todo) - i)
            break
        inv = invokers[s.id]
        outcome = "ok"
        try:
            t1, out = once_ms(lambda inv=inv: inv(check_args), dev)
            if ref_out is not None:
                err = rel_error(out, ref_out)
                if not err <= tol:
                    log.warning("find: %s disagrees with the reference on %s: relative error %.3g > %.0e; "
                                "recorded as wrong, never selected", s.name, key, err, tol)
                    records.append(rec(s, t1, "wrong"))
                    outcome = "wrong"
                    continue
            del out
            t2, out = once_ms(lambda inv=inv: inv(args), dev)  # the first run included compilation
            del out
            builds_ms += max(0.0, t1 - t2)
            live.append((s, min(t1, t2)))
        except (MemoryError, torch.cuda.OutOfMemoryError) as e:
            # not a property of the solver but of this moment's free memory (other processes,
            # the caller's tensors): no record, so that the next find (incremental, `missing`)
            # times it again instead of a stored "failed" ruling it out for good
            outcome = "failed"
            log.warning("find: %s ran out of memory on %s (%s); skipped, not recorded", s.name, key,
                        type(e).__name__)
            out_of_memory = e
            considered.remove(s.id)
            if dev == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:
            outcome = "failed"
            log.warning("find: %s failed on %s: %s: %s; skipped", s.name, key, type(e).__name__, e)
            records.append(rec(s, None, "failed"))
        finally:
            if progress is not None:
                progress(i + 1, len(todo), s.name, outcome)

    ws = max((_workspace(s, problem) for s, _ in live), default=0)
    flush = l2_flusher(dev) if live and l2_policy(problem, ws) == "cold" else None
    times = _rounds(live, invokers, args, dev, repeats, budget - spent_ms(), flush=flush, timer=timer)
    results = []
    for (s, _), t in zip(live, times):
        log.info("find: %s (id %d, %s): %.4f ms", s.name, s.id, s.family, t)
        records.append(rec(s, t, "ok"))
        results.append(PerfResult(s.name, s.family, t, _workspace(s, problem), s.id))

    if only is not None:
        results.sort(key=lambda r: (r.time_ms, r.solver_id))
        return results, records, considered
    if not results and out_of_memory is not None:
        # the float64 reference would need more memory still, and a record of it would make
        # this moment's shortage the problem's choice for good: the call fails as torch's would
        raise out_of_memory
    if not results and ref is not None and not SETTINGS.is_disabled(ref.family) and ref not in todo:
        log.warning("find: no candidate succeeded for %s; falling back to the reference %s", key, ref.name)
        t, _ = once_ms(lambda: prepare(ref)(args), dev)
        records.append(rec(ref, t, "ok"))
        results.append(PerfResult(ref.name, ref.family, t, _workspace(ref, problem), ref.id))
    if not results:
        lines = [f"find: no solver succeeded for {key}:"]
        lines += [f"  {r.solver_name} (id {r.solver_id}, {r.family}): {r.status}" for r in records]
        raise NotSupportedError("\n".join(lines))
    results.sort(key=lambda r: (r.time_ms, r.solver_id))
    return results, records, considered


def _rounds(live: list[tuple[Solver, float]], invokers: dict[int, Invoker], args, dev: str, repeats: int,
            left_ms: float, *, flush=None, timer: Timer | None = None) -> list[float]:
    """Interleaved robust times of the live candidates; every one within CLOSE_CALL of the
    fastest is measured again with 3x the rounds, interleaved with the fastest (while the
    budget allows), and those times replace the first ones."""
    if not live:
        return []
    fns = [lambda inv=invokers[s.id]: inv(args) for s, _ in live]
    firsts = [t for _, t in live]
    if len(live) == 1:
        return firsts  # a lone candidate: nothing to rank
    t0 = time.perf_counter()
    times = interleaved_ms(fns, dev, rounds=repeats, budget_ms=max(left_ms, 0.0), first_ms=firsts, flush=flush,
                           timer=timer)
    left_ms -= (time.perf_counter() - t0) * 1e3
    best = min(times)
    close = [i for i, t in enumerate(times) if t <= best * (1 + CLOSE_CALL)]
    if len(close) >= 2 and left_ms > 0:
        again = interleaved_ms([fns[i] for i in close], dev, rounds=3 * repeats, warmup=0, budget_ms=left_ms,
                               first_ms=[times[i] for i in close], flush=flush, timer=timer)
        for i, t in zip(close, again):
            times[i] = t
    return times


def _workspace(s: Solver, problem) -> int:
    try:
        return int(s.workspace_size(problem))
    except Exception:
        return 0
