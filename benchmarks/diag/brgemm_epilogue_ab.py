"""In-process A/B of the CPU brgemm forward (solver 80) with a fused conv + bias + residual +
ReLU: the post-ops in the native row epilogue (`cpu_brgemm.row_post_ops`, each output row
while it is in cache) against the earlier path (an f32 output, the chain over the whole
tensor, then a copy into y; forced by replacing row_post_ops), and torch eager (conv with
bias, + residual, relu), interleaved call by call (medians of 11 after 2 warm-up rounds),
2 threads, NHWC, the NHWC problems of nnprim/data/suites/conv_cpu.json.

    PYTHONPATH=$PWD python benchmarks/diag/brgemm_epilogue_ab.py [--out results.json]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from nnprim.args import ConvArgs
from nnprim.conv import cpu_brgemm
from nnprim.post_ops import Eltwise, Sum
from nnprim.problems.conv import ConvProblem, to_layout

SUITE = os.path.join(os.path.dirname(__file__), "..", "..", "nnprim", "data", "suites", "conv_cpu.json")


def once(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    specs = [s for s in json.load(open(SUITE))["problems"] if s["layout"] == "nhwc" and len(s["spatial"]) == 2]
    for dt in (torch.float32, torch.bfloat16):
        for s in specs:
            g = torch.Generator().manual_seed(0)
            kw = dict(stride=s["stride"], padding=s["padding"], dilation=s["dilation"], groups=s["groups"])
            x = to_layout(torch.randn(s["N"], s["C"], *s["spatial"], generator=g).to(dt), "nhwc")
            w = to_layout((torch.randn(s["K"], s["C"] // s["groups"], *s["filter"], generator=g) * 0.05).to(dt), "nhwc")
            b = torch.randn(s["K"], generator=g).to(dt)
            p0 = ConvProblem.create("fwd", x.shape, w.shape, dtype=dt, layout="nhwc", device="cpu", **kw)
            res = to_layout(torch.randn(p0.y_shape, generator=g).to(dt), "nhwc")
            ops = (Sum(res), Eltwise("relu"))
            p = ConvProblem.create("fwd", x.shape, w.shape, dtype=dt, layout="nhwc", device="cpu", has_bias=True,
                                   post_ops=tuple(o.signature() for o in ops), **kw)
            if not cpu_brgemm.CpuBrgemmFwd().is_applicable(p):
                continue
            args = ConvArgs(x=x, w=w, bias=b, post_ops=ops)
            new = cpu_brgemm.CpuBrgemmFwd().prepare(p)
            orig = cpu_brgemm.row_post_ops

            def old(args=args, new=new, orig=orig):
                cpu_brgemm.row_post_ops = lambda p, ops: None
                try:
                    return new(args)
                finally:
                    cpu_brgemm.row_post_ops = orig

            def eager(x=x, w=w, b=b, res=res, kw=kw):
                return torch.relu(F.conv2d(x, w, b, **kw) + res)
            err = ((new(args).float() - old().float()).norm() / old().float().norm()).item()
            tn, to, te = [], [], []
            for _ in range(13):
                tn.append(once(lambda new=new, args=args: new(args)))
                to.append(once(old))
                te.append(once(eager))
            n, o, e = (statistics.median(v[2:]) * 1e3 for v in (tn, to, te))
            row = dict(problem=s["name"], dtype=str(dt), row_epilogue_ms=round(n, 3), whole_tensor_ms=round(o, 3),
                       torch_eager_ms=round(e, 3), speedup=round(o / n, 3), x_torch=round(e / n, 3),
                       x_torch_before=round(e / o, 3), rel_diff=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M"), threads=2, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
