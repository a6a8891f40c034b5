"""Solver 127 `gluon_flash_bwd` (Gluon, warp-specialised Hopper backward) against solvers 123
and 111, cuDNN and FLASH_ATTENTION, backward only, interleaved in one run (issue 12).

For each train problem of nnprim/data/suites/attention_gpu.json with D in --dims (default
64,128): bf16 q, k, v, dO; o and lse from nnprim.sdpa. A correctness check of 127 first: its
dq, dk, dv on batch 0 and the query heads of kv head 0 against float32 autograd of that slice
(heads are independent given the saved o and lse), bound 3x cuDNN's error on the same slice
+ 6e-3; a compile error or a wrong result is recorded and 127 is not timed on that problem.
Then, interleaved (nnprim.search.timing.interleaved_samples: rotating order, CUDA events,
warm-up), median ms of the backward alone: 127, 123 and 111 through
`nnprim.sdpa_backward(..., solver=...)`, and torch SDPA's CUDNN_ATTENTION and FLASH_ATTENTION
backends as `torch.autograd.grad(out, (q, k, v), do, retain_graph=True)` on one forward; and
the tile configs of 127 named by --configs (gluon_bwd.CONFIGS) through its plan, checked the
same way, as `g127_<name>`: `default` (what the solver runs: dQ by TMA reduce-adds), `atomic`
(dQ by f32 atomics, the kernel before 2026-12-01's ninth session), `wg_dq` / `wg_dq_atomic`
(each warpgroup adds the dQ of its 64 keys, all columns; the default splits the columns at
d128), `s3` (a 3-stage Q/dO ring, atomics), `hoisted` (K/V wgmma descriptors hoisted out of
the loops, spilling at d128), `ordered` (solver 129's deterministic adds: the rotated walk and
the deferred hand-off), `ordered_eager` (passed on at once), `ordered_fixed` (129 before
2026-12-02: every key block from query block 0), `split_ordered` (129 with the split dQ at
d64), `split` (127 with the split dQ at d64), `rotate` / `norotate` (127's walk of the query
blocks from a per-key-block start, on / off). Solvers 129 and 124
can be forced through the API too (--solvers gluon_129,ordered_124). A config that is the same
kernel as an earlier one at that head dim (d64: no split, 3 stages already) is not timed twice.
Head dim 256 (--dims 256): solver 130 `gluon_flash_bwd_d256` (gluon_bwd_d256.py) through the
API as `gluon_130` and its tile configs named by --configs256 (gluon_bwd_d256.CONFIGS: `default`
dQ boxes by TMA reduce-adds, `atomic` f32 atomics, `red16` 16-column boxes, `aligned` no view
inside a 128-byte swizzle row) through its plan as
`g130_<name>`, checked and timed the same way; 127's configs and solvers 127 / 129 only at
d64 / d128, 130 only at d256.
benchmarks/diag/gluon_bwd_regs.py prints their registers and spills offline.
TFLOP/s (2.5 x the forward's 4*B*Hq*Sq*Sk*D, x0.5 causal) and the ratio to cuDNN. Writes
JSON to --out (a .json path, or a directory: gluon_bwd_<date>.json) and prints a table.

    export PYTHONPATH=$PWD TRITON_INTERPRET=0
    timeout 240 python3 benchmarks/gluon_bwd.py --out $OUT/gluon_bwd.json [--subset a,b] [--rounds 10] \
        [--configs default,atomic,wg_dq,ordered] [--solvers gluon_127,atomic_123,flash_111,gluon_129,ordered_124]
    timeout 240 python3 benchmarks/gluon_bwd.py --dims 256 --solvers gluon_130,flash_111 \
        --configs256 default,atomic,red16,aligned --out $OUT/gluon_bwd_d256.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "0")

os.environ["NNPRIM_GLUON"] = "1"  # measured even where the environment switches them off
from gluon_bench_common import (  # noqa: E402
    attn_flops,
    new_result,
    out_path,
    rel,
    smoke,
    summarise,
    time_row,
    train_problems,
)

import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import gluon_bwd, gluon_bwd_d256  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
OURS = {"gluon_127": "gluon_flash_bwd", "atomic_123": "flash_bwd_atomic", "flash_111": "flash_bwd",
        "gluon_129": "gluon_flash_bwd_ordered", "ordered_124": "flash_bwd_ordered", "gluon_130": "gluon_flash_bwd_d256"}
GLUON_BY_D = {"gluon_127": (64, 128), "gluon_129": (64, 128), "gluon_130": (256,)}   # the dims they serve

SMOKE = """
import sys, torch, nnprim
from nnprim.args import AttnArgs
from nnprim.attention import gluon_bwd, gluon_bwd_d256
from nnprim.problems.attention import AttentionProblem
for d in map(int, sys.argv[2].split(",")):
  for causal in (None, "bottom_right"):
    q, do = (torch.randn(1, 2, 300, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 1, 333, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, lse = nnprim.sdpa(q, k, v, causal=causal, return_lse=True)
    p = AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd")
    if d == 256:   # sys.argv[1]: d256_<a gluon_bwd_d256.CONFIGS name>
        plan = gluon_bwd_d256.GluonBwdD256Plan(p, gluon_bwd_d256.CONFIGS[sys.argv[1][5:]]())
    else:
        plan = gluon_bwd.GluonBwdPlan(p, gluon_bwd.CONFIGS[sys.argv[1]](d))
    plan(AttnArgs(q, k, v, do=do, o=o, lse=lse))
torch.cuda.synchronize()
print("SMOKE-OK")
"""


def slice_reference(q, k, v, do, causal: bool):
    """float32 (dq, dk, dv) of batch 0 and the query heads of kv head 0 (autograd through an
    explicit softmax)."""
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = (t[:1, :h].float().requires_grad_() for t, h in ((q, g), (k, 1), (v, 1)))
    s = (qs @ ks.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        i = torch.arange(Sq, device=DEV)[:, None]
        j = torch.arange(Sk, device=DEV)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    o = torch.softmax(s, -1) @ vs
    return torch.autograd.grad(o, (qs, ks, vs), do[:1, :g].float())


def slice_of(grads, g: int):
    dq, dk, dv = grads
    return dq[:1, :g], dk[:1, :1], dv[:1, :1]


def distinct_configs(names: list[str], d: int) -> list[str]:
    """The names among `names` whose tile config at head dim d differs from every earlier one's
    (none at d256: 127 does not serve it)."""
    if d not in gluon_bwd.HEAD_DIMS:
        return []
    seen, out = [], []
    for n in names:
        cfg = gluon_bwd.CONFIGS[n](d)
        if cfg not in seen:
            seen.append(cfg)
            out.append(n)
    return out


def run_problem(p: dict, rounds: int, smoke_ok: dict[str, bool], configs: list[str], solvers: list[str],
                configs256: list[str]) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Hq, Hkv, Sq, Sk, D, causal = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Sk"], p["D"], p["causal"]
    nc = "top_left" if causal else None
    torch.manual_seed(0)
    q, do = (torch.randn(B, Hq, Sq, D, device=DEV, dtype=BF16) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16) for _ in range(2))
    o, lse = nnprim.sdpa(q, k, v, causal=nc, return_lse=True)
    row = dict(name=p["name"], B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal, ms={}, tflops={},
               vs_cudnn={}, errors={}, err={})
    g = Hq // Hkv

    def ours(solver):
        return lambda: nnprim.sdpa_backward(do, q, k, v, o, lse, causal=nc, solver=solver)

    def peer(be):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([be]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=bool(causal), enable_gqa=Hq != Hkv)

        def f():
            with sdpa_kernel([be]):
                return torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
        return f

    impls = {n: ours(s) for n, s in OURS.items() if n in solvers and D in GLUON_BY_D.get(n, (D,))}
    pb = AttentionProblem.from_tensors(q, k, v, causal=nc, direction="bwd")
    a = AttnArgs(q, k, v, do=do, o=o, lse=lse)
    for c in distinct_configs(configs, D):
        impls[f"g127_{c}"] = (lambda plan: lambda: plan(a))(gluon_bwd.GluonBwdPlan(pb, gluon_bwd.CONFIGS[c](D)))
    for c in configs256 if D == 256 else ():
        impls[f"g130_{c}"] = (lambda plan: lambda: plan(a))(
            gluon_bwd_d256.GluonBwdD256Plan(pb, gluon_bwd_d256.CONFIGS[c]()))
    for n, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            impls[n] = peer(be)
        except Exception as e:  # noqa: BLE001 - a backend that does not serve the problem
            row["errors"][n] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if "gluon_127" in impls and not smoke_ok.get("default", False):
        row["errors"]["gluon_127"] = "smoke run failed or hung: not run"
    if "gluon_130" in impls and not smoke_ok.get("d256_default", False):
        row["errors"]["gluon_130"] = "smoke run failed or hung: not run"
    for c in configs:
        if f"g127_{c}" in impls and not smoke_ok.get(c, False):
            row["errors"][f"g127_{c}"] = "smoke run failed or hung: not run"
    for c in configs256:
        if f"g130_{c}" in impls and not smoke_ok.get(f"d256_{c}", False):
            row["errors"][f"g130_{c}"] = "smoke run failed or hung: not run"
    ref = slice_reference(q, k, v, do, causal)
    e_c = 1e-2
    if "cudnn" in impls:
        try:
            e_c = max(rel(x, r) for x, r in zip(slice_of(impls["cudnn"](), g), ref))
            row["err"]["cudnn"] = round(e_c, 6)
        except Exception as e:  # noqa: BLE001 - no cuDNN for this problem: a plain bound
            row["errors"]["cudnn"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    for name in impls:   # correctness first (127's compile errors and wrong results recorded)
        if name in row["errors"] or name == "cudnn":
            continue
        try:
            t0 = time.time()
            grads = impls[name]()
            torch.cuda.synchronize()
            if name.startswith("g"):
                row[f"{name}_first_call_s"] = round(time.time() - t0, 2)
            errs = [rel(x, r) for x, r in zip(slice_of(grads, g), ref)]
            row["err"][name] = [round(e, 6) for e in errs]
            finite = all(bool(torch.isfinite(x).all()) for x in grads)
            if name.startswith("g") and not (finite and max(errs) <= 3 * e_c + 6e-3):
                row["errors"][name] = f"wrong result: rel errs (dq, dk, dv) {errs} (cuDNN {e_c:.3g}), finite {finite}"
            del grads
        except Exception as e:  # noqa: BLE001 - compile errors are a result here
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:3000]}"
            if name.startswith("g"):
                row["traceback"] = traceback.format_exc()[-3000:]
    live = {n: f for n, f in impls.items() if n not in row["errors"]}
    return time_row(row, live, attn_flops(p, 2.5), rounds, warmup=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default=str(ROOT / "nnprim/data/suites/attention_gpu.json"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--subset", default="", help="comma-separated problem names")
    ap.add_argument("--dims", default="64,128", help="head dims to run")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--configs", default="default,atomic,wg_dq,ordered",
                    help="127's tile configs timed through its plan (gluon_bwd.CONFIGS names)")
    ap.add_argument("--configs256", default="default,atomic,red16,aligned",
                    help="130's tile configs (gluon_bwd_d256.CONFIGS names) timed through its plan at d256")
    ap.add_argument("--solvers", default=",".join(OURS), help="of " + ",".join(OURS))
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    configs256 = [c for c in a.configs256.split(",") if c]
    solvers = [n for n in a.solvers.split(",") if n]
    unknown = ([c for c in configs if c not in gluon_bwd.CONFIGS] + [n for n in solvers if n not in OURS]
               + [c for c in configs256 if c not in gluon_bwd_d256.CONFIGS])
    if unknown:
        ap.error(f"unknown configs / solvers {unknown}; configs: {list(gluon_bwd.CONFIGS)}, "
                 f"configs256: {list(gluon_bwd_d256.CONFIGS)}")
    dims = [int(d) for d in a.dims.split(",") if d]
    small = ",".join(str(d) for d in dims if d in gluon_bwd.HEAD_DIMS)
    probs = train_problems(a.suite, a.dims, a.subset)
    out = out_path(a.out, "gluon_bwd")
    result = new_result()
    with ThreadPoolExecutor(8) as pool:   # each a subprocess compiling its kernels: in parallel
        runs = [(c, [c, small]) for c in dict.fromkeys(["default"] + configs)] if small else []
        if 256 in dims:
            runs += [(f"d256_{c}", [f"d256_{c}", "256"]) for c in dict.fromkeys(["default"] + configs256)]
        why = dict(zip([n for n, _ in runs], pool.map(lambda r: smoke(SMOKE, r[1]), runs)))
    result["smoke"] = {c: (w or "ok") for c, w in why.items()}
    result["configs"] = {c: {d: gluon_bwd.CONFIGS[c](d) for d in dims if d in gluon_bwd.HEAD_DIMS} for c in configs}
    if 256 in dims:
        result["configs256"] = {c: gluon_bwd_d256.CONFIGS[c]() for c in configs256}
    else:
        configs256 = []
    if not small:
        configs = []
    print("smoke:", result["smoke"], flush=True)
    solvers = [n for n in solvers if any(d in GLUON_BY_D.get(n, dims) for d in dims)]
    cols = solvers + [f"g127_{c}" for c in configs] + [f"g130_{c}" for c in configs256] + ["cudnn", "flash"]
    print(f"{'problem':28s} " + " ".join(f"{c[-10:]:>10s}" for c in cols) + "  TFLOP/s | x/cudnn (same order)")
    for p in probs:
        try:
            row = run_problem(p, a.rounds, {c: w is None for c, w in why.items()}, configs, solvers, configs256)
        except Exception as e:  # noqa: BLE001 - keep the other problems' numbers
            row = dict(name=p["name"], errors={"problem": f"{type(e).__name__}: {str(e)[:1000]}"})
        torch.cuda.empty_cache()
        result["problems"].append(row)
        tf, vs = row.get("tflops", {}), row.get("vs_cudnn", {})
        line = " ".join(f"{tf.get(c, float('nan')):10.1f}" for c in cols)
        print(f"{p['name']:28s} {line}  | " + " ".join(f"{vs.get(c, float('nan')):6.3f}" for c in cols[:-2])
              + (f"  ERR {row['errors']}" if row.get("errors") else ""), flush=True)
        out.write_text(json.dumps(result, indent=1))   # partial results survive a timeout
    summarise(result, cols[:-2] + ["flash"])
    out.write_text(json.dumps(result, indent=1))
    print({k: v for k, v in result.items() if k.startswith(("geomean", "min"))})
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
