"""The direct grouped solvers 83/84 with the channel-vector kernel and the in-kernel epilogue
("new") against the row kernel with the post-ops per chunk of images ("old") and torch, alternated
call by call in one process (twenty-fourth session, issue 16). x = median of per-round torch / ours.

  PYTHONPATH=$PWD python benchmarks/diag/cpu_group_vector_ab.py --modes fwd_f32,bwd_data_f32,fused_f32
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

import nnprim.conv.cpu_group_direct as gd  # noqa: E402

EPILOGUE = gd.epilogue


def set_new(new: bool) -> None:
    gd.USE_VECTOR_KERNEL = new
    gd.epilogue = EPILOGUE if new else (lambda p, ops: None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--modes", default="fwd_f32,bwd_data_f32,fused_f32")
    ap.add_argument("--problems", default="grouped_g8")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t = torch.ones(4 << 20)     # raise glibc's mmap threshold, as the suite's earlier problems do
    del t
    suite = json.loads((Path(__file__).parents[2] / "nnprim/data/suites/conv_cpu.json").read_text())["problems"]
    suite = [s for s in suite if s["name"] in a.problems.split(",")]
    recs = []
    for spec in suite:
        for mode in a.modes.split(","):
            name, ours, peer, check, fl = cs.conv_case(spec, mode)

            def run(new: bool, ours=ours):
                set_new(new)
                return ours()
            fns = {"new": lambda: run(True), "old": lambda: run(False), "torch": peer}
            errs = {k: check(fns[k]()) for k in ("new", "old")}
            med, x = alternate(fns, a.rounds)
            rec = dict(problem=spec["name"], mode=mode, solver=name, torch_ms=med["torch"], old_ms=med["old"],
                       new_ms=med["new"], x_old=x["old"], x_new=x["new"], gflops_new=fl / med["new"] / 1e6,
                       err_new=errs["new"], err_old=errs["old"])
            recs.append(rec)
            print(f"{spec['name']:12} {mode:13} torch {med['torch']:6.3f} old {med['old']:6.3f} new {med['new']:6.3f} ms"
                  f"  x_old {x['old']:.2f} x_new {x['new']:.2f}  new {rec['gflops_new']:.0f} GFLOP/s"
                  f"  err {errs['new']:.1e} ({errs['old']:.1e})", flush=True)
    set_new(True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=a.threads,
                                               rounds=a.rounds, results=recs), indent=1))


if __name__ == "__main__":
    main()
