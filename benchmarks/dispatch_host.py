"""Host time of the dispatch alone: the default call against forcing the solver it chose
(`solver=`), with both bound invokers replaced by one that returns a cached output, so
that only nnprim's per-call Python (API checks, call memo, context, run_bound) is timed.
The two alternate loop by loop; tiny conv and attention problems of the device.

    python3 benchmarks/dispatch_host.py [--device cpu] [--calls 2000] [--repeats 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nnprim  # noqa: E402
from nnprim.search.context import context  # noqa: E402


def _memo(inv):
    """The invoker's first output, returned for every later call (no kernel runs)."""
    out = []

    def run(args):
        if not out:
            out.append(inv(args))
        return out[0]
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    dev = a.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    cl = torch.channels_last
    x = torch.randn(1, 8, 8, 8, device=dev, dtype=dt).contiguous(memory_format=cl)
    w = torch.randn(8, 8, 3, 3, device=dev, dtype=dt).contiguous(memory_format=cl)
    q, k, v = (torch.randn(1, 2, 16, 64, device=dev, dtype=dt) for _ in range(3))
    with torch.no_grad():
        nnprim.conv_forward(x, w, padding=1)
        nnprim.sdpa(q, k, v)
        ctx = context(x.device)
        chosen = {b.problem.key()[:4]: b.solver.name for b in ctx.chosen.values()}
        fns = {"conv default": lambda: nnprim.conv_forward(x, w, padding=1),
               "conv solver=": lambda: nnprim.conv_forward(x, w, padding=1, solver=chosen["conv"]),
               "sdpa default": lambda: nnprim.sdpa(q, k, v),
               "sdpa solver=": lambda: nnprim.sdpa(q, k, v, solver=chosen["attn"])}
        for f in fns.values():
            f()
        for b in ctx.calls.values():
            b.invoker = _memo(b.invoker)
        res: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(a.repeats):
            for n, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    f()
                res[n].append((time.perf_counter() - t0) / a.calls * 1e6)
    for n, r in res.items():
        name = chosen["conv" if n.startswith("conv") else "attn"]
        print(f"{n:14} {statistics.median(r):7.2f} us/call (min {min(r):.2f})   {name}")


if __name__ == "__main__":
    main()
