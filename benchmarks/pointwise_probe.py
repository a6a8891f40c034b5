"""Probe of the 1x1 convolutions of the GPU conv suite (rn50 1x1 layers, NHWC bf16), issue 13:
forward and backward data through the public API, the default call (find in this process)
and each applicable GPU solver forced, against cuDNN (cudnn.benchmark=True) and a bare
torch.mm of the same GEMM, interleaved in the same rounds (CUDA events, median). Backward
weights: the default call and gemm_1x1_bwd_weights / gemm_bwd_weights /
implicit_gemm_bwd_weights / gluon_implicit_gemm_bwd_weights forced, timed in three separate
sets of rounds to show how stable each is. Writes JSON to --out.

    python benchmarks/pointwise_probe.py --out benchmarks/results/pointwise_probe.json"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from gluon_bench_common import rel

import nnprim
from nnprim.search.context import context
from nnprim.search.timing import interleaved_samples

ROOT = Path(__file__).resolve().parents[1]
CL = torch.channels_last
SOLVERS = {"fwd": ["gemm_1x1_fwd", "gemm_fwd", "implicit_gemm_fwd", "gluon_implicit_gemm_fwd"],
           "bwd_data": ["gemm_1x1_bwd_data", "gemm_bwd_data", "implicit_gemm_bwd_data",
                        "gluon_implicit_gemm_bwd_data"],
           "bwd_weights": ["gemm_1x1_bwd_weights", "gemm_bwd_weights", "implicit_gemm_bwd_weights",
                           "gluon_implicit_gemm_bwd_weights"]}


def calls(direction: str, x, w, dy):
    """{name: zero-argument call} for one direction: cuDNN, torch.mm, default, forced."""
    xs, ws = tuple(x.shape), tuple(w.shape)
    K, C = ws[0], ws[1]
    x2, dy2, w2 = x.permute(0, 2, 3, 1).reshape(-1, C), dy.permute(0, 2, 3, 1).reshape(-1, K), w.reshape(K, C)
    if direction == "fwd":
        live = {"cudnn": lambda: F.conv2d(x, w), "torch_mm": lambda: x2 @ w2.t(),
                "default": lambda: nnprim.conv_forward(x, w)}
        for s in SOLVERS[direction]:
            live[s] = lambda s=s: nnprim.conv_forward(x, w, solver=s)
    elif direction == "bwd_data":
        live = {"cudnn": lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, False, False])[0],
                "torch_mm": lambda: dy2 @ w2, "default": lambda: nnprim.conv_backward_data(dy, w, xs)}
        for s in SOLVERS[direction]:
            live[s] = lambda s=s: nnprim.conv_backward_data(dy, w, xs, solver=s)
    else:
        live = {"cudnn": lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])[1],
                "torch_mm": lambda: torch.mm(dy2.t(), x2, out_dtype=torch.float32),
                "default": lambda: nnprim.conv_backward_weights(dy, x, ws)}
        for s in SOLVERS[direction]:
            live[s] = lambda s=s: nnprim.conv_backward_weights(dy, x, ws, solver=s)
    return live


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    suite = json.loads((ROOT / "nnprim" / "data" / "suites" / "conv_gpu.json").read_text())["problems"]
    probs = [p for p in suite if p["filter"] == [1, 1] and p["stride"] == 1 and p["groups"] == 1]
    ctx = context(torch.device("cuda"))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "problems": []}
    for p in probs:
        torch.manual_seed(0)
        x = torch.randn(p["N"], p["C"], *p["spatial"], device="cuda").bfloat16().to(memory_format=CL)
        w = (torch.randn(p["K"], p["C"], 1, 1, device="cuda") / p["C"] ** 0.5).bfloat16().to(memory_format=CL)
        dy = torch.randn(p["N"], p["K"], *p["spatial"], device="cuda").bfloat16().to(memory_format=CL)
        for direction in ("fwd", "bwd_data", "bwd_weights"):
            live = calls(direction, x, w, dy)
            row = {"name": p["name"], "direction": direction, "ms": {}, "err": {}, "chosen": None}
            before = set(ctx.chosen)
            live["default"]()               # find runs here, before any solver is forced
            row["chosen"] = sorted(b.solver.name for k, b in list(ctx.chosen.items()) if k not in before)
            ref = live["cudnn"]().double()
            for n, fn in list(live.items()):
                try:
                    row["err"][n] = round(rel(fn(), ref), 5) if n not in ("torch_mm",) else None
                except Exception as e:  # noqa: BLE001 - a solver that does not apply
                    row["err"][n] = f"{type(e).__name__}: {str(e)[:120]}"
                    del live[n]
            names = list(live)
            reps = 3 if direction == "bwd_weights" else 1
            for _ in range(reps):
                samples = interleaved_samples([live[n] for n in names], "cuda", rounds=args.rounds, warmup=3)
                for n, ts in zip(names, samples):
                    row["ms"].setdefault(n, []).append(round(statistics.median(ts), 4))
            row["vs_cudnn"] = {n: round(row["ms"]["cudnn"][0] / row["ms"][n][0], 3) for n in names}
            result["problems"].append(row)
            best = sorted(((v[0], n) for n, v in row["ms"].items()))[:4]
            print(p["name"], direction, " ".join(f"{n}={ms:.4f}" for ms, n in best),
                  f"default={row['ms']['default']} {row['chosen']} cudnn={row['ms']['cudnn']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
