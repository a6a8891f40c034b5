"""nnprim.nn modules: what differs from torch's own under CUDA-graph capture."""
import warnings

import torch

import nnprim
from nnprim import nn as nnp


def test_attention_dropout_warns_inside_capture(monkeypatch):
    """Where its dropout seed is an int drawn on the host (not a CUDA tensor's eager call: there
    the seed is a device seed, tests/gpu/test_integration_gpu.py) a captured graph would
    replay one mask."""
    torch.manual_seed(0)
    attn = nnprim.nn.Attention(32, num_heads=4, num_kv_heads=2, dropout=0.1).train()
    x = torch.randn(2, 5, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn(x)                              # not capturing: no warning
    monkeypatch.setattr(nnp, "capturing", lambda device: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attn(x)
        attn.eval()(x)                       # eval: no dropout, no warning
    msgs = [str(w.message) for w in caught if "CUDA-graph capture" in str(w.message)]
    assert len(msgs) == 1 and "same positions" in msgs[0]
