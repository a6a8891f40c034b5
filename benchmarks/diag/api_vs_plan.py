"""Why a public decode call can time slower than the plan of the solver it chose (the
default-vs-forced gap of decode_swap_sweep.py's `api` rows): per call, the host time (a loop
of calls without a sync), the kernels the GPU ran (torch.profiler: name, count, mean us) and
the device time of the call captured in a CUDA graph, for `nnprim.sdpa` (default and forced)
and for the chosen solver's plan run directly.

Usage: python benchmarks/diag/api_vs_plan.py --out PATH [--formats s4:64,u4:64] [--B 8 --Sk 32768]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from decode_formats import graph_ms  # noqa: E402
from decode_swap_sweep import quant  # noqa: E402

import nnprim  # noqa: E402
from nnprim import launch  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode as dec  # noqa: E402
from nnprim.attention import gluon_decode_quant as q4  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.search import explain  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(t), 1)


def host_profile(fn, calls: int = 300, top: int = 14) -> list[str]:
    """cProfile of `calls` calls: the functions with the most own time (us per call)."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{tt / calls * 1e6:7.1f} us own {ct / calls * 1e6:7.1f} us cum {nc / calls:5.1f}x "
            f"{os.path.basename(f)}:{ln}:{fn_}" for (f, ln, fn_), (_, nc, tt, ct, _) in rows]


def kernels(fn, calls: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    acc: dict = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            acc[e.name[:60]].append(e.device_time)
    return {k: dict(n=len(v) / calls, us=round(statistics.mean(v), 1)) for k, v in acc.items()}


def graph_us(fn, reps: int = 50) -> float | None:
    """Device time of one call replayed from a CUDA graph (decode_formats.graph_ms), in us."""
    ms = graph_ms(fn, reps)
    return None if ms is None else round(ms * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="s4:64,u4:64")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--Sk", type=int, default=32768)
    a = ap.parse_args()
    B, Sk = a.B, a.Sk
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, 8, Sk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, 8, Sk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    res = dict(gpu=torch.cuda.get_device_name(), B=B, Sk=Sk, rows=[])
    for spec in a.formats.split(","):
        kq, vq = quant(k, spec, None), quant(v, spec, None)
        p = AttentionProblem.from_tensors(q, kq, vq)
        nnprim.sdpa(q, kq, vq)
        decision = explain.decision(p)
        sid = decision.split("would run: ")[-1].split()[0] if "would run: " in decision else None
        solver = REGISTRY.get(sid) if sid else None
        args = AttnArgs(q=q, k=kq, v=vq)
        planned = solver.prepare(p)
        fns = {"api": lambda kq=kq, vq=vq: nnprim.sdpa(q, kq, vq),
               f"api:{sid}": lambda kq=kq, vq=vq, sid=sid: nnprim.sdpa(q, kq, vq, solver=sid),
               "plan": lambda planned=planned, args=args: planned(args)}
        if sid == "gluon_decode_q4":   # the sweep's forced row: the launches run without the plan object
            launches = q4.plan(p, args, q4.default_config(p))
            fns["run_planned"] = lambda launches=launches, args=args, p=p: dec.run_planned(p, args, launches)
        for f in fns.values():
            f()
        row = dict(format=spec, decision=decision, host_us={}, kernels={}, graph_us={}, profile={},
                   hooked=launch._hooked())
        for lab, f in fns.items():
            row["host_us"][lab] = host_us(f)
            row["profile"][lab] = host_profile(f)
            print(lab, row["host_us"][lab], "\n  " + "\n  ".join(row["profile"][lab]), flush=True)
            row["kernels"][lab] = kernels(f)
            row["graph_us"][lab] = graph_us(f)
        samples = interleaved_samples(list(fns.values()), "cuda", rounds=60, warmup=10)
        row["events_ms"] = {lab: round(statistics.median(s), 4) for lab, s in zip(fns, samples)}
        res["rows"].append(row)
        print(spec, "graph_us", row["graph_us"], "events_ms", row["events_ms"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
