"""Why the default call measured slower than forcing the solver it chose (regret run of
2026-12-01: +5-27 us on 0.04-0.1 ms problems). Times, for a few held-out problems, the
default call and the forced call in both list orders through interleaved_samples, plus each
one's host time per call (a tight loop, no sync) and device time alone (events around 50
back-to-back calls behind a spin). JSON to --out.

    python benchmarks/diag/default_vs_forced.py --out $OUT/default_vs_forced.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from nnprim.cli.cases import attn_case, conv_case  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

PROBLEMS = [
    ("resnet0_conv_bwd_data", "conv", "bwd_data", dict(N=64, C=128, K=128, spatial=[28, 28], filter=[3, 3],
                                                       padding=[1, 1], layout="nhwc")),
    ("resnet45_conv_fwd", "conv", "fwd", dict(N=32, C=256, K=64, spatial=[56, 56], filter=[1, 1], layout="nhwc")),
    ("unet38_conv_bwd_data", "conv", "bwd_data", dict(N=2, C=512, K=512, spatial=[32, 32], filter=[2, 2],
                                                      stride=[2, 2], layout="nhwc")),
    ("unet20_conv_bwd_weights", "conv", "bwd_weights", dict(N=4, C=512, K=256, spatial=[32, 32], filter=[3, 3],
                                                            padding=[1, 1], layout="nhwc")),
    ("decode35_attn_fwd", "attn", "fwd", dict(B=1, Hq=32, Hkv=8, Sq=4, Sk=1500, D=128, causal="bottom_right")),
]


def back_to_back_ms(fn, n: int = 50) -> tuple[float, float]:
    """(host ms per call, device ms per call) over n calls enqueued behind a spin."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e6))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for name, kind, direction, spec in PROBLEMS:
        make = conv_case if kind == "conv" else attn_case
        case = make(spec, dtype=torch.bfloat16, device="cuda", direction=direction, seed=0)
        case.call_with(None)
        chosen = case.solver().name
        case.call_with(chosen)
        d = lambda c=case: c.call_with(None)  # noqa: E731
        f = lambda c=case, n=chosen: c.call_with(n)  # noqa: E731
        row = dict(name=name, chosen=chosen)
        for label, fns in (("default_first", [d, f]), ("forced_first", [f, d])):
            s = interleaved_samples(fns, "cuda", rounds=30, warmup=2)
            med = [statistics.median(x) for x in s]
            row[label] = med if label == "default_first" else med[::-1]   # always (default, forced)
        f2 = lambda c=case, n=chosen: c.call_with(n)  # noqa: E731
        s = interleaved_samples([f, f2], "cuda", rounds=30, warmup=2)
        row["forced_twins"] = [statistics.median(x) for x in s]  # the same call twice: the order's own bias
        for label, fn in (("default", d), ("forced", f)):
            fn()
            row[f"{label}_host_dev_ms"] = [back_to_back_ms(fn) for _ in range(3)]
        rows.append(row)
        print(json.dumps(row))
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
