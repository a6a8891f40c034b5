"""Why a fused conv + bias + residual + ReLU call can lose to torch eager (fused_conv.py,
2026-12-02 s21: rn50_r5_1x1 0.080 ms against eager's 0.058 where the plain forward runs at
1.15x cuDNN). Per problem: the default fused call (find on its first call), the plain
forward (no post-ops, no bias), every applicable solver forced on the fused call, and torch
eager, timed interleaved (device events, median); plus `nnprim.explain` of the fused problem
(what find measured and chose). --plans adds the Gluon forward's plan run directly on the
fused problem with the residual prefetched during the tile's wgmmas (the default) and read
after them (`GluonTile.res_prefetch`), each output checked against the other. JSON to --out.

    python benchmarks/diag/fused_choice.py --out $OUT/fused_choice.json [--plans]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import nnprim  # noqa: E402
from nnprim.cli.cases import conv_case  # noqa: E402
from nnprim.cli.suites import load_suite  # noqa: E402
from nnprim.search.explain import rows  # noqa: E402
from nnprim.search.random_args import random_args  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

DEFAULT = "rn50_r5_1x1,rn50_r5_3x3,unet_640_32x32,rn50_r4_1x1,rn50_r4_3x3,rn50_r2_3x3"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--plans", action="store_true", help="the Gluon plan with and without the residual prefetch")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    suite = {q["name"]: q for q in load_suite("conv_gpu")[1]}
    out = []
    for name in a.only.split(","):
        spec = dict(suite[name])
        if a.device == "cpu":  # the script itself at toy sizes
            spec["N"] = 1
        fused = conv_case(spec, dtype=dtype, device=a.device, bias=True, post_ops=("sum", "relu"))
        plain = conv_case(spec, dtype=dtype, device=a.device)
        fused.call_with(None)
        plain.call_with(None)
        chosen = fused.solver().name
        text = nnprim.explain(fused.problem, file=None)
        names = [r.name for r in rows(fused.problem) if r.applicable and not r.reasons and r.family != "reference"]
        fns = {"default": lambda f=fused: f.call_with(None), "plain_default": lambda c=plain: c.call_with(None),
               "eager": fused.peer}
        for s in names:
            fns[f"forced:{s}"] = (lambda s=s, f=fused: f.call_with(s))
        errs = {}
        if a.plans and "gluon_implicit_gemm_fwd" in names:
            from nnprim.conv import gluon_conv
            args = random_args(fused.problem, seed=1)
            tile = gluon_conv.tile_config(fused.problem)
            for pf in (True, False):
                plan = gluon_conv.GluonConvPlan(fused.problem, dataclasses.replace(tile, res_prefetch=pf))
                fns[f"plan:res_prefetch={pf}"] = (lambda plan=plan, args=args: plan(args))
            ya, yb = (fns[f"plan:res_prefetch={pf}"]().float() for pf in (True, False))
            errs["plan:max_abs_diff"] = float((ya - yb).abs().max())
        for k in list(fns):
            try:
                fns[k]()
            except Exception as e:  # noqa: BLE001 - a forced solver that cannot run is reported
                errs[k] = f"{type(e).__name__}: {e}"[:200]
                del fns[k]
        samples = interleaved_samples(list(fns.values()), a.device, rounds=a.rounds, warmup=3)
        ms = {k: statistics.median(s) for k, s in zip(fns, samples)}
        row = dict(name=name, chosen=chosen, plain_chosen=plain.solver().name, ms=ms, errors=errs, explain=text)
        out.append(row)
        print(f"{name}: chosen {chosen} (plain {row['plain_chosen']})")
        for k, v in sorted(ms.items(), key=lambda kv: kv[1]):
            print(f"   {k:<44} {v:.4f} ms")
        print(text)
    with open(a.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", rows=out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
