"""Selection regret on held-out problems (nnprim.testing.heldout: random layers of ResNet,
ConvNeXt, UNet, EfficientNet, ViT, Llama, Mistral, Whisper and decode, never a suite problem).

For each problem, through the public API, in one process and one timed run:
  hybrid     the default call (find mode hybrid, empty user db: its first call runs find)
  fast       immediate mode with no find (NNPRIM_FIND_MODE=fast semantics: an empty user
             db, the shipped system db and the learned model, else the heuristic)
  heuristic  the heuristic (estimate) ranking alone
  forced     every applicable solver forced with solver=
The choices of fast and heuristic are made first, against an empty user db (nothing this run
finds can leak into them). Then the default call and every forced solver are timed in
interleaved rounds (CUDA events, warm-up, median; L2 flushed between runs for problems larger
than L2, as find does). regret = time(choice) / time(best forced) - 1; hybrid's is the
default call's own time. Tables (geomean, max, worst problems) to stdout, JSON to --out.

    python benchmarks/regret.py --count 60 --seed 1 --out benchmarks/results/regret.json
    python benchmarks/regret.py --device cpu --count 3          # CPU smoke test (tiny sizes)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from nnprim.cli.cases import attn_case, conv_case  # noqa: E402
from nnprim.cli.problem_args import attn_problem, conv_problem, default_dtype, pick_device  # noqa: E402
from nnprim.search import context, finddb, immediate, modes  # noqa: E402
from nnprim.search.ranking import heuristic_order, interpreted  # noqa: E402
from nnprim.search.timing import interleaved_samples, l2_flusher, l2_policy  # noqa: E402
from nnprim.testing.heldout import FAMILIES, generate  # noqa: E402

MODES = ("hybrid", "fast", "heuristic")


def _fresh_cache(tmp: str, name: str) -> None:
    os.environ["NNPRIM_CACHE_DIR"] = os.path.join(tmp, name)
    finddb.forget_dbs()
    context.reset()


def _problem(h, dtype, device):
    if h.kind == "conv":
        return conv_problem(h.spec, dtype=dtype, device=device, direction=h.direction)
    return attn_problem(h.spec, dtype=dtype, device=device, direction=h.direction)


def _case(h, dtype, device, seed):
    if h.kind == "conv":
        return conv_case(h.spec, dtype=dtype, device=device, direction=h.direction, seed=seed)
    return attn_case(h.spec, dtype=dtype, device=device, direction=h.direction, seed=seed)


def _candidates(p) -> list:
    """Every applicable solver worth forcing: not the reference, not Triton in the interpreter."""
    ctx = context.for_problem(p)
    out = [s for s in heuristic_order(p, workspace_limit=ctx.workspace_limit())
           if s.family != "reference" and not interpreted(s, p)]
    return out


def choices_without_find(problems) -> list[dict]:
    """fast and heuristic choices of each problem (against the current, empty, user db)."""
    modes.set_find_mode("fast")
    out = []
    for p in problems:
        c = context.for_problem(p).constraints(p)
        row = {}
        try:
            sols = immediate.get_solutions(p, 1, constraints=c)
            row["fast"], row["fast_source"] = (sols[0].solver, sols[0].source) if sols else (None, None)
        except Exception as e:
            row["fast"], row["fast_source"] = None, f"error: {e}"
        cands = _candidates(p)
        row["heuristic"] = cands[0].name if cands else None
        out.append(row)
    modes.set_find_mode("hybrid")
    return out


def measure(h, p, choice: dict, dtype, device, reps: int, seed: int) -> dict:
    case = _case(h, dtype, device, seed)
    row = dict(name=h.name, family=h.family, key=p.key(), **choice)
    t0 = time.perf_counter()
    case.call_with(None)  # the default call's first call: find (hybrid, empty user db)
    if device == "cuda":
        torch.cuda.synchronize()
    row["first_call_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    row["hybrid"] = case.solver().name
    fns, names = [lambda: case.call_with(None)], ["<default>"]
    for s in _candidates(p):
        try:
            case.call_with(s.name)  # compile and check that it runs
        except Exception as e:
            row.setdefault("failed", {})[s.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            continue
        fns.append(lambda n=s.name: case.call_with(n))
        names.append(s.name)
    ws = max((s.workspace_size(p) for s in _candidates(p)), default=0)
    flush = l2_flusher(device) if l2_policy(p, ws) == "cold" else None
    samples = interleaved_samples(fns, device, rounds=reps, warmup=2, flush=flush)
    times = {n: statistics.median(t) for n, t in zip(names, samples)}
    row["times_ms"] = {n: round(t, 5) for n, t in times.items()}
    row["l2"] = "cold" if flush is not None else "warm"
    forced = {n: t for n, t in times.items() if n != "<default>"}
    if not forced:
        row["skipped"] = "no solver could be forced"
        return row
    best = min(forced, key=forced.get)
    row["best"], row["best_ms"] = best, forced[best]
    row["regret"] = {
        "hybrid": times["<default>"] / forced[best] - 1.0,
        "hybrid_choice": forced[row["hybrid"]] / forced[best] - 1.0 if row["hybrid"] in forced else None,
        "fast": forced[row["fast"]] / forced[best] - 1.0 if row.get("fast") in forced else None,
        "heuristic": forced[row["heuristic"]] / forced[best] - 1.0 if row.get("heuristic") in forced else None,
    }
    return row


def summarise(rows: list[dict]) -> dict:
    out = {}
    for mode in (*MODES, "hybrid_choice"):
        vals = [(r["regret"][mode], r["name"], r.get(mode if mode != "hybrid_choice" else "hybrid"), r["best"])
                for r in rows if r.get("regret") and r["regret"].get(mode) is not None]
        if not vals:
            out[mode] = dict(problems=0)
            continue
        g = math.exp(statistics.fmean(math.log1p(max(v[0], -0.99)) for v in vals)) - 1.0
        worst = sorted(vals, key=lambda v: -v[0])[:5]
        out[mode] = dict(problems=len(vals), geomean=g, max=max(v[0] for v in vals),
                         worst=[dict(name=n, regret=round(r, 4), chose=c, best=b) for r, n, c, b in worst])
    return out


def print_tables(rows: list[dict], summary: dict, file=sys.stdout) -> None:
    print(f"{'problem':<34} {'best':<26} {'best ms':>9} {'hybrid':>8} {'fast':>8} {'heur':>8}  fast source",
          file=file)
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for r in rows:
        if not r.get("regret"):
            print(f"{r['name']:<34} {r.get('skipped', '?')}", file=file)
            continue
        g = r["regret"]
        print(f"{r['name']:<34} {r['best']:<26} {r['best_ms']:>9.4f} {pct(g['hybrid']):>8} {pct(g['fast']):>8} "
              f"{pct(g['heuristic']):>8}  {r.get('fast_source')}", file=file)
    print(file=file)
    print(f"{'mode':<14} {'problems':>8} {'geomean':>9} {'max':>9}  worst", file=file)
    for mode, s in summary.items():
        if not s.get("problems"):
            print(f"{mode:<14} {0:>8}", file=file)
            continue
        worst = ", ".join(f"{w['name']} {100 * w['regret']:.1f}% ({w['chose']} vs {w['best']})" for w in s["worst"][:3])
        print(f"{mode:<14} {s['problems']:>8} {100 * s['geomean']:>8.2f}% {100 * s['max']:>8.1f}%  {worst}", file=file)


def held_out(count: int, seed: int, fams, scale: str, dtype, device: str):
    """`count` generated problems whose keys the system db does not hold (build-system finds
    layers of the same families with another seed: an exact hit would not be held out)."""
    sdb = finddb.system_db()
    fp = finddb.device_fingerprint(device)
    known = {r.problem_key for r in sdb.for_device(fp, finddb.SOLVER_SET_VERSION)} if sdb is not None else set()
    held, problems = [], []
    for h in generate(4 * count, seed, fams, scale=scale):
        p = _problem(h, dtype, device)
        if p.key() not in known and len(held) < count:
            held.append(h)
            problems.append(p)
    return held, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--families", default=None, help=f"comma list of {','.join(FAMILIES)} (default all)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default bf16 on CUDA, f32 on CPU")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (default 25 CUDA, 5 CPU)")
    ap.add_argument("--scale", default=None, choices=("full", "tiny"), help="default full on CUDA, tiny on CPU")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--workers", type=int, default=8, help="parallel compile processes on a GPU first (1: none)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds after which no new problem is measured (the rest are reported skipped)")
    args = ap.parse_args(argv)
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    device = pick_device(args.device)
    dtype = default_dtype(args.dtype, device)
    scale = args.scale or ("full" if device == "cuda" else "tiny")
    reps = args.reps or (25 if device == "cuda" else 5)
    fams = args.families.split(",") if args.families else None
    held, problems = held_out(args.count, args.seed, fams, scale, dtype, device)
    old_cache, old_mode = os.environ.get("NNPRIM_CACHE_DIR"), modes.get_find_mode()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nnprim-regret-") as tmp:
        try:
            _fresh_cache(tmp, "fast")
            choices = choices_without_find(problems)
            _fresh_cache(tmp, "hybrid")
            if device == "cuda" and args.workers > 1:  # every candidate's kernels into Triton's cache
                from nnprim.warmup import warmup
                warmup(problems, workers=args.workers, find=False)
            for i, (h, p, ch) in enumerate(zip(held, problems, choices)):
                if deadline is not None and time.monotonic() > deadline:
                    rows.append(dict(name=h.name, family=h.family, key=p.key(), skipped="time budget spent"))
                    continue
                print(f"[{i + 1}/{len(held)}] {h.name} {p.key()}", file=sys.stderr, flush=True)
                try:
                    rows.append(measure(h, p, ch, dtype, device, reps, args.seed + i))
                except Exception as e:  # one problem failing must not lose the others
                    rows.append(dict(name=h.name, family=h.family, key=p.key(),
                                     skipped=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
                if device == "cuda":
                    torch.cuda.empty_cache()
        finally:
            modes.set_find_mode(old_mode)
            finddb.forget_dbs()
            context.reset()
            if old_cache is None:
                os.environ.pop("NNPRIM_CACHE_DIR", None)
            else:
                os.environ["NNPRIM_CACHE_DIR"] = old_cache
    summary = summarise(rows)
    print_tables(rows, summary)
    if args.out:
        dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump(dict(device=dev_name, fingerprint=finddb.device_fingerprint(device), count=args.count,
                           seed=args.seed, scale=scale, dtype=str(dtype), reps=reps,
                           system_db_records=(finddb.system_db().count() if finddb.system_db() else 0),
                           summary=summary, problems=[h.to_json() for h in held], rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
