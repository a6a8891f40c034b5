"""Where a public convolution call's time goes on the GPU machine, for the suite layers
whose public-API time sits near the host floor (issue 13: the 1x1 and 7x7 layers at
0.5-0.8x cuDNN). Per case:
  host us (enqueue only, 200 calls, no sync): the public call, the bound invoker alone
  (what `Context.call` runs after its memo lookup), torch's call;
  bench ms (what `nnprim bench` reports: max(event, host) of one call): ours and torch's;
  graph us: the same calls captured in a CUDA graph and replayed (device time only).
Then a cProfile of the public call of the first cases. --fused: the forward layers of
FUSED_CASES with bias + Sum(residual) + ReLU (issue 13's fused target; torch's call is the
conv and the chain as separate ops). JSON to --out.

    PYTHONPATH=$PWD python benchmarks/diag/api_host_breakdown.py --out $OUT/host.json [--fused]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gluon_bench_common import graph_us, host_us  # noqa: E402

from nnprim.cli import cases
from nnprim.cli.suites import load_suite
from nnprim.search.context import for_problem
from nnprim.search.timing import bench_ms

CASES = [("rn50_r5_1x1", "fwd"), ("rn50_r4_1x1", "fwd"), ("rn50_r2_1x1a", "fwd"), ("rn50_r3_1x1", "fwd"),
         ("rn50_r5_1x1", "bwd_data"), ("rn50_r4_1x1b", "bwd_weights"), ("rn50_r3_3x3", "fwd"),
         ("rn50_r5_3x3", "bwd_weights"), ("rn50_r4_3x3", "bwd_data")]
# the fused layers whose ratio to torch eager stays near 1 (2026-12-03: 14x14 and 7x7 layers)
FUSED_CASES = [("rn50_r4_3x3", "fwd"), ("rn50_r5_3x3", "fwd"), ("rn50_r4_1x1", "fwd"), ("rn50_r5_1x1", "fwd"),
               ("rn50_r4_1x1b", "fwd"), ("rn50_r3_3x3", "fwd")]


def bound_of(case):
    """The Bound and args the public call runs (captured from Context.run_bound)."""
    ctx = for_problem(case.problem)
    cap = {}
    orig = ctx.run_bound

    def spy(b, a):
        cap.update(b=b, a=a)
        return orig(b, a)
    ctx.run_bound = spy
    try:
        case.call()
    finally:
        del ctx.run_bound
    return cap["b"], cap["a"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="api_host.json")
    ap.add_argument("--profile", type=int, default=2, help="cProfile the first N cases")
    ap.add_argument("--fused", action="store_true", help="FUSED_CASES with bias + Sum + ReLU")
    a = ap.parse_args()
    fused = dict(bias=True, post_ops=("sum", "relu")) if a.fused else {}
    torch.backends.cudnn.benchmark = True
    _, probs = load_suite("conv_gpu")
    specs = {p["name"]: p for p in probs}
    rows = []
    for i, (name, d) in enumerate(FUSED_CASES if a.fused else CASES):
        case = cases.conv_case(specs[name], dtype=torch.bfloat16, device="cuda", direction=d, **fused)
        for _ in range(3):
            case.call()
            case.peer()
        b, args = bound_of(case)
        inv = b.invoker
        calls = {"api": case.call, "invoker": lambda inv=inv, args=args: inv(args), "torch": case.peer}
        for fn in calls.values():
            for _ in range(20):
                fn()
        row = dict(name=name, direction=d, solver=b.solver.name, fused=a.fused)
        for _ in range(3):
            for k, fn in calls.items():
                row.setdefault(f"host_us_{k}", []).append(round(host_us(fn, 200), 2))
        for k in ("api", "torch"):
            row[f"bench_ms_{k}"] = bench_ms(calls[k], "cuda", repeats=30)
        for k in ("invoker", "torch"):
            row[f"graph_us_{k}"] = graph_us(calls[k], n=50, repeats=5)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if i < a.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                case.call()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue(), flush=True)
            row["profile"] = s.getvalue()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
