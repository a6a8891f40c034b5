"""The Gluon solvers' gate: import failure, the opt-in switch, the interpreter, the device."""
from nnprim import gluon_gate


def test_gate_reasons_in_order(monkeypatch):
    assert "cannot be imported (boom)" in gluon_gate.gluon_reasons("cuda", "boom")[0]
    monkeypatch.delenv("NNPRIM_GLUON", raising=False)
    assert "opt-in (NNPRIM_GLUON=1)" in gluon_gate.gluon_reasons("cuda", None)[0]
    monkeypatch.setenv("NNPRIM_GLUON", "1")
    monkeypatch.setattr(gluon_gate, "interpreting", lambda: True)
    assert "TRITON_INTERPRET=1" in gluon_gate.gluon_reasons("cuda", None)[0]
    monkeypatch.setattr(gluon_gate, "interpreting", lambda: False)
    assert "device cpu" in gluon_gate.gluon_reasons("cpu", None)[0]
