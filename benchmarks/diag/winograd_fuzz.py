"""Random CPU Winograd problems through the public API (2-D and 3-D, C and K with and without
16-lane multiples, padding 0-2, both layouts, f32 / bf16, bias), forced cpu_winograd_fwd and
cpu_winograd_bwd_data, against float64 (f32 1e-5, bf16 1e-2 relative norm error).

    python benchmarks/diag/winograd_fuzz.py SEED COUNT
"""
from __future__ import annotations

import os
import random
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import nnprim  # noqa: E402

FMT = {4: torch.channels_last, 5: torch.channels_last_3d}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def case(rng: random.Random) -> dict | None:
    nd = rng.choice([2, 2, 2, 3])
    sp = ([rng.randint(3, 9)] if nd == 3 else []) + [rng.randint(3, 30), rng.randint(3, 30)]
    pad = rng.choice([0, 1, 2])
    if any(s + 2 * pad < 3 for s in sp):
        return None
    return dict(nd=nd, sp=sp, pad=pad, N=rng.randint(1, 4), C=rng.choice([3, 16, 17, 32, 48, 64, 70]),
                K=rng.choice([5, 16, 32, 48, 64, 80]), layout=rng.choice(["nchw", "nhwc"]),
                dt=rng.choice([torch.float32, torch.float32, torch.bfloat16]))


def check(c: dict) -> list[float]:
    """Error / tolerance of the forward and the backward data (the ones the solvers take)."""
    nd, pad, dt = c["nd"], c["pad"], c["dt"]
    x = torch.randn(c["N"], c["C"], *c["sp"])
    w = torch.randn(c["K"], c["C"], *[3] * nd) / (c["C"] * 9) ** 0.5
    b = torch.randn(c["K"])
    if c["layout"] == "nhwc":
        x, w = x.contiguous(memory_format=FMT[x.dim()]), w.contiguous(memory_format=FMT[x.dim()])
    conv = F.conv2d if nd == 2 else F.conv3d
    grad_in = torch.nn.grad.conv2d_input if nd == 2 else torch.nn.grad.conv3d_input
    out = []
    ref = conv(x.double(), w.double(), b.double(), padding=pad)
    try:
        y = nnprim.conv_forward(x.to(dt), w.to(dt), b.to(dt), padding=pad, solver="cpu_winograd_fwd")
        assert torch.isfinite(y).all(), c
        out.append(rel(y, ref) / TOL[dt])
    except nnprim.NotSupportedError:
        pass
    dy = torch.randn(ref.shape)
    if c["layout"] == "nhwc":
        dy = dy.contiguous(memory_format=FMT[dy.dim()])
    ref_dx = grad_in(x.shape, w.double(), dy.double(), padding=pad)
    try:
        dx = nnprim.conv_backward_data(dy.to(dt), w.to(dt), x.shape, padding=pad, solver="cpu_winograd_bwd_data")
        assert torch.isfinite(dx).all(), c
        out.append(rel(dx, ref_dx) / TOL[dt])
    except nnprim.NotSupportedError:
        pass
    return out


def main() -> None:
    rng = random.Random(int(sys.argv[1]))
    torch.set_num_threads(2)
    errs = []
    for _ in range(int(sys.argv[2])):
        c = case(rng)
        if c is None:
            continue
        got = check(c)
        assert all(e < 1.0 for e in got), (c, got)
        errs += got
    print(f"checked {len(errs)}, worst error / tolerance {max(errs, default=0.0):.3f}")


if __name__ == "__main__":
    main()
