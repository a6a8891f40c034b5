"""Host time (enqueue, no sync) of a 1x1 convolution's calls on the GPU: torch's mm and
conv2d against nnprim's public call with gemm_1x1_fwd / implicit_gemm_fwd forced and the
gemm_1x1 invoker alone; then a cProfile of the forced public call. Prints a table."""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gluon_bench_common import host_us  # noqa: E402

import nnprim  # noqa: E402
from nnprim.args import ConvArgs  # noqa: E402
from nnprim.conv import pointwise_blas as pb  # noqa: E402
from nnprim.problems.conv import ConvProblem  # noqa: E402

CL = torch.channels_last


def main() -> None:
    x = torch.randn(2, 256, 14, 14, device="cuda").bfloat16().to(memory_format=CL)
    w = torch.randn(128, 256, 1, 1, device="cuda").bfloat16().to(memory_format=CL)
    x2, w2 = x.permute(0, 2, 3, 1).reshape(-1, 256), w.reshape(128, 256)
    o = torch.empty(x2.shape[0], 128, device="cuda", dtype=torch.bfloat16)
    p = ConvProblem.create("fwd", tuple(x.shape), tuple(w.shape), dtype=torch.bfloat16, layout="nhwc", device="cuda")
    plan, args = pb.Plan(p), ConvArgs(x=x, w=w)
    calls = {
        "torch x2 @ w2.t()": lambda: x2 @ w2.t(),
        "torch.mm(out=)": lambda: torch.mm(x2, w2.t(), out=o),
        "F.conv2d (cuDNN)": lambda: F.conv2d(x, w),
        "gemm_1x1 invoker": lambda: plan(args),
        "api gemm_1x1_fwd": lambda: nnprim.conv_forward(x, w, solver="gemm_1x1_fwd"),
        "api implicit_gemm_fwd": lambda: nnprim.conv_forward(x, w, solver="implicit_gemm_fwd"),
        "api default": lambda: nnprim.conv_forward(x, w),
    }
    for fn in calls.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(3):
        for name, fn in calls.items():
            print(f"{name:<24} {host_us(fn, 200):7.1f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        nnprim.conv_forward(x, w, solver="gemm_1x1_fwd")
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue())


if __name__ == "__main__":
    main()
