"""Winograd forward block sizes (cpu_winograd.make_plan's block_bytes), alternated call by call in
one process on the conv_cpu suite's Winograd problems, with torch's conv in the same rounds:
median per-round ratio of each variant against the default plan (> 1: faster).

Usage: python benchmarks/diag/winograd_block_ab.py [--sizes 0,16,8] [--rounds 31] [--out PATH]
(sizes in MiB, 0 = make_plan's default; "4w2": 4 MiB blocks on two Python workers of one thread)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from nnprim.args import ConvArgs  # noqa: E402
from nnprim.cli.problem_args import conv_problem  # noqa: E402
from nnprim.cli.suites import load_suite  # noqa: E402
from nnprim.conv import cpu_winograd as cw  # noqa: E402
from nnprim.problems.conv import to_layout  # noqa: E402


def steal_ticks() -> int:
    """The VM's stolen CPU ticks so far (/proc/stat): another guest's load the PSI figures miss."""
    return int(Path("/proc/stat").read_text().split()[8])


def measure(name: str, spec: dict, sizes: str, rounds: int) -> dict:
    p = conv_problem(spec, dtype=torch.float32, device="cpu", direction="fwd")
    x = to_layout(torch.randn(p.x_shape), p.layout)
    w = torch.randn(p.w_shape)
    args = ConvArgs(x=x, w=w)
    fns = {}
    for s in sizes.split(","):       # MiB[wN]: N Python workers of one thread each
        mb, _, nw = s.partition("w")
        inv = cw.prepare_with(p, block_bytes=(int(mb) << 20) or None, workers=int(nw or 1))
        fns[f"{s}MiB" if s != "0" else "default"] = lambda inv=inv: inv(args)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[p.ndim]
    fns["torch"] = lambda: conv(x, w, padding=1)
    ref = fns["torch"]()
    errs = {k: float((f() - ref).norm() / ref.norm()) for k, f in fns.items()}
    ms = {k: [] for k in fns}
    stolen = steal_ticks()
    for r in range(rounds + 2):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            if r >= 2:
                ms[k].append((time.perf_counter() - t0) * 1e3)
    base = ms["default"]
    return dict(problem=name, ms={k: round(statistics.median(t), 2) for k, t in ms.items()},
                x_vs_default={k: round(statistics.median(b / v for b, v in zip(base, t)), 3) for k, t in ms.items()},
                rel_err=errs, pressure=Path("/proc/pressure/cpu").read_text().split()[1],
                steal_ticks=steal_ticks() - stolen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0,16,8")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--problems", default="rn50_r2_3x3,rn50_r2_3x3_nhwc,rn50_r4_3x3,c3d_small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    specs = {s["name"]: s for s in load_suite("conv_cpu")[1]}
    res = dict(threads=a.threads, rows=[])
    for name in a.problems.split(","):
        row = measure(name, specs[name], a.sizes, a.rounds)
        res["rows"].append(row)
        print(name, "ms", row["ms"], "x vs default", row["x_vs_default"], row["pressure"], "steal",
              row["steal_ticks"], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
