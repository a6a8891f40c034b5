"""In-process A/B of the CPU brgemm forward's (solver 80) ways to read x, with torch's
convolution in the same rounds:
  whole        all of x staged first (the state before, 2026-12-02)
  in_place     (a 3-wide, pad-1 last dim of stride 2 (nineteenth session) or 1 (twentieth), NHWC:
               `reads_in_place`) x read in place
Conv suite problems, forward (plain, and with bias + Sum + ReLU on the NHWC ones), bf16 and
f32, where in_place applies (rn50_r3_3x3s2_nhwc, rn50_r2_3x3_nhwc). Two harnesses: pairs (the
default) times each variant against torch in pairs (ours, torch),
as benchmarks/cpu_speed.py does, variants in turn, `--reps` times; --rotate interleaves all
variants and torch call by call. The rotation favoured variants whose buffers stay in cache
between other variants' calls (a staging per block, since removed, measured 1.10-1.15x there
and 0.91x in pairs on rn50_r2_3x3_nhwc bf16): pairs is what the suite sees.

    PYTHONPATH=$PWD python benchmarks/diag/brgemm_s2_in_place_ab.py --threads 2 [--problems rn50_r2_3x3_nhwc]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nnprim.args import ConvArgs
from nnprim.conv import cpu_brgemm
from nnprim.post_ops import Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout

SUITE = Path(__file__).resolve().parents[2] / "nnprim" / "data" / "suites" / "conv_cpu.json"
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


VARIANTS = {"whole": False, "in_place": True}


def prepared(p: ConvProblem, in_place: bool):
    """Solver 80 prepared with reads_in_place forced off, or as it is."""
    orig = cpu_brgemm.reads_in_place
    cpu_brgemm.reads_in_place = lambda p: in_place and orig(p)
    try:
        return cpu_brgemm.CpuBrgemmFwd().prepare(p)
    finally:
        cpu_brgemm.reads_in_place = orig


def case(spec: dict, dt: torch.dtype, fused: bool):
    g = torch.Generator().manual_seed(0)
    C, K, G, lay = spec["C"], spec["K"], spec["groups"], spec["layout"]
    kw = dict(stride=spec["stride"], padding=spec["padding"], dilation=spec["dilation"], groups=G)
    x = to_layout(torch.randn(spec["N"], C, *spec["spatial"], generator=g).to(dt), lay)
    w = to_layout((torch.randn(K, C // G, *spec["filter"], generator=g)
                   / math.sqrt(C // G * math.prod(spec["filter"]))).to(dt), lay)
    conv, targs = CONV[len(spec["spatial"])], (kw["stride"], kw["padding"], kw["dilation"], G)
    if not fused:
        p = ConvProblem.create("fwd", x.shape, w.shape, dtype=dt, layout=lay, **kw)
        return p, ConvArgs(x=x, w=w), lambda: conv(x, w, None, *targs)
    b = torch.randn(K, generator=g).to(dt)
    p0 = ConvProblem.create("fwd", x.shape, w.shape, dtype=dt, layout=lay, **kw)
    res = to_layout(torch.randn(p0.y_shape, generator=g).to(dt), lay)
    ops = (Sum(res), Eltwise("relu"))
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=dt, layout=lay, has_bias=True,
                           post_ops=tuple(o.signature() for o in ops), **kw)
    return p, ConvArgs(x=x, w=w, bias=b, post_ops=ops), lambda: torch.relu(conv(x, w, b, *targs) + res)


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def rotate(calls: dict, rounds: int) -> dict:
    """All variants and torch call by call, the order rotated per round: {name: [seconds]}."""
    ts = {k: [] for k in calls}
    for f in calls.values():
        f()
    for r in range(rounds):
        for k in list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]:
            ts[k].append(timed(calls[k]))
    return ts


def pairs(calls: dict, rounds: int, reps: int) -> dict:
    """Each variant against torch in (ours, torch) pairs, `rounds` a turn, variants in turn `reps`
    times: {name: [seconds]}, {"torch_" + name: [seconds]}."""
    ts = {k: [] for k in calls if k != "torch"} | {"torch_" + k: [] for k in calls if k != "torch"}
    for _ in range(reps):
        for k in (k for k in calls if k != "torch"):
            calls[k](), calls["torch"]()
            for _ in range(rounds):
                ts[k].append(timed(calls[k]))
                ts["torch_" + k].append(timed(calls["torch"]))
    return ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="pairs (or rotations) per turn")
    ap.add_argument("--reps", type=int, default=3, help="turns of every variant (pairs)")
    ap.add_argument("--rotate", action="store_true", help="interleave all variants call by call")
    ap.add_argument("--problems", default="")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    specs = json.loads(SUITE.read_text())["problems"]
    want = set(filter(None, a.problems.split(",")))
    rows = []
    for spec in specs:
        if want and spec["name"] not in want:
            continue
        for dn in a.dtypes.split(","):
            dt = {"bf16": torch.bfloat16, "f32": torch.float32}[dn]
            for fused in (False, True) if spec["layout"] == "nhwc" else (False,):
                p, args, peer = case(spec, dt, fused)
                if not cpu_brgemm.CpuBrgemmFwd().is_applicable(p):
                    continue
                names = [v for v in VARIANTS if v != "in_place" or cpu_brgemm.reads_in_place(p)]
                if len(names) < 2:
                    continue
                fns = {v: prepared(p, VARIANTS[v]) for v in names}
                ref = fns["whole"](args).float()
                err = max(((f(args).float() - ref).norm() / ref.norm()).item() for f in fns.values())
                calls = {v: (lambda f=f, args=args: f(args)) for v, f in fns.items()}
                calls["torch"] = peer
                ts = rotate(calls, a.rounds) if a.rotate else pairs(calls, a.rounds, a.reps)
                peer_of = (lambda k: "torch") if a.rotate else (lambda k: "torch_" + k)
                med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
                ratio = lambda u, v, ts=ts: statistics.median(x / y for x, y in zip(ts[u], ts[v]))  # noqa: E731
                row = dict(problem=spec["name"], dtype=dn, fused=fused, harness="rotate" if a.rotate else "pairs",
                           **{f"{k}_ms": v for k, v in med.items()},
                           **{f"torch_over_{k}": ratio(peer_of(k), k) for k in names}, rel_diff=err)
                for k in names[1:]:      # per-pair ratios against torch, over whole's
                    row[f"{k}_speedup"] = row[f"torch_over_{k}"] / row["torch_over_whole"]
                rows.append(row)
                print(f"{spec['name']:19s} {dn:4s} {'fused' if fused else 'plain':5s} "
                      + " ".join(f"{k} {med[k]:.3f}" for k in names) + " | x whole: "
                      + " ".join(f"{k} {row[k + '_speedup']:.2f}" for k in names[1:]) + " | torch/: "
                      + " ".join(f"{k} {row['torch_over_' + k]:.2f}" for k in names) + f" | diff {err:.0e}",
                      flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(threads=a.threads, rounds=a.rounds, reps=a.reps, rows=rows), indent=1))


if __name__ == "__main__":
    main()
