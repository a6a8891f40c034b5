"""`nnprim bench --suite NAME|FILE`: run a benchmark suite (the JSON format of
nnprim/data/suites/), verify each problem, time ours and torch's own op (alternating, run by run:
`paired_ms`), print a table."""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from ..errors import BadParameterError
from ..search.timing import bench_ms, interleaved_samples
from . import cases
from .plot import plot_rows
from .problem_args import default_dtype, pick_device, positive_int
from .suites import load_suite


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="run a benchmark suite with verification and torch peers")
    b.add_argument("--suite", required=True, help="suite name (conv_cpu, conv_gpu, attention_gpu, decode_quant_gpu) or JSON file")
    b.add_argument("--dtype", default=None, help="f32, f16 or bf16 (default: bf16 on cuda, f32 on cpu)")
    b.add_argument("--device", default="auto")
    b.add_argument("--direction", default="fwd", help="comma list: fwd,bwd_data,bwd_weights (conv) or fwd,bwd")
    b.add_argument("--scale", type=positive_int, default=1, help="divide batch sizes by this (quick runs)")
    b.add_argument("--limit", type=positive_int, default=None, help="run only the first N problems")
    b.add_argument("--only", default=None, help="comma list of problem names")
    b.add_argument("--reps", type=positive_int, default=30, help="timed runs per problem (median; default 30); with the peer, "
                   "rounds of one run each, alternating")
    b.add_argument("--no-verify", dest="verify", action="store_false")
    b.add_argument("--no-peer", dest="peer", action="store_false", help="skip timing torch's own op")
    b.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false",
                   help="leave torch.backends.cudnn.benchmark as it is (default: on, so cuDNN picks its "
                        "fastest algorithm, as users after speed run it)")
    b.add_argument("--json", default=None, metavar="FILE")
    b.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the ratios to torch and the roofline positions (PNG; needs matplotlib)")
    b.add_argument("--from-json", default=None, metavar="FILE",
                   help="with --plot: draw a previous run's JSON instead of running the suite")
    b.set_defaults(func=run_bench)


def _scaled(spec: dict, scale: int, key: str) -> dict:
    s = dict(spec)
    s[key] = max(1, int(s[key]) // scale)
    return s


def paired_ms(ours, peer, device: str, reps: int) -> tuple[float, float, float]:
    """(our median ms, the peer's, the median of the per-round ratios peer / ours): one run of
    each per round, the order alternating (nnprim.search.timing.interleaved_samples), so a
    machine whose speed drifts during the run (other jobs, clocks) moves both sides alike."""
    ours_ms, peer_ms = interleaved_samples([ours, peer], device, rounds=reps, warmup=3)
    ratio = statistics.median(p / max(o, 1e-9) for o, p in zip(ours_ms, peer_ms))
    return statistics.median(ours_ms), statistics.median(peer_ms), ratio


def run_bench(args) -> int:
    if args.from_json:
        if not args.plot:
            raise BadParameterError("--from-json needs --plot FILE")
        try:
            data = json.loads(Path(args.from_json).read_text())
            rows = data["rows"]
        except (OSError, ValueError, KeyError) as e:
            raise BadParameterError(f"--from-json {args.from_json}: not a bench JSON ({e})") from None
        plot_rows(rows, args.plot, data.get("suite", ""))
        return 0
    if args.scale < 1:
        raise BadParameterError(f"--scale={args.scale} must be >= 1")
    kind, probs = load_suite(args.suite)
    device = pick_device(args.device)
    dtype = default_dtype(args.dtype, device)
    if device == "cuda" and args.cudnn_benchmark:
        import torch
        torch.backends.cudnn.benchmark = True
    dirs = [d for d in args.direction.split(",") if d]
    valid = ("fwd", "bwd_data", "bwd_weights") if kind == "conv" else ("fwd", "bwd")
    for d in dirs:
        if d not in valid:
            raise BadParameterError(f"--direction {d!r} is not one of {valid} for a {kind} suite")
    if args.only:
        names = {n for n in args.only.split(",") if n}
        unknown = sorted(names - {p.get("name") for p in probs})
        if unknown:
            raise BadParameterError(f"--only names {unknown} are not in the suite "
                                    f"({', '.join(str(p.get('name')) for p in probs)})")
        probs = [p for p in probs if p.get("name") in names]
    probs = probs[: args.limit] if args.limit else probs
    rows, failed = [], 0
    total = len(probs) * len(dirs)
    i = 0
    for spec in probs:
        for d in dirs:
            i += 1
            if kind == "attention" and d == "bwd" and spec.get("mode") == "decode":
                continue
            name = spec.get("name", "?")
            print(f"[{i}/{total}] {name} {d} ...", file=sys.stderr, flush=True)
            if kind == "conv":
                case = cases.conv_case(_scaled(spec, args.scale, "N"), dtype=dtype, device=device, direction=d)
            else:
                case = cases.attn_case(_scaled(spec, args.scale, "B"), dtype=dtype, device=device, direction=d)
            row = dict(name=name, direction=d, dtype=str(dtype).replace("torch.", ""), device=device)
            try:
                s = case.solver()
                case.call()
                row.update(solver=s.name, family=s.family)
                if args.verify:
                    err = case.check()
                    row["rel_err"] = err
                    row["ok"] = bool(err == err and err <= cases.tolerance(dtype))
                    failed += not row["ok"]
                if args.peer and case.peer is not None:
                    ms, pms, speedup = paired_ms(case.call, case.peer, device, args.reps)
                    row.update(peer_ms=pms, peer_tflops=cases.tflops(case.flops, pms), speedup=speedup)
                else:
                    ms = bench_ms(case.call, device, repeats=args.reps)
                row.update(ms=ms, tflops=cases.tflops(case.flops, ms), tbps=case.bytes / ms / 1e9)
            except (BadParameterError, NotImplementedError) as e:
                row["error"] = str(e).splitlines()[0]
                failed += 1
            rows.append(row)
            if args.json:  # after every problem: a run stopped early keeps what it measured
                Path(args.json).write_text(json.dumps(dict(suite=args.suite, rows=rows), indent=1))
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(suite=args.suite, rows=rows), indent=1))
    if args.plot:
        plot_rows(rows, args.plot, args.suite)
    return 1 if failed else 0


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"


def _print_table(rows: list[dict]) -> None:
    hdr = (f"{'problem':24} {'dir':11} {'solver':26} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>7} {'torch ms':>9} "
           f"{'x torch':>8} {'rel_err':>9}")
    print(hdr)
    print("-" * len(hdr))
    speedups = []
    for r in rows:
        if "error" in r:
            print(f"{r['name'][:24]:24} {r['direction']:11} ERROR: {r['error']}")
            continue
        if "speedup" in r:
            speedups.append(r["speedup"])
        print(f"{r['name'][:24]:24} {r['direction']:11} {r.get('solver', '-')[:26]:26} {_fmt(r.get('ms'), '9.3f')} "
              f"{_fmt(r.get('tflops'), '8.2f')} {_fmt(r.get('tbps'), '7.3f')} {_fmt(r.get('peer_ms'), '9.3f')} "
              f"{_fmt(r.get('speedup'), '8.2f')} {_fmt(r.get('rel_err'), '9.1e')}"
              + ("" if r.get("ok", True) else "  FAIL"))
    if speedups:
        gm = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"geometric mean speed-up over torch: {gm:.2f}x over {len(speedups)} problems")
