"""Why the attention backward through autograd measured slower than the same solver forced at
the op (`nnprim.sdpa_backward(..., solver=)`) on the s1024 train problems (2026-12-02:
+0.09-0.2 ms on 0.6-1.1 ms). For each problem and determinism mode: the kernels each path
launches (torch.profiler, per-kernel device time over N calls) and each path's time back to
back (device events around N calls behind a spin). JSON to --out.

    python benchmarks/diag/attn_autograd_trace.py --out $OUT/attn_autograd_trace.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import nnprim  # noqa: E402
from nnprim.search.context import context  # noqa: E402

PROBLEMS = {   # name: (B, Hq, Hkv, S, D, causal)
    "train_d128_s1024": (16, 16, 16, 1024, 128, False),
    "train_d128_s1024_causal": (16, 16, 16, 1024, 128, True),
    "train_d64_s1024": (16, 32, 32, 1024, 64, False),
    "train_d128_s4096": (4, 16, 16, 4096, 128, False),
}


def back_to_back_ms(fn, n: int = 20) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e7))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def kernels(fn, n: int = 5) -> list[tuple[str, int, float]]:
    """(kernel name, calls per fn call, device us per fn call) of fn, heaviest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dev > 0 and e.key and not e.key.startswith("aten::") and not e.key.startswith("cuda"):
            rows.append((e.key[:90], round(e.count / n, 2), round(dev / n, 1)))
    return sorted(rows, key=lambda r: -r[2])


def measure(name: str, det: bool) -> dict:
    """One problem in one determinism mode: the autograd path, the op with the solver autograd
    chose forced, and the op's default call."""
    B, Hq, Hkv, S, D, causal = PROBLEMS[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    do = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
    c = causal or None
    nnprim.set_deterministic(det)
    torch.use_deterministic_algorithms(det, warn_only=True)
    try:
        o_graph = nnprim.sdpa(q, k, v, causal=c)
        with torch.no_grad():
            o, lse = nnprim.sdpa(q, k, v, causal=c, return_lse=True)
        torch.autograd.grad(o_graph, (q, k, v), do, retain_graph=True)
        ctx = context(torch.device("cuda"))
        chosen = sorted(b.solver.name for b in list(ctx.chosen.values())
                        if f"b{B}hq{Hq}hkv{Hkv}-sq{S}sk{S}-d{D}" in b.problem.key()
                        and b.problem.key().startswith("attn-bwd"))
        solver = chosen[0] if chosen else ("gluon_flash_bwd_ordered" if det else "gluon_flash_bwd")
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        paths = {
            "autograd": lambda: torch.autograd.grad(o_graph, (q, k, v), do, retain_graph=True),
            "op_forced": lambda: nnprim.sdpa_backward(do, qd, kd, vd, o, lse, causal=c, solver=solver),
            "op_default": lambda: nnprim.sdpa_backward(do, qd, kd, vd, o, lse, causal=c),
        }
        row = dict(problem=name, det=det, solver=solver, chosen=chosen,
                   saved=dict(o_stride=list(o_graph.stride()), lse=[str(lse.dtype), list(lse.stride())]))
        for label, fn in paths.items():
            row[f"{label}_ms"] = [round(back_to_back_ms(fn), 4) for _ in range(3)]
            row[f"{label}_kernels"] = kernels(fn)
        return row
    finally:
        nnprim.set_deterministic(False)
        torch.use_deterministic_algorithms(False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    args = ap.parse_args()
    out = []
    for name in args.problems.split(","):
        for det in (False, True):
            row = measure(name, det)
            print(json.dumps(row)[:3000], flush=True)
            out.append(row)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
