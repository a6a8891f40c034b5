"""bf16 on avx512_bf16 without AMX, our own vdpbf16ps kernels ("new") against the same solvers
with them switched off ("old": a cpu_brgemm flag, torch's brgemm instead) and torch, alternated
call by call in one process (twenty-third session, issue 16). x = median of per-round torch / ours.
--flag USE_OWN_WGRAD (cpu_wgrad's backward weights) or USE_OWN_FWD_TILE (the in-place forward's
tile: forward, and stride-1 backward data through its forward twin).

  PYTHONPATH=$PWD python benchmarks/diag/cpu_own_kernels_ab.py --flag USE_OWN_WGRAD --mode bwd_weights_bf16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cpu_speed as cs  # noqa: E402
from ab_rounds import alternate  # noqa: E402

import nnprim.conv.cpu_brgemm as cb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--mode", default="bwd_weights_bf16")
    ap.add_argument("--flag", default="USE_OWN_WGRAD", choices=["USE_OWN_WGRAD", "USE_OWN_FWD_TILE"])
    ap.add_argument("--problems", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    suite = json.loads((Path(__file__).parents[2] / "nnprim/data/suites/conv_cpu.json").read_text())["problems"]
    if a.problems:
        suite = [s for s in suite if s["name"] in a.problems.split(",")]
    recs = []
    for spec in suite:
        name, ours, peer, check, fl = cs.conv_case(spec, a.mode)

        def run(new: bool, ours=ours):
            setattr(cb, a.flag, new)
            return ours()
        fns = {"new": lambda: run(True), "old": lambda: run(False), "torch": peer}
        errs = {k: check(fns[k]()) for k in ("new", "old")}
        med, x = alternate(fns, a.rounds)
        rec = dict(problem=spec["name"], solver=name, torch_ms=med["torch"], old_ms=med["old"], new_ms=med["new"],
                   x_old=x["old"], x_new=x["new"], gflops_new=fl / med["new"] / 1e6, err_new=errs["new"],
                   err_old=errs["old"])
        recs.append(rec)
        print(f"{spec['name']:18} torch {med['torch']:6.2f} old {med['old']:6.2f} new {med['new']:6.2f} ms  "
              f"x_old {x['old']:.2f} x_new {x['new']:.2f}  new {rec['gflops_new']:.0f} GFLOP/s  "
              f"err {errs['new']:.1e} ({errs['old']:.1e})", flush=True)
    for k in ("x_old", "x_new"):
        print(k, f"{cs.geomean(r[k] for r in recs):.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=a.threads,
                                               mode=a.mode, flag=a.flag, rounds=a.rounds, results=recs), indent=1))


if __name__ == "__main__":
    main()
