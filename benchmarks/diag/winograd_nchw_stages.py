"""CPU Winograd forward, the layout-dependent stages of one block in one process (issue 16):
staging x into the channels-last f32 buffer (torch's strided copy vs the native 16x16
transposes, and the nhwc copy for reference) and the output transform (the nchw y through an
f32 channels-last block + copy vs written in place by tile rows, and nhwc in place). The
calls alternate; medians over the block's rounds, ms for the whole problem (all blocks).

    python benchmarks/diag/winograd_nchw_stages.py [--problem rn50_r2_3x3] [--threads 2] [--rounds 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nnprim.conv import cpu_wino_native as native  # noqa: E402
from nnprim.conv import cpu_winograd as cw  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402

SUITE = Path(__file__).resolve().parents[2] / "nnprim/data/suites/conv_cpu.json"


def timed(fns: dict, rounds: int) -> dict[str, float]:
    """Median ms of each fn, called in turn `rounds` times after one warm-up call each."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def layout_stages(nat, spec: dict, lay: str, x0: torch.Tensor, rounds: int) -> dict[str, float]:
    """The stages of the problem's first block in `lay`, ms x the block count."""
    xs, K = tuple(x0.shape), spec["K"]
    p = ConvProblem.create("fwd", xs, (K, xs[1], 3, 3), dtype=torch.float32, layout=lay, padding=spec["padding"])
    plan = cw.make_plan(p, cw.choose_m(p))
    _, bufs = cw._carve(plan, torch.empty(plan.workspace_bytes(), dtype=torch.uint8))
    buf, blk, m = bufs[0], plan.blocks[0], plan.m
    x, y = to_layout(x0, lay), cw.empty_in_layout(p.y_shape, lay)
    (pt, pl), (H, W), (OH, OW) = p.pad_before, p.in_size, p.out_size
    P = cw._stage(plan, x, blk, buf["stage"], True)
    xb = x[blk.n0:blk.n1]
    Mp = torch.randn(plan.alpha ** 2, blk.nb * (blk.th1 - blk.th0) * plan.TW, K)
    r1 = min(m * blk.th1, OH)
    fns = {f"{lay} stage torch copy": lambda: P[:, :, pt:pt + H, pl:pl + W].copy_(xb)}
    if lay == "nchw":
        fns["nchw stage native"] = lambda: nat.wino_stage(xb, P.permute(0, 2, 3, 1), pt, pl)
        Yb = cw._phys_buffer(torch.empty(blk.nb * K * plan.thb * m * plan.TW * m),
                             (blk.nb, K, plan.thb * m, plan.TW * m), cw.NHWC)[:, :, :r1, :OW]

        def via_block() -> None:     # the output as before: an f32 nhwc block, then one copy
            nat.wino_output(Mp, None, Yb, m, plan.thb, plan.TW)
            y[blk.n0:blk.n1, :, :r1].copy_(Yb)
        fns["nchw output via nhwc block + copy"] = via_block
    fns[f"{lay} output in place"] = lambda: cw._output_transform(plan, Mp, blk, y, None, [], buf)
    return {k: v * len(plan.blocks) for k, v in timed(fns, rounds).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", default="rn50_r2_3x3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    nat = native.ops()
    assert nat is not None, "the native transforms are not built here"
    spec = next(s for s in json.loads(SUITE.read_text())["problems"] if s["name"] == a.problem)
    x0 = torch.randn(spec["N"], spec["C"], *spec["spatial"], generator=torch.Generator().manual_seed(0))
    res = {**layout_stages(nat, spec, "nchw", x0, a.rounds), **layout_stages(nat, spec, "nhwc", x0, a.rounds)}
    print(f"{a.problem}, {a.threads} threads, torch {torch.__version__}, ms per problem (median x blocks)")
    for k, v in res.items():
        print(f"  {k:38s} {v:7.3f}")


if __name__ == "__main__":
    main()
