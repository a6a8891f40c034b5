"""Test-only solvers (ids >= 1000) with known behaviour: cost (sleep), raising,
wrong results, MemoryError, large workspace, long compilation, estimates.

Imported by tests/search/conftest.py and by the subprocesses the db tests start."""
from __future__ import annotations

import time

import torch

from nnprim.conv.reference import reference
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search import context, finddb
from nnprim.search.modes import SETTINGS
from nnprim.search.solver import REGISTRY, Solver

# real families hidden during these tests so that only the test solvers (and the
# reference, find's oracle) are candidates
REAL_FAMILIES = ("gemm", "direct", "winograd", "implicit_gemm", "fft", "flash", "decode")

PROBLEM = ConvProblem.create("fwd", (1, 2, 5, 5), (3, 2, 3, 3), dtype=torch.float32, padding=1)


def make_solver(id_: int, name: str, *, family: str = "t_a", sleep_ms: float = 0.0, behaviour: str = "ok",
                build_ms: float = 0.0,
                workspace: int = 0, estimate: float | None = None, long_compile: bool = False,
                directions=("fwd",), dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> Solver:
    """behaviour: ok | raise | wrong | memory | nan | prepare_fails | overflow (inf outputs
    on inputs past 1e20, where a low-precision kernel would overflow and the f64 reference not).
    build_ms: the first call sleeps this much more (a JIT compile or a native build)."""

    class _TestSolver(Solver):
        primitive = "conv"

        def __init__(self) -> None:
            self.id, self.name, self.family = id_, name, family
            self.directions = frozenset(directions)
            self.dtypes = frozenset(dtypes)
            self.long_compile = long_compile
            self.calls = 0
            self.prepares = 0

        def workspace_size(self, problem) -> int:
            return workspace

        def estimate(self, problem):
            return estimate

        def prepare(self, p: ConvProblem):
            self.prepares += 1
            if behaviour == "prepare_fails":
                raise RuntimeError(f"{name}: cannot compile")

            cache = {}

            def invoke(args):
                self.calls += 1
                if build_ms and self.calls == 1:
                    time.sleep(build_ms / 1000)
                if sleep_ms:
                    time.sleep(sleep_ms / 1000)
                if behaviour == "raise":
                    raise RuntimeError(f"{name}: kernel launch failed")
                if behaviour == "memory":
                    raise MemoryError(f"{name}: out of memory")
                key = id(args)  # the f64 reference once per inputs: timing is the sleep
                if key not in cache:
                    cache.clear()
                    cache[key] = (args, reference(p, args))
                y = cache[key][1]
                if behaviour == "wrong":
                    y = y * 1.01 + 0.1
                if behaviour == "overflow" and args.x.abs().max() > 1e20:
                    y = torch.full_like(y, float("inf"))
                if behaviour == "nan":
                    y = y.clone()
                    y.view(-1)[0] = float("nan")
                return to_layout(y.to(p.out_dtype), p.layout)
            return invoke

    return _TestSolver()


class SolverSet:
    """Registers test solvers; `remove_all` unregisters them."""

    def __init__(self) -> None:
        self.added: list[Solver] = []

    def add(self, id_: int, name: str, **kw) -> Solver:
        s = make_solver(id_, name, **kw)
        REGISTRY.add(s)
        self.added.append(s)
        context.reset()
        return s

    def remove_all(self) -> None:
        for s in self.added:
            if REGISTRY.find_id(s.id) is s:
                REGISTRY.remove(s)
        self.added.clear()
        context.reset()


def reset_search_state() -> None:
    """Fresh settings (from the environment), caches and db handles."""
    SETTINGS.reload()
    context.reset()
    finddb.forget_dbs()


def run(problem, args, solver=None):
    """Run a problem without tensors of its own device (the CPU tests' context)."""
    return context.for_problem(problem).run(problem, args, solver)


def resolve(problem, solver=None):
    return context.for_problem(problem).resolve(problem, solver)


def chosen(problem):
    """The Bound (solver, invoker) the context chose for `problem`."""
    return context.for_problem(problem).chosen[problem]
