"""The per-device search context (MIOpen's Handle + ExecutionContext).

One `Context` per device (cpu, cuda:0, cuda:1, ...) owns everything a call needs
besides the problem: the prepared invokers, the chosen solver of each problem, the
API-level call memo, solvers that failed at run time, the device's find-db
fingerprint and workspace limit, and per-device runtime state (Triton's scratch
allocator). Solvers hold no state; nothing is process-global and set once:
`context(device)` looks the context up, `reset()` drops them all (tests).

Hot path (`Context.call`): a memo hit gives a bound (problem, solver, invoker); the
invoker runs under the device's guard. A miss validates, selects (policy.select) and
prepares once. A chosen solver that raises at run time is excluded for that problem
and the next one runs, with a warning once per problem (NNPRIM_STRICT=1 raises); a
forced solver's error propagates. Threads: every public entry may be called from any
thread; selection of one problem is serialised by a per-context lock, and Triton's
allocator (a ContextVar, unset in new threads such as autograd's backward thread) is
installed around each Triton launch."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from .. import alloc
from ..errors import BadParameterError, NotSupportedError, NumericsError, SolverUnavailableError
from . import finddb, numerics
from .capture import capturing
from .find import PerfResult
from .find import find as _find
from .immediate import Constraints, Solution
from .immediate import get_solutions as _get_solutions
from .modes import SETTINGS
from .policy import Decision, select
from .solver import REGISTRY, Invoker, Solver

log = logging.getLogger("nnprim.search")

WORKSPACE_SHARE = 0.25  # default workspace limit: this share of the device's free (CUDA) or total memory
_USER_ERRORS = (BadParameterError, NotSupportedError, NumericsError)


@dataclass
class Bound:
    """A problem bound to the solver that serves it and that solver's invoker."""
    problem: object
    solver: Solver
    invoker: Invoker
    forced: bool


def _deterministic() -> bool:
    return SETTINGS.deterministic or torch._C._get_deterministic_algorithms()  # torch.are_deterministic_...


class Context:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.index = device.index if self.is_cuda else None
        self.lock = threading.RLock()
        self.invokers: dict[tuple[str, int], Invoker] = {}
        self.calls: dict[Hashable, Bound] = {}
        self.chosen: dict[object, Bound] = {}
        self.failed: dict[str, frozenset[int]] = {}
        self.warned: set[str] = set()
        self._fingerprint: str | None = None
        self._default_limit: int | None = None
        self._deterministic = False  # the determinism the cached choices were made under
        self._allocator = None

    def __repr__(self) -> str:
        return f"<nnprim.Context {self.device}>"

    # ---- device state -------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = finddb.device_fingerprint(self.device)
        return self._fingerprint

    def workspace_limit(self) -> int:
        """Bytes a solver may allocate beyond its outputs (NNPRIM_WORKSPACE_LIMIT /
        set_workspace_limit, else WORKSPACE_SHARE of the memory free at the first call)."""
        if SETTINGS.workspace_limit is not None:
            return SETTINGS.workspace_limit
        if self._default_limit is None:
            if self.is_cuda:
                free, _ = torch.cuda.mem_get_info(self.index)
            else:
                free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self._default_limit = int(free * WORKSPACE_SHARE)
        return self._default_limit

    def constraints(self, problem) -> Constraints:
        return Constraints(self.fingerprint, self.workspace_limit(), _deterministic(),
                           self.failed.get(problem.key(), frozenset()))

    def guard(self):
        """Make this context's device current (Triton launches on the current device)."""
        if self.is_cuda and torch._C._cuda_getDevice() != self.index:
            return torch.cuda.device(self.index)
        return contextlib.nullcontext()

    def triton_allocator(self):
        """Triton's scratch allocator for this device (in-kernel TMA descriptors). Outside
        CUDA-graph capture one buffer per stream is reused (launches on a stream are
        ordered, so one kernel's scratch is free when the next starts); while capturing,
        each launch gets its own from the graph's pool."""
        if self._allocator is None:
            dev, held = self.device, {}

            def scratch(size: int, align: int, stream):
                if torch.cuda.is_current_stream_capturing():
                    return alloc.empty((size,), torch.int8, dev)
                buf = held.get(stream)
                if buf is None or buf.numel() < size:
                    buf = held[stream] = alloc.empty((max(size, 1 << 16),), torch.int8, dev)
                return buf
            self._allocator = scratch
        return self._allocator

    # ---- caches -----------------------------------------------------------------------------
    def invoker_for(self, problem, solver: Solver) -> Invoker:
        key = (problem.key(), solver.id)
        inv = self.invokers.get(key)
        if inv is None:
            with self.guard():
                inv = solver.prepare(problem)
            inv = _with_triton_runtime(self, inv) if solver.uses_triton and self.is_cuda else inv
            self.invokers[key] = inv
        return inv

    def call_path(self, problem, solver: Solver) -> Invoker:
        """What find times: the cached invoker run as a call runs it (run_bound: the device
        guard, numerics checks); errors propagate so that find records them."""
        b = Bound(problem, solver, self.invoker_for(problem, solver), True)
        return lambda args: self.run_bound(b, args)

    def clear_choices(self) -> None:
        """Forget which solver each problem uses (a settings change); invokers stay."""
        with self.lock:
            self.calls.clear()
            self.chosen.clear()

    def clear(self) -> None:
        with self.lock:
            self.invokers.clear()
            self.calls.clear()
            self.chosen.clear()
            self.failed.clear()
            self.warned.clear()

    # ---- selection --------------------------------------------------------------------------
    def bind(self, problem, solver=None, args=None) -> Bound:
        """The bound solver of `problem`: forced (`solver` name, id or Solver) or chosen by
        the find mode (a find runs on `args` when one is due)."""
        if solver is not None:
            s = REGISTRY.get(solver)
            reasons = s.reasons(problem)
            if reasons:
                raise NotSupportedError(f"solver {s.name} (id {s.id}) cannot run {problem.key()}: "
                                        + "; ".join(reasons))
            return Bound(problem, s, self.invoker_for(problem, s), True)
        self._check_determinism()
        hit = self.chosen.get(problem)
        if hit is not None:
            return hit
        with self.lock:
            hit = self.chosen.get(problem)
            if hit is None:
                hit = self._bind_chosen(problem, args)
                self.chosen[problem] = hit
        return hit

    def _bind_chosen(self, problem, args) -> Bound:
        """The chosen solver with its invoker. A plan that fails (a limit the solver's
        applicability check missed) excludes that solver for the problem, as a failed run
        does, and the next choice is planned (NNPRIM_STRICT=1 raises instead)."""
        while True:
            with self.guard():
                d = self.decide(problem, args)
            try:
                return Bound(problem, d.solver, self.invoker_for(problem, d.solver), False)
            except Exception as e:
                if SETTINGS.strict or isinstance(e, (BadParameterError, NumericsError)):
                    raise
                key = problem.key()
                self.failed[key] = self.failed.get(key, frozenset()) | {d.solver.id}
                self.warn_once(("plan", key, d.solver.id),
                               f"nnprim: solver {d.solver.name} (id {d.solver.id}) could not be planned for "
                               f"{key}: {type(e).__name__}: {e}; choosing again (NNPRIM_STRICT=1 raises instead)")

    def decide(self, problem, args=None) -> Decision:
        now_capturing = capturing(self.device)
        d = select(problem, self.constraints(problem), lambda s: self.call_path(problem, s), args=args,
                   capturing=now_capturing)
        if d.would_find:
            self.warn_once(("capture", problem.key()),
                           f"nnprim: {problem.key()} was first called during CUDA graph capture, where no find "
                           f"can run; using {d.solver.name} ({d.source}). Call it once before capturing so that "
                           "find picks the fastest solver.")
        return d

    def resolve(self, problem, solver=None) -> Solver:
        return self.bind(problem, solver).solver

    def find(self, problem, tensors=None, workspace_limit: int | None = None, *, exhaustive: bool = False,
             refind: bool = False, dynamic_only: bool = False, record: bool = True,
             progress=None, timer=None) -> list[PerfResult]:
        c = self.constraints(problem)
        if workspace_limit is not None:
            c = Constraints(c.fingerprint, workspace_limit, c.deterministic, c.exclude)
        with self.lock, self.guard():
            res = _find(problem, lambda s: self.call_path(problem, s), c, tensors=tensors,
                        exhaustive=exhaustive, refind=refind, dynamic_only=dynamic_only, record=record,
                        progress=progress, timer=timer)
            if workspace_limit is None:      # a find under another limit leaves the calls' choice be
                best = REGISTRY.get(res[0].solver_id)
                self.chosen[problem] = Bound(problem, best, self.invoker_for(problem, best), False)
                self.calls.clear()
        return res

    # ---- running ------------------------------------------------------------------------------
    def run(self, problem, args, solver=None):
        """Run `problem` on `args` with the forced or chosen solver (no call memo)."""
        return self.run_bound(self.bind(problem, solver, args), args)

    def _check_determinism(self) -> None:
        """torch.use_deterministic_algorithms may change between calls: choices made under
        the other setting no longer hold."""
        if _deterministic() is not self._deterministic:
            self.clear_choices()
            self._deterministic = not self._deterministic

    def call(self, key: Hashable, make_problem: Callable[[], object], args, solver=None):
        """The hot path: `key` memoises (problem, solver) for one call signature."""
        if (SETTINGS.deterministic or torch._C._get_deterministic_algorithms()) is not self._deterministic:
            self._check_determinism()   # (_deterministic() inlined)
        b = self.calls.get(key)
        if b is None:
            b = self.bind(make_problem(), solver, args)
            if len(self.calls) > 8192:
                self.calls.clear()
            self.calls[key] = b
        return self.run_bound(b, args)

    def run_bound(self, b: Bound, args):
        checks = SETTINGS.check_numerics and not capturing(self.device)  # the checks read values
        if checks:
            numerics.check_args(args)
        try:
            if self.is_cuda and torch._C._cuda_getDevice() != self.index:
                with torch.cuda.device(self.index):
                    out = b.invoker(args)
            else:
                out = b.invoker(args)
        except SolverUnavailableError as e:
            if b.forced or SETTINGS.strict or capturing(self.device):
                raise
            return self._fall_back(b, args, e)
        except _USER_ERRORS:
            raise
        except Exception as e:
            if b.forced or SETTINGS.strict or capturing(self.device):
                raise
            return self._fall_back(b, args, e)
        if checks:
            numerics.check_outputs(out)
        return out

    def _fall_back(self, b: Bound, args, err: Exception):
        """A chosen solver raised: exclude it for this problem, warn once, run the next."""
        p, key = b.problem, b.problem.key()
        if isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        with self.lock:
            self.failed[key] = self.failed.get(key, frozenset()) | {b.solver.id}
            self.chosen.pop(p, None)
            self.calls.clear()
        nxt = self.bind(p, None, args)
        self.warn_once(("fallback", key, b.solver.id),
                       f"nnprim: solver {b.solver.name} (id {b.solver.id}) failed on {key}: "
                       f"{type(err).__name__}: {err}; falling back to {nxt.solver.name} "
                       "(NNPRIM_STRICT=1 raises instead)")
        return self.run_bound(nxt, args)

    def warn_once(self, what: tuple, msg: str) -> None:
        if what in self.warned:
            return
        self.warned.add(what)
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)


def _with_triton_runtime(ctx: Context, inv: Invoker) -> Invoker:
    """Install the context's Triton allocator around a Triton invoker when the calling
    thread has another (Triton keeps it in a ContextVar: new threads start without)."""
    from triton.runtime import _allocation

    var = _allocation._allocator
    scratch = ctx.triton_allocator()

    def invoker(args):
        if var.get() is scratch:
            return inv(args)
        token = var.set(scratch)
        try:
            return inv(args)
        finally:
            var.reset(token)
    invoker.__wrapped__ = inv   # the solver's own invoker (its plans), for tests and diagnostics
    return invoker


# ---- the contexts --------------------------------------------------------------------------
_CONTEXTS: dict[torch.device, Context] = {}
_CONTEXTS_LOCK = threading.Lock()


def context(device) -> Context:
    """The context of a torch.device (or "cpu", "cuda", "cuda:1"); "cuda" is the current device."""
    ctx = _CONTEXTS.get(device)
    if ctx is not None:
        return ctx
    dev = torch.device(device)
    floating = dev.type == "cuda" and dev.index is None  # follows the current device: not memoised
    if floating:
        dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cuda":
        dev = torch.device(dev.type)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(dev)
        if ctx is None:
            ctx = _CONTEXTS[dev] = Context(dev)
        if not floating:
            _CONTEXTS[device] = ctx
    return ctx


def check_problem(problem) -> None:
    """The search entry points take a ConvProblem or an AttentionProblem (their from_tensors)."""
    if type(problem).__name__ not in ("ConvProblem", "AttentionProblem"):
        raise BadParameterError(f"problem={problem!r} must be a ConvProblem or an AttentionProblem "
                                "(nnprim.ConvProblem.from_tensors, nnprim.AttentionProblem.from_tensors)")


def for_problem(problem) -> Context:
    """The context a problem without tensors runs in (its device type; CUDA: the current device)."""
    check_problem(problem)
    return context(problem.device)


def contexts() -> list[Context]:
    return list({id(c): c for c in _CONTEXTS.values()}.values())


def clear_choices() -> None:
    for c in contexts():
        c.clear_choices()


def reset() -> None:
    """Drop every context (tests: a fresh process's state)."""
    with _CONTEXTS_LOCK:
        _CONTEXTS.clear()


SETTINGS.subscribe(clear_choices)


# ---- public search entry points ----------------------------------------------------------
def find(problem, tensors=None, workspace_limit: int | None = None, exhaustive: bool = False,
         count: int | None = None, **kw) -> list[PerfResult]:
    """Benchmark the applicable solvers of `problem` (see find.py); fastest first.
    `tensors`: the inputs to time on (ConvArgs / AttnArgs; random ones by default)."""
    from .find import check_limit
    limit = check_limit(workspace_limit)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise BadParameterError(f"count={count!r} must be None or a positive int")
    check_problem(problem)
    ctx = for_problem(problem) if tensors is None else context(_device_of(tensors))
    res = ctx.find(problem, tensors, limit, exhaustive=exhaustive, **kw)
    return res if count is None else res[:count]


def _device_of(args) -> torch.device:
    if not hasattr(args, "__dict__"):
        raise BadParameterError(f"tensors={args!r} must be a ConvArgs or an AttnArgs")
    for v in vars(args).values():
        if isinstance(v, torch.Tensor):
            return v.device
    raise BadParameterError("tensors holds no tensor")


def workspace_size(problem, solver) -> int:
    """Workspace bytes `solver` (name, id or Solver) needs for `problem`; error if not applicable."""
    check_problem(problem)
    s = REGISTRY.get(solver)
    reasons = s.reasons(problem)
    if reasons:
        raise NotSupportedError(f"solver {s.name} (id {s.id}) cannot run {problem.key()}: " + "; ".join(reasons))
    return int(s.workspace_size(problem))


def compile(problem, solver) -> Invoker:  # noqa: A001 - MIOpen's name (CompileSolution)
    """Prepare (compile) `solver` for `problem` ahead of time; returns the cached invoker."""
    return for_problem(problem).bind(problem, solver).invoker


def get_solutions(problem, max_count: int | None = None, *, nearest: bool = True) -> list[Solution]:
    """Immediate mode (find-db, nearest record unless `nearest=False`, else the heuristic)
    under the device's workspace limit and determinism setting; best first, at most max_count."""
    return _get_solutions(problem, max_count, nearest=nearest, constraints=for_problem(problem).constraints(problem))
