"""`nnprim conv ...` and `nnprim attn ...`: run one problem, print the solver chosen,
the time and rate, and (by default) the error against the float64 reference."""
from __future__ import annotations

import argparse
import json

from ..errors import BadParameterError
from . import cases
from .timing import time_ms


def _ints(s: str) -> list[int]:
    try:
        return [int(v) for v in s.replace("x", ",").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="f32", help="f32, f16 or bf16 (default f32)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--solver", default=None, help="force a solver by name or id")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the float64 check")
    p.add_argument("--time", action="store_true", help="time the call (median of repeats)")
    p.add_argument("--reps", type=int, default=10, help="timed repeats (default 10)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")


def add_parser(sub) -> None:
    c = sub.add_parser("conv", help="run one convolution problem")
    c.add_argument("-n", "--batch", type=int, default=1)
    c.add_argument("-c", "--channels", type=int, required=True, help="input channels C")
    c.add_argument("-k", "--out-channels", type=int, required=True, help="output channels K")
    c.add_argument("--spatial", type=_ints, required=True, help="input size, e.g. 56,56 (1-3 dims)")
    c.add_argument("--filter", type=_ints, required=True, help="filter size, e.g. 3,3")
    c.add_argument("--stride", type=_ints, default=[1])
    c.add_argument("--pad", type=_ints, default=[0], help="padding per dim, or before,after pairs as 2*nd ints")
    c.add_argument("--dilation", type=_ints, default=[1])
    c.add_argument("-g", "--groups", type=int, default=1)
    c.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw")
    c.add_argument("--direction", choices=("fwd", "bwd_data", "bwd_weights"), default="fwd")
    c.add_argument("--bias", action="store_true")
    c.add_argument("--post", default="", help="post-op chain, e.g. sum,relu or binary_mul,gelu_erf")
    c.add_argument("--out-dtype", default=None)
    _common(c)
    c.set_defaults(func=run_conv)

    a = sub.add_parser("attn", help="run one attention problem")
    a.add_argument("-b", "--batch", type=int, default=1)
    a.add_argument("--hq", type=int, required=True, help="query heads")
    a.add_argument("--hkv", type=int, default=None, help="key/value heads (default hq)")
    a.add_argument("--sq", type=int, required=True)
    a.add_argument("--sk", type=int, default=None, help="keys (default sq)")
    a.add_argument("-d", "--head-dim", type=int, required=True)
    a.add_argument("--dv", type=int, default=None)
    a.add_argument("--causal", choices=("none", "top_left", "bottom_right"), default="none")
    a.add_argument("--mask", choices=("none", "bool", "additive"), default="none")
    a.add_argument("--dropout", type=float, default=0.0)
    a.add_argument("--kv-quant", choices=("s8", "u8", "s4", "u4"), default=None)
    a.add_argument("--group-size", type=int, default=None)
    a.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    _common(a)
    a.set_defaults(func=run_attn)


def _spatial_arg(v: list[int], nd: int, name: str):
    if len(v) == 1:
        return v[0]
    if len(v) == nd:
        return v
    raise BadParameterError(f"--{name} {v} must have 1 or {nd} values")


def _pad_arg(v: list[int], nd: int):
    if len(v) == 2 * nd:
        return [(v[2 * i], v[2 * i + 1]) for i in range(nd)]
    return _spatial_arg(v, nd, "pad")


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
        ms = time_ms(case.call, device=case.problem.device, reps=args.reps)
        res.update(time_ms=ms, tflops=cases.tflops(case.flops, ms), gbps=case.bytes / ms / 1e6)
    parts = [f"{res['problem']}", f"solver={s.name} ({s.family}, id {s.id})"]
    if "time_ms" in res:
        parts.append(f"{res['time_ms']:.4f} ms  {res['tflops'] * 1000:.1f} GFLOP/s  {res['gbps']:.1f} GB/s")
    if "rel_err" in res:
        parts.append(f"rel_err={res['rel_err']:.2e} {'OK' if ok else 'FAIL'} (tol {res['tolerance']:.0e})")
    print("  ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


def run_conv(args) -> int:
    nd = len(args.spatial)
    if not 1 <= nd <= 3 or len(args.filter) != nd:
        raise BadParameterError(f"--spatial {args.spatial} and --filter {args.filter} must both have 1-3 values")
    spec = dict(N=args.batch, C=args.channels, K=args.out_channels, spatial=args.spatial, filter=args.filter,
                stride=_spatial_arg(args.stride, nd, "stride"), padding=_pad_arg(args.pad, nd),
                dilation=_spatial_arg(args.dilation, nd, "dilation"), groups=args.groups, layout=args.layout)
    post = tuple(p for p in args.post.split(",") if p)
    case = cases.conv_case(spec, dtype=cases.parse_dtype(args.dtype), device=cases.pick_device(args.device),
                           direction=args.direction, bias=args.bias, post_ops=post, solver=args.solver,
                           out_dtype=cases.parse_dtype(args.out_dtype) if args.out_dtype else None)
    return report(case, args, args.direction)


def run_attn(args) -> int:
    spec = dict(B=args.batch, Hq=args.hq, Hkv=args.hkv or args.hq, Sq=args.sq, Sk=args.sk or args.sq,
                D=args.head_dim, Dv=args.dv or args.head_dim)
    case = cases.attn_case(spec, dtype=cases.parse_dtype(args.dtype), device=cases.pick_device(args.device),
                           direction=args.direction, causal=None if args.causal == "none" else args.causal,
                           mask=None if args.mask == "none" else args.mask, dropout_p=args.dropout,
                           kv_quant=args.kv_quant, group_size=args.group_size, solver=args.solver)
    return report(case, args, args.direction)
