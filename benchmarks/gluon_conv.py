"""Solver 27 `gluon_implicit_gemm_fwd` (Gluon, persistent, warp-specialised, Hopper) against
solver 20 `implicit_gemm_fwd` (Triton TMA convolution) and cuDNN, bf16 NHWC forward, in one run.

For each non-grouped forward problem of nnprim/data/suites/conv_gpu.json:
  1. applicability: the Gluon solver's not-applicable reasons are recorded (stride 2, C=3,
     1-D, 3-D) and the problem skipped;
  2. correctness first, at the real size: each of ours vs F.conv2d in f32 (TF32 off) on
     the same bf16 inputs, relative norm error (< 1e-2); a compile error or a wrong
     result is recorded and that candidate is not timed;
  3. timing through the public API (`nnprim.conv_forward(..., solver=...)`, the plan cached
     after the first call) and cuDNN (`torch.backends.cudnn.benchmark=True`, F.conv2d on
     channels_last), interleaved (nnprim.search.timing.interleaved_samples: CUDA events,
     warm-up, rotating order), median ms, TFLOP/s and the ratio vs cuDNN (> 1: faster).
The JSON (--out) is rewritten after every problem, so a timeout keeps what was measured.

  PYTHONUNBUFFERED=1 timeout 570 python benchmarks/gluon_conv.py --out $OUT/gluon_conv.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ["NNPRIM_GLUON"] = "1"  # measured even where the environment switches them off
import nnprim
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY
from nnprim.search.timing import interleaved_samples

SUITE = Path(__file__).parents[1] / "nnprim" / "data" / "suites" / "conv_gpu.json"
OURS = ("gluon_implicit_gemm_fwd", "implicit_gemm_fwd")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run_problem(spec: dict, rounds: int) -> dict:
    nd = len(spec["spatial"])
    x_shape = (spec["N"], spec["C"], *spec["spatial"])
    w_shape = (spec["K"], spec["C"], *spec["filter"])
    kw = dict(stride=spec["stride"], padding=spec["padding"], dilation=spec["dilation"])
    p = ConvProblem.create("fwd", x_shape, w_shape, dtype=torch.bfloat16, layout=spec["layout"], device="cuda", **kw)
    rec: dict = {"name": spec["name"], "problem": p.key(), "tflop": p.flops() / 1e12}
    reasons = REGISTRY.get("gluon_implicit_gemm_fwd").not_supported_reasons(p)
    if reasons:
        rec["skipped"] = reasons
        return rec
    fmt = torch.channels_last if nd == 2 else torch.channels_last_3d
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*x_shape, generator=g, device="cuda").to(torch.bfloat16).to(memory_format=fmt)
    w = (torch.randn(*w_shape, generator=g, device="cuda") / math.sqrt(math.prod(w_shape[1:])))
    w = w.to(torch.bfloat16).to(memory_format=fmt)
    conv = F.conv2d if nd == 2 else F.conv3d
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ref = conv(x.float(), w.float(), **kw)
    fns, names = [], []
    for name in OURS:
        try:
            t0 = time.perf_counter()
            y = nnprim.conv_forward(x, w, solver=name, **kw)
            torch.cuda.synchronize()
            rec[f"{name}_first_s"] = time.perf_counter() - t0
            err = rel_err(y, ref)
            rec[f"{name}_rel_err"] = err
            if not err < 1e-2:
                rec[f"{name}_error"] = f"wrong result: rel err {err:.3g}"
                continue
        except Exception as e:  # noqa: BLE001 - record compile/launch errors, keep going
            rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            traceback.print_exc()
            continue
        fns.append(lambda name=name: nnprim.conv_forward(x, w, solver=name, **kw))
        names.append(name)
    del ref
    torch.backends.cudnn.benchmark = True
    fns.append(lambda: conv(x, w, **kw))
    names.append("cudnn")
    samples = interleaved_samples(fns, "cuda", rounds=rounds, warmup=3)
    for name, s in zip(names, samples):
        ms = statistics.median(s)
        rec[f"{name}_ms"] = ms
        rec[f"{name}_tflops"] = p.flops() / ms / 1e9
    for name in names[:-1]:
        rec[f"{name}_vs_cudnn"] = rec["cudnn_ms"] / rec[f"{name}_ms"]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default=str(SUITE))
    ap.add_argument("--only", default="", help="comma-separated problem names")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    suite = [s for s in json.load(open(args.suite))["problems"] if s["groups"] == 1]
    if args.only:
        suite = [s for s in suite if s["name"] in args.only.split(",")]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "problems": []}
    for spec in suite:
        try:
            rec = run_problem(spec, args.rounds)
        except Exception as e:  # noqa: BLE001 - one problem's failure does not end the run
            rec = {"name": spec["name"], "error": f"{type(e).__name__}: {str(e)[:1500]}"}
        res["problems"].append(rec)
        ratios = {n: rec.get(f"{n}_vs_cudnn") for n in OURS}
        print(spec["name"], {k: (round(v, 3) if v else None) for k, v in ratios.items()},
              {k: v for k, v in rec.items() if k.endswith(("_tflops", "_error", "skipped"))}, flush=True)
        for n in OURS:
            rs = [r[f"{n}_vs_cudnn"] for r in res["problems"] if f"{n}_vs_cudnn" in r]
            if rs:
                res[f"{n}_geomean_vs_cudnn"] = math.exp(sum(math.log(r) for r in rs) / len(rs))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    print({k: v for k, v in res.items() if k.endswith("geomean_vs_cudnn")})


if __name__ == "__main__":
    main()
