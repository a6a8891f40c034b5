"""In-process A/B of the native CPU flash forward's tile sizes (solver 117, `cpu_flash_native.forward`
with q_block x kv_block) against torch's CPU SDPA, interleaved rounds, median ms (issue 16).

    PYTHONPATH=. python benchmarks/diag/cpu_flash_fwd_tiles.py --threads 2 --tiles 128x256,256x256 \
        [--dtype bf16] [--rounds 7] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from nnprim.args import AttnArgs
from nnprim.attention import cpu_flash_native
from nnprim.problems.attention import AttentionProblem
from nnprim.search.timing import median_ms

PROBLEMS = [(1, 8, 1024, 64), (1, 8, 2048, 128)]   # (B, H, S, D): benchmarks/attention_cpu.py's


def run_problem(shape: tuple[int, int, int, int], a, dtype: torch.dtype, ops, tiles: list[tuple[int, int]]) -> dict:
    B, H, S, D = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(3))
    p = AttentionProblem.from_tensors(q, k, v, causal="top_left" if a.causal else None)
    args = AttnArgs(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=a.causal)
    fns = {"torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)}
    for qb, kb in tiles:
        fns[f"{qb}x{kb}"] = (lambda qb=qb, kb=kb: cpu_flash_native.forward(p, args, ops, qb, kb))
    for n, fn in fns.items():
        o = fn()
        o = o[0] if isinstance(o, tuple) else o
        err = (o.double() - ref).abs().max().item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), (n, err)
    times = {n: [] for n in fns}
    for r in range(a.rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for n in order:
            times[n].append(median_ms(fns[n], "cpu", repeats=a.reps, warmup=0))
    med = {n: statistics.median(t) for n, t in times.items()}
    row = dict(B=B, H=H, S=S, D=D, dtype=a.dtype, threads=a.threads, causal=a.causal, ms=med,
               vs_torch={n: round(med["torch"] / t, 3) for n, t in med.items()})
    print(json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiles", default="128x256,256x256,64x256,128x512")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    ops = cpu_flash_native.LIBRARY.ops()
    tiles = [tuple(int(x) for x in t.split("x")) for t in a.tiles.split(",")]
    out = [run_problem(shape, a, dtype, ops, tiles) for shape in PROBLEMS]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
