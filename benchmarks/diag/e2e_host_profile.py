"""The host side of an nnprim ResNet-50 training step (e2e.py's, eager): cProfile of a few
warmed steps (the GPU is far behind: what the Python and launch paths cost), top functions
by own time and by cumulative time, and the same for torch's model as the reference.

    PYTHONPATH=$PWD python benchmarks/diag/e2e_host_profile.py --out $OUT/e2e_host.txt
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--impls", default="nnprim,torch")
    ap.add_argument("--out", default="e2e_host.txt")
    args = ap.parse_args()
    import torchvision
    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    report = io.StringIO()
    for impl in args.impls.split(","):
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
        # host time per step without the profiler, GPU never waited for inside the loop
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        host = (time.perf_counter() - t0) / args.steps * 1e3
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step()
        pr.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
            report.write(f"===== {impl}: {host:.2f} ms host per step (no profiler); cProfile of {args.steps} steps by {key}\n")
            report.write(s.getvalue())
        print(f"{impl}: {host:.2f} ms host per step", flush=True)
        del m, opt
    with open(args.out, "w") as f:
        f.write(report.getvalue())


if __name__ == "__main__":
    main()
