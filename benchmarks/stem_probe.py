"""Probe of the small-channel stem solvers (70/71/72, nnprim/conv/stem.py) on rn50_conv1
(N=128, C=3, 224x224, K=64, 7x7, stride 2, padding 3, NHWC bf16), issue 13.

For each direction: every tile variant in stem.VARIANTS through its plan (correctness
against an f32 cuDNN reference without TF32, then time), the public API call
(nnprim.conv_forward / conv_backward_data / conv_backward_weights, which runs find on
its first call) and cuDNN (F.conv2d / aten.convolution_backward with one gradient,
cudnn.benchmark=True), all in this process. Times: CUDA events around batches of calls,
median over batches, after warm-up. Writes JSON to --out.

    python benchmarks/stem_probe.py --out benchmarks/results/stem_probe.json"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv import stem
from nnprim.problems.conv import ConvProblem

STRIDE, PAD = 2, 3
TOL = 1e-2    # relative norm error, bf16 (DESIGN.md)


def time_ms(fn, batch: int = 10, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / batch)
    return statistics.median(times)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def bwd(dy, x, w, mask):
    return torch.ops.aten.convolution_backward(dy, x, w, None, [STRIDE] * 2, [PAD] * 2, [1, 1], False, [0, 0], 1,
                                               mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=128)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    t_start = time.time()
    cl = torch.channels_last
    torch.manual_seed(0)
    xs, ws = (args.n, 3, 224, 224), (64, 3, 7, 7)
    x = torch.randn(xs, device="cuda").to(torch.bfloat16).to(memory_format=cl)
    w = (torch.randn(ws, device="cuda") / 147 ** 0.5).to(torch.bfloat16).to(memory_format=cl)
    dy = torch.randn(args.n, 64, 112, 112, device="cuda").to(torch.bfloat16).to(memory_format=cl)
    xf, wf, dyf = x.float(), w.float(), dy.float()
    refs = {"fwd": F.conv2d(xf, wf, stride=STRIDE, padding=PAD),
            "bwd_data": bwd(dyf, xf, wf, [True, False, False])[0],
            "bwd_weights": bwd(dyf, xf, wf, [False, True, False])[1]}
    cudnn = {"fwd": lambda: F.conv2d(x, w, stride=STRIDE, padding=PAD),
             "bwd_data": lambda: bwd(dy, x, w, [True, False, False])[0],
             "bwd_weights": lambda: bwd(dy, x, w, [False, True, False])[1]}
    api = {"fwd": lambda: nnprim.conv_forward(x, w, stride=STRIDE, padding=PAD),
           "bwd_data": lambda: nnprim.conv_backward_data(dy, w, xs, stride=STRIDE, padding=PAD),
           "bwd_weights": lambda: nnprim.conv_backward_weights(dy, x, ws, stride=STRIDE, padding=PAD)}
    cargs = ConvArgs(x=x, w=w, dy=dy)
    out: dict = {"problem": f"rn50_conv1 N={args.n} bf16 nhwc", "device": torch.cuda.get_device_name(), "results": {}}
    for d in ("fwd", "bwd_data", "bwd_weights"):
        p = ConvProblem.create(d, xs, ws, dtype=torch.bfloat16, layout="nhwc", device="cuda",
                               stride=STRIDE, padding=PAD)
        res = out["results"][d] = {"variants": []}
        t = time_ms(cudnn[d])
        res["cudnn_ms"] = t
        res["cudnn_err"] = rel(cudnn[d](), refs[d])
        for tile in stem.VARIANTS[d]:
            row = {"tile": repr(tile), "default": tile == stem.DEFAULT_TILES[d]}
            try:
                pl = stem.plan(p, tile)
                row["err"] = rel(pl(cargs), refs[d])
                row["ok"] = row["err"] < TOL
                row["ms"] = time_ms(lambda pl=pl: pl(cargs))
                row["x_cudnn"] = t / row["ms"]
            except Exception as e:  # noqa: BLE001 - record and go on with the other variants
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["variants"].append(row)
            print(d, row, flush=True)
        ya = api[d]()
        res["api_err"] = rel(ya, refs[d])
        res["api_ms"] = time_ms(api[d])
        res["api_x_cudnn"] = t / res["api_ms"]
        sols = nnprim.get_solutions(p, max_count=3)
        res["api_solutions"] = [repr(s) for s in sols]
        ok = [v for v in res["variants"] if v.get("ok")]
        if ok:
            best = min(ok, key=lambda v: v["ms"])
            res["best_variant"], res["best_ms"], res["best_x_cudnn"] = best["tile"], best["ms"], t / best["ms"]
        print(d, {k: v for k, v in res.items() if k != "variants"}, flush=True)
    out["wall_s"] = time.time() - t_start
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
