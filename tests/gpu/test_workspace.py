"""`workspace_size(problem)` of the GPU solvers against torch.cuda.max_memory_allocated: one
call of the prepared invoker (after a warm-up call: compilation, cuBLAS workspace) may
allocate its outputs plus at most the reported workspace (the caching allocator rounds each
block up to 512 bytes, and may hand out a cached block up to 1 MiB larger than asked), and
must not allocate less (a solver that under-reports breaks the workspace limit).
Run with TRITON_INTERPRET=0 (benchmarks/fuzz_gpu.sh runs it next to the fuzz)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: run with TRITON_INTERPRET=0", allow_module_level=True)

from nnprim.launch import ensure_allocator  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.problems.conv import ConvProblem  # noqa: E402
from nnprim.search.random_args import random_args  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CONV = [  # (id, direction, x, w, options)
    ("nhwc-3x3", "fwd", (8, 64, 28, 28), (64, 64, 3, 3), dict(padding=1, layout="nhwc", dtype=BF16)),
    ("nchw-s2-g2", "fwd", (4, 32, 30, 30), (32, 16, 3, 3), dict(padding=1, stride=2, groups=2, dtype=F32)),
    ("nhwc-1x1", "fwd", (8, 128, 14, 14), (256, 128, 1, 1), dict(layout="nhwc", dtype=F16, has_bias=True)),
    ("nchw-3x3", "bwd_data", (4, 32, 30, 30), (48, 32, 3, 3), dict(padding=1, dtype=BF16)),
    ("nhwc-s2", "bwd_data", (8, 64, 28, 28), (64, 64, 3, 3), dict(padding=1, stride=2, layout="nhwc", dtype=BF16)),
    ("nchw-3x3", "bwd_weights", (16, 32, 28, 28), (64, 32, 3, 3), dict(padding=1, dtype=F16)),
    ("nhwc-dw", "bwd_weights", (8, 128, 28, 28), (128, 1, 3, 3), dict(padding=1, groups=128, layout="nhwc",
                                                                      dtype=BF16)),
    ("nhwc-g8", "bwd_weights", (8, 64, 28, 28), (64, 8, 3, 3), dict(padding=1, groups=8, layout="nhwc", dtype=F32)),
    # grouped Gluon forward / backward data (the packed block-diagonal filter), 3-D
    ("nhwc-g32", "fwd", (8, 128, 28, 28), (128, 4, 3, 3), dict(padding=1, groups=32, layout="nhwc", dtype=BF16)),
    ("nhwc-g32", "bwd_data", (8, 128, 28, 28), (128, 4, 3, 3), dict(padding=1, groups=32, layout="nhwc",
                                                                    dtype=BF16)),
    ("ndhwc-3x3x3", "bwd_weights", (2, 64, 8, 28, 28), (128, 64, 3, 3, 3), dict(padding=1, layout="nhwc",
                                                                                 dtype=BF16)),
    # the long causal depthwise conv1d of issue 11: bounded workspaces
    ("long-causal-dw", "fwd", (8, 768, 8192), (768, 1, 8192), dict(padding=((8191, 0),), groups=768, dtype=BF16)),
    ("long-causal-dw", "bwd_data", (8, 768, 8192), (768, 1, 8192), dict(padding=((8191, 0),), groups=768,
                                                                        dtype=BF16)),
    ("long-causal-dw", "bwd_weights", (8, 768, 8192), (768, 1, 8192), dict(padding=((8191, 0),), groups=768,
                                                                           dtype=BF16)),
]
ATTN = [  # (id, solver, problem fields)
    ("d64", "flash_fwd", dict(B=2, Hq=8, Hkv=2, Sq=1000, Sk=1500, D=64, Dv=64, dtype=BF16, return_lse=True)),
    ("d128", "flash_bwd", dict(B=2, Hq=8, Hkv=2, Sq=1000, Sk=700, D=128, Dv=128, dtype=BF16, direction="bwd")),
    ("d160-split", "flash_bwd", dict(B=1, Hq=4, Hkv=4, Sq=600, Sk=900, D=160, Dv=160, dtype=F16, direction="bwd")),
    ("d256-split", "flash_bwd", dict(B=1, Hq=4, Hkv=1, Sq=500, Sk=500, D=256, Dv=256, dtype=BF16,
                                     direction="bwd")),
    ("d128", "flash_bwd_atomic", dict(B=2, Hq=8, Hkv=2, Sq=1000, Sk=700, D=128, Dv=128, dtype=BF16,
                                      direction="bwd")),
    ("d256", "flash_bwd_ordered", dict(B=1, Hq=4, Hkv=1, Sq=500, Sk=500, D=256, Dv=256, dtype=BF16,
                                       direction="bwd")),
    ("splits", "decode_split_k", dict(B=1, Hq=8, Hkv=1, Sq=1, Sk=65536, D=128, Dv=128, dtype=BF16)),
    ("splits-quant", "decode_split_k_quant_grouped", dict(B=2, Hq=8, Hkv=2, Sq=1, Sk=32768, D=128, Dv=128, dtype=BF16,
                                                          k_quant=("s8", 32, "g", "float16", None))),
]
SLACK = 2 * 2 ** 20


def _measure(solver, problem) -> tuple[int, int]:
    """(bytes allocated beyond the outputs at the peak of one call, reported workspace)."""
    args = random_args(problem, seed=0)
    ensure_allocator(torch.device("cuda"))            # as the search context does around calls
    inv = solver.prepare(problem)
    inv(args)                                         # compile, cuBLAS workspace, plan variants
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outs = inv(args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    outs = outs if isinstance(outs, tuple) else (outs,)
    out_bytes = sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in outs if t is not None)
    return peak - out_bytes, solver.workspace_size(problem)


def _check(solver, problem) -> None:
    measured, reported = _measure(solver, problem)
    print(f"{solver.name:<32} {problem.key()[:90]:<90} reported {reported:>12} measured {measured:>12}")
    assert measured >= reported, f"{solver.name}: allocated {measured} B < reported {reported} B"
    assert measured <= reported + SLACK + reported // 50, f"{solver.name}: allocated {measured} B > reported {reported} B"


@pytest.mark.parametrize("case", CONV, ids=[f"{c[1]}-{c[0]}" for c in CONV])
def test_conv(case):
    _, direction, x, w, kw = case
    p = ConvProblem.create(direction, x, w, device="cuda", **kw)
    solvers = [s for s in REGISTRY.for_problem(p) if s.uses_triton and s.is_applicable(p)]
    assert solvers
    for s in solvers:
        _check(s, p)


@pytest.mark.parametrize("case", ATTN, ids=[f"{c[1]}-{c[0]}" for c in ATTN])
def test_attention(case):
    _, name, fields = case
    p = AttentionProblem(**(dict(direction="fwd", device="cuda") | fields))
    s = REGISTRY.get(name)
    assert s.is_applicable(p), s.not_supported_reasons(p)
    _check(s, p)
