"""CPU attention forward with few query rows per head (decode, short chunks): solver 117 with
K / V read in place (S^T = K Q^T, `cpu_flash_native.keys_as_rows`) against the same solver
packing K / V per call (VNNI on AMX CPUs, K^T otherwise), torch's CPU SDPA, and the public
`nnprim.sdpa` (default hybrid mode; run it on a fresh find-db) in the same rounds; medians of
7 calls after 2, 2 threads.

    NNPRIM_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD python benchmarks/diag/cpu_attn_short_q.py [--out results.json]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention import cpu_flash_native as cfn
from nnprim.problems.attention import AttentionProblem

SHAPES = [(1, 8, 8, 16, 16384, 128), (4, 32, 8, 1, 4096, 128), (2, 32, 8, 4, 8192, 128), (1, 8, 8, 32, 8192, 128),
          (1, 8, 8, 64, 8192, 64), (1, 16, 16, 128, 4096, 64)]   # (B, Hq, Hkv, Sq, Sk, D)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    ops, rows = cfn.LIBRARY.ops(), []
    for dt in (torch.bfloat16, torch.float32):
        for B, H, Hkv, Sq, Sk, D in SHAPES:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(B, H, Sq, D, generator=g).to(dt)
            k, v = (torch.randn(B, Hkv, Sk, D, generator=g).to(dt) for _ in range(2))
            p, args = AttentionProblem.from_tensors(q, k, v), AttnArgs(q, k, v)
            fns = {"keys": lambda p=p, args=args: cfn.forward(p, args, ops, by_keys=True),
                   "pack": lambda p=p, args=args: cfn.forward(p, args, ops, by_keys=False),
                   "api": lambda q=q, k=k, v=v: nnprim.sdpa(q, k, v),
                   "torch": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
            ref = fns["torch"]().double()
            err = {n: float((fns[n]()[0] if n in ("keys", "pack") else fns[n]()).double().sub(ref).norm() / ref.norm())
                   for n in ("keys", "pack", "api")}
            ts = {n: [] for n in fns}
            for _ in range(9):
                for n, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    ts[n].append(time.perf_counter() - t0)
            ms = {n: round(statistics.median(v[2:]) * 1e3, 3) for n, v in ts.items()}
            row = dict(dtype=str(dt), B=B, Hq=H, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, ms=ms,
                       x_torch={n: round(ms["torch"] / t, 3) for n, t in ms.items()}, err_vs_torch=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=2, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
