"""Fused conv + bias + residual + ReLU through the public API against torch eager and the same
expression under torch.compile (issue 13's targets: >= 2.0x eager and >= 1.2x compile, the
ResNet-50 problems' geomean), peers in the same run.

Per problem of the suite (ungrouped NHWC; bf16 on the GPU):
  ours     nnprim.conv_forward(x, w, b, post_ops=(Sum(r), Eltwise("relu"))), the default
           selection (find on the first call where no record answers)
  eager    torch.relu(F.conv2d(x, w, b) + r): cuDNN's convolution, then torch's add and ReLU
  compile  torch.compile of the eager expression: cuDNN's convolution (an extern kernel) and
           one generated pointwise kernel
timed interleaved (nnprim.search.timing.interleaved_samples: device events, rotating order,
warm-up, the median of --rounds), each checked against the float64 result (relative norm;
ours no further than 3x torch eager's error + 6e-3). JSON to --out.

    python3 benchmarks/fused_conv.py --out $OUT/fused_conv.json
    python3 benchmarks/fused_conv.py --device cpu --dry       # the script itself at toy sizes
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nnprim  # noqa: E402
from nnprim import api  # noqa: E402
from nnprim.cli.suites import load_suite  # noqa: E402
from nnprim.post_ops import Eltwise, Sum  # noqa: E402
from nnprim.problems.conv import ConvProblem  # noqa: E402
from nnprim.search.context import for_problem  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_FMT = {2: torch.channels_last, 3: torch.channels_last_3d}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def setup(q: dict, device: str, dtype: torch.dtype, scale: int):
    """Inputs of one suite problem (batch divided by `scale`) and the three callables."""
    nd = len(q["spatial"])
    g = torch.Generator(device=device).manual_seed(0)
    xs = (max(1, q["N"] // scale), q["C"], *q["spatial"])
    ws = (q["K"], q["C"], *q["filter"])
    fmt = dict(memory_format=_FMT[nd]) if nd in _FMT else {}
    x = torch.randn(*xs, generator=g, device=device).to(dtype).to(**fmt)
    w = (torch.randn(*ws, generator=g, device=device) / math.sqrt(math.prod(ws[1:]))).to(dtype).to(**fmt)
    b = torch.randn(q["K"], generator=g, device=device).to(dtype)
    kw = dict(stride=q["stride"], padding=q["padding"], dilation=q["dilation"])
    y_shape = _CONV[nd](x[:1].float(), w.float(), None, **kw).shape[1:]
    r = torch.randn(xs[0], *y_shape, generator=g, device=device).to(dtype).to(**fmt)
    ops = (Sum(r, 1.0), Eltwise("relu"))
    conv = _CONV[nd]

    def eager():
        return torch.relu(conv(x, w, b, **kw) + r)

    def ours():
        return nnprim.conv_forward(x, w, b, post_ops=ops, **kw)

    def chosen() -> str:
        """The solver the default call runs (after its first call: find's choice)."""
        p = ConvProblem.from_tensors(x, w, "fwd", bias=b, post_ops=api._post_ops(ops, x.dim(), q["K"]), **kw)
        return for_problem(p).resolve(p, None).name
    ref = torch.relu(conv(x.double(), w.double(), b.double(), **kw) + r.double())
    return ours, eager, ref, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="conv_gpu")
    ap.add_argument("--only", default="", help="comma-separated problem names")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--dry", action="store_true", help="toy sizes (batch / 64, two problems): the script itself")
    ap.add_argument("--out", default="fused_conv.json")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    probs = [q for q in load_suite(a.suite)[1] if q.get("groups", 1) == 1 and q.get("layout", "nhwc") == "nhwc"]
    if a.only:
        probs = [q for q in probs if q["name"] in a.only.split(",")]
    scale = 64 if a.dry else 1
    if a.dry:
        probs = probs[:2]
    if a.device == "cuda":
        torch.backends.cudnn.benchmark = True
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    t0 = time.time()
    for q in probs:
        row: dict = {"name": q["name"]}
        try:
            ours, eager, ref, chosen = setup(q, a.device, dtype, scale)
            cands = {"ours": ours, "eager": eager}
            if not a.no_compile:
                # a fresh dynamo cache per problem: every problem's `eager` shares one code
                # object, and past 8 shapes dynamo stops compiling it (recompile_limit) and
                # runs it eagerly (2026-12-02: the 9th problem on timed torch eager as "compile")
                torch._dynamo.reset()
                cands["compile"] = torch.compile(eager, dynamic=False)
            with torch.no_grad():
                outs = {k: fn() for k, fn in cands.items()}       # first calls: find, compile
                errs = {k: rel(o, ref) for k, o in outs.items()}
                del outs
                samples = interleaved_samples(list(cands.values()), a.device, rounds=a.rounds, warmup=3)
            for (k, _), s in zip(cands.items(), samples):
                row[k] = {"ms": statistics.median(s), "rel_err": errs[k]}
            row["chosen"] = chosen()
            row["ours_ok"] = errs["ours"] <= 3 * errs["eager"] + 6e-3
            row["vs_eager"] = row["eager"]["ms"] / row["ours"]["ms"]
            if "compile" in row:
                row["vs_compile"] = row["compile"]["ms"] / row["ours"]["ms"]
            print(f"{q['name']:<18} ours {row['ours']['ms']:.4f} ms  eager {row['eager']['ms']:.4f} "
                  f"(x{row['vs_eager']:.2f})" + (f"  compile {row['compile']['ms']:.4f} (x{row['vs_compile']:.2f})"
                                                  if "compile" in row else "") + f"  [{row['chosen']}]"
                  + ("" if row["ours_ok"] else f"  WRONG: rel err {errs['ours']:.3g}"), flush=True)
        except Exception as e:  # noqa: BLE001 - keep the other problems
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(q["name"], row["error"], flush=True)
        res["rows"].append(row)
        res["elapsed_s"] = time.time() - t0
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    for key in ("vs_eager", "vs_compile"):
        vals = [r[key] for r in res["rows"] if key in r and r["name"].startswith("rn50")]
        if vals:
            res[f"rn50_{key}_geomean"] = math.exp(sum(map(math.log, vals)) / len(vals))
            print(f"rn50 geomean {key}: {res[f'rn50_{key}_geomean']:.3f} over {len(vals)} problems")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
