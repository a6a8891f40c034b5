"""GPU convolution (Triton implicit GEMM, im2col+cuBLAS GEMM, direct) against cuDNN
through torch (cudnn.benchmark=True), bf16, in one run.

For each problem of suites/conv_gpu.json and each direction:
  1. correctness at the real size: ours vs torch in f32 (TF32 off) on the same bf16
     inputs, relative norm error (must be < 1e-2);
  2. timing (triton.testing.do_bench, median) of each tile-config variant of ours and of
     cuDNN (F.conv*d / aten.convolution_backward with one output);
  3. fused forward: conv + bias + residual (Sum) + ReLU in one call vs torch eager doing
     conv, then the three elementwise ops.
Results go to JSON (--out, rows written after every problem so a timeout keeps what was
measured) and a table on stdout; the last lines give the best config per problem class
(the source of nnprim/conv/configs.py's TABLE) and the geometric means.

  PYTHONUNBUFFERED=1 python benchmarks/conv.py --mode quick --out $OUT/conv_quick.json
  PYTHONUNBUFFERED=1 python benchmarks/conv.py --mode full  --out $OUT/conv_2026-11-29.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnprim.args import ConvArgs  # noqa: E402
from nnprim.conv import configs, direct, im2col_gemm  # noqa: E402
from nnprim.conv import implicit_gemm as ig  # noqa: E402
from nnprim.conv import implicit_gemm_bwd as igb  # noqa: E402
from nnprim.post_ops import Eltwise, Sum  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
T = configs.GemmTile
D = configs.DirectTile
# tile variants timed in --mode quick (the table's candidates)
GEMM_VARIANTS = {
    "fwd": [T(128, 128, 64, 8, 3), T(128, 128, 64, 4, 4), T(128, 64, 64, 4, 4), T(256, 128, 64, 8, 3),
            T(128, 256, 64, 8, 3)],
    "bwd_data": [T(128, 128, 64, 8, 3), T(128, 128, 64, 4, 4), T(128, 64, 64, 4, 4)],
    "bwd_weights": [T(128, 128, 64, 8, 3), T(128, 128, 32, 8, 4), T(64, 128, 64, 4, 3)],
}
DIRECT_VARIANTS = {
    "fwd": [D(64, 64, 4), D(128, 64, 4), D(128, 32, 4), D(256, 32, 8)],
    "bwd_data": [D(64, 64, 4), D(128, 64, 4), D(128, 32, 4)],
    "bwd_weights": [D(128, 32, 4), D(128, 64, 4)],
}
# --mode full: the table's pick plus these alternatives
FULL_EXTRA = {"fwd": [T(128, 128, 64, 8, 3)], "bwd_data": [T(128, 128, 64, 4, 4)], "bwd_weights": []}
QUICK = ["rn50_r3_3x3", "rn50_r2_1x1b", "rn50_r3_3x3s2", "rn50_conv1", "resnext_g32", "mbv2_dw3x3"]


DEVICE = "cuda"


def bench(fn, rep=40):
    if DEVICE == "cpu":   # dry run of the script itself (TRITON_INTERPRET=1, tiny suite)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def make_problem(spec, direction, **kw):
    nd = len(spec["spatial"])
    x_shape = (spec["N"], spec["C"], *spec["spatial"])
    w_shape = (spec["K"], spec["C"] // spec["groups"], *spec["filter"])
    return ConvProblem.create(direction, x_shape, w_shape, dtype=torch.bfloat16, layout=spec["layout"],
                              device=DEVICE, stride=spec["stride"], padding=spec["padding"],
                              dilation=spec["dilation"], groups=spec["groups"], **kw), nd


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ours_runs(p: ConvProblem, mode: str):
    """[(solver/config label, fn(args) -> tensor)] for a direction."""
    d = p.direction
    runs = []
    igfn = {"fwd": ig.conv_fwd, "bwd_data": ig.conv_bwd_data, "bwd_weights": igb.conv_bwd_weights}[d]
    use_direct = p.groups > 1 and not direct.DirectFwd().not_supported_reasons(p.with_direction("fwd"))
    if not (use_direct and mode == "full"):   # implicit GEMM is 20-50x slower there (quick run)
        tiles = GEMM_VARIANTS[d] if mode == "quick" else \
            list(dict.fromkeys([configs.pick(p)] + FULL_EXTRA[d]))
        for t in tiles:
            runs.append((f"igemm:{t.BM}x{t.BN}x{t.BK}w{t.warps}s{t.stages}", lambda a, t=t: igfn(p, a, t)))
    if p.groups > 1 and not direct.DirectFwd().not_supported_reasons(p.with_direction("fwd")):
        dfn = {"fwd": direct.conv_fwd, "bwd_data": direct.conv_bwd_data, "bwd_weights": direct.conv_bwd_weights}[d]
        tiles = DIRECT_VARIANTS[d] if mode == "quick" else [configs.pick_direct(p)]
        for t in tiles:
            runs.append((f"direct:{t.BP}x{t.BC}w{t.warps}", lambda a, t=t: dfn(p, a, t)))
        if d == "bwd_weights":
            for t in [D(128, 64, 4), D(256, 32, 4)]:
                runs.append((f"direct_tapgrid:{t.BP}x{t.BC}w{t.warps}",
                             lambda a, t=t: direct.conv_bwd_weights(p, a, t, tap_grid=True)))
    if p.groups == 1 and (mode == "quick" or all(f == 1 for f in p.filter)):
        gfn = {"fwd": im2col_gemm.conv_fwd, "bwd_data": im2col_gemm.conv_bwd_data,
               "bwd_weights": im2col_gemm.conv_bwd_weights}[d]
        runs.append(("gemm", lambda a: gfn(p, a)))
    return runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["quick", "full"], default="full")
    ap.add_argument("--suite", default=str(Path(__file__).parent / "suites" / "conv_gpu.json"))
    ap.add_argument("--only", default="", help="comma-separated problem names")
    ap.add_argument("--out", default="conv_gpu.json")
    ap.add_argument("--device", default="cuda", help="cpu: dry run of this script under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.backends.cudnn.benchmark = True
    gpu = torch.cuda.get_device_properties(0) if DEVICE == "cuda" else None
    import triton
    res = {"date": "2026-11-29", "machine": gpu.name if gpu else "cpu", "mode": args.mode,
           "env": {"torch": torch.__version__, "triton": triton.__version__,
                   "cudnn": torch.backends.cudnn.version(), "sms": gpu.multi_processor_count if gpu else 0},
           "rows": [], "fused": []}
    suite = json.load(open(args.suite))["problems"]
    names = [s.strip() for s in args.only.split(",") if s.strip()] or (QUICK if args.mode == "quick" else None)
    if names:
        suite = [s for s in suite if s["name"] in names]
    t_start = time.time()
    for spec in suite:
        run_problem(spec, args.mode, res)
        torch.cuda.empty_cache()
        summarize(res)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"-- {time.time() - t_start:.0f}s", flush=True)
    print_table(res)


def run_problem(spec, mode, res):
    dev = torch.device(DEVICE)
    name = spec["name"]
    p_fwd, nd = make_problem(spec, "fwd")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = to_layout(torch.randn(p_fwd.x_shape, device=dev, generator=g).to(torch.bfloat16), p_fwd.layout)
    w = to_layout((torch.randn(p_fwd.w_shape, device=dev, generator=g)
                   / math.sqrt(p_fwd.w_shape[1] * math.prod(p_fwd.filter))).to(torch.bfloat16), p_fwd.layout)
    dy = to_layout(torch.randn(p_fwd.y_shape, device=dev, generator=g).to(torch.bfloat16), p_fwd.layout)
    conv_kw = dict(stride=p_fwd.stride, padding=spec["padding"], dilation=p_fwd.dilation, groups=p_fwd.groups)
    torch.backends.cudnn.allow_tf32 = False
    with torch.no_grad():
        y_ref = CONV[nd](x.float(), w.float(), None, **conv_kw)
        dx_ref, dw_ref, _ = torch.ops.aten.convolution_backward(
            dy.float(), x.float(), w.float(), None, list(p_fwd.stride), [spec["padding"]] * nd,
            list(p_fwd.dilation), False, [0] * nd, p_fwd.groups, [True, True, False])
    torch.backends.cudnn.allow_tf32 = True
    refs = {"fwd": y_ref, "bwd_data": dx_ref, "bwd_weights": dw_ref}
    peers = {
        "fwd": lambda: CONV[nd](x, w, None, **conv_kw),
        "bwd_data": lambda: torch.ops.aten.convolution_backward(
            dy, x, w, None, list(p_fwd.stride), [spec["padding"]] * nd, list(p_fwd.dilation), False,
            [0] * nd, p_fwd.groups, [True, False, False]),
        "bwd_weights": lambda: torch.ops.aten.convolution_backward(
            dy, x, w, None, list(p_fwd.stride), [spec["padding"]] * nd, list(p_fwd.dilation), False,
            [0] * nd, p_fwd.groups, [False, True, False]),
    }
    for d in ("fwd", "bwd_data", "bwd_weights"):
        p = p_fwd.with_direction(d)
        a = ConvArgs(x=x, w=w, dy=dy)
        with torch.no_grad():
            cudnn_ms = bench(peers[d])
        row = dict(name=name, direction=d, flops=p.flops(), bytes=p.bytes(), cudnn_ms=round(cudnn_ms, 4),
                   cudnn_tflops=round(p.flops() / cudnn_ms / 1e9, 1), variants={})
        for label, fn in ours_runs(p, mode):
            try:
                out = fn(a)
                err = rel(out, refs[d])
                ms = bench(lambda fn=fn, a=a: fn(a))
                row["variants"][label] = dict(ms=round(ms, 4), tflops=round(p.flops() / ms / 1e9, 1),
                                              tb_s=round(p.bytes() / ms / 1e9, 2), err=float(f"{err:.2e}"),
                                              ok=err < 1e-2)
            except Exception as e:  # keep measuring the rest
                row["variants"][label] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        okv = {k: v for k, v in row["variants"].items() if v.get("ok")}
        if okv:
            best = min(okv, key=lambda k: okv[k]["ms"])
            row.update(best=best, ms=okv[best]["ms"], tflops=okv[best]["tflops"],
                       ratio=round(cudnn_ms / okv[best]["ms"], 3))
        res["rows"].append(row)
        print(f"{name:18s} {d:11s} cudnn {cudnn_ms:8.4f} ms {row['cudnn_tflops']:6.1f} TF | "
              + " ".join(f"{k}={v.get('ms', 'ERR')}({v.get('err', v.get('error', ''))})"
                         for k, v in row["variants"].items()), flush=True)
    # fused conv + bias + residual + relu vs torch eager
    if spec["groups"] == 1 or spec["name"] in ("resnext_g32", "mbv2_dw3x3"):
        bias = torch.randn(p_fwd.K, device=dev, generator=g).to(torch.bfloat16)
        resid = to_layout(torch.randn(p_fwd.y_shape, device=dev, generator=g).to(torch.bfloat16), p_fwd.layout)
        chain = (Sum(resid, 1.0), Eltwise("relu"))
        pf, _ = make_problem(spec, "fwd", has_bias=True, post_ops=tuple(o.signature() for o in chain))
        fa = ConvArgs(x=x, w=w, bias=bias, post_ops=chain)
        use_direct = pf.groups > 1 and not direct.DirectFwd().not_supported_reasons(pf)
        fused = (lambda: direct.conv_fwd(pf, fa)) if use_direct else (lambda: ig.conv_fwd(pf, fa))
        eager = lambda: torch.relu(CONV[nd](x, w, None, **conv_kw) + bias.view(1, -1, *([1] * nd)) + resid)  # noqa: E731
        with torch.no_grad():
            err = rel(fused(), torch.relu(y_ref + bias.float().view(1, -1, *([1] * nd)) + resid.float()))
            f_ms, e_ms = bench(fused), bench(eager)
        res["fused"].append(dict(name=name, ours_ms=round(f_ms, 4), eager_ms=round(e_ms, 4),
                                 speedup=round(e_ms / f_ms, 3), err=float(f"{err:.2e}")))
        print(f"{name:18s} fused       eager {e_ms:8.4f} ms ours {f_ms:8.4f} ms x{e_ms / f_ms:5.2f} "
              f"err {err:.1e}", flush=True)


def summarize(res):
    gm = {}
    for d in ("fwd", "bwd_data", "bwd_weights"):
        rs = [r for r in res["rows"] if r["direction"] == d and "ratio" in r
              and r["name"] not in ("resnext_g32", "mbv2_dw3x3")]
        if rs:
            gm[f"{d}_nongrouped_ratio"] = round(math.exp(sum(math.log(r["ratio"]) for r in rs) / len(rs)), 3)
        for n in ("resnext_g32", "mbv2_dw3x3"):
            rs = [r for r in res["rows"] if r["direction"] == d and r["name"] == n and "ratio" in r]
            if rs:
                gm[f"{d}_{n}_ratio"] = rs[0]["ratio"]
    if res["fused"]:
        rn = [f for f in res["fused"] if f["name"].startswith("rn50")]
        if rn:
            gm["fused_rn50_speedup_geomean"] = round(math.exp(sum(math.log(f["speedup"]) for f in rn) / len(rn)), 3)
    # best config per (direction, class)
    best = {}
    for r in res["rows"]:
        for k, v in r["variants"].items():
            if v.get("ok"):
                best.setdefault((r["direction"], r["name"]), []).append((v["ms"], k))
    res["geomeans"] = gm
    res["best_per_problem"] = {f"{d}:{n}": min(v)[1] for (d, n), v in best.items()}


def print_table(res):
    print(f"\n{'problem':18s} {'dir':11s} {'ours ms':>8s} {'TF/s':>6s} {'cuDNN ms':>8s} {'TF/s':>6s} "
          f"{'ratio':>6s}  best")
    for r in res["rows"]:
        print(f"{r['name']:18s} {r['direction']:11s} {r.get('ms', float('nan')):8.4f} "
              f"{r.get('tflops', float('nan')):6.1f} {r['cudnn_ms']:8.4f} {r['cudnn_tflops']:6.1f} "
              f"{r.get('ratio', float('nan')):6.3f}  {r.get('best', '-')}")
    for f in res["fused"]:
        print(f"fused {f['name']:18s} ours {f['ours_ms']:.4f} eager {f['eager_ms']:.4f} x{f['speedup']:.2f}")
    print("geomeans", json.dumps(res.get("geomeans", {})))


if __name__ == "__main__":
    main()
