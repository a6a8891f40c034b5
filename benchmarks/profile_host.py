"""cProfile of the public calls' host path on tiny problems (where the host time goes).

    python3 benchmarks/profile_host.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nnprim  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=22)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(1, 8, 8, 8, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
    q = torch.randn(1, 2, 16, 64, device=dev, dtype=dt)
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    qg = q.detach().clone().requires_grad_()

    def conv_train():
        nnprim.conv_forward(xg, wg, padding=1).sum().backward()

    def sdpa_train():
        nnprim.sdpa(qg, qg, qg).sum().backward()

    for name, fn in (("conv_forward", lambda: nnprim.conv_forward(x, w, padding=1)),
                     ("sdpa", lambda: nnprim.sdpa(q, q, q)),
                     ("conv_forward+backward (autograd)", conv_train),
                     ("sdpa forward+backward (autograd)", sdpa_train)):
        for _ in range(100):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        if dev == "cuda":
            torch.cuda.synchronize()
        print(f"==== {name}: {a.calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
