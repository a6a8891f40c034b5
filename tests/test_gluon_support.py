"""The Gluon solvers' shared gate: import failure, the off switch, the interpreter, the device."""
from nnprim import gluon_support


def test_gate_reasons_in_order(monkeypatch):
    monkeypatch.setattr(gluon_support, "GLUON_ERROR", "ImportError: boom")
    assert "cannot be imported (ImportError: boom)" in gluon_support.gluon_reasons("cuda")[0]
    monkeypatch.setattr(gluon_support, "GLUON_ERROR", None)
    monkeypatch.setenv("NNPRIM_GLUON", "0")
    assert "switched off (NNPRIM_GLUON=0)" in gluon_support.gluon_reasons("cuda")[0]
    monkeypatch.delenv("NNPRIM_GLUON", raising=False)   # on by default
    monkeypatch.setattr(gluon_support, "interpreting", lambda: True)
    assert "TRITON_INTERPRET=1" in gluon_support.gluon_reasons("cuda")[0]
    monkeypatch.setattr(gluon_support, "interpreting", lambda: False)
    assert "device cpu" in gluon_support.gluon_reasons("cpu")[0]


def test_solvers_carry_the_gate(monkeypatch):
    """Both Gluon solvers name the switch when it is off."""
    import torch

    from nnprim.problems.attention import AttentionProblem
    from nnprim.problems.conv import ConvProblem
    from nnprim.search.solver import REGISTRY
    monkeypatch.setattr(gluon_support, "GLUON_ERROR", None)
    monkeypatch.setenv("NNPRIM_GLUON", "0")
    a = AttentionProblem(direction="fwd", device="cuda", B=1, Hq=2, Hkv=2, Sq=64, Sk=64, D=64, Dv=64,
                         dtype=torch.bfloat16)
    c = ConvProblem.create("fwd", (1, 64, 9, 9), (64, 64, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                           padding=1, device="cuda")
    for name, p in (("gluon_flash_fwd", a), ("gluon_implicit_gemm_fwd", c)):
        assert "NNPRIM_GLUON=0" in " | ".join(REGISTRY.get(name).not_supported_reasons(p))
