"""Where sdpa's forward + backward through autograd spends its host time on the GPU machine.
2026-12-04 (H200, B4 H16 S512 D64 bf16 causal): the public forward cost 37 us of host and
sdpa_backward called directly 146 us, but forward + backward through autograd 592 us (torch's
own SDPA through autograd 287 us); cProfile of the main thread shows run_backward as one
opaque call, because CUDA backwards run on autograd's device thread. This measures each
part, then the same backward with autograd's multithreading off (backward in the calling
thread: what the device thread costs, and a cProfile that sees our backward).

    NNPRIM_CACHE_DIR=$(mktemp -d) python benchmarks/diag/attn_autograd_host.py [--out F]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402
import nnprim.ops.attention as attn_ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from host_clock import host_us, profile_text  # noqa: E402


def _time_inside(module, name: str):
    """Wrap module.name with a wall clock (whichever thread calls it); returns a function that
    gives the mean us per call since the last time it was asked."""
    inner = getattr(module, name)
    acc = [0.0, 0]

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            acc[0] += time.perf_counter() - t0
            acc[1] += 1

    setattr(module, name, timed)

    def read() -> float:
        us = acc[0] / max(acc[1], 1) * 1e6
        acc[0], acc[1] = 0.0, 0
        return round(us, 1)
    return read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, help="a torch.profiler chrome trace of 5 calls (all threads)")
    a = ap.parse_args()
    q, k, v = (torch.randn(4, 16, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = nnprim.sdpa(q, k, v, causal="top_left", return_lse=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def ours():
        nnprim.sdpa(qg, kg, vg, causal="top_left").backward(do)

    def torchs():
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

    kept = nnprim.sdpa(qg, kg, vg, causal="top_left")
    inside = _time_inside(attn_ops, "_sdpa_backward")
    row = {
        "fwd_nograd": host_us(lambda: nnprim.sdpa(q, k, v, causal="top_left")),
        "fwd_autograd_apply": host_us(lambda: nnprim.sdpa(qg, kg, vg, causal="top_left")),
        "bwd_direct": host_us(lambda: nnprim.sdpa_backward(do, q, k, v, o, lse, causal="top_left")),
        "backward_only": host_us(lambda: kept.backward(do, retain_graph=True)),
        "fwd_bwd_autograd": host_us(ours),
        "torch_fwd_bwd_autograd": host_us(torchs),
    }
    row["inside_backward_us_per_call"] = inside()
    torch.autograd.set_multithreading_enabled(False)
    try:
        row["backward_only_calling_thread"] = host_us(lambda: kept.backward(do, retain_graph=True))
        row["fwd_bwd_autograd_calling_thread"] = host_us(ours)
        row["torch_fwd_bwd_calling_thread"] = host_us(torchs)
        prof = profile_text(ours)
    finally:
        torch.autograd.set_multithreading_enabled(True)
    if a.trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as p:
            for _ in range(5):
                ours()
            torch.cuda.synchronize()
        p.export_chrome_trace(a.trace)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)[:5000])
    print(json.dumps(row), flush=True)
    print(prof[:6000])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(row, profile=prof), f, indent=1)


if __name__ == "__main__":
    main()
