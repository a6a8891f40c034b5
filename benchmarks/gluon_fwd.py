"""Solver 126 `gluon_flash_fwd` (Gluon, warp-specialised Hopper forward) against solver 110,
cuDNN and FLASH_ATTENTION, interleaved in one run (issue 12).

For each train problem of nnprim/data/suites/attention_gpu.json with D in --dims (default
64,128): bf16 q, k, v; a correctness check of 126 first (its output against a float32 torch
reference on batch 0 and the query heads of kv head 0, bound 3x cuDNN's error + 6e-3, lse
too); a compile error or a wrong result is recorded and 126 is not timed on that problem.
Then 126 (`nnprim.sdpa(..., solver="gluon_flash_fwd")`, its default variant for the problem),
each of 126's kernel variants through its launcher (`g126_<consumers>_<launch>`: `pp` two
ping-pong warpgroups, `pp3` three (d64 only) or `1c` one 8-warp consumer; `pers` persistent,
grid <= #SMs, or `single`, one tile per CTA; one plan each, as the solver keeps; --variants picks them, each checked for
correctness first), 110 (`solver="flash_fwd"`) and torch SDPA with the CUDNN_ATTENTION and
FLASH_ATTENTION backends are timed interleaved
(nnprim.search.timing.interleaved_samples: rotating order, CUDA events, warm-up), median ms,
TFLOP/s (4*B*Hq*Sq*Sk*D, x0.5 causal when Sq == Sk) and the ratio to cuDNN. Writes JSON to
--out (a .json path, or a directory: gluon_fwd_<date>.json) and prints a table.

    export PYTHONPATH=$PWD TRITON_INTERPRET=0
    timeout 300 python3 benchmarks/gluon_fwd.py --out $OUT/gluon.json [--subset a,b] [--rounds 15]
        [--variants pp_pers,pp_single,pp3_pers,pp3_single,1c_pers,1c_single]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
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
from nnprim.attention import gluon_fwd  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16

SMOKE = """
import sys, torch
from nnprim.args import AttnArgs
from nnprim.attention import gluon_fwd
from nnprim.problems.attention import AttentionProblem
pp, consumers = sys.argv[1] == "1", int(sys.argv[3])
D = 64 if consumers == 3 else 128
q = torch.randn(1, 2, 300, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 1, 333, D, device="cuda", dtype=torch.bfloat16)
for causal in (None, "bottom_right"):
    p = AttentionProblem.from_tensors(q, k, k, causal=causal)
    cfg = gluon_fwd.tile_config(D, pp, sys.argv[2] == "1", consumers=consumers if pp else None)
    gluon_fwd.gluon_forward(p, AttnArgs(q, k, k), cfg=cfg)
torch.cuda.synchronize()
print("SMOKE-OK")
"""


VARIANTS = {  # name: (ping-pong, persistent, consumers)
    "pp_pers": (True, True, 2), "pp_single": (True, False, 2), "pp3_pers": (True, True, 3),
    "pp3_single": (True, False, 3), "1c_pers": (False, True, 1), "1c_single": (False, False, 1)}


def variant_cfg(D: int, name: str) -> dict | None:
    """The tile config of variant `name` at head dim D (None: three consumers past d64)."""
    pp, persistent, consumers = VARIANTS[name]
    if consumers == 3 and D > 64:
        return None
    return gluon_fwd.tile_config(D, pp, persistent, consumers=consumers if pp else None)


def default_variant(cfg: dict) -> tuple[bool, bool, int]:
    """The VARIANTS key of a tile config."""
    return cfg["CONSUMERS"] > 1, cfg["PERSISTENT"], cfg["CONSUMERS"]


def problem_of(p: dict) -> AttentionProblem:
    """The suite problem as run_problem builds it (bf16, causal bottom-right)."""
    return AttentionProblem(direction="fwd", device=DEV, dtype=BF16, B=p["B"], Hq=p["Hq"], Hkv=p["Hkv"], Sq=p["Sq"],
                            Sk=p["Sk"], D=p["D"], Dv=p["D"], causal="bottom_right" if p["causal"] else None)


def slice_reference(q, k, v, causal: bool):
    """float32 (o, lse) of batch 0 and the query heads of kv head 0 (heads are independent,
    so the slice checks the whole launch's indexing for one (b, kv head) group)."""
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = q[:1, :g].float(), k[:1, :1].float(), v[:1, :1].float()
    s = (qs @ ks.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        i = torch.arange(Sq, device=DEV)[:, None]
        j = torch.arange(Sk, device=DEV)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    return torch.softmax(s, -1) @ vs, torch.logsumexp(s, -1)


def run_problem(p: dict, rounds: int, ok: dict[tuple[bool, bool, int], bool], variants: list[str]) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Hq, Hkv, Sq, Sk, D, causal = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Sk"], p["D"], p["causal"]
    nc = "bottom_right" if causal else None   # Sq == Sk on the train problems: same as top-left
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, s, D, device=DEV, dtype=BF16) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    row = dict(name=p["name"], B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal, ms={}, tflops={},
               vs_cudnn={}, errors={})
    g = Hq // Hkv

    def peer(be):
        def f():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=Hq != Hkv)
        return f

    pb = AttentionProblem.from_tensors(q, k, v, causal=nc)
    dcfg = gluon_fwd.tile_config(D, problem=pb)
    default = default_variant(dcfg)
    row["gluon_126_default"] = next(n for n, var in VARIANTS.items() if var == default)

    def variant(cfg):   # one plan per variant, as the solver keeps one per problem
        plan, args = gluon_fwd.GluonFwdPlan(pb, cfg), AttnArgs(q, k, v)
        return lambda: plan(args)[0]
    impls = {"gluon_126": lambda: nnprim.sdpa(q, k, v, causal=nc, solver="gluon_flash_fwd")}
    impls |= {f"g126_{n}": variant(variant_cfg(D, n)) for n in variants if variant_cfg(D, n) is not None}
    impls |= {
        "flash_110": lambda: nnprim.sdpa(q, k, v, causal=nc, solver="flash_fwd"),
        "cudnn": peer(SDPBackend.CUDNN_ATTENTION),
        "flash": peer(SDPBackend.FLASH_ATTENTION),
    }
    if not ok.get(default, False):
        row["errors"]["gluon_126"] = "smoke run failed or hung: not run"
    for n in variants:
        if not ok.get(VARIANTS[n], False) and f"g126_{n}" in impls:
            row["errors"][f"g126_{n}"] = "smoke run failed or hung: not run"
    ref_o, ref_lse = slice_reference(q, k, v, causal)
    try:
        e_c = rel(impls["cudnn"]()[:1, :g], ref_o)
        row["err_cudnn"] = round(e_c, 6)
    except Exception:  # noqa: BLE001 - no cuDNN for this problem: a plain bound
        e_c = 1e-2
    for name in (f"g126_{n}" for n in variants if f"g126_{n}" in impls):
        if name in row["errors"]:
            continue
        try:
            e_v = rel(impls[name]()[:1, :g], ref_o)
            row[f"err_{name}"] = round(e_v, 6)
            if not e_v <= 3 * e_c + 6e-3:
                row["errors"][name] = f"wrong result: o rel err {e_v:.3g} (cuDNN {e_c:.3g})"
        except Exception as e:  # noqa: BLE001 - compile errors are a result here
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:3000]}"
    # correctness first: 126 (compile errors and wrong results recorded, then left out)
    try:
        if "gluon_126" in row["errors"]:
            raise _Skip
        t0 = time.time()
        o, lse = nnprim.sdpa(q, k, v, causal=nc, return_lse=True, solver="gluon_flash_fwd")
        torch.cuda.synchronize()
        row["gluon_first_call_s"] = round(time.time() - t0, 2)
        e_o = rel(o[:1, :g], ref_o)
        e_lse = float((lse[:1, :g].double() - ref_lse.double()).abs().max())
        row["err_gluon"] = dict(o_rel=round(e_o, 6), lse_abs=round(e_lse, 6), finite=bool(torch.isfinite(o).all()))
        o2 = nnprim.sdpa(q, k, v, causal=nc, solver="gluon_flash_fwd")
        row["gluon_bit_identical"] = bool(torch.equal(o, o2))
        if not (torch.isfinite(o).all() and e_o <= 3 * e_c + 6e-3 and e_lse < 1e-2):
            row["errors"]["gluon_126"] = f"wrong result: o rel err {e_o:.3g} (cuDNN {e_c:.3g}), lse err {e_lse:.3g}"
        del o, o2, lse
    except _Skip:
        pass
    except Exception as e:  # noqa: BLE001 - compile errors are a result here
        row["errors"]["gluon_126"] = f"{type(e).__name__}: {str(e)[:3000]}"
        row["traceback"] = traceback.format_exc()[-3000:]
    live = {}
    for name, f in impls.items():
        if name in row["errors"]:
            continue
        try:
            f()
            torch.cuda.synchronize()
            live[name] = f
        except Exception as e:  # noqa: BLE001 - a backend that does not serve the problem
            row["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return time_row(row, live, attn_flops(p), rounds, warmup=3)


class _Skip(Exception):
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default=str(ROOT / "nnprim/data/suites/attention_gpu.json"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--subset", default="", help="comma-separated problem names")
    ap.add_argument("--dims", default="64,128", help="head dims to run")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="126 variants timed beside its default")
    a = ap.parse_args()
    variants = [n for n in a.variants.split(",") if n]
    bad = [n for n in variants if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}: choose from {list(VARIANTS)}")
    probs = train_problems(a.suite, a.dims, a.subset)
    out = out_path(a.out, "gluon_fwd")
    result = new_result()
    # the variants asked for and every problem's default
    defaults = {default_variant(gluon_fwd.tile_config(p["D"], problem=problem_of(p))) for p in probs}
    runs = [n for n, v in VARIANTS.items() if n in variants or v in defaults]
    why = {n: smoke(SMOKE, ["1" if VARIANTS[n][0] else "0", "1" if VARIANTS[n][1] else "0", str(VARIANTS[n][2])])
           for n in runs}
    result["smoke"] = {n: (w or "ok") for n, w in why.items()}
    print("smoke:", result["smoke"], flush=True)
    ok = {VARIANTS[n]: w is None for n, w in why.items()}   # (a variant not run: .get -> False)
    cols = ["gluon_126"] + [f"g126_{n}" for n in variants] + ["flash_110", "cudnn", "flash"]
    print(f"{'problem':28s} " + " ".join(f"{c.replace('gluon_', '').replace('g126_', ''):>9s}" for c in cols)
          + "  TFLOP/s | 126/cudnn 110/cudnn  default")
    for p in probs:
        try:
            row = run_problem(p, a.rounds, ok, variants)
        except Exception as e:  # noqa: BLE001 - keep the other problems' numbers
            row = dict(name=p["name"], errors={"problem": f"{type(e).__name__}: {str(e)[:1000]}"})
        result["problems"].append(row)
        tf, vs = row.get("tflops", {}), row.get("vs_cudnn", {})
        line = " ".join(f"{tf.get(c, float('nan')):9.1f}" for c in cols)
        print(f"{p['name']:28s} {line}  | {vs.get('gluon_126', float('nan')):6.3f} {vs.get('flash_110', float('nan')):6.3f}"
              f"  {row.get('gluon_126_default', '?')}" + (f"  ERR {row['errors']}" if row.get("errors") else ""),
              flush=True)
        out.write_text(json.dumps(result, indent=1))   # partial results survive a timeout
    summarise(result, ["gluon_126"] + [f"g126_{n}" for n in variants] + ["flash_110", "flash"])
    out.write_text(json.dumps(result, indent=1))
    print({k: v for k, v in result.items() if k.startswith(("geomean", "min"))})
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
