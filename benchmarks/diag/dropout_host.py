"""Host time of sdpa with dropout through the public API and autograd (a new seed on every
call, as nn.Attention draws one), against the same call without dropout. Before the
thirty-third session every new seed made a new plan in the invoker (the seed was part of
the plan key), so each dropout call took Triton's JIT launch path; now the counters are set
per call on the planned launch (`Launch.with_counters`). Also: event time of one call.

Usage: NNPRIM_CACHE_DIR=$(mktemp -d) python benchmarks/diag/dropout_host.py [--out F]"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from host_clock import host_us  # noqa: E402

SHAPES = [dict(B=4, H=16, S=512, D=64), dict(B=2, H=16, S=2048, D=128)]


def event_ms(fn, reps: int = 30) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def measure(sh: dict, seeds) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sh["B"], sh["H"], sh["S"], sh["D"], device="cuda", dtype=torch.bfloat16,
                           generator=g).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)

    # without dropout the seed stays 0, as callers pass it (a new seed per call would miss the
    # public call's memo, whose key holds it: 90 against 37 us on the H200, 2026-12-04)
    def fwd(p):
        with torch.no_grad():
            return nnprim.sdpa(q, k, v, causal="top_left", dropout_p=p, seed=next(seeds) if p else 0)

    def fwd_bwd(p):
        o = nnprim.sdpa(q, k, v, causal="top_left", dropout_p=p, seed=next(seeds) if p else 0)
        o.backward(do)

    row = dict(shape=sh)
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        for p in (0.0, 0.1):
            call = functools.partial(fn, p)
            call(), call()                   # find, compile
            row[f"{name}_p{p}_host_us"] = host_us(call)
            row[f"{name}_p{p}_ms"] = round(event_ms(call), 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    seeds = itertools.count(2 ** 40)
    for sh in SHAPES:
        row = measure(sh, seeds)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
