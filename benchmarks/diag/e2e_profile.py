"""Where a ResNet-50 training step's time goes, nnprim convs against torch's (cuDNN), eager:
the e2e.py step (bf16 autocast, channels-last, SGD), warmed, then a few steps under
torch.profiler. Per implementation: wall ms per step, GPU kernel ms per step, the GPU's idle
share, the top kernels by time, and per conv direction the kernels' total; memory after the
forward and the peak.

    PYTHONPATH=$PWD python benchmarks/diag/e2e_profile.py --out $OUT/e2e_profile.json
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import e2e  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="e2e_profile.json")
    args = ap.parse_args()
    import torchvision
    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    out = {}
    for impl in ("torch", "nnprim"):
        m = copy.deepcopy(base)
        if impl == "nnprim":
            e2e.to_nnprim_convs(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)

        def step(m=m, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for _ in range(8):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        # host time of a step: the same steps with the GPU never waited for (enqueue only)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        kern = collections.Counter()
        count = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kern[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                count[ev.name] += 1
        total = sum(kern.values()) / 1e3 / args.steps
        top = [dict(name=n[:120], ms_per_step=round(t / 1e3 / args.steps, 3), calls=count[n] // args.steps)
               for n, t in kern.most_common(30)]
        out[impl] = dict(wall_ms=round(wall, 2), host_enqueue_ms=round(host, 2), gpu_kernel_ms=round(total, 2),
                         peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2), top=top)
        print(f"== {impl}: wall {wall:.2f} ms/step, one step's enqueue {host:.2f} ms, GPU kernels {total:.2f} ms, "
              f"peak {out[impl]['peak_gb']} GB", flush=True)
        for t in top:
            print(f"   {t['ms_per_step']:8.3f} ms  x{t['calls']:3d}  {t['name']}")
        del m, opt
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
