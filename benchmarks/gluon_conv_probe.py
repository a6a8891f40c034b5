"""Probe of solver 27 `gluon_implicit_gemm_fwd`'s kernel variants on a few problems, in one
device run (<= ~150 s on an H200): where does its time go?

For rn50_r2_1x1a, rn50_r3_3x3, rn50_r4_1x1, unet_640_32x32 (nnprim/data/suites/conv_gpu.json,
NHWC bf16) it times, interleaved (nnprim.search.timing.interleaved_samples: CUDA events,
warm-up, rotating order; each sample is max(event time, host enqueue time)):
  - `old`: the first device run's tile (old_tile below) on Triton's JIT launch path
    (descriptors validated and encoded on every call), i.e. what the first run measured;
  - `old_planned`: the same tile through the planned launch (host-cost fix alone);
  - `new`: tile_config's tile, planned launch (what the solver runs now);
  - variants of `new`: STAGES, consumer warps, BN, KSUB, `noepi` (epilogue and store
    dropped: the main loop alone);
  - solver 20 (`nnprim.conv_forward(..., solver="implicit_gemm_fwd")`) and cuDNN
    (F.conv2d on channels_last, cudnn.benchmark=True).
Per candidate it also records `host_us` (perf_counter per call over back-to-back calls,
no sync: the host cost) and, for ours, `graph_ms` (one call captured in a CUDA graph,
replays timed the same way: the GPU time without any host cost). Each variant's output
(except noepi) is checked against cuDNN's (relative norm error < 2e-2) after its timed
calls, i.e. on the planned fast path.

Hang guard: every variant's first call runs first in a child process (this script with
--child) with a timeout; a variant that hangs or fails there is recorded and not run here.

  PYTHONUNBUFFERED=1 timeout 170 python benchmarks/gluon_conv_probe.py --out $OUT/gluon_conv_probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ["NNPRIM_GLUON"] = "1"  # measured even where the environment switches them off
from gluon_bench_common import graph_fn, host_us  # noqa: E402

import nnprim  # noqa: E402
from nnprim.args import ConvArgs  # noqa: E402
from nnprim.conv import gluon_conv  # noqa: E402
from nnprim.conv.implicit_gemm import geom  # noqa: E402
from nnprim.problems.conv import ConvProblem  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

SUITE = ROOT / "nnprim" / "data" / "suites" / "conv_gpu.json"
PROBLEMS = ("rn50_r2_1x1a", "rn50_r3_3x3", "rn50_r4_1x1", "unet_640_32x32")


def old_tile(p: ConvProblem) -> gluon_conv.GluonTile:
    """tile_config as of the first device run (2026-12-01): BN 256 whenever K >= 256,
    KSUB up to 3 for C <= 64 even when that leaves 2 stages."""
    gm = geom(p)
    OH, OW = gm.out[1], gm.out[2]
    BM = 64 if OH * OW <= 64 else 128
    BH, BW = gluon_conv.rect(BM, OH, OW)
    BN = 256 if gm.K >= 256 and BM == 128 else min(128, max(64, 1 << (gm.K - 1).bit_length()))
    BK = 64 if gm.C >= 64 else (32 if gm.C >= 32 else 16)
    steps = gm.taps * math.ceil(gm.C / BK)
    KSUB = next(k for k in (3, 2, 1) if steps % k == 0) if gm.C <= 64 else 1
    warps = 8 if BM * BN > 128 * 128 else 4
    t = gluon_conv.GluonTile(BH, BW, BN, BK, KSUB, 4, warps)
    while t.STAGES > 2 and t.smem_bytes() > gluon_conv.SMEM_BYTES:
        t = replace(t, STAGES=t.STAGES - 1)
    return t


def fits(t: gluon_conv.GluonTile) -> bool:
    return t.smem_bytes() <= gluon_conv.SMEM_BYTES and t.BM * t.BN // (t.warps * 32) <= 128


def variants(p: ConvProblem) -> dict[str, tuple[gluon_conv.GluonTile, bool]]:
    """name -> (tile, planned launch)."""
    old, new = old_tile(p), gluon_conv.tile_config(p)
    out = {"old": (old, False), "old_planned": (old, True), "new": (new, True),
           "noepi": (replace(new, epilogue=False), True)}
    extra = [("st3", replace(new, STAGES=3)), ("st4", replace(new, STAGES=4))]
    if new.warps == 4:
        extra.append(("w8", replace(new, warps=8)))
    if new.BN == 128 and new.BM == 128 and p.K >= 256:
        extra.append(("bn256", replace(new, BN=256, warps=8, STAGES=3)))
    if new.BN == 256:
        extra.append(("bn128", replace(new, BN=128, warps=4, STAGES=6)))
    gm = geom(p)
    if p.C <= 64 and new.KSUB == 1 and gm.taps * math.ceil(gm.C / new.BK) % 3 == 0:
        extra.append(("ksub3_st2", replace(new, KSUB=3, STAGES=2)))
    for name, t in extra:
        if fits(t) and all(t != v[0] for v in out.values()):
            out[name] = (t, True)
    return out


def make_problem(spec: dict) -> tuple[ConvProblem, dict]:
    x_shape = (spec["N"], spec["C"], *spec["spatial"])
    w_shape = (spec["K"], spec["C"], *spec["filter"])
    kw = dict(stride=spec["stride"], padding=spec["padding"], dilation=spec["dilation"])
    p = ConvProblem.create("fwd", x_shape, w_shape, dtype=torch.bfloat16, layout="nhwc", device="cuda", **kw)
    return p, kw


def inputs(p: ConvProblem):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*p.x_shape, generator=g, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(*p.w_shape, generator=g, device="cuda") / math.sqrt(math.prod(p.w_shape[1:]))
    return x, w.to(torch.bfloat16).to(memory_format=torch.channels_last)


def child(names: list[str]) -> None:
    """First call of each variant ('problem/variant'), printing OK or ERR after each."""
    specs = {s["name"]: s for s in json.load(open(SUITE))["problems"]}
    for full in names:
        pname, vname = full.split("/")
        p, _ = make_problem(specs[pname])
        tile, planned = variants(p)[vname]
        x, w = inputs(p)
        try:
            gluon_conv.GluonConvPlan(p, tile, planned)(ConvArgs(x=x, w=w))
            torch.cuda.synchronize()
            print(f"OK {full}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"ERR {full} {type(e).__name__}: {str(e)[:300]!r}", flush=True)


def guard(names: list[str], budget_s: float) -> dict[str, str]:
    """Run first calls in children; a hang kills the child, marks the variant and goes on
    with the rest in a new child. Returns name -> 'ok' or why not."""
    status: dict[str, str] = {}
    todo = list(names)
    deadline = time.time() + budget_s
    while todo and time.time() < deadline:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.Popen([sys.executable, __file__, "--child", ",".join(todo)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        per_variant = 30.0
        last = time.time()
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if not sel.select(timeout=1.0):
                if proc.poll() is not None or time.time() - last > per_variant or time.time() > deadline:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            parts = line.split(" ", 2)
            if parts[0] in ("OK", "ERR") and len(parts) >= 2 and parts[1].strip() in todo:
                name = parts[1].strip()
                status[name] = "ok" if parts[0] == "OK" else "error: " + (parts[2].strip() if len(parts) > 2 else "")
                todo.remove(name)
                last = time.time()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if todo:   # the first unreported variant hung (or crashed the child)
            status[todo.pop(0)] = f"hung or crashed the child (> {per_variant:.0f} s, rc {proc.returncode})"
    for n in todo:
        status[n] = "not run: guard budget spent"
    return status




def run_problem(spec: dict, status: dict[str, str], rounds: int) -> dict:
    p, kw = make_problem(spec)
    x, w = inputs(p)
    rec: dict = {"name": spec["name"], "tflop": p.flops() / 1e12, "variants": {}}
    torch.backends.cudnn.benchmark = True
    ref = F.conv2d(x, w, **kw)
    names, fns, graphs = [], [], []
    for vname, (tile, planned) in variants(p).items():
        full = f"{spec['name']}/{vname}"
        v = rec["variants"][vname] = {"tile": {**tile.__dict__, "planned": planned}, "guard": status.get(full)}
        if status.get(full) != "ok":
            continue
        plan = gluon_conv.GluonConvPlan(p, tile, planned)
        args = ConvArgs(x=x, w=w)
        fn = (lambda plan=plan, args=args: plan(args))
        fn()
        names.append(vname)
        fns.append(fn)
        graphs.append(graph_fn(fn))
    fns.append(lambda: nnprim.conv_forward(x, w, solver="implicit_gemm_fwd", **kw))
    names.append("solver20")
    graphs.append(None)
    fns.append(lambda: F.conv2d(x, w, **kw))
    names.append("cudnn")
    graphs.append(None)
    for fn in fns[-2:]:
        fn()
    samples = interleaved_samples(fns, "cuda", rounds=rounds, warmup=3)
    gfns = [g for g in graphs if g is not None]
    gsamples = iter(interleaved_samples(gfns, "cuda", rounds=rounds, warmup=2)) if gfns else iter(())
    for name, fn, s, g in zip(names, fns, samples, graphs):
        ms = statistics.median(s)
        v = rec["variants"].setdefault(name, {})
        v.update(ms=ms, tflops=p.flops() / ms / 1e9, host_us=host_us(fn))
        if g is not None:
            v["graph_ms"] = statistics.median(next(gsamples))
            v["graph_tflops"] = p.flops() / v["graph_ms"] / 1e9
        if name not in ("cudnn", "noepi"):
            y = fn()
            torch.cuda.synchronize()
            v["rel_err"] = float((y.float() - ref.float()).norm() / ref.float().norm())
            if not v["rel_err"] < 2e-2:
                v["error"] = f"wrong result: rel err {v['rel_err']:.3g}"
    cud = rec["variants"]["cudnn"]["ms"]
    for v in rec["variants"].values():
        if "ms" in v:
            v["vs_cudnn"] = cud / v["ms"]
    return rec


def table(rec: dict) -> str:
    lines = [f"{rec['name']} ({rec['tflop'] * 1e3:.1f} GFLOP)",
             f"  {'variant':<11} {'ms':>8} {'TFLOP/s':>8} {'graph_ms':>9} {'host_us':>8} {'xcuDNN':>7}  tile / notes"]
    for name, v in rec["variants"].items():
        t = v.get("tile")
        tile = (f"BH{t['BH']} BW{t['BW']} BN{t['BN']} BK{t['BK']} KSUB{t['KSUB']} ST{t['STAGES']} w{t['warps']}"
                f"{'' if t['planned'] else ' jit'}{'' if t['epilogue'] else ' noepi'}") if t else ""
        note = v.get("error") or ("" if v.get("guard") in (None, "ok") else v["guard"])
        if "ms" not in v:
            lines.append(f"  {name:<11} {'-':>8} {'-':>8} {'-':>9} {'-':>8} {'-':>7}  {tile} {note}")
            continue
        gm = f"{v['graph_ms']:.4f}" if "graph_ms" in v else "-"
        lines.append(f"  {name:<11} {v['ms']:8.4f} {v['tflops']:8.1f} {gm:>9} {v['host_us']:8.1f} "
                     f"{v['vs_cudnn']:7.2f}  {tile} {note}".rstrip())
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--only", default=",".join(PROBLEMS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--guard-s", type=float, default=100.0, help="budget of the hang-guard children")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        child(a.child.split(","))
        return
    if not a.out:
        ap.error("--out is required")
    t0 = time.time()
    specs = {s["name"]: s for s in json.load(open(SUITE))["problems"]}
    todo = [specs[n] for n in a.only.split(",")]
    names = [f"{s['name']}/{v}" for s in todo for v in variants(make_problem(s)[0])]
    status = guard(names, a.guard_s)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "guard_s": time.time() - t0,
           "guard": status, "problems": []}
    print(f"guard: {sum(v == 'ok' for v in status.values())}/{len(status)} ok in {time.time() - t0:.0f} s", flush=True)
    for k, v in status.items():
        if v != "ok":
            print("  ", k, v, flush=True)
    for spec in todo:
        try:
            rec = run_problem(spec, status, a.rounds)
        except Exception as e:  # noqa: BLE001 - keep the other problems
            rec = {"name": spec["name"], "error": f"{type(e).__name__}: {str(e)[:1500]}", "variants": {}}
            print(spec["name"], rec["error"], flush=True)
        res["problems"].append(rec)
        if "tflop" in rec:
            print(table(rec), flush=True)
        res["elapsed_s"] = time.time() - t0
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
