"""What the decode solvers' interpreter tests share: small random cases, poisoned launcher
buffers (a sentinel, so unwritten elements show) and the comparison of (o, lse) with the
float64 reference (dequantise then attend)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from nnprim.args import AttnArgs
from nnprim.attention import decode
from nnprim.attention.decode import DecodeConfig
from nnprim.attention.reference import reference_forward
from nnprim.problems.attention import AttentionProblem

SENTINEL = 1234.5
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
SMALL = DecodeConfig(block_n=16, block_m=16, num_warps=4, num_stages=1)


def poison_buffers(monkeypatch) -> None:
    """Fill o, lse and the split partials with SENTINEL before the kernels write them."""
    monkeypatch.setattr(decode, "_empty", lambda shape, dtype, device: torch.full(shape, SENTINEL, dtype=dtype,
                                                                                   device=device))


def make_case(B=2, Hq=4, Hkv=1, Sq=1, Sk=37, D=16, Dv=None, dtype=torch.float16, seed=0):
    """Random q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv)."""
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, Dv, generator=g).to(dtype)
    return q, k, v


def check_decode(q, k, v, run: Callable, solver_id: int, kernel_kv=None, **opts):
    """run(problem, args) -> (o, lse) for solver `solver_id` (asserted applicable), on
    `kernel_kv` = (k, v) when given, compared with reference_forward on (k, v): no sentinel
    left, o within TOL, lse within 2e-3 (f32: 1e-5) relative, fully masked rows -inf with o
    NaN (0 with softmax_inf_as_zero). Returns (problem, o, lse)."""
    opts.setdefault("return_lse", True)
    call = {n: opts[n] for n in ("attn_mask", "scale", "seed", "offset", "kv_lens") if n in opts}
    problem = AttentionProblem.from_tensors(q, k, v, **opts)
    from nnprim.search.solver import REGISTRY
    solver = REGISTRY.get(solver_id)
    assert solver.is_applicable(problem), solver.not_supported_reasons(problem)
    args = AttnArgs(q=q, k=k, v=v, **call)
    kargs = args if kernel_kv is None else AttnArgs(q=q, k=kernel_kv[0], v=kernel_kv[1], **call)
    o, lse = run(problem, kargs)
    ro, rlse = reference_forward(problem, args)
    assert o.dtype == q.dtype and o.shape == ro.shape
    assert not (o == SENTINEL).any() and not (lse == SENTINEL).any()
    dead = torch.isneginf(rlse)
    live = ~dead
    if live.any():
        err = (o.double()[live] - ro[live]).norm() / ro[live].norm()
        assert err < TOL[q.dtype], f"o rel err {err:.3g}"
        lerr = (lse.double()[live] - rlse[live]).abs().max()
        assert lerr < (1e-5 if q.dtype == torch.float32 else 2e-3) * max(1.0, rlse[live].abs().max()), lerr
    if dead.any():
        assert torch.isneginf(lse[dead]).all()
        assert (o[dead] == 0).all() if opts.get("softmax_inf_as_zero") else o[dead].isnan().all()
    return problem, o, lse
