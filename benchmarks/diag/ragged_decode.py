"""Decode over ragged kv_lens: solvers 133 and 128 with their chunks shared by length
(DecodeConfig.balanced, decode.balanced_counts) against the even split per sequence, and the public call,
on full, uniform-random and one-long-sequence lengths, contiguous and 16-key pages;
interleaved (one run of each per round, device events), through the plans. cuDNN (torch's
SDPA) on the full bf16 cache in the same rounds for scale. Each output is compared with the
unbalanced 133's (tested) on the rows' valid keys.

Usage: python benchmarks/diag/ragged_decode.py --out PATH [--rounds 30] [--formats s4g64,u4g64zp]"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode as dec  # noqa: E402
from nnprim.attention import decode_swap, gluon_decode_quant  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import quantize_kv  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from paged_q4_probe import FORMATS, paginate  # noqa: E402

PROBLEMS = {"decode_b8_k32k": (8, 32768), "decode_b64_k8k": (64, 8192)}


def lengths(kind: str, B: int, Sk: int, dev: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "full":
        t = torch.full((B,), Sk)
    elif kind == "uniform":
        t = torch.randint(1, Sk + 1, (B,), generator=g)
    else:  # one sequence at Sk, the others at Sk / 16
        t = torch.full((B,), Sk // 16)
        t[B // 2] = Sk
    return t.to(torch.int32).to(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--formats", default="s4g64,u4g64zp")
    ap.add_argument("--pages", default="0,16")
    ap.add_argument("--lens", default="full,uniform,onelong")
    ap.add_argument("--main-only", action="store_true",
                    help="also time each plan's main kernel without the combine (label X_main)")
    a = ap.parse_args()
    dev = "cuda"
    res = dict(gpu=torch.cuda.get_device_name(), rows=[])
    t0 = time.time()
    for name, (B, Sk) in PROBLEMS.items():
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
        cudnn = partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)
        for fname in a.formats.split(","):
            dt, sym, gs = FORMATS[fname]
            kq = quantize_kv(k, dt, group_size=gs, symmetric=sym, scale_dtype=torch.bfloat16)
            vq = quantize_kv(v, dt, group_size=gs, symmetric=sym, scale_dtype=torch.bfloat16)
            for page in (int(x) for x in a.pages.split(",")):
                kk, vv, bt = (kq, vq, None) if page == 0 else paginate(kq, vq, page)
                for lk in a.lens.split(","):
                    lens = lengths(lk, B, Sk, dev)
                    args = AttnArgs(q=q, k=kk, v=vv, kv_lens=lens, block_table=bt)
                    p = AttentionProblem.from_tensors(q, kk, vv, kv_lens=lens, block_table=bt)
                    c133 = gluon_decode_quant.default_config(p)
                    plans = {"133_bal": gluon_decode_quant.plan(p, args, replace(c133, balanced=True)),
                             "133_even": gluon_decode_quant.plan(p, args, replace(c133, balanced=False)),
                             "128_bal": decode_swap.plan(p, args, decode_swap.default_config(p)),
                             "128_even": decode_swap.plan(p, args, replace(decode_swap.default_config(p),
                                                                           balanced=False))}
                    fns = {lab: partial(dec.run_planned, p, args, pl) for lab, pl in plans.items()}
                    if a.main_only:
                        fns.update({f"{lab}_main": partial(dec.run_planned, p, args, (pl[0], None, pl[2]))
                                    for lab, pl in plans.items()})
                    kw = dict(kv_lens=lens, block_table=bt) if page else dict(kv_lens=lens)
                    fns["api"] = partial(nnprim.sdpa, q, kk, vv, **kw)
                    fns["cudnn_full_bf16"] = cudnn
                    outs = {lab: f() for lab, f in fns.items() if lab != "cudnn_full_bf16" and "_main" not in lab}
                    outs = {lab: (o[0] if isinstance(o, tuple) else o) for lab, o in outs.items()}
                    base = outs["133_even"].float()
                    diff = {lab: float((o.float() - base).abs().max()) for lab, o in outs.items()}
                    labels = list(fns)
                    samples = interleaved_samples([fns[x] for x in labels], dev, rounds=a.rounds, warmup=5)
                    ms = {lab: round(statistics.median(s), 4) for lab, s in zip(labels, samples)}
                    row = dict(problem=name, format=fname, page=page, lens=lk, lens_values=lens.tolist()[:16],
                               mean_len=float(lens.float().mean()), max_len=int(lens.max()), ms=ms,
                               max_abs_diff_vs_133_even=diff)
                    res["rows"].append(row)
                    print(name, fname, f"p{page}", lk, " ".join(f"{x}={y}" for x, y in ms.items()),
                          "maxdiff", round(max(diff.values()), 5), flush=True)
                    with open(a.out, "w") as f:   # after every row: a run cut short keeps its rows
                        json.dump(res, f, indent=1)
    res["seconds"] = round(time.time() - t0, 1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"done in {res['seconds']} s")


if __name__ == "__main__":
    main()
