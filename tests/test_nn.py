"""nnprim.nn modules: dropout seeds under torch.compile (no graph break for a host value,
a fresh mask per call); on CUDA, CUDA-graph replays in tests/gpu/test_integration_gpu.py."""
import torch
import torch._dynamo.testing

import nnprim


def test_attention_dropout_compiles_without_a_graph_break():
    torch.manual_seed(0)
    attn = nnprim.nn.Attention(32, num_heads=4, num_kv_heads=2, dropout=0.3).train()
    x = torch.randn(2, 5, 32)
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(attn, backend=counter, fullgraph=True)   # a graph break raises here
    y1, y2 = f(x), f(x)
    assert counter.frame_count == 1
    assert not torch.equal(y1, y2)                              # a new seed per call
    y1.sum().backward()
    assert attn.q_proj.weight.grad is not None and torch.isfinite(attn.q_proj.weight.grad).all()


def test_attention_dropout_eager_is_reproducible_under_manual_seed():
    attn = nnprim.nn.Attention(32, num_heads=4, num_kv_heads=2, dropout=0.3).train()
    x = torch.randn(2, 5, 32)
    torch.manual_seed(1)
    a = attn(x)
    torch.manual_seed(1)
    assert torch.equal(a, attn(x))
    assert torch.equal(attn.eval()(x), attn(x))                 # eval: no dropout
