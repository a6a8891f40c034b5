"""Where a ResNet-50 training step's time goes, nnprim convs against torch's (cuDNN), eager:
e2e.py's step (bf16 autocast, channels-last, SGD), warmed, then a few steps profiled.

- default: torch.profiler over the GPU: wall ms per step, one step's enqueue (host) ms, GPU kernel
  ms per step, the top kernels by time, peak memory.
- `--host`: cProfile of the steps (the GPU far behind: what the Python and launch paths cost),
  top functions by own and by cumulative time, with the host ms per step without the profiler.

    PYTHONPATH=$PWD python benchmarks/diag/e2e_profile.py --out $OUT/e2e_profile.json
    PYTHONPATH=$PWD python benchmarks/diag/e2e_profile.py --host --out $OUT/e2e_host.txt
"""
from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import e2e  # noqa: E402

import nnprim  # noqa: E402,F401


def training_step(base, impl: str, batch: int):
    """A warmed step function of a copy of `base` (nnprim's convs for impl "nnprim")."""
    m = copy.deepcopy(base)
    if impl == "nnprim":
        e2e.to_nnprim_convs(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    return step


def kernels(step, steps: int) -> dict:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5 * 1e3
    t0 = time.perf_counter()
    step()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kern, count = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kern[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
    top = [dict(name=n[:120], ms_per_step=round(t / 1e3 / steps, 3), calls=count[n] // steps)
           for n, t in kern.most_common(30)]
    return dict(wall_ms=round(wall, 2), host_enqueue_ms=round(host, 2),
                gpu_kernel_ms=round(sum(kern.values()) / 1e3 / steps, 2),
                peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2), top=top)


def host(step, steps: int, impl: str) -> str:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
        out.write(f"===== {impl}: {ms:.2f} ms host per step (no profiler); cProfile of {steps} steps by {key}\n")
        out.write(s.getvalue())
    print(f"{impl}: {ms:.2f} ms host per step", flush=True)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--impls", default="torch,nnprim")
    ap.add_argument("--host", action="store_true", help="cProfile of the host side instead of the GPU kernels")
    ap.add_argument("--out", default="e2e_profile.json")
    args = ap.parse_args()
    import torchvision
    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    out, report = {}, io.StringIO()
    for impl in args.impls.split(","):
        step = training_step(base, impl, args.batch)
        if args.host:
            report.write(host(step, args.steps, impl))
            continue
        out[impl] = r = kernels(step, args.steps)
        print(f"== {impl}: wall {r['wall_ms']} ms/step, one step's enqueue {r['host_enqueue_ms']} ms, GPU kernels "
              f"{r['gpu_kernel_ms']} ms, peak {r['peak_gb']} GB", flush=True)
        for t in r["top"]:
            print(f"   {t['ms_per_step']:8.3f} ms  x{t['calls']:3d}  {t['name']}")
        del step
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        if args.host:
            f.write(report.getvalue())
        else:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
