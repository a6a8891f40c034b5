"""Attention backward solvers at real sizes on the GPU: 111 flash_bwd (7 GEMMs), 123
flash_bwd_atomic (5 GEMMs, atomic dQ) and 124 flash_bwd_ordered (5 GEMMs, ordered dQ)
against the float64 reference, errors bounded by a multiple of torch's same-dtype error;
outputs poisoned with NaN; 111 and 124 bit-identical run to run (123's run-to-run
difference is printed); under torch.use_deterministic_algorithms the chosen backward is
deterministic. A hang here means the ordered dQ's semaphores deadlocked: run with
`timeout`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_bit_identical, assert_close, chosen_solvers

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import configs, flash_bwd, flash_bwd_atomic
from nnprim.problems.attention import AttentionProblem
from nnprim.search.solver import REGISTRY

DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16
SOLVERS = ("flash_bwd", "flash_bwd_atomic", "flash_bwd_ordered")

# (B, Hq, Hkv, Sq, Sk, D, Dv, causal, dtype)
CASES = [
    (2, 8, 2, 1024, 1024, 64, 64, "top_left", BF16),
    (1, 8, 8, 2048, 2048, 64, 64, None, F16),
    (1, 4, 4, 2048, 2048, 128, 128, None, BF16),
    (1, 8, 2, 4096, 4096, 128, 128, "bottom_right", BF16),
    (1, 4, 4, 1024, 1024, 256, 256, "top_left", BF16),
    (1, 4, 2, 2048, 2048, 256, 256, None, BF16),
    (2, 4, 2, 1000, 1531, 80, 64, "bottom_right", BF16),   # tails, Dv != D, Sq != Sk
    (1, 4, 1, 1531, 1000, 128, 128, "top_left", F16),      # Sq > Sk, MQA
]


def _id(c) -> str:
    return f"b{c[0]}h{c[1]}-{c[2]}-s{c[3]}x{c[4]}-d{c[5]}v{c[6]}-{c[7]}-{str(c[8])[6:]}"


def _torch(q, k, v, causal, do):
    """torch's SDPA (GQA by repeat) and its gradients in the tensors' dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    Sq, Sk = q.shape[2], k.shape[2]
    mask = None
    if causal is not None:
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq if causal == "bottom_right" else 0)
    F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).backward(do)
    return q.grad, k.grad, v.grad


def _setup(case):
    B, Hq, Hkv, Sq, Sk, D, Dv, causal, dt = case
    g = torch.Generator(device=DEV).manual_seed(5)
    q64 = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.float64, generator=g)
    k64 = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.float64, generator=g)
    v64 = torch.randn(B, Hkv, Sk, Dv, device=DEV, dtype=torch.float64, generator=g)
    do64 = torch.randn(B, Hq, Sq, Dv, device=DEV, dtype=torch.float64, generator=g)
    q, k, v, do = (t.to(dt) for t in (q64, k64, v64, do64))
    o, lse = nnprim.sdpa(q, k, v, causal=causal, return_lse=True)
    return (q64, k64, v64, do64), (q, k, v, do, o, lse)


def _direct(name, pb, a):
    """The solver's kernels with NaN-poisoned outputs (the invoker allocates its own)."""
    out = tuple(torch.full(t.shape, float("nan"), device=DEV, dtype=a.q.dtype) for t in (a.q, a.k, a.v))
    s = REGISTRY.get(name)
    if name == "flash_bwd":
        kw = {}
        if flash_bwd.use_split(pb):
            kw["dq_cfg"], kw["dq_split"] = configs.choose_dq(pb)
        return flash_bwd.flash_backward(pb, a, configs.choose(pb)[1], out=out, **kw)
    return flash_bwd_atomic.backward(pb, a, configs.choose_bwd_atomic(pb), ordered=s.ordered, out=out)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_backward_solvers_vs_float64(case):
    causal = case[7]
    (q64, k64, v64, do64), (q, k, v, do, o, lse) = _setup(case)
    ref = _torch(q64, k64, v64, causal, do64)
    theirs = _torch(q, k, v, causal, do)
    pb = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd")
    a = AttnArgs(q, k, v, do=do, o=o, lse=lse)
    for name in SOLVERS:
        assert REGISTRY.get(name).is_applicable(pb), (name, REGISTRY.get(name).not_supported_reasons(pb))
        ours = _direct(name, pb, a)
        for gname, x, t, r in zip(("dq", "dk", "dv"), ours, theirs, ref):
            assert_close(f"{name} {gname}", x, t, r)
        api = [nnprim.sdpa_backward(do, q, k, v, o, lse, causal=causal, solver=name)
               for _ in range(2)]
        if name == "flash_bwd_atomic":
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(*api))
            print(f"[{_id(case)}] flash_bwd_atomic run-to-run max |diff| {diff:.3g}")
        else:
            for x, y, z in zip(api[0], api[1], ours):
                assert torch.equal(x, y), f"{name}: not bit-identical run to run"
                assert torch.equal(x, z), f"{name}: API and direct launch differ"


def test_deterministic_mode_chooses_deterministic_solver_and_repeats():
    case = (2, 8, 2, 2048, 2048, 128, 128, "top_left", BF16)
    _, (q, k, v, do, _, _) = _setup(case)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = []
        for _ in range(2):
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            nnprim.sdpa(qq, kk, vv, causal="top_left").backward(do)
            grads.append((qq.grad, kk.grad, vv.grad))
        chosen = chosen_solvers()
    finally:
        torch.use_deterministic_algorithms(False)
    bwd = [s for key, s in chosen.items() if key.startswith("attn-bwd")]
    assert bwd and "flash_bwd_atomic" not in bwd, chosen
    assert all(REGISTRY.get(s).deterministic for s in bwd), chosen
    assert_bit_identical(grads)
