"""Solver base class and the append-only registry (MIOpen's solver registry).

A solver says which problems it serves (`not_supported_reasons`, empty = applicable),
how much workspace it needs, how long it should take (`estimate`, ms, or None when it
cannot tell), and turns a problem into an invoker (`prepare`) that the invoker cache
keeps. Ids are stable: a removed solver leaves a `Placeholder` so ids never shift."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, ClassVar

import torch

from ..errors import BadParameterError

Invoker = Callable[[Any], Any]

PRIMITIVES = ("conv", "attention")
CONV_FAMILIES = ("gemm", "direct", "winograd", "implicit_gemm", "fft", "reference")
ATTN_FAMILIES = ("flash", "decode", "reference")


def triton_usable(device: str) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    if device == "cuda":
        return True
    return device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


class Solver:
    id: ClassVar[int]
    name: ClassVar[str]
    family: ClassVar[str]
    primitive: ClassVar[str]                      # "conv" | "attention"
    directions: ClassVar[frozenset[str]]          # conv: fwd/bwd_data/bwd_weights; attention: fwd/bwd
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.float16, torch.bfloat16})
    uses_triton: ClassVar[bool] = False
    long_compile: ClassVar[bool] = False          # dynamic_hybrid skips these on a db miss
    deterministic: ClassVar[bool] = True
    paged: ClassVar[bool] = False                 # attention: serves page-pool K/V (block_table)
    # When the solver's kernel last changed enough to move its time (UTC, ISO 8601): find-db
    # records older than this no longer describe it, and the learned model leaves them out
    revised: ClassVar[str | None] = None
    # A solver whose learned prediction, times the ratio of the two solvers' estimates, prices
    # this one where it has no records of its own (a variant of that solver: 129 of 127)
    priced_as: ClassVar[int | None] = None

    @classmethod
    def revised_at(cls) -> float:
        """`revised` as a POSIX timestamp (0: never revised)."""
        if not cls.revised:
            return 0.0
        return datetime.fromisoformat(cls.revised.replace("Z", "+00:00")).timestamp()

    def not_supported_reasons(self, problem) -> list[str]:
        """Why this solver cannot run `problem` (empty list = applicable). Subclasses
        extend the list: `reasons = super().not_supported_reasons(p)`."""
        reasons = self._other_primitive(problem)
        if reasons:
            return reasons
        if problem.direction not in self.directions:
            reasons.append(f"direction {problem.direction} not in {sorted(self.directions)}")
        if problem.device not in self.devices:
            reasons.append(f"device {problem.device} not in {sorted(self.devices)}")
        elif self.uses_triton and not triton_usable(problem.device):
            reasons.append("Triton needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        if problem.dtype not in self.dtypes:
            reasons.append(f"dtype {problem.dtype} not in {sorted(str(d) for d in self.dtypes)}")
        if getattr(problem, "page_size", 0) and not self.paged:
            reasons.append("paged K/V (block_table) are not supported")
        return reasons

    def _other_primitive(self, problem) -> list[str]:
        kind = "conv" if type(problem).__name__ == "ConvProblem" else "attention"
        return [] if kind == self.primitive else [f"serves {self.primitive}, not {kind}"]

    def reasons(self, problem) -> list[str]:
        """not_supported_reasons for any problem: one of the other primitive is answered here
        (subclasses' checks read fields only their primitive's problems have; a conv call
        forcing an attention solver raised AttributeError)."""
        return self._other_primitive(problem) or self.not_supported_reasons(problem)

    def is_applicable(self, problem) -> bool:
        return not self.reasons(problem)

    def workspace_size(self, problem) -> int:
        return 0

    def estimate(self, problem) -> float | None:
        """Predicted time in ms, or None when unknown."""
        return None

    def prepare(self, problem) -> Invoker:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} {self.family}/{self.name}>"


class Placeholder(Solver):
    """Keeps a retired solver's id taken; never applicable."""

    def __init__(self, id_: int, name: str, primitive: str, family: str) -> None:
        self.id, self.name, self.primitive, self.family = id_, name, primitive, family
        self.directions = frozenset()

    def not_supported_reasons(self, problem) -> list[str]:
        return ["retired solver"]


class Registry:
    def __init__(self) -> None:
        self._by_id: dict[int, Solver] = {}
        self._by_name: dict[str, Solver] = {}

    def add(self, solver: Solver) -> Solver:
        if solver.id in self._by_id:
            raise RuntimeError(f"solver id {solver.id} taken by {self._by_id[solver.id]!r}")
        if solver.name in self._by_name:
            raise RuntimeError(f"solver name {solver.name!r} taken")
        if solver.primitive not in PRIMITIVES:
            raise RuntimeError(f"{solver!r}: primitive {solver.primitive!r}")
        fams = CONV_FAMILIES if solver.primitive == "conv" else ATTN_FAMILIES
        if solver.family not in fams and solver.id < 1000:
            raise RuntimeError(f"{solver!r}: family {solver.family!r} not in {fams}")
        self._by_id[solver.id] = solver
        self._by_name[solver.name] = solver
        return solver

    def remove(self, solver: Solver | int | str) -> None:
        """Only for tests' temporary solvers."""
        s = self.get(solver)
        del self._by_id[s.id]
        del self._by_name[s.name]

    def get(self, key: Solver | int | str) -> Solver:
        if isinstance(key, Solver):
            return key
        if isinstance(key, int) and not isinstance(key, bool):
            s = self._by_id.get(key)
        elif isinstance(key, str):
            s = self._by_name.get(key)
            if s is None and key.isdigit():
                s = self._by_id.get(int(key))
        else:
            s = None
        if s is None:
            raise BadParameterError(f"solver={key!r} is not a known solver id or name")
        return s

    def find_id(self, id_: int) -> Solver | None:
        return self._by_id.get(id_)

    def all(self, primitive: str | None = None) -> list[Solver]:
        return [s for _, s in sorted(self._by_id.items())
                if not isinstance(s, Placeholder) and (primitive is None or s.primitive == primitive)]

    def for_problem(self, problem) -> Iterable[Solver]:
        kind = "conv" if type(problem).__name__ == "ConvProblem" else "attention"
        return self.all(kind)


REGISTRY = Registry()


def register(cls: type[Solver]) -> type[Solver]:
    """Class decorator: instantiate and add to the registry."""
    REGISTRY.add(cls())
    return cls
