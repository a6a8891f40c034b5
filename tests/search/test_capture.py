"""nnprim.search.capture: value checks that read the device are skipped while a CUDA graph
is being captured (a host read there invalidates the capture; tests/gpu runs the real one)."""
import pytest
import torch

import nnprim
from nnprim.problems import attention as attn_problems
from nnprim.problems.attention import AttentionProblem
from nnprim.search.capture import capturing


def test_cpu_is_never_capturing():
    assert capturing(torch.device("cpu")) is False


def test_kv_lens_values_not_read_while_capturing(monkeypatch):
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    bad = torch.tensor([3, 99], dtype=torch.int32)
    with pytest.raises(nnprim.BadParameterError, match="kv_lens"):
        AttentionProblem.from_tensors(q, k, v, kv_lens=bad)
    monkeypatch.setattr(attn_problems, "capturing", lambda device: True)
    p = AttentionProblem.from_tensors(q, k, v, kv_lens=bad)   # shapes still checked, values not
    assert p.Sk == 8
    with pytest.raises(nnprim.BadParameterError, match="kv_lens shape"):
        AttentionProblem.from_tensors(q, k, v, kv_lens=bad[:1])
