"""Depthwise convolution on the H200 (issue 13): the row-walking solvers (46/47/48) and the
tile solvers (43/44/45) with tile candidates, the general direct solvers (40/41/42) and cuDNN
(cudnn.benchmark=True) in the same run, bf16 NHWC, all three directions; checked against
cuDNN in f32.
Reports ms, effective TB/s (x + w + y bytes once) and the ratio to cuDNN.

    PYTHONUNBUFFERED=1 python benchmarks/depthwise.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nnprim.args import ConvArgs
from nnprim.conv import depthwise, depthwise_walk, direct
from nnprim.problems.conv import ConvProblem

PROBLEMS = [  # name, N, C, H, W, R, stride, pad
    ("mbv2_dw3x3", 128, 144, 56, 56, 3, 1, 1),          # the suite's problem
    ("mbv2_dw3x3_s2", 128, 96, 112, 112, 3, 2, 1),
    ("mbv2_dw3x3_7x7", 128, 960, 7, 7, 3, 1, 1),
    ("effnet_dw3x3_28", 128, 240, 28, 28, 3, 1, 1),
    ("convnext_dw7x7", 64, 128, 56, 56, 7, 1, 3),       # direct only (depthwise: <= 9 taps)
]
# None: the solver's own tile; 2026-11-30 also timed (4,16,64,4), (16,16,32,8), (8,16,128,8),
# (2,32,128,4), (16,8,64,8): all slower, the last three by 2-30x (spills)
TILES = [None, (8, 16, 64, 4)]
# (BH, BC, WALK, warps[, LOOK]) of the walking solvers; None: the solver's own
WALK_TILES = [None, (16, 16, 28, 1, 3), (8, 16, 28, 1, 2), (4, 16, 28, 1, 3), (8, 8, 28, 1, 3),
              (16, 16, 28, 2, 3), (8, 16, 56, 1, 3), (8, 32, 28, 1, 3)]


def bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def run_problem(name, N, C, H, W, R, st, pad) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    x = torch.randn(N, C, H, W, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
    w = (torch.randn(C, 1, R, R, device="cuda") / R).to(torch.bfloat16).to(memory_format=torch.channels_last)
    kw = dict(stride=st, padding=pad, groups=C)
    y = F.conv2d(x, w, **kw)
    dy = torch.randn_like(y)
    with torch.no_grad():
        xf, wf, dyf = x.float(), w.float(), dy.float()
        torch.backends.cudnn.allow_tf32 = False
        ref = {"fwd": F.conv2d(xf, wf, **kw)}
        ref["bwd_data"], ref["bwd_weights"], _ = torch.ops.aten.convolution_backward(
            dyf, xf, wf, None, [st, st], [pad, pad], [1, 1], False, [0, 0], C, [True, True, False])
        torch.backends.cudnn.allow_tf32 = True
    bw = ([st, st], [pad, pad], [1, 1], False, [0, 0], C)
    peers = {"fwd": lambda: F.conv2d(x, w, **kw),
             "bwd_data": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw, [True, False, False]),
             "bwd_weights": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw, [False, True, False])}
    nbytes = (x.numel() + y.numel()) * 2 + w.numel() * 2
    args = ConvArgs(x=x, w=w, dy=dy)
    for d in ("fwd", "bwd_data", "bwd_weights"):
        p = ConvProblem.create(d, tuple(x.shape), tuple(w.shape), dtype=torch.bfloat16, layout="nhwc",
                               device="cuda", **kw)
        row = dict(name=name, direction=d, cudnn_ms=round(bench(peers[d]), 4), variants={})
        cands = [("direct", (direct.bwd_weights_plan(p) if d == "bwd_weights" else direct.DirectPlan(p)))]
        plan_cls = depthwise.DwBwdWeightsPlan if d == "bwd_weights" else depthwise.DwPlan
        if R * R <= depthwise.MAX_TAPS:
            cands += [(f"dw:{t}", plan_cls(p, t)) for t in TILES]
        if not depthwise_walk.shape_reasons(p):
            walk_cls = depthwise_walk.WalkWgradPlan if d == "bwd_weights" else depthwise_walk.WalkPlan
            cands += [(f"walk:{t}", walk_cls(p, t)) for t in WALK_TILES]
        for label, plan in cands:
            try:
                out = plan(args)
                err = ((out.float() - ref[d]).norm() / ref[d].norm()).item()
                ms = bench(lambda plan=plan, args=args: plan(args))
                row["variants"][label] = dict(ms=round(ms, 4), err=float(f"{err:.1e}"),
                                              tbs=round(nbytes / ms / 1e9, 2),
                                              vs_cudnn=round(row["cudnn_ms"] / ms, 3))
            except Exception as e:  # noqa: BLE001
                row["variants"][label] = "ERR " + str(e).split("\n")[0][:150]
        ok = {k: v for k, v in row["variants"].items() if isinstance(v, dict) and v["err"] < 1e-2}
        if ok:
            best = min(ok, key=lambda k: ok[k]["ms"])
            row["best"], row["best_vs_cudnn"] = best, ok[best]["vs_cudnn"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma-separated problem names (default: all)")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for spec in PROBLEMS:
        if not a.only or spec[0] in a.only.split(","):
            rows += run_problem(*spec)
    (Path(a.out) / f"depthwise_{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
