"""CPU flash attention (solvers 115/116) against torch's CPU scaled_dot_product_attention,
in one run.

Problems: B=1, H=8, (S=1024, D=64) and (S=2048, D=128), f32 and bf16, no mask.
Modes (`default` is the public call, which the ratios report; the solvers' invokers follow):
  fwd      ours: nnprim.sdpa under no_grad (its find picks 115 or 117 cpu_flash_fwd_native),
           115's and 117's invokers
           peer: F.scaled_dot_product_attention (no grad)
  fwd_bwd  ours: nnprim.sdpa + .backward through autograd, and 115 + 116's invokers
           peer: F.scaled_dot_product_attention + .backward
Each problem is first checked against a float64 torch reference (o and dq, dk, dv).
Every variant of ours and the peer are timed alternately for --rounds rounds (median of
--reps calls each after a warm-up); the reported time is the median over rounds; other
jobs share this machine, so the spread (min/max over rounds) is kept too. The whole run
is repeated for each thread count in --threads.

  PYTHONUNBUFFERED=1 python benchmarks/attention_cpu.py \
      --out benchmarks/results/attention_cpu_2026-11-29.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# the default (hybrid) find mode on a fresh find-db, as a new user's first calls: the warm-up
# call of each problem runs find, the timed calls run its choice
os.environ.setdefault("NNPRIM_CACHE_DIR", tempfile.mkdtemp(prefix="nnprim_attention_cpu_"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import cpu_flash as cf  # noqa: E402
from nnprim.attention import cpu_flash_native as cfn  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402

PROBLEMS = [dict(B=1, H=8, S=1024, D=64), dict(B=1, H=8, S=2048, D=128)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TARGET = 1.0    # issue 16: torch's CPU SDPA speed, f32 and bf16


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


def check(q, k, v, do) -> dict:
    """Relative errors of ours (public API, autograd) against float64 torch."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = F.scaled_dot_product_attention(q64, k64, v64)
    o64.backward(do.double())
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = nnprim.sdpa(qa, ka, va, solver="cpu_flash_fwd")
    o.backward(do)
    return {"o": rel_err(o.detach(), o64.detach()), "dq": rel_err(qa.grad, q64.grad),
            "dk": rel_err(ka.grad, k64.grad), "dv": rel_err(va.grad, v64.grad)}


def bench(spec: dict, dname: str, reps: int, rounds: int, log) -> list[dict]:
    dtype = DTYPES[dname]
    B, H, S, D = spec["B"], spec["H"], spec["S"], spec["D"]
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(4))
    errs = check(q, k, v, do)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ok = all(e < tol for e in errs.values())
    log(f"  check {dname} S={S} D={D}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
        + ("" if ok else "  FAILED"))
    p = AttentionProblem.from_tensors(q, k, v, return_lse=True)
    pb = p.with_direction("bwd")
    args = AttnArgs(q, k, v)
    plans, bplans = {"default": cf.plan(p)}, {"default": cf.plan(pb)}
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

    def peer_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v)

    def peer_fb():
        F.scaled_dot_product_attention(qa, ka, va).backward(do)

    def ours_api_fb():
        nnprim.sdpa(qa, ka, va).backward(do)

    def ours_fb(n):
        o, lse = cf.cpu_forward(p, args, plans[n])
        cf.cpu_backward(pb, AttnArgs(q, k, v, do=do, o=o, lse=lse), bplans[n])

    ops = cfn.LIBRARY.ops()

    def api_fwd():
        with torch.no_grad():
            return nnprim.sdpa(q, k, v)

    runs = {
        "fwd": {"torch": peer_fwd, "default": api_fwd, "torchops_115": lambda: cf.cpu_forward(p, args, plans["default"]),
                **({"native_117": lambda: cfn.forward(p, args, ops)} if ops is not None else {})},
        "fwd_bwd": {"torch": peer_fb, "default": ours_api_fb, "invokers_115_116": lambda: ours_fb("default")},
    }
    flops = 4.0 * B * H * S * S * D
    out = []
    for mode, fns in runs.items():
        for fn in fns.values():
            fn()                                           # warm-up
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, fn in fns.items():
                times[n].append(timeit(fn, reps))
        med = {n: statistics.median(t) for n, t in times.items()}
        mode_flops = flops * (3.5 if mode == "fwd_bwd" else 1.0)
        best = min((n for n in fns if n != "torch"), key=med.get)
        rec = {"problem": f"b{B}h{H}s{S}d{D}", **spec, "dtype": dname, "mode": mode,
               "threads": torch.get_num_threads(), "check": errs, "check_ok": ok,
               "ms": med, "ms_min": {n: min(t) for n, t in times.items()},
               "ms_max": {n: max(t) for n, t in times.items()},
               "gflops": {n: mode_flops / (t * 1e6) for n, t in med.items()},
               "speedup_default": med["torch"] / med["default"],
               "best_variant": best, "speedup_best": med["torch"] / med[best],
               "plan_115": vars(plans["default"])}
        out.append(rec)
        log(f"  {mode:8s} torch {med['torch']:8.2f} ms | ours default {med['default']:8.2f} ms "
            f"(x{rec['speedup_default']:.2f}) | best {best} {med[best]:8.2f} ms (x{rec['speedup_best']:.2f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/attention_cpu_2026-11-29.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="2,1", help="comma-separated intra-op thread counts")
    a = ap.parse_args()
    log = print
    results = []
    for th in (int(x) for x in a.threads.split(",")):
        torch.set_num_threads(th)
        log(f"threads={th}")
        for spec in PROBLEMS:
            for dname in DTYPES:
                results.extend(bench(spec, dname, a.reps, a.rounds, log))
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "load_avg": os.getloadavg(), "reps": a.reps, "rounds": a.rounds,
            "plan_115": {"tile_elems": cf._TILE_ELEMS, "kv_block": cf._KV_BLOCK},
            "blocks_117": {"q_block": cfn.Q_BLOCK, "kv_block": cfn.KV_BLOCK, "kv_block_vnni": cfn.KV_BLOCK_VNNI}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    log(f"\nwrote {a.out}\n")
    log(f"{'thr':>3} {'problem':16s} {'dt':4s} {'mode':8s} {'torch ms':>9s} {'ours ms':>9s} {'x':>5s} "
        f"{'best':>12s} {'x':>5s} {'GF/s torch/ours':>16s} check")
    for r in results:
        log(f"{r['threads']:>3} {r['problem']:16s} {r['dtype']:4s} {r['mode']:8s} {r['ms']['torch']:9.2f} "
            f"{r['ms']['default']:9.2f} {r['speedup_default']:5.2f} {r['best_variant']:>12s} "
            f"{r['speedup_best']:5.2f} {r['gflops']['torch']:7.0f}/{r['gflops']['default']:<7.0f} "
            f"{'ok' if r['check_ok'] else 'FAIL'}")
    for th in sorted({r["threads"] for r in results}, reverse=True):
        for mode in ("fwd", "fwd_bwd"):
            for dname in DTYPES:
                xs = [r["speedup_default"] for r in results if r["threads"] == th and r["mode"] == mode
                      and r["dtype"] == dname]
                if xs:
                    gm = 1.0
                    for x in xs:
                        gm *= x
                    gm **= 1 / len(xs)
                    log(f"threads={th} {mode} {dname} geomean torch/ours = x{gm:.2f} (target x{TARGET})")


if __name__ == "__main__":
    main()
