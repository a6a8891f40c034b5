"""CPU GEMM convolution (solvers 10-12) against torch's own CPU convolution, in one run.

Modes, per problem of nnprim/data/suites/conv_cpu.json:
  fwd_bf16   ours bf16 -> bf16           vs torch F.conv*d in bf16
  fwd_f32    ours f32                    vs torch F.conv*d in f32 (oneDNN)
  bwd_bf16   ours bwd_data + bwd_weights vs torch's bf16 autograd backward (dx and dw)
  fused_f32  ours conv + bias + Sum(residual) + ReLU fused  vs torch eager f32
Each problem is checked against torch in f32 (bf16 inputs upcast) first. Every
config variant of ours and the peer are timed alternately for --rounds rounds
(median of --reps calls each, after a warm-up); the reported time is the median over
rounds (other jobs share this machine: the spread is reported too).

  PYTHONUNBUFFERED=1 python benchmarks/conv_cpu.py --out benchmarks/results/conv_cpu_DATE.json

--before DIR adds the variant "before": cpu_gemm.py / cpu_im2col.py from DIR (e.g. an
earlier commit's, `git show REV:nnprim/conv/cpu_gemm.py`), timed in the same rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnprim.args import ConvArgs  # noqa: E402
from nnprim.conv.cpu_gemm import CpuGemmConfig, prepare_with  # noqa: E402
from nnprim.post_ops import Eltwise, Sum  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
VARIANTS = {   # "default" is what the registered solvers use
    "default": CpuGemmConfig(),
    "blk_4M": CpuGemmConfig(block_bytes=4 << 20),
    "blk_16M": CpuGemmConfig(block_bytes=16 << 20),
    "pool_4M": CpuGemmConfig(threads="pool", block_bytes=4 << 20),
    "mkl_gemm": CpuGemmConfig(gemm="matmul"),
    "col2im": CpuGemmConfig(bwd_data_as_fwd=False),
    "no_wide": CpuGemmConfig(wide=0.0),
    "f32_gemm": CpuGemmConfig(bf16_gemm="f32"),
    "native_bf16": CpuGemmConfig(bf16_gemm="native"),
}


def load_before(d: str):
    """Module `cpu_gemm` as it is in directory d (with its own cpu_im2col), solvers not
    registered; its default config is the variant "before"."""
    im = Path(d, "cpu_im2col.py").read_text()
    gm = Path(d, "cpu_gemm.py").read_text()
    gm = gm.replace("from .cpu_im2col import", "from .cpu_im2col_before import").replace("@register\n", "")
    for name, src in (("nnprim.conv.cpu_im2col_before", im), ("nnprim.conv.cpu_gemm_before", gm)):
        mod = types.ModuleType(name)
        mod.__package__ = "nnprim.conv"
        sys.modules[name] = mod
        exec(compile(src, f"{d}/{name}", "exec"), mod.__dict__)
    return sys.modules["nnprim.conv.cpu_gemm_before"]


def preparer(variant):
    """(prepare function, config) of a variant."""
    return variant if isinstance(variant, tuple) else (prepare_with, variant)
TARGETS = {"fwd_bf16": 6.0, "fwd_f32": 0.7, "bwd_bf16": 4.0, "fused_f32": 1.3}


def timeit(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def problem_tensors(spec: dict, dtype: torch.dtype, seed: int = 0):
    nd = len(spec["spatial"])
    g = torch.Generator().manual_seed(seed)
    C, K, G = spec["C"], spec["K"], spec["groups"]
    x = torch.randn(spec["N"], C, *spec["spatial"], generator=g)
    w = torch.randn(K, C // G, *spec["filter"], generator=g) / math.sqrt(C // G * math.prod(spec["filter"]))
    kw = dict(stride=spec["stride"], padding=spec["padding"], dilation=spec["dilation"], groups=G)
    lay = spec["layout"]
    x, w = to_layout(x.to(dtype), lay), to_layout(w.to(dtype), lay)
    return nd, x, w, kw


def bench_problem(spec: dict, modes: list[str], variants: dict, reps: int, rounds: int, log) -> list[dict]:
    return [bench_mode(spec, mode, variants, reps, rounds, log) for mode in modes]


def bench_mode(spec: dict, mode: str, variants: dict, reps: int, rounds: int, log) -> dict:
    lay = spec["layout"]
    dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float32
    nd, x, w, kw = problem_tensors(spec, dtype)
    direction = "fwd"
    p = ConvProblem.create("fwd", x.shape, w.shape, dtype=dtype, layout=lay, **kw)
    conv = CONV[nd]
    with torch.no_grad():
        y32 = conv(x.float(), w.float(), None, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
    dy = to_layout(torch.randn(p.y_shape, generator=torch.Generator().manual_seed(3)).to(dtype), lay)
    if mode in ("fwd_bf16", "fwd_f32"):
        args = ConvArgs(x=x, w=w)
        ours = {k: preparer(c)[0](p, preparer(c)[1]) for k, c in variants.items()}
        run = {k: (lambda inv=inv: inv(args)) for k, inv in ours.items()}
        ref = y32
        check = lambda out: rel_err(out, ref)  # noqa: E731

        def peer():
            with torch.no_grad():
                return conv(x, w, None, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
    elif mode == "fused_f32":
        b = torch.randn(p.K)
        res = to_layout(torch.randn(p.y_shape), lay)
        ops = (Sum(res), Eltwise("relu"))
        pf = ConvProblem.create("fwd", x.shape, w.shape, dtype=dtype, layout=lay, has_bias=True,
                                post_ops=tuple(o.signature() for o in ops), **kw)
        args = ConvArgs(x=x, w=w, bias=b, post_ops=ops)
        ours = {k: preparer(c)[0](pf, preparer(c)[1]) for k, c in variants.items()}
        run = {k: (lambda inv=inv: inv(args)) for k, inv in ours.items()}
        ref = torch.relu(y32 + b.view(1, -1, *([1] * nd)) + res)
        check = lambda out: rel_err(out, ref)  # noqa: E731

        def peer():
            with torch.no_grad():
                return torch.relu(conv(x, w, b, kw["stride"], kw["padding"], kw["dilation"], kw["groups"]) + res)
    else:   # bwd_bf16
        direction = "bwd"
        pd = ConvProblem.create("bwd_data", x.shape, w.shape, dtype=dtype, layout=lay, **kw)
        pw = ConvProblem.create("bwd_weights", x.shape, w.shape, dtype=dtype, layout=lay, **kw)
        args = ConvArgs(x=x, w=w, dy=dy)
        ours = {k: (preparer(c)[0](pd, preparer(c)[1]), preparer(c)[0](pw, preparer(c)[1]))
                for k, c in variants.items()}
        run = {k: (lambda inv=inv: (inv[0](args), inv[1](args))) for k, inv in ours.items()}
        xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
        yr = conv(xr, wr, None, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
        ref = torch.autograd.grad(yr, (xr, wr), dy.float())
        check = lambda out: max(rel_err(out[0], ref[0]), rel_err(out[1], ref[1]))  # noqa: E731
        xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        yb = conv(xb, wb, None, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])

        def peer():
            return torch.autograd.grad(yb, (xb, wb), dy, retain_graph=True)
    errs = {k: check(f()) for k, f in run.items()}
    peer_err = check(peer())
    peer()
    for f in run.values():
        f()
    times = {k: [] for k in run}
    times["torch"] = []
    peer_reps = max(1, min(reps, 3)) if dtype == torch.bfloat16 else reps
    for _ in range(rounds):
        times["torch"].append(timeit(peer, peer_reps))
        for k, f in run.items():
            times[k].append(timeit(f, reps))
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in run), key=lambda k: med[k])
    flops = p.flops() * (2 if direction == "bwd" else 1)
    rec = dict(problem=spec["name"], layout=lay, mode=mode, gflop=flops / 1e9,
               torch_ms=med["torch"], torch_gflops=flops / med["torch"] / 1e6,
               ours_ms={k: med[k] for k in run}, best=best, best_ms=med[best],
               ours_gflops=flops / med[best] / 1e6, speedup=med["torch"] / med[best],
               spread={k: [min(v), max(v)] for k, v in times.items()},
               rel_err=errs, torch_rel_err=peer_err)
    log(f"{spec['name']:<20} {mode:<10} torch {med['torch']:8.2f} ms  ours best {best:<9} "
        f"{med[best]:7.2f} ms  x{rec['speedup']:.2f}  ({rec['ours_gflops']:.0f} GF/s)  "
        f"err {max(errs.values()):.1e}")
    return rec


def geomean(v):
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(Path(__file__).parents[1] / "nnprim" / "data" / "suites" / "conv_cpu.json"))
    ap.add_argument("--modes", default="fwd_bf16,fwd_f32,bwd_bf16,fused_f32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--problems", default="")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--before", default="", help="directory with the earlier cpu_gemm.py and cpu_im2col.py")
    a = ap.parse_args()
    suite = json.loads(Path(a.suite).read_text())["problems"]
    if a.problems:
        suite = [s for s in suite if s["name"] in a.problems.split(",")]
    variants = {k: VARIANTS[k] for k in a.variants.split(",")}
    if a.before:
        old = load_before(a.before)
        variants["before"] = (old.prepare_with, old.CpuGemmConfig())
    modes = a.modes.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    recs = []
    for spec in suite:
        recs += bench_problem(spec, modes, variants, a.reps, a.rounds, print)
    summary = {}
    print("\nmode        geomean speedup (best variant per problem)  target  | per variant")
    for m in modes:
        rs = [r for r in recs if r["mode"] == m]
        g = geomean([r["speedup"] for r in rs])
        per_var = {k: geomean([r["torch_ms"] / r["ours_ms"][k] for r in rs]) for k in variants}
        summary[m] = dict(geomean_speedup=g, target=TARGETS[m], met=g >= TARGETS[m], per_variant=per_var)
        pv = "  ".join(f"{k} x{v:.2f}" for k, v in per_var.items())
        print(f"{m:<11} x{g:6.2f}  target x{TARGETS[m]}  {'MET' if g >= TARGETS[m] else 'short'}  | {pv}")
    out = dict(date=time.strftime("%Y-%m-%d"), machine=f"{platform.node()} cpu, {os.cpu_count()} cores",
               torch=torch.__version__, threads=torch.get_num_threads(), reps=a.reps, rounds=a.rounds,
               variants={k: vars(preparer(v)[1]) for k, v in variants.items()}, summary=summary,
               results=recs)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
        print("wrote", a.out)


if __name__ == "__main__":
    main()
