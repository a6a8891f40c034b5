"""Solver 133 on paged 4-bit caches: its L2 prefetch distance (Q4Config.prefetch, in key
blocks) on the contiguous cache and on shuffled page pools of 16 / 64 / 256 keys, with 122 on
the same caches, interleaved (one run of each per round, device events), through the plans.
Every variant's output is compared with 133's on the contiguous cache.

Usage: python benchmarks/diag/paged_q4_probe.py --out PATH [--prefetch 0,2,4] [--formats s4g64,u4g32zp] [--smoke]
(--smoke: CPU compile-only of the 133 variants is not possible; it runs 122 alone under the
interpreter at a small size to check the script.)"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode as dec  # noqa: E402
from nnprim.attention import decode_quant, gluon_decode_quant  # noqa: E402
from nnprim.paged import to_pages  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import quantize_kv  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

PROBLEMS = {"decode_b8_k32k": (8, 32768), "decode_b64_k8k": (64, 8192)}
FORMATS = {"s4g64": ("s4", True, 64), "u4g64zp": ("u4", False, 64), "s4g32": ("s4", True, 32),
           "u4g32zp": ("u4", False, 32), "s4g128": ("s4", True, 128), "u4g128zp": ("u4", False, 128)}


def paginate(k, v, page: int, seed: int = 0):
    B, _, S, _ = k.shape
    M = S // page
    n = B * M + 16
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(n, generator=g)[:B * M].reshape(B, M).to(torch.int32).to(k.data.device)
    return to_pages(k, bt, n), to_pages(v, bt, n), bt


def variant(cfg, spec: str):
    """133's config for a --prefetch entry: 'N[+nofast][+nolazy][+ringR][+rC]' (prefetch distance,
    rows always clamped, acc rescaled every step, a cp.async ring of R slots, register cap C)."""
    d, *flags = spec.split("+")
    cfg = replace(cfg, prefetch=int(d), fast_rows="nofast" not in flags, lazy_rescale="nolazy" not in flags,
                  ring=0, maxnreg=None)
    for f in flags:
        if f.startswith("ring"):
            cfg = replace(cfg, ring=int(f[4:]))
        elif f.startswith("r"):
            cfg = replace(cfg, maxnreg=int(f[1:]))
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefetch", default="0,2,4",
                    help="133 variants: prefetch distances, each optionally +nofast (rows always clamped) and / or "
                         "+nolazy (acc rescaled every step), e.g. 2,2+nofast,2+nofast+nolazy")
    ap.add_argument("--pages", default="0,16,64,256")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--formats", default="s4g64,u4g64zp", help=f"of {','.join(FORMATS)}")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    dev = "cpu" if a.smoke else "cuda"
    problems = {"smoke": (2, 256)} if a.smoke else PROBLEMS
    res = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", rows=[])
    t0 = time.time()
    for name, (B, Sk) in problems.items():
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
        lens = torch.full((B,), Sk, device=dev, dtype=torch.int32)
        for fname in a.formats.split(","):
            dt, sym, gs = FORMATS[fname]
            kq = quantize_kv(k, dt, group_size=gs, symmetric=sym, scale_dtype=torch.bfloat16)
            vq = quantize_kv(v, dt, group_size=gs, symmetric=sym, scale_dtype=torch.bfloat16)
            fns, labels, outs = [], [], {}
            for page in (int(x) for x in a.pages.split(",")):
                kk, vv, bt = (kq, vq, None) if page == 0 else paginate(kq, vq, page)
                args = AttnArgs(q=q, k=kk, v=vv, kv_lens=lens, block_table=bt)
                p = AttentionProblem.from_tensors(q, kk, vv, kv_lens=lens, block_table=bt)
                variants = [("122", decode_quant, decode_quant.default_config(p))]
                if not a.smoke:
                    variants += [(f"133+pf{d}", gluon_decode_quant, variant(gluon_decode_quant.default_config(p), d))
                                 for d in a.prefetch.split(",")]
                for lab, mod, cfg in variants:
                    planned = mod.plan(p, args, cfg)
                    o = dec.run_planned(p, args, planned)[0]
                    outs[f"p{page}:{lab}"] = o
                    fns.append(lambda p=p, args=args, planned=planned: dec.run_planned(p, args, planned))
                    labels.append(f"p{page}:{lab}")
            base = outs.get("p0:133+pf0", outs[labels[0]])
            diff = {lab: float((o.float() - base.float()).abs().max()) for lab, o in outs.items()}
            samples = interleaved_samples(fns, dev, rounds=a.rounds, warmup=5)
            ms = {lab: round(statistics.median(s), 4) for lab, s in zip(labels, samples)}
            row = dict(problem=name, format=fname, ms=ms, max_abs_diff_vs_contiguous_133=diff)
            res["rows"].append(row)
            print(name, fname, " ".join(f"{k_}={v_}" for k_, v_ in ms.items()), "maxdiff",
                  max(diff.values()), flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"done in {res['seconds']} s")


if __name__ == "__main__":
    main()
