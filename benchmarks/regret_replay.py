"""Replay a `benchmarks/regret.py` run against the current selection code, without a GPU.

regret.py times every applicable solver of each held-out problem on the device (forced with
`solver=`, interleaved, same process) and stores those times. This script recomputes, on any
machine, what immediate mode (`fast`: exact db record, else the learned model over the
shipped system db, else the heuristic) and the heuristic alone would choose for each problem
now, and prices each choice with the stored device times: regret = time(choice) /
time(best forced) - 1. It lets a change to estimates or to the model be judged on real
held-out device measurements between device sessions. Problems whose key the system db
now holds are left out (they are no longer held out).

    python benchmarks/regret_replay.py benchmarks/results/regret_2026-11-30_biased_timing.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nnprim  # noqa: E402,F401  (registers the solvers)
from nnprim.search import finddb, immediate  # noqa: E402
from nnprim.search.keys import problem_from_key  # noqa: E402


def as_if_on_hopper() -> None:
    """The Gluon solvers check for an sm_90 GPU in their applicability; the replay prices
    H200 records on a machine without one, so a "no CUDA GPU" answer, alone, is taken back
    (Gluon missing, switched off or the interpreter still count)."""
    from nnprim import gluon_support
    from nnprim.attention import gluon_decode_quant, gluon_fwd
    from nnprim.conv import gluon_conv
    real = gluon_support.gluon_reasons

    def reasons(device: str) -> list[str]:
        out = real(device)
        return [] if device == "cuda" and len(out) == 1 and "needs a CUDA GPU" in out[0] else out
    gluon_fwd.gluon_reasons = gluon_conv.gluon_reasons = gluon_decode_quant.gluon_reasons = reasons


def _first_timed(sols, names: set[str]) -> tuple[str | None, str | None, list[str]]:
    """The first solution that was timed on the device, its source, and the solvers ranked
    above it that the run did not time (solvers added or newly applicable since the run, e.g.
    the stem solvers 70-72 or stride 2 in 28/29): the replay cannot price those, so it prices
    the next timed one instead and reports the choice as unpriced."""
    untimed = []
    for s in sols:
        if s.solver in names:
            return s.solver, s.source, untimed
        untimed.append(s.solver)
    return None, None, untimed


def heuristic_choice(p, fingerprint: str, names: set[str]) -> tuple[str | None, list[str]]:
    got = _first_timed(immediate.heuristic_solutions(p, immediate.Constraints(fingerprint)), names)
    return got[0], got[2]


def fast_choice(p, fingerprint: str, names: set[str]) -> tuple[str | None, str | None, list[str]]:
    return _first_timed(immediate.get_solutions(p, constraints=immediate.Constraints(fingerprint)), names)


def geomean_regret(vals: list[float]) -> float:
    return math.exp(statistics.fmean(math.log1p(max(v, -0.99)) for v in vals)) - 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="JSON written by benchmarks/regret.py --out")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    run = json.load(open(args.run))
    fp = run["fingerprint"]
    if "cuda" in fp:
        as_if_on_hopper()
    sdb = finddb.system_db()
    known = {r.problem_key.split("|")[0] for r in sdb.for_device(fp, finddb.SOLVER_SET_VERSION)} if sdb else set()
    rows, skipped = [], []
    for r in run["rows"]:
        times = {n: t for n, t in r.get("times_ms", {}).items() if n != "<default>"}
        if not times:
            continue
        if r["key"] in known:
            skipped.append((r["name"], "in the system db now"))
            continue
        p = problem_from_key(r["key"])
        if p is None:
            skipped.append((r["name"], "key not parsed"))
            continue
        best = min(times.values())
        fast, src, fast_untimed = fast_choice(p, fp, set(times))
        heur, heur_untimed = heuristic_choice(p, fp, set(times))
        row = dict(name=r["name"], key=r["key"], best=min(times, key=times.get), fast=fast, fast_source=src,
                   heuristic=heur, unpriced=dict(fast=fast_untimed, heuristic=heur_untimed),
                   recorded_fast=r.get("fast"), recorded_heuristic=r.get("heuristic"),
                   regret=dict(fast=None if fast is None else times[fast] / best - 1.0,
                               heuristic=None if heur is None else times[heur] / best - 1.0,
                               recorded_fast=(times[r["fast"]] / best - 1.0) if r.get("fast") in times else None,
                               recorded_heuristic=(times[r["heuristic"]] / best - 1.0)
                               if r.get("heuristic") in times else None))
        rows.append(row)
    summary = {}
    for mode in ("fast", "heuristic", "recorded_fast", "recorded_heuristic"):
        vals = [(row["regret"][mode], row["name"]) for row in rows if row["regret"][mode] is not None]
        if vals:
            worst = sorted(vals, key=lambda v: -v[0])[:3]
            unpriced = sum(1 for row in rows if row["unpriced"].get(mode))
            summary[mode] = dict(problems=len(vals), unpriced=unpriced, geomean=geomean_regret([v for v, _ in vals]),
                                 max=max(v for v, _ in vals), worst=[dict(name=n, regret=round(v, 4)) for v, n in worst])
    print(f"{'problem':34} {'best':26} {'fast (now)':26} {'regret':>7} {'heuristic (now)':26} {'regret':>7}")
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for row in rows:
        g = row["regret"]
        mf, mh = ("*" if row["unpriced"][m] else " " for m in ("fast", "heuristic"))
        print(f"{row['name']:34} {row['best']:26} {str(row['fast']):25}{mf} {pct(g['fast']):>7} "
              f"{str(row['heuristic']):25}{mh} {pct(g['heuristic']):>7}")
    print()
    for mode in ("fast", "heuristic"):
        unp = [(row["name"], row["unpriced"][mode]) for row in rows if row["unpriced"][mode]]
        if unp:  # the regret above is of the next timed solver, not of the choice
            print(f"* {mode}: {len(unp)} choices not timed in this run, priced as the next timed solver: "
                  + "; ".join(f"{n} ({', '.join(u)})" for n, u in unp))
    for mode, s in summary.items():
        worst = ", ".join(f"{w['name']} {100 * w['regret']:.0f}%" for w in s["worst"])
        print(f"{mode:20} {s['problems']:3d} problems ({s['unpriced']} unpriced)  geomean {100 * s['geomean']:6.2f}%  "
              f"max {100 * s['max']:7.1f}%  "
              f"worst: {worst}")
    if skipped:
        print(f"left out: {len(skipped)} ({', '.join(f'{n}: {why}' for n, why in skipped[:5])})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(source=args.run, fingerprint=fp, summary=summary, rows=rows, skipped=skipped), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
