"""`nnprim conv ...` and `nnprim attn ...`: run one problem, print the solver chosen,
the time and rate, and (by default) the error against the float64 reference."""
from __future__ import annotations

import argparse
import json

from ..search.timing import bench_ms
from . import cases
from .problem_args import (
    add_attn_args,
    add_conv_args,
    attn_spec,
    conv_spec,
    default_dtype,
    parse_dtype,
    pick_device,
    positive_int,
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--solver", default=None, help="force a solver by name or id")
    p.add_argument("--verify", dest="verify", action="store_true", default=True,
                   help="check against the float64 reference (the default)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the float64 check")
    p.add_argument("--time", action="store_true", help="time the call (median of repeats)")
    p.add_argument("--reps", type=positive_int, default=30, help="timed repeats (default 30)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")


def add_parser(sub) -> None:
    c = sub.add_parser("conv", help="run one convolution problem")
    add_conv_args(c)
    c.add_argument("--post", default="", help="post-op chain, e.g. sum,relu or binary_mul,gelu_erf")
    c.add_argument("--out-dtype", default=None)
    _common(c)
    c.set_defaults(func=run_conv)

    a = sub.add_parser("attn", help="run one attention problem")
    add_attn_args(a)
    _common(a)
    a.set_defaults(func=run_attn)


def report(case: cases.Case, args, direction: str) -> int:
    s = case.solver(args.solver)
    res = dict(problem=case.problem.key(), solver=s.name, family=s.family, solver_id=s.id,
               direction=direction)
    out = case.call()  # first call: find (hybrid mode) and compile happen here
    del out
    ok = True
    if args.verify:
        err = case.check()
        tol = cases.tolerance(case.problem.dtype)
        ok = err == err and err <= tol
        res.update(rel_err=err, tolerance=tol, verified=ok)
    if args.time:
        ms = bench_ms(case.call, case.problem.device, repeats=args.reps)
        res.update(time_ms=ms, tflops=cases.tflops(case.flops, ms), tbps=case.bytes / ms / 1e9)
        if case.peer is not None:
            pms = bench_ms(case.peer, case.problem.device, repeats=args.reps)
            res.update(peer_ms=pms, speedup=pms / ms)
    parts = [f"{res['problem']}", f"solver={s.name} ({s.family}, id {s.id})"]
    if "time_ms" in res:
        parts.append(f"{res['time_ms']:.4f} ms  {res['tflops']:.2f} TFLOP/s  {res['tbps']:.3f} TB/s")
        if "peer_ms" in res:
            parts.append(f"torch {res['peer_ms']:.4f} ms (x{res['speedup']:.2f})")
    if "rel_err" in res:
        parts.append(f"rel_err={res['rel_err']:.2e} {'OK' if ok else 'FAIL'} (tol {res['tolerance']:.0e})")
    print("  ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


def run_conv(args) -> int:
    post = tuple(p for p in args.post.split(",") if p)
    if post and args.direction != "fwd":
        from ..errors import BadParameterError
        raise BadParameterError(f"--post {args.post} applies to --direction fwd only, not {args.direction}")
    device = pick_device(args.device)
    case = cases.conv_case(conv_spec(args), dtype=default_dtype(args.dtype, device), device=device,
                           direction=args.direction, bias=args.bias, post_ops=post, solver=args.solver,
                           out_dtype=parse_dtype(args.out_dtype) if args.out_dtype else None)
    return report(case, args, args.direction)


def run_attn(args) -> int:
    device = pick_device(args.device)
    case = cases.attn_case(attn_spec(args), dtype=default_dtype(args.dtype, device), device=device,
                           direction=args.direction, causal=None if args.causal == "none" else args.causal,
                           mask=None if args.mask == "none" else args.mask, dropout_p=args.dropout,
                           kv_quant=args.kv_quant, group_size=args.group_size, solver=args.solver)
    return report(case, args, args.direction)
