"""NCHW convolution through the NHWC kernels (issue 13): the layout copies alone (torch's
channels-last copy against nnprim's Triton transpose, layout_copy.py) and the suite's NCHW
problem (rn50_r3_3x3_nchw) through the public API with each applicable solver forced, against
cuDNN's NCHW convolution in the same run (cudnn.benchmark=True), bf16, all three directions.

    PYTHONUNBUFFERED=1 python benchmarks/nchw_probe.py --out $OUT/nchw_probe.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv.layout_change import LayoutChangePlan, inner_solver
from nnprim.conv.layout_copy import Transpose, to_nchw, to_nhwc
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=80, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=128)
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    N, C, H, W, K = a.n, 128, 28, 28, 128
    x = torch.randn(N, C, H, W, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(K, C, 3, 3, device="cuda") / 34).to(torch.bfloat16)
    res = {"copies": {}, "api": {}}
    nbytes = 2 * x.numel() * 2
    xl = to_nhwc(x)
    # the planned copies the solvers hold (to_nhwc / to_nchw plan a new one per call: host-bound)
    t_nhwc, t_nchw = Transpose(tuple(x.shape), "nhwc"), Transpose(tuple(x.shape), "nchw")
    for name, fn in (("torch_to_nhwc", lambda: x.contiguous(memory_format=torch.channels_last)),
                     ("triton_to_nhwc", lambda: t_nhwc(x)),
                     ("torch_to_nchw", lambda: xl.contiguous()),
                     ("triton_to_nchw", lambda: t_nchw(xl))):
        ms = bench(fn)
        res["copies"][name] = dict(ms=round(ms, 4), tbs=round(nbytes / ms / 1e9, 2))
    assert torch.equal(to_nhwc(x), x) and torch.equal(to_nchw(xl), x)
    y = F.conv2d(x, w, padding=1)
    dy = torch.randn_like(y)
    bw = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    peers = {"fwd": lambda: F.conv2d(x, w, padding=1),
             "bwd_data": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw, [True, False, False]),
             "bwd_weights": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw, [False, True, False])}
    calls = {"fwd": lambda s: nnprim.conv_forward(x, w, padding=1, solver=s),
             "bwd_data": lambda s: nnprim.conv_backward_data(dy, w, tuple(x.shape), padding=1, solver=s),
             "bwd_weights": lambda s: nnprim.conv_backward_weights(dy, x, tuple(w.shape), padding=1, solver=s)}
    for d in ("fwd", "bwd_data", "bwd_weights"):
        p = ConvProblem.create(d, tuple(x.shape), tuple(w.shape), dtype=torch.bfloat16, layout="nchw",
                               device="cuda", padding=1)
        row = {"cudnn_ms": round(bench(peers[d]), 4)}
        for s in REGISTRY.for_problem(p):
            if s.family == "reference" or not s.is_applicable(p) or s.family in ("fft", "winograd"):
                continue
            try:
                calls[d](s.name)
                ms = bench(lambda s=s, d=d: calls[d](s.name))
                row[s.name] = dict(ms=round(ms, 4), vs_cudnn=round(row["cudnn_ms"] / ms, 3))
            except Exception as e:  # noqa: BLE001
                row[s.name] = "ERR " + str(e).split("\n")[0][:150]
        # the layout-changing plan's parts: its NHWC solver alone on NHWC copies of the inputs
        plan = LayoutChangePlan(p)
        nargs = ConvArgs(x=to_nhwc(x) if d != "bwd_data" else None, w=to_nhwc(w),
                         dy=to_nhwc(dy) if d != "fwd" else None)
        row["inner"] = dict(solver=inner_solver(p).name, ms=round(bench(lambda f=plan.inner, a=nargs: f(a)), 4))
        args = ConvArgs(x=x if d != "bwd_data" else None, w=w, dy=dy if d != "fwd" else None)
        row["plan_ms"] = round(bench(lambda f=plan, a=args: f(a)), 4)
        row["default_ms"] = round(bench(lambda d=d: calls[d](None)), 4)
        row["default_vs_cudnn"] = round(row["cudnn_ms"] / row["default_ms"], 3)
        res["api"][d] = row
        print(d, json.dumps(row), flush=True)
    print(json.dumps(res["copies"]))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
