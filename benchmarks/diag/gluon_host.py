"""Host time per public call of the Gluon solvers against their Triton siblings and torch.

Tiny problems (the GPU always waits for the host): a loop of calls, wall time / calls,
the median of several loops (`host_overhead.per_call_us`). Rows: nnprim.sdpa forced to 126
`gluon_flash_fwd` and to 110 `flash_fwd`, and F.scaled_dot_product_attention; nnprim.conv_forward
forced to 27 `gluon_implicit_gemm_fwd` and to 20 `implicit_gemm_fwd`, and F.conv2d.

    python3 benchmarks/diag/gluon_host.py --out $OUT/gluon_host.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from host_overhead import per_call_us  # noqa: E402

import nnprim  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gluon_host.json")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    dev, dt, cl = "cuda", torch.bfloat16, torch.channels_last
    q, k, v = (torch.randn(1, 2, 128, 64, device=dev, dtype=dt) for _ in range(3))
    x = torch.randn(1, 64, 8, 8, device=dev, dtype=dt).contiguous(memory_format=cl)
    w = torch.randn(64, 64, 3, 3, device=dev, dtype=dt).contiguous(memory_format=cl)
    cases = {
        "sdpa 126 gluon_flash_fwd": lambda: nnprim.sdpa(q, k, v, solver="gluon_flash_fwd"),
        "sdpa 110 flash_fwd": lambda: nnprim.sdpa(q, k, v, solver="flash_fwd"),
        "sdpa default": lambda: nnprim.sdpa(q, k, v),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v),
        "conv 27 gluon_implicit_gemm_fwd": lambda: nnprim.conv_forward(x, w, padding=1,
                                                                      solver="gluon_implicit_gemm_fwd"),
        "conv 20 implicit_gemm_fwd": lambda: nnprim.conv_forward(x, w, padding=1, solver="implicit_gemm_fwd"),
        "conv default": lambda: nnprim.conv_forward(x, w, padding=1),
        "F.conv2d": lambda: F.conv2d(x, w, padding=1),
    }
    rows = {}
    with torch.no_grad():
        for name, fn in cases.items():
            try:
                fn()
                rows[name] = round(per_call_us(fn, a.calls, a.repeats, torch.cuda.synchronize), 2)
            except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
                rows[name] = f"{type(e).__name__}: {e}"[:300]
            print(f"{name:<36} {rows[name]}", flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
