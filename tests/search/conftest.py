"""Fixtures of the solver-search tests: a private cache dir per test, clean settings
and caches, and a registry of test-only solvers with the real families disabled."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from search_helpers import REAL_FAMILIES, SolverSet, reset_search_state  # noqa: E402

from nnprim.search import modes  # noqa: E402


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """Private NNPRIM_CACHE_DIR, no NNPRIM_* search settings from the environment."""
    for var in ("NNPRIM_FIND_MODE", "NNPRIM_DISABLE", "NNPRIM_STRICT", "NNPRIM_FIND_BUDGET_MS",
                "NNPRIM_FIND_MAX_CANDIDATES", "NNPRIM_FIND_REPEATS", "NNPRIM_CHECK_NUMERICS", "NNPRIM_LOG_LEVEL",
                "NNPRIM_SYSTEM_DB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NNPRIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", str(tmp_path / "no-system-db.sqlite"))
    reset_search_state()
    yield tmp_path
    monkeypatch.undo()
    reset_search_state()


@pytest.fixture
def solvers(clean):
    """Add test solvers with `solvers.add(id, name, ...)`; real families are disabled."""
    reg = SolverSet()
    modes.set_disabled(REAL_FAMILIES)
    yield reg
    reg.remove_all()
