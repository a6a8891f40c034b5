"""Host-side (Python) cost of one GPU-convolution invoker call, with the kernel launch
stubbed out, on CPU: what the GPU waits for between back-to-back launches.

Every Triton launch is replaced by a no-op: `JITFunction.run` (the first, slow-path
launch of a prepared invoker and every launch of code that calls `kernel[grid](...)`)
returns a stand-in compiled kernel whose `run` (the cached fast path) does nothing.
Tensors are `meta` tensors of the real (ResNet-50) sizes (allocation costs about what
the CUDA caching allocator does, ~2 us; a CPU malloc of 100 MB would not); no data is
touched, so the time is argument assembly, output allocation and launch bookkeeping only (Triton's own
binder/launcher C code is not included in either case: it is skipped by the cached
fast path and stubbed in the slow path).

  TRITON_INTERPRET=0 python benchmarks/conv_host.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.runtime.jit as tjit  # noqa: E402

import nnprim.conv.direct  # noqa: E402,F401
import nnprim.conv.im2col_gemm  # noqa: E402,F401
import nnprim.conv.implicit_gemm  # noqa: E402,F401
from nnprim.args import ConvArgs  # noqa: E402
from nnprim.post_ops import Eltwise, Sum  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402


class _FakeCompiled:
    function = None
    packed_metadata = None

    @staticmethod
    def run(*args, **kwargs):
        return None


def _stub_run(self, *args, grid, warmup, **kwargs):
    return _FakeCompiled()


CASES = [
    # (label, solver, x, w, kw, fused)
    ("igemm fwd r3_3x3", "implicit_gemm_fwd", (128, 128, 28, 28), (128, 128, 3, 3), dict(padding=1), False),
    ("igemm fwd r3_3x3 +bias+sum+relu", "implicit_gemm_fwd", (128, 128, 28, 28), (128, 128, 3, 3),
     dict(padding=1), True),
    ("igemm fwd r4_1x1", "implicit_gemm_fwd", (128, 1024, 14, 14), (256, 1024, 1, 1), {}, False),
    ("igemm bwd_data r3_3x3s2", "implicit_gemm_bwd_data", (128, 128, 56, 56), (128, 128, 3, 3),
     dict(padding=1, stride=2), False),
    ("igemm bwd_weights r3_3x3", "implicit_gemm_bwd_weights", (128, 128, 28, 28), (128, 128, 3, 3),
     dict(padding=1), False),
    ("gemm fwd r4_1x1", "gemm_fwd", (128, 1024, 14, 14), (256, 1024, 1, 1), {}, False),
    ("direct fwd mbv2_dw", "direct_fwd", (128, 144, 56, 56), (144, 1, 3, 3), dict(padding=1, groups=144), False),
    ("direct bwd_weights mbv2_dw", "direct_bwd_weights", (128, 144, 56, 56), (144, 1, 3, 3),
     dict(padding=1, groups=144), False),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    tjit.JITFunction.run = _stub_run
    try:   # the cached fast path asks CUDA for the current stream: no CUDA here
        from nnprim.conv import launch
        launch._stream = lambda: 0
    except ImportError:   # the code before the planned launches
        pass
    # the GEMM of the gemm family is cuBLAS work, not host overhead: stub it as well
    from nnprim.conv import im2col_gemm
    im2col_gemm._bmm_f32 = lambda x, y: torch.empty((x.shape[0], x.shape[1], y.shape[2]), device=x.device)
    rows = []
    for label, solver, xs, ws, kw, fused in CASES:
        direction = REGISTRY.get(solver).directions
        direction = next(iter(direction))
        extra = {}
        chain = ()
        if fused:
            p0 = ConvProblem.create("fwd", xs, ws, dtype=torch.bfloat16, layout="nhwc", device="cpu", **kw)
            res = to_layout(torch.empty(p0.y_shape, dtype=torch.bfloat16, device="meta"), "nhwc")
            chain = (Sum(res, 1.0), Eltwise("relu"))
            extra = dict(has_bias=True, post_ops=tuple(o.signature() for o in chain))
        p = ConvProblem.create(direction, xs, ws, dtype=torch.bfloat16, layout="nhwc", device="cpu", **kw, **extra)
        x = to_layout(torch.empty(p.x_shape, dtype=torch.bfloat16, device="meta"), "nhwc")
        w = to_layout(torch.empty(p.w_shape, dtype=torch.bfloat16, device="meta"), "nhwc")
        dy = to_layout(torch.empty(p.y_shape, dtype=torch.bfloat16, device="meta"), "nhwc")
        bias = torch.empty(p.K, dtype=torch.bfloat16, device="meta") if fused else None
        args = ConvArgs(x=x, w=w, dy=dy, bias=bias,
                        post_ops=chain)
        inv = REGISTRY.get(solver).prepare(p)
        for _ in range(20):
            inv(args)
        best = float("inf")   # best of 20 short runs: robust to other load on the machine
        for _ in range(20):
            t = time.perf_counter()
            for _ in range(a.iters):
                inv(args)
            best = min(best, time.perf_counter() - t)
        us = best / a.iters * 1e6
        rows.append(dict(case=label, us_per_call=round(us, 2)))
        print(f"{label:36s} {us:7.2f} us/call", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"date": "2026-11-29", "machine": "cpu (2 cores)", "rows": rows},
                                          indent=1))


if __name__ == "__main__":
    main()
