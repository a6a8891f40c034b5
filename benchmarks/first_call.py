"""First-call time of a new shape whose kernel variant is already compiled (issue 15 target:
<= 50 ms). For each case: forced solver (no find) on a first shape (compiles), then the first
call of new shapes of the same kernel (new image size / sequence lengths), timed wall-clock
with device syncs; a second call shows the steady state. Run in a fresh process with a fresh
NNPRIM_CACHE_DIR so that Triton's disk cache is cold at the start. JSON to --out.

    python benchmarks/first_call.py --out benchmarks/results/first_call.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("NNPRIM_CACHE_DIR", tempfile.mkdtemp(prefix="nnprim-first-"))

import torch  # noqa: E402

import nnprim  # noqa: E402


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def conv_calls(solver: str, direction: str):
    def make(hw: int, n: int = 8, c: int = 64, k: int = 64):
        x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        w = torch.randn(k, c, 3, 3, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        if direction == "fwd":
            return lambda: nnprim.conv_forward(x, w, padding=1, solver=solver)
        dy = torch.randn(n, k, hw, hw, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        if direction == "bwd_data":
            return lambda: nnprim.conv_backward_data(dy, w, x.shape, padding=1, solver=solver)
        return lambda: nnprim.conv_backward_weights(dy, x, w.shape, padding=1, solver=solver)
    return make


def attn_calls(solver: str, decode: bool):
    def make(s: int):
        sq = 2 if decode else s
        q = torch.randn(2, 32, sq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 8, s, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 8, s, 128, device="cuda", dtype=torch.bfloat16)
        return lambda: nnprim.sdpa(q, k, v, causal="bottom_right", solver=solver)
    return make


CASES = [
    ("conv_fwd_implicit_gemm", conv_calls("implicit_gemm_fwd", "fwd"), [56, 28, 27, 14, 13, 7, 100]),
    ("conv_bwd_data_implicit_gemm", conv_calls("implicit_gemm_bwd_data", "bwd_data"), [56, 28, 27, 13, 7]),
    ("conv_bwd_weights_implicit_gemm", conv_calls("implicit_gemm_bwd_weights", "bwd_weights"), [56, 28, 27, 13]),
    ("attn_flash_fwd", attn_calls("flash_fwd", False), [1024, 1000, 2048, 777, 4096]),
    ("attn_decode", attn_calls("decode_split_k", True), [4096, 4000, 8192, 5001, 1500]),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name, make, sizes in CASES:
        row = dict(case=name, sizes=sizes, first_ms=[], second_ms=[])
        try:
            for s in sizes:
                fn = make(s)
                row["first_ms"].append(round(_ms(fn), 2))
                row["second_ms"].append(round(_ms(fn), 3))
        except Exception as e:  # a solver name this build lacks: report, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(row, flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
