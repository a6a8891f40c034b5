"""SASS of the depthwise kernels compiled for sm_90 on a machine without a GPU (the
compile-only stub of nnprim.testing.compile_check, Triton's bundled nvdisasm/cuobjdump):
registers, spills and the instruction mix of the main loop (the largest backward branch),
per solver family and tile, on the suite's mbv2_dw3x3 shape (N 2 for the compile).

Usage: TRITON_INTERPRET=0 python benchmarks/diag/dw_sass.py [--family walk|tile]
       [--direction fwd] [--tile 8,16,28,1,3] [--stride 2]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from sass_count import loop_body  # noqa: E402  (installs the compile-only stub)

from nnprim.conv import depthwise, depthwise_walk  # noqa: E402
from nnprim.problems.conv import ConvProblem  # noqa: E402
from nnprim.search.random_args import random_args  # noqa: E402
from nnprim.testing.compile_check import _cubin_usage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="walk", choices=("walk", "tile"))
    ap.add_argument("--direction", default="fwd", choices=("fwd", "bwd_data", "bwd_weights"))
    ap.add_argument("--tile", default=None, help="comma-separated tile tuple of the family's plans")
    ap.add_argument("--stride", type=int, default=1)
    a = ap.parse_args()
    tile = tuple(int(v) for v in a.tile.split(",")) if a.tile else None
    p = ConvProblem.create(a.direction, (2, 144, 56, 56), (144, 1, 3, 3), device="cpu", layout="nhwc",
                           dtype=torch.bfloat16, padding=1, groups=144, stride=a.stride)
    wgrad = a.direction == "bwd_weights"
    if a.family == "walk":
        plan = (depthwise_walk.WalkWgradPlan if wgrad else depthwise_walk.WalkPlan)(p, tile)
        kernel = depthwise_walk._walk_wgrad_kernel if wgrad else depthwise_walk._walk_kernel
    else:
        plan = (depthwise.DwBwdWeightsPlan if wgrad else depthwise.DwPlan)(p, tile)
        kernel = depthwise._dw_bwd_w_kernel if wgrad else depthwise._dw_kernel
    plan(random_args(p, seed=0))
    for cache in kernel.device_caches.values():
        for ck in cache[0].values():
            loop = loop_body(ck.asm["cubin"], needs=None)
            ops = collections.Counter(s.split()[1] if s.startswith("@") else s.split()[0] for s in loop)
            print(f"{a.family} {a.direction} stride {a.stride} tile={tile or 'default'}: {_cubin_usage(ck)}; main loop "
                  f"{len(loop)} instructions: {ops.most_common(12)}")


if __name__ == "__main__":
    main()
