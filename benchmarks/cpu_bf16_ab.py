"""bf16 CPU conv: this branch's AMX paths against the same code with them switched off
("old"), and torch, interleaved call by call in ONE process (seventh session, issue 16).

The machine's speed swings by up to 2x between runs (another process on the sibling
hyperthread), so separate before/after processes compare states, not code; here each
round runs new, torch and old back to back (order alternating) and reports the medians
of the per-round ratios torch/new and torch/old. "old" = REPLICATE_MAX_C* = 0 (no x
replicas), DY_CM_MIN_CF = inf (no channel-major dy), AMX_RELAYOUT off, and main's relayout
twin (x and y converted as whole tensors); the image-by-image channel-major staging copy
is not switched (it only serves the new paths and grouped nhwc).

  PYTHONPATH=$PWD python benchmarks/cpu_bf16_ab.py --threads 1 --out results/X.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_speed as cs  # noqa: E402

import nnprim.conv.cpu_gemm as cg  # noqa: E402
import nnprim.conv.cpu_tap as ct  # noqa: E402
from nnprim.args import ConvArgs  # noqa: E402
from nnprim.problems.conv import to_layout  # noqa: E402

NEW_FWD = cg.conv_fwd
NEW_STATE = dict(REPLICATE_MAX_C=ct.REPLICATE_MAX_C, REPLICATE_MAX_C_NCHW=ct.REPLICATE_MAX_C_NCHW,
                 DY_CM_MIN_CF=ct.DY_CM_MIN_CF)
OLD_STATE = dict(REPLICATE_MAX_C=0, REPLICATE_MAX_C_NCHW=0, DY_CM_MIN_CF=1 << 60)
MODES = ("fwd_bf16", "bwd_data_bf16", "bwd_weights_bf16", "bwd_bf16")


def old_fwd(plan, args, ws, y_layout=None):
    """main's conv_fwd: a relayout twin converts x in and y out as whole tensors."""
    if plan.via is not None:
        sub = plan.via
        y = NEW_FWD(sub, ConvArgs(x=to_layout(args.x, sub.p.layout), w=args.w), plan.carve(ws)[1]["via"])
        return to_layout(y, plan.p.layout)
    a = ConvArgs(x=to_layout(args.x, plan.p.layout), w=args.w, bias=args.bias, post_ops=args.post_ops)
    return NEW_FWD(plan, a, ws)


def state(new: bool) -> None:
    for k, v in (NEW_STATE if new else OLD_STATE).items():
        setattr(ct, k, v)
    cg.AMX_RELAYOUT = new
    cg.conv_fwd = NEW_FWD if new else old_fwd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--problems", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cg._RUN["fwd"] = lambda *x, **k: cg.conv_fwd(*x, **k)     # the invokers look it up per call
    suite = json.loads((Path(__file__).parents[1] / "nnprim/data/suites/conv_cpu.json").read_text())["problems"]
    if a.problems:
        suite = [s for s in suite if s["name"] in a.problems.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    recs = []
    for spec in suite:
        for mode in a.modes.split(","):
            with torch.set_grad_enabled(mode == "bwd_bf16"):
                fns, errs = {}, {}
                for lbl in ("new", "old"):
                    state(lbl == "new")
                    name, ours, peer, check, _ = cs.conv_case(spec, mode)

                    def run(ours=ours, new=(lbl == "new")):
                        state(new)
                        return ours()
                    fns[lbl] = run
                    errs[lbl] = check(run())
                fns["torch"] = peer
                ts: dict[str, list[float]] = {k: [] for k in fns}
                for f in fns.values():
                    f()
                for i in range(a.rounds):
                    for k in (("new", "torch", "old") if i % 2 == 0 else ("old", "torch", "new")):
                        t0 = time.perf_counter()
                        fns[k]()
                        ts[k].append(time.perf_counter() - t0)
            r = {k: statistics.median(p / o for p, o in zip(ts["torch"], ts[k])) for k in ("new", "old")}
            med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
            rec = dict(problem=spec["name"], mode=mode, solver=name, torch_ms=med["torch"], old_ms=med["old"],
                       new_ms=med["new"], ratio_old=r["old"], ratio_new=r["new"], err_new=errs["new"],
                       err_old=errs["old"])
            recs.append(rec)
            print(f"{spec['name']:18} {mode:16} {name:32} torch {med['torch']:6.2f} old {med['old']:6.2f} "
                  f"new {med['new']:6.2f}  x_old {r['old']:.2f} x_new {r['new']:.2f}  err {errs['new']:.1e}",
                  flush=True)
    summary = {}
    for m in dict.fromkeys(r["mode"] for r in recs):
        rs = [r for r in recs if r["mode"] == m]
        summary[m] = {k: cs.geomean(r[k] for r in rs) for k in ("ratio_old", "ratio_new")}
        print(f"{m:18} geomean x_old {summary[m]['ratio_old']:.2f} x_new {summary[m]['ratio_new']:.2f}")
    print("load", os.getloadavg())
    if a.out:
        Path(a.out).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=a.threads,
                                               rounds=a.rounds, load_avg_end=os.getloadavg(),
                                               summary=summary, results=recs), indent=1))


if __name__ == "__main__":
    main()
