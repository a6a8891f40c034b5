"""Forward tile search with Triton's automatic warp specialisation (issue 12).

For each train problem of the attention suite: cuDNN's and FlashAttention's forward
through torch SDPA, solver 110 with the tuned table's tiles, and candidate tiles with
and without `warp_specialize` (TileConfig.warp_specialize), each checked against the
table config's output. Writes attention_fwd_ws_<date>.json under --out.

    PYTHONUNBUFFERED=1 python benchmarks/attention_fwd_ws.py --out $OUT [--subset a,b]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from nnprim.args import AttnArgs
from nnprim.attention import configs, flash_fwd
from nnprim.attention.configs import TileConfig as T
from nnprim.problems.attention import AttentionProblem

ROOT = Path(__file__).resolve().parents[1]
CANDS = {  # (BM, BN, warps, stages, warp_specialize)
    64: [(128, 64, 8, 3, False), (128, 128, 8, 3, False), (128, 64, 4, 4, False), (64, 64, 4, 3, False),
         (128, 64, 8, 4, False), (64, 128, 4, 3, False), (128, 64, 8, 3, True)],
    128: [(128, 64, 8, 4, False), (128, 128, 8, 3, False), (128, 128, 8, 3, True), (128, 128, 8, 4, False),
          (64, 128, 4, 3, False), (64, 64, 4, 3, False), (128, 128, 8, 2, False)],
    256: [(128, 64, 8, 2, False), (128, 64, 8, 3, False), (64, 64, 4, 2, False), (128, 128, 8, 2, False),
          (64, 128, 8, 2, False), (128, 64, 8, 2, True)],
}


def bench(fn, rep=60):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def flops_of(p):
    frac = 0.5 if p["causal"] else 1.0
    return 4.0 * p["B"] * p["Hq"] * p["Sq"] * p["Sk"] * p["D"] * frac


def run(p) -> dict:
    B, Hq, Hkv, S, D, causal = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["D"], p["causal"]
    torch.manual_seed(0)
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    prob = AttentionProblem.from_tensors(q, k, v, causal="top_left" if causal else None)
    args = AttnArgs(q, k, v)
    fl = flops_of(p)
    row = dict(name=p["name"])
    tcfg = configs.choose(prob)[0]
    ref, _ = flash_fwd.flash_forward(prob, args, tcfg)
    row["table"] = [*tcfg.as_tuple(), tcfg.warp_specialize]
    row["table_tflops"] = round(fl / bench(lambda: flash_fwd.flash_forward(prob, args, tcfg)) / 1e9, 1)
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def f(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        try:
            with torch.no_grad():
                row[f"{name}_tflops"] = round(fl / bench(f) / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            row[f"{name}_err"] = str(e)[:100]
    dcls = 64 if D <= 64 else (128 if D <= 128 else 256)
    row["cands"] = {}
    for c in CANDS[dcls]:
        cfg = T(*c)
        try:
            o, _ = flash_fwd.flash_forward(prob, args, cfg)
            err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = bench(lambda cfg=cfg: flash_fwd.flash_forward(prob, args, cfg))
            row["cands"][str(c)] = dict(tflops=round(fl / ms / 1e9, 1), err=float(f"{err:.2e}"))
        except Exception as e:  # noqa: BLE001
            row["cands"][str(c)] = "ERR " + str(e).split("\n")[0][:120]
    best = max((v["tflops"], k) for k, v in row["cands"].items() if isinstance(v, dict))
    row["best"] = best[1]
    row["best_tflops"] = best[0]
    if "cudnn_tflops" in row:
        row["best_vs_cudnn"] = round(best[0] / row["cudnn_tflops"], 3)
        row["table_vs_cudnn"] = round(row["table_tflops"] / row["cudnn_tflops"], 3)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--subset", default="")
    a = ap.parse_args()
    suite = json.load(open(ROOT / "nnprim/data/suites/attention_gpu.json"))["problems"]
    probs = [p for p in suite if p["mode"] == "train"]
    if a.subset:
        probs = [p for p in probs if p["name"] in a.subset.split(",")]
    rows = []
    for p in probs:
        t0 = time.time()
        r = run(p)
        rows.append(r)
        print(json.dumps(r), f"{time.time() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
    g = {k: math.exp(sum(math.log(r[k]) for r in rows if k in r) / len(rows))
         for k in ("best_vs_cudnn", "table_vs_cudnn")}
    print("geomean", g)
    out = Path(a.out) / f"attention_fwd_ws_{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps(dict(rows=rows, geomean=g), indent=1))


if __name__ == "__main__":
    main()
