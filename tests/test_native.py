"""nnprim.native: the reason solvers give when the native library cannot be there."""
import torch

from nnprim.conv import cpu_group_direct
from nnprim.native import ENV, NativeLibrary
from nnprim.problems.conv import ConvProblem


def test_missing_reasons_name_the_switch(monkeypatch):
    lib = NativeLibrary("nnprim_test_never_built", "// empty", "test library")
    monkeypatch.setenv(ENV, "0")
    (reason,) = lib.missing_reasons()
    assert "test library" in reason and f"{ENV}=0" in reason
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(lib, "expected", lambda: True)
    assert lib.missing_reasons() == []


def test_solver_not_applicable_when_switched_off(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    p = ConvProblem.create("fwd", (1, 8, 8, 8), (8, 4, 3, 3), dtype=torch.float32, groups=2)
    reasons = cpu_group_direct.CpuGroupDirectFwd().not_supported_reasons(p)
    assert any(ENV in r for r in reasons), reasons
