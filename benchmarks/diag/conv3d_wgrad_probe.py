"""3-D backward weights on the H200: solver 36 `conv3d_via_2d_bwd_weights` (one 2-D weight
gradient per depth tap over tall images, nnprim/conv/conv3d_slices.py) against Triton 22
(`implicit_gemm_bwd_weights`, the 3-D kernel), the default call and cuDNN, interleaved in one
process (nnprim.search.timing: device events, the order rotated per round, median), each
checked against a float64 reference first. Problems: the suite's c3d_3x3x3 and two variants.

    PYTHONPATH=$PWD python benchmarks/diag/conv3d_wgrad_probe.py --out $OUT/conv3d_wgrad.json"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import nnprim
from nnprim.search.timing import interleaved_samples

PROBLEMS = {   # name: (N, C, D, H, W, K), 3x3x3, padding 1, NDHWC bf16
    "c3d_3x3x3": (8, 64, 16, 56, 56, 128),
    "c3d_c128": (8, 128, 8, 28, 28, 128),
    "c3d_c256": (4, 256, 8, 14, 14, 256),
}
SOLVERS = ("conv3d_via_2d_bwd_weights", "implicit_gemm_bwd_weights")


def wgrad_torch(dy, x, w):
    return torch.ops.aten.convolution_backward(dy, x, w, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1,
                                               [False, True, False])[1]


def probe(name: str, dims: tuple[int, ...], rounds: int) -> dict:
    """One problem: every implementation checked against float64, then timed interleaved."""
    N, C, D, H, W, K = dims
    cl = torch.channels_last_3d
    torch.manual_seed(0)
    x = torch.randn(N, C, D, H, W, device="cuda").to(torch.bfloat16).to(memory_format=cl)
    w = (torch.randn(K, C, 3, 3, 3, device="cuda") / (3 * C ** 0.5)).to(torch.bfloat16).to(memory_format=cl)
    dy = torch.randn(N, K, D, H, W, device="cuda").to(torch.bfloat16).to(memory_format=cl)
    ref = wgrad_torch(dy.double(), x.double(), w.double())
    fns = {"cudnn": lambda: wgrad_torch(dy, x, w),
           "default": lambda: nnprim.conv_backward_weights(dy, x, tuple(w.shape), padding=1)}
    for s in SOLVERS:
        fns[s] = (lambda s=s: nnprim.conv_backward_weights(dy, x, tuple(w.shape), padding=1, solver=s))
    row = dict(name=name, shape=list(dims), err={}, ms={})
    live = {}
    for n, f in fns.items():
        try:
            out = f()
            row["err"][n] = float((out.double() - ref).norm() / ref.norm())
            live[n] = f
        except Exception as e:  # noqa: BLE001 - a solver that does not serve the problem
            row["err"][n] = f"{type(e).__name__}: {str(e)[:200]}"
    names = list(live)
    for n, ts in zip(names, interleaved_samples([live[n] for n in names], "cuda", rounds=rounds, warmup=3)):
        row["ms"][n] = round(statistics.median(ts), 4)
    flops = 2 * N * D * H * W * K * C * 27
    row["x_cudnn"] = {n: round(row["ms"]["cudnn"] / t, 3) for n, t in row["ms"].items()}
    row["tflops"] = {n: round(flops / t / 1e9, 1) for n, t in row["ms"].items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="conv3d_wgrad.json")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for name, dims in PROBLEMS.items():
        rows.append(probe(name, dims, a.rounds))
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
