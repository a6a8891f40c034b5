"""Ahead-of-time work for a model's first step: list the problems it calls, compile every
candidate solver of each (in parallel processes on a GPU: Triton compiles one kernel per
process at a time, and they share Triton's on-disk cache), then find each one so that
the find-db answers the model's first real call.

    probs = nnprim.warmup.problems_of(lambda m, x: m(x).sum(), model, x)   # fake tensors: no GPU work
    nnprim.warmup.warmup(probs, workers=8)
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import torch

log = logging.getLogger("nnprim.warmup")

_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar("nnprim_recorder", default=None)


def note(problem) -> None:
    """Called by the ops' validators with every problem they build."""
    rec = _RECORDER.get()
    if rec is not None:
        rec.append(problem)


@contextlib.contextmanager
def record_problems() -> Iterator[list]:
    """Collect the problems validated inside the block (in call order, repeats included)."""
    rec: list = []
    token = _RECORDER.set(rec)
    try:
        yield rec
    finally:
        _RECORDER.reset(token)


def _unique(problems: Iterable) -> list:
    seen, out = set(), []
    for p in problems:
        if p.key() not in seen:
            seen.add(p.key())
            out.append(p)
    return out


def problems_of(step: Callable, module: torch.nn.Module, *inputs, backward: bool = True) -> list:
    """The distinct problems `step(module, *inputs)` (returning a loss) calls, forward and,
    with `backward`, backward: traced on fake tensors, so nothing runs on the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_state = {n: mode.from_tensor(t, static_shapes=True) for n, t in state.items()}
        for n, t in state.items():
            if isinstance(t, torch.nn.Parameter):
                fake_state[n].requires_grad_(t.requires_grad)
        fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        with record_problems() as rec:
            def run(*xs):
                return step(_Bound(module, fake_state), *xs)
            loss = run(*fake_inputs)
            params = [t for t in fake_state.values() if t.requires_grad]
            if backward and params:
                torch.autograd.grad(loss, params, allow_unused=True)
    return _unique(rec)


class _Bound:
    """module(*args) with the module's parameters and buffers replaced (functional_call)."""

    def __init__(self, module: torch.nn.Module, state: dict) -> None:
        self.module, self.state = module, state

    def __call__(self, *args, **kw):
        return torch.func.functional_call(self.module, self.state, args, kw)


class Progress:
    """One stderr line redrawn in place: `label i/n [#####     ] elapsed item` (no dependency)."""

    def __init__(self, label: str, total: int, enabled: bool = True, file=None, width: int = 24) -> None:
        self.label, self.total, self.enabled, self.width = label, max(total, 1), enabled, width
        self.file = file or sys.stderr
        self.t0 = time.perf_counter()
        self.done = 0

    def step(self, item: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        fill = self.width * self.done // self.total
        bar = "#" * fill + " " * (self.width - fill)
        print(f"\r{self.label} {self.done}/{self.total} [{bar}] {time.perf_counter() - self.t0:6.1f}s {item[:40]:<40}",
              end="", file=self.file, flush=True)

    def close(self) -> None:
        if self.enabled and self.done:
            print(file=self.file, flush=True)


def compile_solvers(problems: list, device: str = "cuda") -> tuple[int, int]:
    """Run every applicable, enabled, non-reference solver of each problem once on random
    inputs (so their kernels compile into Triton's cache); (runs, failures)."""
    from .search.context import for_problem
    from .search.random_args import random_args
    from .search.ranking import heuristic_order
    runs = failures = 0
    for p in problems:
        ctx = for_problem(p)
        args = None
        for s in heuristic_order(p):
            if s.family == "reference":
                continue
            try:
                args = args or random_args(p)
                ctx.invoker_for(p, s)(args)
                runs += 1
            except Exception as e:  # find records it; here it only costs the compile
                failures += 1
                log.info("warmup: %s on %s: %s: %s", s.name, p.key(), type(e).__name__, e)
    if device == "cuda":
        torch.cuda.synchronize()
    return runs, failures


def _worker(problems: list) -> tuple[int, int]:
    return compile_solvers(problems)


def warmup(problems: Iterable, *, workers: int | None = None, find: bool = True,
           progress: bool = True) -> dict:
    """Compile (in `workers` processes on a GPU; default min(8, problems)) and find every
    problem, with a progress line on stderr; returns timings. The find-db then answers the
    model's calls, and Triton's cache (under the nnprim cache dir) holds the kernels."""
    from .search.context import find as run_find
    problems = _unique(problems)
    t0 = time.perf_counter()
    cuda = any(p.device == "cuda" for p in problems)
    workers = min(8, len(problems)) if workers is None else workers
    runs = failures = 0
    bar = Progress("nnprim warmup: compile", len(problems), progress)
    if cuda and workers > 1:
        with mp.get_context("spawn").Pool(workers) as pool:  # one task a problem: progress as each ends
            for r, f in pool.imap_unordered(_worker, [[p] for p in problems]):
                runs, failures = runs + r, failures + f
                bar.step()
    else:
        for p in problems:
            r, f = compile_solvers([p], "cuda" if cuda else "cpu")
            runs, failures = runs + r, failures + f
            bar.step(p.key())
    bar.close()
    t1 = time.perf_counter()
    if find:
        bar = Progress("nnprim warmup: find   ", len(problems), progress)
        for p in problems:
            res = run_find(p)
            bar.step(res[0].solver)
        bar.close()
    t2 = time.perf_counter()
    return dict(problems=len(problems), compile_runs=runs, compile_failures=failures,
                compile_s=round(t1 - t0, 2), find_s=round(t2 - t1, 2))
