"""Probe of the Gluon conv solvers 28 `gluon_implicit_gemm_bwd_data` and 29
`gluon_implicit_gemm_bwd_weights` (and 27, the forward, with --directions fwd,...) on
stride-2 layers, C = 64 layers and 3-D layers (issue 13), in one device run
(< ~2 min on an H200), NHWC bf16:
  - rn50_r3_3x3s2 (nnprim/data/suites/conv_gpu.json: N=128, C=K=128, 56x56 -> 28x28, 3x3,
    stride 2, pad 1), the target: >= 0.9x cuDNN in both directions;
  - rn50_r3_ds_1x1s2: ResNet-50's stage-3 downsample projection (N=128, C=256 -> K=512,
    1x1 stride 2 at 56x56; backward data has three zero phases);
  - rn50_r3_3x3 (stride 1, 28x28), the no-regression reference (0.95x / 0.93x before).
Per problem and direction it times, interleaved (nnprim.search.timing.interleaved_samples:
CUDA events, warm-up, rotating order; each sample is max(event time, host enqueue time)):
ours and the Triton solver of the direction (21 / 22) through the public API
(`nnprim.conv_backward_data/_weights(..., solver=...)`, the plan cached after the first
call), and cuDNN
(aten.convolution_backward with one output, cudnn.benchmark on); median ms, TFLOP/s, the
ratio vs cuDNN (> 1: faster), ours' host us per call and its CUDA-graph time (no host
cost). Each result is checked against cuDNN's f32 result (relative norm error < 2e-2).

Hang guard: ours' first calls run in a child process (this script with --child) with a
timeout; a candidate that hangs or fails there is reported and not timed here.

  PYTHONUNBUFFERED=1 timeout 170 python benchmarks/gluon_conv_bwd_probe.py --out $OUT/gluon_conv_bwd_probe.json
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ["NNPRIM_GLUON"] = "1"  # measured even where the environment switches them off
from gluon_bench_common import graph_fn, host_us  # noqa: E402

import nnprim  # noqa: E402
from nnprim.problems.conv import ConvProblem  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

PROBLEMS = {  # name: (x, w, stride, padding)
    "rn50_r3_3x3s2": ((128, 128, 56, 56), (128, 128, 3, 3), 2, 1),
    "rn50_r3_ds_1x1s2": ((128, 256, 56, 56), (512, 256, 1, 1), 2, 0),
    "rn50_r3_3x3": ((128, 128, 28, 28), (128, 128, 3, 3), 1, 1),
    "rn50_r2_3x3": ((128, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    "c3d_3x3x3": ((8, 64, 16, 56, 56), (128, 64, 3, 3, 3), 1, 1),       # 3-D: planes as images
    "c3d_s2": ((8, 128, 16, 28, 28), (256, 128, 3, 3, 3), 2, 1),
}
SOLVERS = {"fwd": ("gluon_implicit_gemm_fwd", "implicit_gemm_fwd"),
           "bwd_data": ("gluon_implicit_gemm_bwd_data", "implicit_gemm_bwd_data"),
           "bwd_weights": ("gluon_implicit_gemm_bwd_weights", "implicit_gemm_bwd_weights")}


def spec(name: str) -> tuple:
    """(x, w, stride, padding, groups) of a PROBLEMS entry or a conv_gpu suite problem."""
    if name in PROBLEMS:
        return (*PROBLEMS[name], 1)
    from nnprim.cli.suites import load_suite
    q = {p["name"]: p for p in load_suite("conv_gpu")[1]}[name]
    g = q.get("groups", 1)
    return ((q["N"], q["C"], *q["spatial"]), (q["K"], q["C"] // g, *q["filter"]), q["stride"], q["padding"], g)


def setup(name: str, direction: str):
    x_shape, w_shape, stride, pad, groups = spec(name)
    p = ConvProblem.create(direction, x_shape, w_shape, dtype=torch.bfloat16, layout="nhwc", device="cuda",
                           stride=stride, padding=pad, groups=groups)
    g = torch.Generator(device="cuda").manual_seed(0)
    nd = len(x_shape) - 2
    cl = dict(memory_format=torch.channels_last if nd == 2 else torch.channels_last_3d)
    x = torch.randn(*x_shape, generator=g, device="cuda").to(torch.bfloat16).to(**cl)
    w = (torch.randn(*w_shape, generator=g, device="cuda") / math.sqrt(math.prod(w_shape[1:]))).to(torch.bfloat16)
    w = w.to(**cl)
    dy = torch.randn(p.y_shape, generator=g, device="cuda").to(torch.bfloat16).to(**cl)
    kw = dict(stride=stride, padding=pad, groups=groups)

    def api(solver: str | None):
        if direction == "fwd":
            return lambda: nnprim.conv_forward(x, w, solver=solver, **kw)
        if direction == "bwd_data":
            return lambda: nnprim.conv_backward_data(dy, w, x_shape, solver=solver, **kw)
        return lambda: nnprim.conv_backward_weights(dy, x, w_shape, solver=solver, **kw)
    mask = [direction == "bwd_data", direction == "bwd_weights", False]
    bw = ([stride] * nd, [pad] * nd, [1] * nd, False, [0] * nd, groups)
    if direction == "fwd":
        cudnn = lambda: torch.ops.aten.convolution(x, w, None, *bw)  # noqa: E731
    else:
        cudnn = lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw, mask)[0 if mask[0] else 1]  # noqa: E731
    return p, api, cudnn, (dy, x, w, bw, mask)


def conv_tile_variants(p: ConvProblem, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict:
    """Forward / stride-1 backward data with one consumer warpgroup: solver 27's plan with
    256-row tiles (twice the default rectangle's rows, two consumer warpgroups sharing each
    weight box) next to the default 128, through the plan (no API)."""
    from dataclasses import replace

    from nnprim.args import ConvArgs
    from nnprim.conv import gluon_conv as gc
    if p.direction == "bwd_weights" or gc.shape_reasons(p) or (p.direction == "bwd_data" and max(p.stride) > 1):
        return {}
    fp = gc.forward_view(p)
    t0 = gc.tile_config(fp)
    if t0.warps != 4 or t0.BM != 128 or t0.BH * 2 > fp.out_size[-2]:
        return {}
    t = replace(t0, BH=2 * t0.BH, warps=8, epi_bufs=1)
    while t.STAGES > 2 and t.smem_bytes() > gc.SMEM_BYTES:
        t = replace(t, STAGES=t.STAGES - 1)
    plan = gc.GluonConvPlan(p, tile=t)
    args = ConvArgs(dy=dy, w=w) if p.direction == "bwd_data" else ConvArgs(x=x, w=w)
    return {f"bm256s{t.STAGES}k{t.KSUB}": lambda: plan(args)}


def tile_variants(p: ConvProblem, dy: torch.Tensor, x: torch.Tensor) -> dict:
    """Backward weights: solver 29's plan with 64-, 128- and 256-pixel steps (the default
    rectangle's rows times 1, 2, 4; those that keep 3 ring stages), through the plan (no API)."""
    from nnprim.args import ConvArgs
    from nnprim.conv import gluon_conv_wgrad as gw
    from nnprim.conv.gluon_conv import rect, shape_reasons
    if p.direction != "bwd_weights" or shape_reasons(p) or p.groups > 1 or gw.flat_view(p) is not None:
        return {}
    t0 = gw.tile_config(p)
    out = {}
    for bp in (64, 128, 256):
        bh, bw = rect(bp, p.out_size[-2], p.out_size[-1])
        if (bh, bw) == (t0.BH, t0.BW) or bh > 2 * p.out_size[-2]:
            continue
        t = gw.WgradTile(bh, bw, t0.BM, t0.BN, 1, t0.warps)
        if (gw.SMEM_BYTES - 2048) // t.stage_bytes() < 3:
            continue
        name = f"bp{bp}"
        t = gw.WgradTile(bh, bw, t0.BM, t0.BN, min(gw.MAX_STAGES, (gw.SMEM_BYTES - 2048) // t.stage_bytes()),
                         t0.warps)
        plan = gw.GluonWgradPlan(p, tile=t)
        out[name] = lambda plan=plan: plan(ConvArgs(dy=dy, x=x))
    if math.prod(p.filter) > 1:     # two taps a unit (the dy box shared)
        plan = gw.GluonWgradPlan(p, tile=gw.taps2_tile(p))
        out["taps2"] = lambda plan=plan: plan(ConvArgs(dy=dy, x=x))
    # 64-wide tiles with 128-pixel steps where C or K is no multiple of 128 (K = 320: 128-row
    # tiles compute 384 rows)
    if p.K % 128 or p.C % 128:
        bh, bw = rect(128, p.out_size[-2], p.out_size[-1])
        for bm, bn in ((128, 64), (64, 128), (64, 64)):
            if (bm, bn) == (t0.BM, t0.BN) or bm > p.K or bn > p.C:
                continue
            t = gw.WgradTile(bh, bw, bm, bn, 1, 4)
            t = gw.WgradTile(bh, bw, bm, bn, min(gw.MAX_STAGES, (gw.SMEM_BYTES - 2048) // t.stage_bytes()),
                             8 if bm * bn > 128 * 64 else 4)
            plan = gw.GluonWgradPlan(p, tile=t)
            out[f"{bm}x{bn}bp128"] = lambda plan=plan: plan(ConvArgs(dy=dy, x=x))
    return out


def child(names: list[str]) -> None:
    """First call of ours per 'problem/direction', printing OK or ERR after each."""
    for full in names:
        name, d = full.split("/")
        p, api, _, _ = setup(name, d)
        try:
            api(SOLVERS[d][0])()
            torch.cuda.synchronize()
            print(f"OK {full}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"ERR {full} {type(e).__name__}: {str(e)[:300]!r}", flush=True)


def guard(names: list[str], timeout_s: float) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    try:
        r = subprocess.run([sys.executable, __file__, "--child", ",".join(names)], env=env, capture_output=True,
                           text=True, timeout=timeout_s)
        out = r.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    status = {}
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if parts[0] in ("OK", "ERR") and len(parts) >= 2:
            status[parts[1]] = "ok" if parts[0] == "OK" else "error: " + (parts[2] if len(parts) > 2 else "")
    first_missing = True
    for n in names:
        if n not in status:
            status[n] = "hung or crashed the child" if first_missing else "not run (an earlier one hung)"
            first_missing = False
    return status


def graph_ms(fn, rounds: int) -> float | None:
    """Median ms of fn replayed from a CUDA graph (no host cost); None when capture fails."""
    g = graph_fn(fn)
    return None if g is None else statistics.median(interleaved_samples([g], "cuda", rounds=rounds, warmup=2)[0])


def run(name: str, d: str, ok: bool, rounds: int, default: bool = False) -> dict:
    p, api, cudnn, (dy, x, w, bw, mask) = setup(name, d)
    rec: dict = {"problem": name, "direction": d, "key": p.key(), "gflop": p.flops() / 1e9}
    ours, triton_s = SOLVERS[d]
    reasons = REGISTRY.get(ours).not_supported_reasons(p)
    rec["ours_reasons"] = reasons
    with torch.no_grad():
        torch.backends.cudnn.allow_tf32 = False
        if d == "fwd":
            ref = torch.ops.aten.convolution(x.float(), w.float(), None, *bw)
        else:
            ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, *bw, mask)[
                0 if mask[0] else 1]
        torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    cands = {}
    if ok and not reasons:
        cands["ours"] = api(ours)
        cands.update(tile_variants(p, dy, x))
        cands.update(conv_tile_variants(p, x, w, dy))
    cands["triton"] = api(triton_s)
    if default:
        cands["default"] = api(None)     # the public call as users make it (find on the first call)
    cands["cudnn"] = cudnn
    for fn in cands.values():
        fn()
    samples = interleaved_samples(list(cands.values()), "cuda", rounds=rounds, warmup=3)
    for (cname, fn), s in zip(cands.items(), samples):
        ms = statistics.median(s)
        v = rec[cname] = {"ms": ms, "tflops": p.flops() / ms / 1e9}
        out = fn()
        torch.cuda.synchronize()
        v["rel_err"] = float((out.float() - ref).norm() / ref.norm())
        if not v["rel_err"] < 2e-2:
            v["error"] = f"wrong result: rel err {v['rel_err']:.3g}"
        if cname == "ours":
            v["host_us"] = host_us(fn)
            v["graph_ms"] = graph_ms(fn, rounds)
    for cname in cands:
        rec[cname]["vs_cudnn"] = rec["cudnn"]["ms"] / rec[cname]["ms"]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--only", default=",".join(PROBLEMS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--guard-s", type=float, default=90.0)
    ap.add_argument("--child", default="")
    ap.add_argument("--directions", default="bwd_data,bwd_weights")
    ap.add_argument("--default", action="store_true", help="also the call without solver= (find on its first call)")
    a = ap.parse_args()
    if a.child:
        child(a.child.split(","))
        return
    if not a.out:
        ap.error("--out is required")
    t0 = time.time()
    names = [f"{n}/{d}" for n in a.only.split(",") for d in a.directions.split(",")]
    status = guard(names, a.guard_s)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "guard": status, "results": []}
    print(f"guard ({time.time() - t0:.0f} s): {status}", flush=True)
    print(f"{'problem/direction':<30} {'ours ms':>8} {'x cuDNN':>7} {'graph':>7} {'host us':>7} "
          f"{'triton ms':>9} {'x cuDNN':>7} {'cuDNN ms':>8}", flush=True)
    for full in names:
        name, d = full.split("/")
        try:
            rec = run(name, d, status[full] == "ok", a.rounds, a.default)
        except Exception as e:  # noqa: BLE001 - keep the others
            rec = {"problem": name, "direction": d, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
        res["results"].append(rec)
        o, t, c = rec.get("ours", {}), rec.get("triton", {}), rec.get("cudnn", {})
        if "cudnn" in rec:
            gm = o.get("graph_ms")
            print(f"{full:<30} {o.get('ms', float('nan')):8.4f} {o.get('vs_cudnn', float('nan')):7.2f} "
                  f"{gm if gm is not None else float('nan'):7.4f} {o.get('host_us', float('nan')):7.1f} "
                  f"{t['ms']:9.4f} {t['vs_cudnn']:7.2f} {c['ms']:8.4f} "
                  f"{o.get('error', '') or t.get('error', '') or status[full]}", flush=True)
            extra = {k: v for k, v in rec.items() if isinstance(v, dict) and k not in ("ours", "triton", "cudnn")}
            for k, v in extra.items():
                print(f"{'':<30} {k}: {v['ms']:.4f} ms, {v['vs_cudnn']:.2f}x cuDNN {v.get('error', '')}", flush=True)
        else:
            print(full, rec.get("error"), flush=True)
        res["elapsed_s"] = time.time() - t0
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
