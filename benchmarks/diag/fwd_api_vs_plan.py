"""Issue 12's short causal forwards: does the public `nnprim.sdpa` call cost more than the plan of
the solver it chose (the 2026-12-03 API run: d128 s1024 causal 0.2042 against 0.1911 ms)? Per
train problem: host us per call (a loop without a sync), the kernels the GPU ran (profiler), the
CUDA-graph device time, and device events interleaved with cuDNN and FLASH_ATTENTION (the
harness of benchmarks/attention.py), for the public call (inputs that require grad, under
no_grad, as attention.py --api times it), the same call forced to the chosen solver, and the
plan called directly.

Usage: python benchmarks/diag/fwd_api_vs_plan.py --out PATH [--problems train_d128_s1024_causal,...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from api_vs_plan import graph_us, host_us, kernels  # noqa: E402

import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.cli.suites import load_suite  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.search import explain  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

DEFAULT = "train_d64_s1024_causal,train_d128_s1024_causal,train_d256_s1024_causal,train_d128_s1024"


def measure(name: str, s: dict, rounds: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    q, k, v = (torch.randn(s["B"], h, n, s["D"], device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h, n in ((s["Hq"], s["Sq"]), (s["Hkv"], s["Sk"]), (s["Hkv"], s["Sk"])))
    causal = s["causal"] or None
    with torch.no_grad():
        nnprim.sdpa(q, k, v, causal=causal)
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        p = AttentionProblem.from_tensors(qd, kd, vd, causal=causal)
        decision = explain.decision(p)
        sid = decision.split("would run: ")[-1].split()[0] if "would run: " in decision else None
        planned = REGISTRY.get(sid).prepare(p)
        args = AttnArgs(q=qd, k=kd, v=vd)
        fns = {"api": lambda: nnprim.sdpa(q, k, v, causal=causal),
               f"api:{sid}": lambda: nnprim.sdpa(q, k, v, causal=causal, solver=sid),
               "plan": lambda: planned(args)}
        for lab, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def peer(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            fns[lab] = peer
        row = dict(problem=name, solver=sid, decision=decision, host_us={}, kernels={}, graph_us={})
        for lab, f in fns.items():
            f()
            row["host_us"][lab] = host_us(f, calls=100)
            row["kernels"][lab] = kernels(f)
            row["graph_us"][lab] = graph_us(f)
        samples = interleaved_samples(list(fns.values()), "cuda", rounds=rounds, warmup=5)
        row["events_ms"] = {lab: round(statistics.median(t), 4) for lab, t in zip(fns, samples)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--problems", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    specs = {s["name"]: s for s in load_suite("attention_gpu")[1]}
    res = dict(gpu=torch.cuda.get_device_name(), rows=[])
    for name in a.problems.split(","):
        row = measure(name, specs[name], a.rounds)
        res["rows"].append(row)
        print(name, row["solver"], "host_us", row["host_us"], "\n  graph_us", row["graph_us"], "\n  events_ms",
              row["events_ms"], "\n  kernels", row["kernels"]["api"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
