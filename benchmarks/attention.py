"""Flash attention (solvers 110/111) on the GPU: correctness at real sizes, then speed
against the peers (torch SDPA with the CUDNN_ATTENTION and FLASH_ATTENTION backends)
measured in the same run.

    PYTHONUNBUFFERED=1 python benchmarks/attention.py [--subset N1,N2] [--tune]
                       [--out DIR] [--features] [--date 2026-11-29]
    PYTHONUNBUFFERED=1 python benchmarks/attention.py --bwd-variants \
        --subset train_d256_s4096,train_d128_s4096 --out DIR

`--bwd-variants`: backward only (the head-dim split follow-up): per problem, each dK/dV and
dQ tile candidate of the split kernels (kernels timed separately, every candidate's
gradients checked), the fused kernels as before, the table's choice end to end, and the
peers' backward; candidates compile in parallel worker processes first (Triton's disk
cache), so one device call covers them all. Writes attention_bwd_d256_<date>.json.

`--api`: through the public API (`nnprim.sdpa` + autograd), the peers (torch SDPA with the
cuDNN, FLASH_ATTENTION and default backends) in the same run, each phase's implementations
interleaved round by round (`--rounds`, device events, a GPU lead covering each run's host
enqueue, median; until 2026-12-02 each implementation was timed alone, 30 runs with a
synchronise after each, which moved the same backend by up to 15 % between two of its
rows): forward, backward by autograd with nnprim's default choice, and backward with
determinism on (`nnprim.set_deterministic(True)`; the peers under
`torch.use_deterministic_algorithms(True, warn_only=True)`); the solver-level backward
forcing each backward solver (111 flash_bwd, 123 flash_bwd_atomic, 124 flash_bwd_ordered,
`nnprim.sdpa_backward(..., solver=)`), with `--tune-5gemm` also tile candidates of the
five-GEMM kernels. Writes --out (a .json path, or a directory: attention_api_<date>.json).

    PYTHONUNBUFFERED=1 python benchmarks/attention.py --api --out results/attention_api.json

Default: every `train` problem of nnprim/data/suites/attention_gpu.json with the tuned
table's tiles (what the solvers pick). `--tune` times candidate tile configs (and TMA vs
pointer loads) per problem as well; benchmarks/tune_attention.py is this mode.
Correctness: each problem's forward and backward is compared with a float32 torch
reference on one batch entry and the query heads of one kv head (heads are independent,
so the slice checks the full launch); `--features` also checks options (masks, kv_lens,
dropout, GQA, Dv != D, strides, f32/f16) against nnprim's float64 reference.
Writes $OUT (or --out) /attention_<date>[_tune].json and prints a table.
FLOPs follow the peers' convention: fwd 4*B*Hq*Sq*Sk*D (x0.5 causal when Sq == Sk),
bwd 2.5x that.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _import_nnprim():
    """Import nnprim; if a module unrelated to attention fails to import (work in
    progress elsewhere), fall back to a bare package so the attention modules load."""
    try:
        import nnprim  # noqa: F401
    except Exception as e:  # pragma: no cover - only on a broken tree
        print(f"[warn] import nnprim failed ({type(e).__name__}: {e}); using a bare package")
        for m in [m for m in sys.modules if m == "nnprim" or m.startswith("nnprim.")]:
            del sys.modules[m]
        pkg = types.ModuleType("nnprim")
        pkg.__path__ = [str(ROOT / "nnprim")]
        sys.modules["nnprim"] = pkg


_import_nnprim()
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import configs, flash_bwd, flash_fwd  # noqa: E402
from nnprim.attention.configs import TileConfig as T  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16

# candidate tiles for --tune: forward (BM, BN, warps, stages, tma), backward (BM, BN, warps, stages)
FWD_CANDS = {
    64: [(128, 64, 4, 3, True), (128, 64, 4, 4, True), (128, 128, 8, 3, True), (128, 64, 8, 3, True),
         (256, 64, 8, 3, True)],
    128: [(128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 64, 4, 3, True), (128, 64, 8, 4, True),
          (256, 64, 8, 2, True)],
    256: [(128, 64, 8, 2, True), (128, 32, 8, 3, True), (64, 64, 4, 2, True), (128, 64, 8, 1, True)],
}
BWD_CANDS = {
    64: [(64, 128, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    128: [(64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 4, 2), (64, 128, 8, 3), (128, 64, 8, 2)],
    256: [(64, 64, 4, 1), (32, 128, 8, 1), (32, 64, 4, 2), (64, 64, 8, 1)],  # split dK/dV
}


def bench(fn, rep=80):
    return do_bench(fn, warmup=20, rep=rep, return_mode="median")


def rel(x, ref):
    x = x.float()
    ref = ref.float()
    return ((x - ref).norm() / ref.norm()).item()


def flops_of(p):
    frac = 0.5 if (p["causal"] and p["Sq"] == p["Sk"]) else 1.0
    return 4.0 * p["B"] * p["Hq"] * p["Sq"] * p["Sk"] * p["D"] * frac


def ref_slice(q, k, v, do, causal):
    """f32 math reference for batch 0 and the query heads of kv head 0."""
    g = q.shape[1] // k.shape[1]
    qs = q[:1, :g].float().detach().requires_grad_()
    ks = k[:1, :1].float().detach().requires_grad_()
    vs = v[:1, :1].float().detach().requires_grad_()
    Sq, Sk = q.shape[2], k.shape[2]
    s = (qs @ ks.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if causal:
        i = torch.arange(Sq, device=DEV)[:, None]
        j = torch.arange(Sk, device=DEV)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vs
    dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), do[:1, :g].float())
    return o.detach(), lse.detach(), dq, dk, dv


# --bwd-variants candidates (head dims > 128): dK/dV tiles (BM query rows per step, BN keys
# per program, warps, stages), split (column halves) or fused; dQ tiles (BM keys per step,
# BN query rows per program, ...), split or fused
SPLIT_DKDV_CANDS = [(64, 64, 8, 1), (32, 128, 8, 1), (64, 64, 4, 1), (32, 64, 4, 2)]
FUSED_DKDV_CANDS = [(32, 64, 8, 1), (16, 64, 8, 2)]
SEPARATE_DKDV_CANDS = [(32, 64, 4, 1), (64, 64, 4, 1)]  # dV-only + dK-only launches (untimed)
SPLIT_DQ_CANDS = [(64, 128, 8, 1), (64, 64, 4, 1)]
FUSED_DQ_CANDS = [(32, 64, 4, 2), (32, 128, 8, 2), (16, 64, 4, 2)]
FUSED_BEFORE = (64, 64, 8, 1)  # the fused kernels' d256 tiles before the split


def _variant_tensors(p, Sq=None):
    B, Hq, Hkv, D = p["B"], p["Hq"], p["Hkv"], p["D"]
    Sq = Sq or p["Sq"]
    Sk = Sq if Sq != p["Sq"] else p["Sk"]
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, device=DEV, dtype=BF16)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16)
    prob = AttentionProblem.from_tensors(q, k, v, causal="bottom_right" if p["causal"] else None,
                                         return_lse=True)
    fcfg, _ = configs.choose(prob)
    o, lse = flash_fwd.flash_forward(prob, AttnArgs(q, k, v), fcfg)
    do = torch.randn_like(o)
    return q, k, v, do, prob.with_direction("bwd"), AttnArgs(q, k, v, do=do, o=o, lse=lse)


def _variant_list(p):
    """(label, flash_backward kwargs, kernels to time) for a problem: the table's choice,
    the fused kernels as before, and each dK/dV and dQ candidate (paired with the
    table's other kernel)."""
    out = [("table", {}, ("pre", "dkdv", "dq", "all"))]
    if p["D"] > 128:
        out.append(("fused_before", dict(cfg=T(*FUSED_BEFORE), split=False), ("dkdv", "dq", "all")))
        for c in SPLIT_DKDV_CANDS:
            out.append((f"dkdv_split{c}", dict(cfg=T(*c), split=True), ("dkdv",)))
        for c in FUSED_DKDV_CANDS:
            out.append((f"dkdv_fused{c}", dict(cfg=T(*c), split=False), ("dkdv",)))
        for c in SEPARATE_DKDV_CANDS:
            out.append((f"dkdv_separate{c}", dict(cfg=T(*c), split="separate"), ("dkdv",)))
        for c in SPLIT_DQ_CANDS:
            out.append((f"dq_split{c}", dict(dq_cfg=T(*c), dq_split=True), ("dq",)))
        for c in FUSED_DQ_CANDS:
            out.append((f"dq_fused{c}", dict(dq_cfg=T(*c), dq_split=False), ("dq",)))
    return out


def _dq_kw(pb):
    """the solver's dQ choice for flash_backward (as FlashBackward.prepare makes it)"""
    if not flash_bwd.use_split(pb):
        return {}
    dq_cfg, dq_split = configs.choose_dq(pb)
    return dict(dq_cfg=dq_cfg, dq_split=dq_split)


def _resolve(pb, label, kw):
    """flash_backward arguments of a variant: the table's choice where it sets nothing."""
    kw = dict(kw)
    cfg = kw.pop("cfg", None) or configs.choose(pb)[1]
    if flash_bwd.use_split(pb) and "dq_cfg" not in kw and kw.get("split") is not False:
        kw["dq_cfg"], kw["dq_split"] = configs.choose_dq(pb)
    return cfg, kw


def _warm_worker(task):
    """Compile one (problem, variant) on a small problem with the same specialisation."""
    p, label, kw = task
    try:
        _, _, _, _, pb, bargs = _variant_tensors(p, Sq=256)
        cfg, kw = _resolve(pb, label, kw)
        flash_bwd.flash_backward(pb, bargs, cfg, **kw)
        torch.cuda.synchronize()
        return label, "ok"
    except Exception as e:  # reported, the main run retries
        return label, "ERR " + str(e).split("\n")[0][:100]


def warm_compile(probs):
    """Fill Triton's disk cache for every (causal, head dim, variant) in parallel processes."""
    import multiprocessing as mp
    seen, tasks = set(), []
    for p in probs:
        for label, kw, _ in _variant_list(p):
            key = (p["D"], p["Hq"], p["Hkv"], p["causal"], label)
            if key not in seen:
                seen.add(key)
                tasks.append((p, label, kw))
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(len(tasks), max(1, (os.cpu_count() or 2) - 1))) as pool:
        res = pool.map(_warm_worker, tasks, chunksize=1)
    bad = [r for r in res if r[1] != "ok"]
    print(f"warm compile: {len(tasks)} tasks in {time.time() - t0:.0f}s, failures {bad}", flush=True)
    return dict(tasks=len(tasks), seconds=round(time.time() - t0, 1), failures=bad)


def run_bwd_variants(p):
    """Backward of one problem: every variant checked against the f32 reference slice and
    timed (end to end and per kernel), then the peers."""
    q, k, v, do, pb, bargs = _variant_tensors(p)
    fl = 2.5 * flops_of(p)
    row = dict(name=p["name"], B=p["B"], Hq=p["Hq"], Hkv=p["Hkv"], Sq=p["Sq"], Sk=p["Sk"],
               D=p["D"], causal=p["causal"], variants={})
    ro, rl, rdq, rdk, rdv = ref_slice(q, k, v, do, p["causal"])
    g = p["Hq"] // p["Hkv"]
    for label, kw, timed in _variant_list(p):
        cfg, kw = _resolve(pb, label, kw)
        vr = dict(cfg=list(cfg.as_tuple()), dq_cfg=list(kw["dq_cfg"].as_tuple())
                  if kw.get("dq_cfg") else None, split=kw.get("split"), dq_split=kw.get("dq_split"))
        try:
            dq, dk, dv = flash_bwd.flash_backward(pb, bargs, cfg, **kw)
            vr["err"] = dict(dq=round(rel(dq[:1, :g], rdq), 5), dk=round(rel(dk[:1, :1], rdk), 5),
                             dv=round(rel(dv[:1, :1], rdv), 5))
            vr["ok"] = all(e < 1.5e-2 for e in vr["err"].values())
            del dq, dk, dv
            if "all" in timed:
                ms = bench(lambda cfg=cfg, kw=kw: flash_bwd.flash_backward(pb, bargs, cfg, **kw),
                           rep=40)
                vr["ms"] = round(ms, 3)
                vr["tflops"] = round(fl / ms / 1e9, 1)
            _, launches = flash_bwd.backward_launches(pb, bargs, cfg, **kw)
            vr["kernels"] = {}
            for kname, launch in launches:
                if kname in timed:
                    ck = launch()
                    vr["kernels"][kname] = dict(ms=round(bench(launch, rep=25), 3),
                                                regs=getattr(ck, "n_regs", None),
                                                spills=getattr(ck, "n_spills", None))
        except Exception as e:
            vr["error"] = str(e).split("\n")[0][:120]
        row["variants"][label] = vr
        print("  ", p["name"], label, json.dumps(vr), flush=True)
    # best combination from the per-kernel times (table's pre + best dK/dV + best dQ)
    vs = row["variants"]
    if p["D"] > 128 and "kernels" in vs["table"]:
        best = {}
        for kname in ("dkdv", "dq"):
            best[kname] = min(((lb, vr["kernels"][kname]["ms"]) for lb, vr in vs.items()
                               if vr.get("ok") and kname in vr.get("kernels", {})),
                              key=lambda t: t[1])
        ms = vs["table"]["kernels"]["pre"]["ms"] + best["dkdv"][1] + best["dq"][1]
        row["best_combo"] = dict(dkdv=best["dkdv"][0], dq=best["dq"][0], ms=round(ms, 3),
                                 tflops=round(fl / ms / 1e9, 1))
    del ro, rl, rdq, rdk, rdv
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    for pname, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=p["causal"],
                                                     enable_gqa=p["Hq"] != p["Hkv"])
            ms = bench(lambda out=out: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True),
                       rep=40)
            row[f"{pname}_bwd_tflops"] = round(fl / ms / 1e9, 1)
        except Exception as e:
            row[f"{pname}_err"] = str(e).split("\n")[0][:100]
    for lb in ("table", "fused_before"):
        if "tflops" in vs.get(lb, {}) and "cudnn_bwd_tflops" in row:
            row[f"vs_cudnn_{lb}"] = round(vs[lb]["tflops"] / row["cudnn_bwd_tflops"], 3)
    if "best_combo" in row and "cudnn_bwd_tflops" in row:
        row["vs_cudnn_best_combo"] = round(row["best_combo"]["tflops"] / row["cudnn_bwd_tflops"], 3)
    return row


def bwd_variants_main(a, probs):
    res = dict(date=a.date, machine=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cudnn=torch.backends.cudnn.version(),
               rows=[])
    out = Path(a.out) / f"attention_bwd_d256_{a.date}.json"
    t0 = time.time()
    res["warm"] = warm_compile(probs)
    json.dump(res, open(out, "w"), indent=1)
    for p in probs:
        row = run_bwd_variants(p)
        torch.cuda.empty_cache()
        res["rows"].append(row)
        print(f"[{time.time() - t0:.0f}s] {p['name']} done", flush=True)
        json.dump(res, open(out, "w"), indent=1)
    print(f"{'problem':26s} {'table':>6s} {'before':>6s} {'best':>6s} {'cudnn':>6s} {'flash':>6s} "
          f"{'t/cud':>6s} {'b/cud':>6s} ok")
    for r in res["rows"]:
        vs = r["variants"]
        print(f"{r['name']:26s} {vs['table'].get('tflops', 0):6.1f} "
              f"{vs.get('fused_before', {}).get('tflops', 0):6.1f} "
              f"{r.get('best_combo', {}).get('tflops', 0):6.1f} {r.get('cudnn_bwd_tflops', 0):6.1f} "
              f"{r.get('flash_bwd_tflops', 0):6.1f} {r.get('vs_cudnn_table', 0):6.3f} "
              f"{r.get('vs_cudnn_best_combo', 0):6.3f} "
              f"{all(v.get('ok', False) for v in vs.values())}")
        if "best_combo" in r:
            print("    best:", r["best_combo"])
        for lb, vr in vs.items():
            ks = {kk: (kv["ms"], kv["regs"], kv["spills"]) for kk, kv in vr.get("kernels", {}).items()}
            print(f"    {lb:26s} {vr.get('tflops', 0):6.1f} ok={vr.get('ok')} {ks} {vr.get('error', '')}")
    print(f"wrote {out} in {time.time() - t0:.0f}s")


def run_problem(p, tune: bool, check: bool):
    B, Hq, Hkv, Sq, Sk, D, causal = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Sk"], p["D"], p["causal"]
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, device=DEV, dtype=BF16)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=BF16)
    cz = "bottom_right" if causal else None
    prob = AttentionProblem.from_tensors(q, k, v, causal=cz, return_lse=True)
    pb = prob.with_direction("bwd")
    fcfg, bcfg = configs.choose(prob)
    dqkw = _dq_kw(pb)
    fl = flops_of(p)
    row = dict(name=p["name"], B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal,
               fwd_cfg=list(fcfg.as_tuple()), bwd_cfg=list(bcfg.as_tuple()))
    args = AttnArgs(q, k, v)
    o, lse = flash_fwd.flash_forward(prob, args, fcfg)
    do = torch.randn_like(o)
    bargs = AttnArgs(q, k, v, do=do, o=o, lse=lse)
    if check:
        dq, dk, dv = flash_bwd.flash_backward(pb, bargs, bcfg, **dqkw)
        ro, rl, rdq, rdk, rdv = ref_slice(q, k, v, do, causal)
        g = Hq // Hkv
        row["err"] = dict(o=rel(o[:1, :g], ro), lse=rel(lse[:1, :g], rl), dq=rel(dq[:1, :g], rdq),
                          dk=rel(dk[:1, :1], rdk), dv=rel(dv[:1, :1], rdv))
        with torch.no_grad():
            oc = F.scaled_dot_product_attention(q[:1, :g], k[:1, :1].expand(1, g, Sk, D),
                                                v[:1, :1].expand(1, g, Sk, D), is_causal=causal)
        row["err"]["o_torch_bf16"] = rel(oc, ro)
        row["ok"] = all(e < 1.5e-2 for key, e in row["err"].items() if key != "o_torch_bf16")
        del ro, rl, rdq, rdk, rdv, dq, dk, dv
    # ours with the table's config
    ms = bench(lambda: flash_fwd.flash_forward(prob, args, fcfg))
    row["ours_fwd_ms"] = ms
    row["ours_fwd_tflops"] = fl / ms / 1e9
    ms = bench(lambda: flash_bwd.flash_backward(pb, bargs, bcfg, **dqkw))
    row["ours_bwd_ms"] = ms
    row["ours_bwd_tflops"] = 2.5 * fl / ms / 1e9
    # per-kernel split of the backward, with registers / spills of each kernel
    bcfg_fit, dq_fit = configs.FITTED.get(("bwd", pb.key(), bcfg, None, None,
                                           dqkw.get("dq_cfg"), dqkw.get("dq_split")),
                                          (bcfg, dqkw.get("dq_cfg")))
    _, launches = flash_bwd.backward_launches(pb, bargs, bcfg_fit, dq_cfg=dq_fit,
                                              dq_split=dqkw.get("dq_split"))
    row["bwd_kernels"] = {}
    for kname, launch in launches:
        ck = launch()
        row["bwd_kernels"][kname] = dict(ms=round(bench(launch, rep=40), 3),
                                         regs=getattr(ck, "n_regs", None),
                                         spills=getattr(ck, "n_spills", None))
    _, flaunch = flash_fwd.forward_launch(prob, args)
    ck = flaunch(configs.FITTED.get(("fwd", prob.key(), fcfg, None), fcfg))
    row["fwd_kernel"] = dict(regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None))
    if tune:
        dcls = 64 if D <= 64 else (128 if D <= 128 else 256)
        row["tune_fwd"] = {}
        for c in FWD_CANDS[dcls]:
            cfg = T(*c[:4])
            try:
                ms = bench(lambda cfg=cfg, c=c: flash_fwd.flash_forward(prob, args, cfg, use_tma=c[4]),
                           rep=40)
                row["tune_fwd"][str(c)] = round(fl / ms / 1e9, 1)
            except Exception as e:  # out of resources etc.
                row["tune_fwd"][str(c)] = "ERR " + str(e).split("\n")[0][:80]
        row["tune_bwd"] = {}
        for c in BWD_CANDS[dcls]:
            cfg = T(*c)
            try:
                ms = bench(lambda cfg=cfg: flash_bwd.flash_backward(pb, bargs, cfg), rep=40)
                row["tune_bwd"][str(c)] = round(2.5 * fl / ms / 1e9, 1)
            except Exception as e:
                row["tune_bwd"][str(c)] = "ERR " + str(e).split("\n")[0][:80]
    # peers, same tensors
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    for pname, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            def f(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                          enable_gqa=Hq != Hkv)
            with torch.no_grad():
                ms = bench(f)
            row[f"{pname}_fwd_tflops"] = fl / ms / 1e9
            out = f()
            ms = bench(lambda out=out: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
            row[f"{pname}_bwd_tflops"] = 2.5 * fl / ms / 1e9
        except Exception as e:
            row[f"{pname}_err"] = str(e).split("\n")[0][:100]
    for pname in ("cudnn", "flash"):
        for d in ("fwd", "bwd"):
            if f"{pname}_{d}_tflops" in row:
                row[f"vs_{pname}_{d}"] = row[f"ours_{d}_tflops"] / row[f"{pname}_{d}_tflops"]
    for key, val in list(row.items()):
        if isinstance(val, float):
            row[key] = round(val, 4 if key.startswith(("vs_", "err")) else 2)
    return row


def feature_checks():
    """Options at medium sizes vs nnprim's float64 reference (forward and backward)."""
    from nnprim.attention.reference import reference_backward, reference_forward
    g = torch.Generator(device=DEV).manual_seed(1)

    def rnd(*s, dt=BF16):
        return torch.randn(*s, device=DEV, generator=g).to(dt)

    cases = []
    B, Hq, Hkv, Sq, Sk = 2, 8, 2, 1000, 1531
    cases.append(("gqa_br_boolmask_d80_dv64", dict(q=rnd(B, Hq, Sq, 80), k=rnd(B, Hkv, Sk, 80),
                  v=rnd(B, Hkv, Sk, 64), causal="bottom_right",
                  attn_mask=torch.rand(B, 1, Sq, Sk, device=DEV, generator=g) > 0.2)))
    cases.append(("f32_causal_d128", dict(q=rnd(1, 4, 777, 128, dt=torch.float32),
                  k=rnd(1, 4, 777, 128, dt=torch.float32), v=rnd(1, 4, 777, 128, dt=torch.float32),
                  causal="top_left")))
    am = torch.randn(1, 4, 513, 700, device=DEV, generator=g)
    cases.append(("d256_additive_kvlens_dropout", dict(q=rnd(2, 4, 513, 256), k=rnd(2, 4, 700, 256),
                  v=rnd(2, 4, 700, 256), attn_mask=am, kv_lens=torch.tensor([700, 333], device=DEV),
                  dropout_p=0.1, seed=1234, offset=99, softmax_inf_as_zero=True)))
    cases.append(("f16_bshd_strides_d64", dict(q=rnd(2, 1024, 8, 64, dt=torch.float16).transpose(1, 2),
                  k=rnd(2, 1100, 8, 64, dt=torch.float16).transpose(1, 2),
                  v=rnd(2, 1100, 8, 64, dt=torch.float16).transpose(1, 2), causal="top_left")))
    cases.append(("d112_tensor_scale_inv_mqa", dict(q=rnd(1, 8, 600, 112), k=rnd(1, 1, 900, 112),
                  v=rnd(1, 1, 900, 112), scale=torch.tensor(9.0, device=DEV), invert_scale=True)))
    res = []
    for name, c in cases:
        q, k, v = c.pop("q"), c.pop("k"), c.pop("v")
        seed, offset = c.pop("seed", 0), c.pop("offset", 0)
        p = AttentionProblem.from_tensors(q, k, v, return_lse=True, **c)
        args = AttnArgs(q, k, v, attn_mask=c.get("attn_mask"), scale=c.get("scale"), seed=seed,
                        offset=offset, kv_lens=c.get("kv_lens"))
        fcfg, bcfg = configs.choose(p)
        out = torch.full((q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), float("nan"),
                         device=DEV, dtype=q.dtype)
        o, lse = flash_fwd.flash_forward(p, args, fcfg, out=out)
        ro, rl = reference_forward(p, args)
        do = torch.randn(o.shape, device=DEV, generator=g).to(q.dtype)
        pb = p.with_direction("bwd")
        bargs = AttnArgs(q, k, v, attn_mask=args.attn_mask, scale=args.scale, seed=seed,
                         offset=offset, kv_lens=args.kv_lens, do=do, o=o, lse=lse)
        grads = flash_bwd.flash_backward(pb, bargs, bcfg, **_dq_kw(pb))
        rg = reference_backward(pb, bargs)

        def err(x, r):
            fin = torch.isfinite(r)
            if not torch.equal(torch.isfinite(x), fin):
                return float("inf")
            return ((x.double()[fin] - r[fin]).norm() / r[fin].norm()).item()
        errs = dict(o=err(o, ro), lse=err(lse, rl), dq=err(grads[0], rg[0]), dk=err(grads[1], rg[1]),
                    dv=err(grads[2], rg[2]))
        tol = 2e-5 if q.dtype == torch.float32 else 1.5e-2
        row = dict(name=name, dtype=str(q.dtype), errs={kk: round(vv, 6) for kk, vv in errs.items()},
                   tma=flash_fwd.tma_ok(q, k, v), ok=all(e < tol for e in errs.values()))
        print("[feature]", row, flush=True)
        res.append(row)
    return res


# ---- --api: the public API and autograd, both determinism modes -------------------------

BWD_SOLVERS = ("flash_bwd", "flash_bwd_atomic", "flash_bwd_ordered")
# --tune-5gemm candidates of solvers 123/124 by head-dim class: (BM rows per step, BN keys
# per program, warps, stages)
FIVE_GEMM_CANDS = {
    64: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (128, 128, 8, 2)],
    128: [(64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2)],
    256: [(32, 64, 8, 1), (16, 64, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (64, 64, 8, 1)],
}


def bench_events(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median ms of `fn` by CUDA events, after `warmup` calls (the first call may compile
    and, in find mode, search)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def _api_chosen() -> dict[str, str]:
    from nnprim.search.context import context
    ctx = context(torch.device(DEV))
    return {b.problem.key(): b.solver.name for b in list(ctx.chosen.values())}


def _timed(fns: dict, rounds: int, row: dict, label: str, work: float) -> None:
    """Times the callables of `fns` interleaved (nnprim.search.timing.interleaved_samples: one
    run of each per round, the order rotated and reshuffled, a GPU lead covering each run's
    host enqueue, device events) and records each median under label.format(name); a
    callable that raises once is left out and named in row["errors"]."""
    from nnprim.search.timing import interleaved_samples
    live = {}
    for name, f in fns.items():
        try:
            f()
            live[name] = f
        except Exception as e:  # a backend that does not serve the problem
            row.setdefault("errors", {})[label.format(name)] = str(e).split("\n")[0][:120]
    if not live:
        return
    names = list(live)
    for name, ts in zip(names, interleaved_samples([live[n] for n in names], DEV, rounds=rounds, warmup=3)):
        ts = sorted(ts)
        ms = ts[len(ts) // 2]
        row["ms"][label.format(name)] = round(ms, 4)
        row["tflops"][label.format(name)] = round(work / ms / 1e9, 1)


def run_api_problem(p, tune5: bool, bwd_solvers: tuple[str, ...] = BWD_SOLVERS, rounds: int = 20):
    """One suite problem through the public API: the forward (no grad), the backward by autograd
    in the default and the deterministic mode, and the backward solvers forced at the op
    (`nnprim.sdpa_backward(..., solver=)`, timed with the default mode's backward), each phase's
    implementations (nnprim, torch SDPA on the cuDNN, FLASH_ATTENTION and default backends)
    interleaved round by round (`_timed`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import nnprim
    B, Hq, Hkv, Sq, Sk, D, causal = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Sk"], p["D"], p["causal"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, s, D, device=DEV, dtype=BF16).requires_grad_()
               for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    do = torch.randn(B, Hq, Sq, D, device=DEV, dtype=BF16)
    fl = flops_of(p)
    row = dict(name=p["name"], B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal, ms={}, tflops={})

    impls = {"nnprim": lambda: nnprim.sdpa(q, k, v, causal=causal or None)}
    peers = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION], "torch_default": None}
    for pname, be in peers.items():
        def f(be=be):
            if be is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
        impls[pname] = f
    with torch.no_grad():
        _timed(impls, rounds, row, "{}_fwd", fl)
        o, lse = nnprim.sdpa(q, k, v, causal=causal or None, return_lse=True)
    forced = {}
    for sname in bwd_solvers:
        def fb(sname=sname):
            return nnprim.sdpa_backward(do, q.detach(), k.detach(), v.detach(), o, lse, causal=causal or None,
                                        solver=sname)
        try:
            g1, g2 = fb(), fb()
            row.setdefault("bit_identical", {})[sname] = all(torch.equal(x, y) for x, y in zip(g1, g2))
            del g1, g2
            forced[f"solver_{sname}"] = fb
        except Exception as e:
            row.setdefault("errors", {})[f"solver_{sname}"] = str(e).split("\n")[0][:120]
    grads = {}
    for det in (False, True):
        tag = "det" if det else "default"
        nnprim.set_deterministic(det)
        torch.use_deterministic_algorithms(det, warn_only=True)
        try:
            outs, fns = {}, {}
            for name, f in impls.items():
                try:
                    outs[name] = f()
                    grads[(name, tag)] = torch.autograd.grad(outs[name], (q, k, v), do, retain_graph=True)
                except Exception as e:  # a backend that does not serve the problem
                    row.setdefault("errors", {})[f"{name}_{tag}"] = str(e).split("\n")[0][:120]
                    continue
                fns[f"{name}_bwd_{tag}"] = lambda out=outs[name]: torch.autograd.grad(out, (q, k, v), do,
                                                                                      retain_graph=True)
            if not det:
                fns.update(forced)
            _timed(fns, rounds, row, "{}", 2.5 * fl)
            # the choices are cleared when determinism changes
            row.setdefault("chosen", {})[tag] = sorted(
                s_ for k_, s_ in _api_chosen().items() if f"b{B}hq{Hq}hkv{Hkv}-sq{Sq}sk{Sk}-d{D}" in k_)
            del outs, fns
        finally:
            nnprim.set_deterministic(False)
            torch.use_deterministic_algorithms(False)
    ref = grads.get(("cudnn", "default")) or grads.get(("torch_default", "default"))
    if ref is not None:
        row["grad_rel_vs_torch"] = {f"{n}_{t}": [round(rel(x, r), 5) for x, r in zip(g, ref)]
                                    for (n, t), g in grads.items() if n == "nnprim"}
    del grads
    if tune5:
        from nnprim.attention import flash_bwd_atomic
        pb = AttentionProblem.from_tensors(q.detach(), k.detach(), v.detach(), causal=causal or None,
                                           direction="bwd")
        args = AttnArgs(q.detach(), k.detach(), v.detach(), do=do, o=o, lse=lse)
        dcls = 64 if D <= 64 else (128 if D <= 128 else 256)
        row["tune_5gemm"] = {}
        for c in FIVE_GEMM_CANDS[dcls]:
            for ordered in (False, True):
                label = f"{'ordered' if ordered else 'atomic'}{c}"
                try:
                    def ft(c=c, ordered=ordered):
                        return flash_bwd_atomic.backward(pb, args, T(*c), ordered=ordered)
                    ft()
                    row["tune_5gemm"][label] = round(2.5 * fl / bench_events(ft, 2, 10) / 1e9, 1)
                except Exception as e:
                    row["tune_5gemm"][label] = "ERR " + str(e).split("\n")[0][:80]
    for name in ("nnprim",) + tuple(f"solver_{s_}" for s_ in bwd_solvers):
        for peer in ("cudnn", "flash"):
            for tag in ("fwd", "bwd_default", "bwd_det"):
                mine = row["tflops"].get(f"{name}_{tag}" if name == "nnprim" else name)
                theirs = row["tflops"].get(f"{peer}_{tag}")
                if mine and theirs and (name == "nnprim" or tag == "bwd_default"):
                    row[f"{name}_vs_{peer}_{tag}"] = round(mine / theirs, 3)
    return row


def api_main(a, probs):
    res = dict(date=a.date, machine=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cudnn=torch.backends.cudnn.version(), rows=[])
    out = Path(a.out)
    if out.suffix != ".json":
        out = out / f"attention_api_{a.date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for p in probs:
        row = run_api_problem(p, a.tune_5gemm, tuple(x for x in a.bwd_solvers.split(",") if x), a.rounds)
        torch.cuda.empty_cache()
        res["rows"].append(row)
        print(f"[{time.time() - t0:.0f}s]", json.dumps(row), flush=True)
        json.dump(res, open(out, "w"), indent=1)
    keys = sorted({k_ for r in res["rows"] for k_, v_ in r.items() if "_vs_" in k_ and isinstance(v_, float)})
    res["geomean"] = {k_: round(geomean([r.get(k_) for r in res["rows"]]), 3) for k_ in keys}
    res["min"] = {k_: min((r[k_] for r in res["rows"] if k_ in r), default=None) for k_ in keys}
    json.dump(res, open(out, "w"), indent=1)
    cols = ["nnprim_fwd", "cudnn_fwd", "nnprim_bwd_default", "nnprim_bwd_det", "cudnn_bwd_default",
            "cudnn_bwd_det", "flash_bwd_default"] + [f"solver_{s_}" for s_ in a.bwd_solvers.split(",") if s_]
    print(f"{'problem':26s} " + " ".join(f"{c[:14]:>14s}" for c in cols))
    for r in res["rows"]:
        print(f"{r['name']:26s} " + " ".join(f"{r['tflops'].get(c, 0):14.1f}" for c in cols))
    print("geomean:", res["geomean"])
    print("min:", res["min"])
    print(f"wrote {out} in {time.time() - t0:.0f}s")


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(ROOT / "nnprim/data/suites/attention_gpu.json"))
    ap.add_argument("--subset", default="")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--features", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--bwd-variants", action="store_true")
    ap.add_argument("--api", action="store_true")
    ap.add_argument("--tune-5gemm", action="store_true")
    ap.add_argument("--rounds", type=int, default=20, help="--api: interleaved rounds per phase")
    ap.add_argument("--bwd-solvers", default=",".join(BWD_SOLVERS),
                    help="--api: backward solvers forced one by one (solver level), comma-separated names")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    a = ap.parse_args()
    probs = [p for p in json.load(open(a.suite))["problems"] if p["mode"] == "train"]
    if a.subset:
        want = a.subset.split(",")
        probs = sorted((p for p in probs if p["name"] in want), key=lambda p: want.index(p["name"]))
    if a.bwd_variants:
        return bwd_variants_main(a, probs)
    if a.api:
        return api_main(a, probs)
    res = dict(date=a.date, machine=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cudnn=torch.backends.cudnn.version(), rows=[])
    out = Path(a.out) / f"attention_{a.date}{'_tune' if a.tune else ''}.json"
    t0 = time.time()
    if a.features:
        res["features"] = feature_checks()
        print(f"features done {time.time() - t0:.0f}s", flush=True)
    for p in probs:
        row = run_problem(p, a.tune, not a.no_check)
        torch.cuda.empty_cache()
        res["rows"].append(row)
        print(f"[{time.time() - t0:.0f}s]", json.dumps(row), flush=True)
        json.dump(res, open(out, "w"), indent=1)
    rows = res["rows"]
    for key in ("vs_cudnn_fwd", "vs_flash_fwd", "vs_cudnn_bwd", "vs_flash_bwd"):
        res[f"geomean_{key}"] = round(geomean([r.get(key) for r in rows]), 3)
    json.dump(res, open(out, "w"), indent=1)
    hdr = f"{'problem':28s} {'ours f':>7s} {'cudnn f':>7s} {'flash f':>7s} {'ours b':>7s} " \
          f"{'cudnn b':>7s} {'flash b':>7s} {'f/cud':>6s} {'f/fla':>6s} {'b/cud':>6s} {'b/fla':>6s} ok"
    print(hdr)
    for r in rows:
        print(f"{r['name']:28s} {r['ours_fwd_tflops']:7.1f} {r.get('cudnn_fwd_tflops', 0):7.1f} "
              f"{r.get('flash_fwd_tflops', 0):7.1f} {r['ours_bwd_tflops']:7.1f} "
              f"{r.get('cudnn_bwd_tflops', 0):7.1f} {r.get('flash_bwd_tflops', 0):7.1f} "
              f"{r.get('vs_cudnn_fwd', 0):6.3f} {r.get('vs_flash_fwd', 0):6.3f} "
              f"{r.get('vs_cudnn_bwd', 0):6.3f} {r.get('vs_flash_bwd', 0):6.3f} {r.get('ok')}")
        if "tune_fwd" in r:
            print("   fwd:", r["tune_fwd"], "\n   bwd:", r["tune_bwd"])
    print("geomeans:", {k: v for k, v in res.items() if k.startswith("geomean")})
    print(f"wrote {out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
