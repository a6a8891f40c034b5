"""A/B of the native brgemm conv solvers (36-38) against the solver find picks today and torch
(oneDNN), interleaved rounds, on ../shared/suites/conv_cpu.json (the project's copy in
nnprim/data/suites). Solver level: prepare() once, then invoke; median of rounds.
    python benchmarks/diag/cpu_brgemm_ab.py [--dtype bf16] [--threads 2] [--rounds 9]"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from nnprim import _solvers
from nnprim.args import ConvArgs
from nnprim.problems.conv import ConvProblem, to_layout
from nnprim.search.solver import REGISTRY

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--problems", default="")
ap.add_argument("--directions", default="fwd,bwd_data,bwd_weights")
ap.add_argument("--others", default="10,11,12,13,14,15,16,17,18")
a = ap.parse_args()
torch.set_num_threads(a.threads)
_solvers.load_all()
dt = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
suite = json.loads((Path(__file__).parents[2] / "nnprim/data/suites/conv_cpu.json").read_text())["problems"]
NEW = {"fwd": 80, "bwd_data": 81, "bwd_weights": 82}
solvers = {s.id: s for s in REGISTRY.all("conv")}


def torch_call(p: ConvProblem, d: str, x, w, dy, kw: dict):
    from torch.nn import functional as fn
    from torch.nn.grad import conv2d_input, conv2d_weight, conv3d_input, conv3d_weight
    two = p.ndim == 2
    if d == "fwd":
        return lambda: (fn.conv2d if two else fn.conv3d)(x, w, None, **kw)
    if d == "bwd_data":
        return lambda: (conv2d_input if two else conv3d_input)(p.x_shape, w, dy, **kw)
    return lambda: (conv2d_weight if two else conv3d_weight)(x, p.w_shape, dy, **kw)


def bench(pr: dict, d: str) -> None:
    xs = (pr["N"], pr["C"], *pr["spatial"])
    ws = (pr["K"], pr["C"] // pr["groups"], *pr["filter"])
    kw = dict(stride=pr["stride"], padding=pr["padding"], dilation=pr["dilation"], groups=pr["groups"])
    p = ConvProblem.create(d, xs, ws, dtype=dt, layout=pr["layout"], **kw)
    x, w, dy = (to_layout(torch.randn(s).to(dt), p.layout) for s in (p.x_shape, p.w_shape, p.y_shape))
    args = ConvArgs(x=x, w=w, dy=dy)
    cands = {}
    for sid in [NEW[d]] + [int(s) for s in a.others.split(",")]:
        s = solvers.get(sid)
        if s is not None and d in s.directions and s.is_applicable(p):
            inv = s.prepare(p)
            cands[s.name] = (lambda inv=inv: inv(args))
    cands["torch"] = torch_call(p, d, x, w, dy, kw)
    times = {k: [] for k in cands}
    for fn in cands.values():
        fn()
    for _ in range(a.rounds):
        for k, fn in cands.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    tt = med["torch"]
    print(f"{pr['name']:20s} {d:11s} torch {tt:7.2f} | " +
          " ".join(f"{k} {v:.2f} ({tt / v:.2f}x)" for k, v in med.items() if k != "torch"), flush=True)


for pr in suite:
    if a.problems and pr["name"] not in a.problems.split(","):
        continue
    for d in a.directions.split(","):
        bench(pr, d)
