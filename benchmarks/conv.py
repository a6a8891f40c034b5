"""GPU convolution (Triton implicit GEMM / TMA GEMM, im2col+cuBLAS GEMM, direct) against
cuDNN through torch (cudnn.benchmark=True), bf16, in one run.

For each problem of nnprim/data/suites/conv_gpu.json and each direction:
  1. correctness at the real size: ours vs torch in f32 (TF32 off) on the same bf16
     inputs, relative norm error (must be < 1e-2), checked before any timing;
  2. timing of each variant of ours (a prepared invoker: the plan made once, as the
     solver's `prepare` does) and of cuDNN (F.conv*d / aten.convolution_backward with
     one output), two ways:
       eager  triton.testing.do_bench, median: back-to-back calls from Python, what a
              user gets (host launch overhead included when it exceeds the kernel);
       graph  a CUDA graph of 20 invocations (captured after a warm-up on a side
              stream), replayed; per invocation, median of 10 replays: the kernels'
              own time, launch overhead removed (inputs stay in L2 between the 20
              calls when they fit: small problems look a little faster than cold);
     plus host_us, the Python time per call (50 calls enqueued back to back);
  3. fused forward: conv + bias + residual (Sum) + ReLU in one call vs torch eager doing
     conv, then the three elementwise ops (both timings).
The ratio vs cuDNN uses the eager numbers; the graph numbers place the kernels against
the roofline. Kernels are compiled first by worker processes in parallel (--warm N),
so the measuring process finds them in Triton's cache. Results go to JSON (--out,
rewritten after every problem, so a timeout keeps what was measured) and a table on
stdout.

  PYTHONUNBUFFERED=1 python benchmarks/conv.py --out $OUT/conv_2026-11-29.json
  python benchmarks/conv.py --device cpu --only tiny   # dry run under TRITON_INTERPRET=1
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

from nnprim.args import ConvArgs  # noqa: E402
from nnprim.conv import configs, direct  # noqa: E402
from nnprim.conv import implicit_gemm as ig  # noqa: E402
from nnprim.conv import implicit_gemm_bwd as igb  # noqa: E402
from nnprim.post_ops import Eltwise, Sum  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
T = configs.GemmTile
D = configs.DirectTile
# candidates timed per direction besides the table's pick (deduplicated after `fit`)
GEMM_EXTRA = {
    "fwd": [T(128, 128, 64, 8, 3)],
    "bwd_data": [T(128, 128, 64, 4, 4)],
    "bwd_weights": [],
}
TMA_EXTRA = [T(128, 128, 64, 8, 3), T(128, 64, 64, 4, 4), T(128, 256, 64, 8, 3), T(256, 128, 64, 8, 3),
             T(128, 128, 64, 4, 4)]
TMA_CONV_VARIANTS = [T(128, 128, 64, 8, 3), T(128, 256, 64, 8, 3), T(128, 128, 64, 4, 4), T(128, 128, 64, 4, 3),
                     T(256, 128, 64, 8, 3), T(64, 128, 64, 4, 4), T(128, 256, 64, 8, 4)]
# backward weights: BM = output channels, BN = input channels, BK = pixels per step
TMA_BWD_W_VARIANTS = [T(128, 128, 64, 8, 3), T(128, 128, 128, 8, 3), T(128, 256, 64, 8, 3), T(256, 128, 64, 8, 3),
                      T(128, 128, 64, 4, 4), T(64, 128, 128, 4, 3)]
DIRECT_EXTRA = {
    "fwd": [D(128, 16, 4), D(256, 16, 4)],
    "bwd_data": [D(128, 16, 4)],
    "bwd_weights": [],
}
DIRECT_TILES_BWD_W = [D(128, 32, 4), D(128, 16, 4)]
GROUPED = ("resnext_g32", "mbv2_dw3x3")
TINY = [dict(name="tiny", N=2, C=16, spatial=[7, 9], K=24, filter=[3, 3], stride=1, padding=1, dilation=1,
             groups=1, layout="nhwc"),
        dict(name="tiny_1x1", N=2, C=32, spatial=[5, 7], K=16, filter=[1, 1], stride=1, padding=0, dilation=1,
             groups=1, layout="nhwc"),
        dict(name="tiny_dw", N=2, C=16, spatial=[7, 9], K=16, filter=[3, 3], stride=1, padding=1, dilation=1,
             groups=16, layout="nhwc")]

DEVICE = "cuda"


def bench_eager(fn, rep=25):
    if DEVICE == "cpu":   # dry run of the script itself (TRITON_INTERPRET=1, tiny problems)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def bench_graph(fn, n=20, reps=10):
    """ms per invocation of fn, from a CUDA graph of n invocations (median of reps replays)."""
    if DEVICE == "cpu":
        return bench_eager(fn)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    del g
    return statistics.median(times)


def host_us(fn, n=50):
    """Python time per call with the GPU not waited for (launches are asynchronous)."""
    if DEVICE == "cpu":
        return 0.0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def make_problem(spec, direction, **kw):
    nd = len(spec["spatial"])
    x_shape = (spec["N"], spec["C"], *spec["spatial"])
    w_shape = (spec["K"], spec["C"] // spec["groups"], *spec["filter"])
    return ConvProblem.create(direction, x_shape, w_shape, dtype=torch.bfloat16, layout=spec["layout"],
                              device=DEVICE, stride=spec["stride"], padding=spec["padding"],
                              dilation=spec["dilation"], groups=spec["groups"], **kw), nd


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _gl(prefix: str, t: configs.GemmTile) -> str:
    return f"{prefix}:{t.BM}x{t.BN}x{t.BK}w{t.warps}s{t.stages}"


def ours_plans(p: ConvProblem):
    """[(label, prepared invoker)] for a problem: the solver's own pick first, then the
    candidate variants of each applicable family."""
    d = p.direction
    runs = []
    is_direct = p.groups > 1 and not direct.DirectFwd().not_supported_reasons(p.with_direction("fwd"))
    if is_direct:
        tiles = list(dict.fromkeys([configs.pick_direct(p)] + DIRECT_EXTRA[d]))
        for t in tiles:
            lab = f"direct:{t.BP}x{t.BC}w{t.warps}" + (f"bw{t.BW}" if t.BW else "")
            if d == "bwd_weights":
                runs.append((lab, lambda t=t: direct.BwdWeightsPlan(p, t)))
            else:
                runs.append((lab, lambda t=t: direct.DirectPlan(p, t)))
        if d == "bwd_weights" and hasattr(direct, "BwdWeightsTilePlan"):
            for t in DIRECT_TILES_BWD_W:
                runs.append((f"direct_tiles:{t.BP}x{t.BC}w{t.warps}", lambda t=t: direct.BwdWeightsTilePlan(p, t)))
        return runs
    plan_cls = {"fwd": ig.FwdPlan, "bwd_data": ig.BwdDataPlan, "bwd_weights": igb.BwdWeightsPlan}[d]
    tma = d != "bwd_weights" and ig.is_plain_gemm(p)
    pick = configs.pick(p)
    tiles = list(dict.fromkeys([pick] + (TMA_EXTRA if tma else GEMM_EXTRA[d])))
    seen = set()
    for t in tiles:
        key = fitted(p, t, tma)
        if key in seen:
            continue
        seen.add(key)
        runs.append((_gl("tma" if tma else "igemm", t), lambda t=t: plan_cls(p, t)))
    if tma:
        runs.append((_gl("igemm", pick), lambda: plan_cls(p, pick, tma=False)))
    if d != "bwd_weights" and ig.is_tma_conv(p):
        for t in TMA_CONV_VARIANTS:
            runs.append((_gl("tmaconv", t), lambda t=t: plan_cls(p, t, tma_conv=True)))
    if d == "bwd_weights" and (ig.is_tma_conv(p) or ig.is_plain_gemm(p)):
        for t in TMA_BWD_W_VARIANTS:
            runs.append((_gl("tmaconv", t), lambda t=t: plan_cls(p, t, tma_conv=True)))
    if p.groups == 1 and all(f == 1 for f in p.filter):
        gname = {"fwd": "gemm_fwd", "bwd_data": "gemm_bwd_data", "bwd_weights": "gemm_bwd_weights"}[d]
        runs.append(("gemm", lambda: REGISTRY.get(gname).prepare(p)))
    return runs


def fitted(p: ConvProblem, t: configs.GemmTile, tma: bool) -> tuple:
    """The tile a plan really uses (blocks clamped to the GEMM's sides), to skip duplicates."""
    gm = ig.geom(p)
    if p.direction == "bwd_weights":
        return igb.plan_split(p, t)[:3] + (t.warps, t.stages)
    M = gm.N * gm.P
    if p.direction == "fwd":
        ks = gm.C if tma else (gm.Cg * gm.taps if gm.Cg < 32 and gm.taps > 1 else gm.Cg)
        return ig.fit(t.BM, M), ig.fit(t.BN, gm.Kg), ig.fit(t.BK, ks), t.warps, t.stages
    return t.BM, ig.fit(t.BN, gm.Cg), ig.fit(t.BK, gm.Kg), t.warps, t.stages


def setup(spec):
    """Inputs, references and peers of one problem (shared by all directions)."""
    dev = torch.device(DEVICE)
    p_fwd, nd = make_problem(spec, "fwd")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = to_layout(torch.randn(p_fwd.x_shape, device=dev, generator=g).to(torch.bfloat16), p_fwd.layout)
    w = to_layout((torch.randn(p_fwd.w_shape, device=dev, generator=g)
                   / math.sqrt(p_fwd.w_shape[1] * math.prod(p_fwd.filter))).to(torch.bfloat16), p_fwd.layout)
    dy = to_layout(torch.randn(p_fwd.y_shape, device=dev, generator=g).to(torch.bfloat16), p_fwd.layout)
    bias = torch.randn(p_fwd.K, device=dev, generator=g).to(torch.bfloat16)
    resid = to_layout(torch.randn(p_fwd.y_shape, device=dev, generator=g).to(torch.bfloat16), p_fwd.layout)
    return dict(p_fwd=p_fwd, nd=nd, x=x, w=w, dy=dy, bias=bias, resid=resid)


def fused_problem(spec, s):
    """(fused problem's args, [(label, plan)]): the solver's pick, plus the TMA
    convolution where it applies."""
    chain = (Sum(s["resid"], 1.0), Eltwise("relu"))
    pf, _ = make_problem(spec, "fwd", has_bias=True, post_ops=tuple(o.signature() for o in chain))
    fa = ConvArgs(x=s["x"], w=s["w"], bias=s["bias"], post_ops=chain)
    use_direct = pf.groups > 1 and not direct.DirectFwd().not_supported_reasons(pf)
    plans = [("pick", direct.DirectPlan(pf) if use_direct else ig.FwdPlan(pf))]
    if ig.is_tma_conv(pf):
        plans.append(("tmaconv", ig.FwdPlan(pf, T(128, 128, 64, 8, 3), tma_conv=True)))
    return fa, plans


def warm(spec):
    """Worker: compile every kernel variant of one problem (one call each) so that the
    measuring process finds them in Triton's on-disk cache."""
    t0 = time.time()
    n_ok = n_err = 0
    try:
        s = setup(spec)
        for d in ("fwd", "bwd_data", "bwd_weights"):
            p = s["p_fwd"].with_direction(d)
            a = ConvArgs(x=s["x"], w=s["w"], dy=s["dy"])
            for _, mk in ours_plans(p):
                try:
                    mk()(a)
                    n_ok += 1
                except Exception:
                    n_err += 1
        fa, plans = fused_problem(spec, s)
        for _, plan in plans:
            try:
                plan(fa)
            except Exception:
                n_err += 1
        torch.cuda.synchronize()
    except Exception as e:   # the measuring process will report it
        return spec["name"], time.time() - t0, n_ok, n_err, repr(e)[:200]
    return spec["name"], time.time() - t0, n_ok, n_err, ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(Path(__file__).parents[1] / "nnprim" / "data" / "suites" / "conv_gpu.json"))
    ap.add_argument("--only", default="", help="comma-separated problem names ('tiny': the dry-run problems)")
    ap.add_argument("--out", default="conv_gpu.json")
    ap.add_argument("--warm", type=int, default=14, help="compile worker processes (0: none)")
    ap.add_argument("--warm-timeout", type=float, default=150.0, help="seconds")
    ap.add_argument("--device", default="cuda", help="cpu: dry run of this script under TRITON_INTERPRET=1")
    ap.add_argument("--reanalyze", default="", help="results JSON: recompute the solver picks with the "
                    "current configs, rewrite it and print the table (no measuring)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.reanalyze:
        DEVICE = "cpu"
        res = json.load(open(args.reanalyze))
        add_solver_picks(res, json.load(open(args.suite))["problems"])
        summarize(res)
        Path(args.reanalyze).write_text(json.dumps(res, indent=1))
        print_table(res)
        return
    torch.backends.cudnn.benchmark = True
    gpu = torch.cuda.get_device_properties(0) if DEVICE == "cuda" else None
    import triton
    res = {"date": "2026-11-29", "machine": gpu.name if gpu else "cpu",
           "env": {"torch": torch.__version__, "triton": triton.__version__,
                   "cudnn": torch.backends.cudnn.version(), "sms": gpu.multi_processor_count if gpu else 0},
           "timing": "eager = do_bench median (ratio uses it); graph = CUDA graph of 20 calls, per call",
           "rows": [], "fused": [], "warm": []}
    names = [s.strip() for s in args.only.split(",") if s.strip()]
    suite = TINY if names == ["tiny"] else json.load(open(args.suite))["problems"]
    if names and names != ["tiny"]:
        suite = [s for s in suite if s["name"] in names]
    t_start = time.time()
    if args.warm > 0 and DEVICE == "cuda":
        import multiprocessing as mp
        try:
            with mp.get_context("spawn").Pool(args.warm) as pool:
                it = pool.imap_unordered(warm, suite)
                for _ in suite:
                    r = it.next(timeout=max(1.0, args.warm_timeout - (time.time() - t_start)))
                    res["warm"].append(dict(name=r[0], s=round(r[1], 1), ok=r[2], err=r[3], exc=r[4]))
                    print(f"warm {r[0]:18s} {r[1]:6.1f}s ok={r[2]} err={r[3]} {r[4]}", flush=True)
                pool.terminate()
        except Exception as e:   # a timeout leaves the rest to compile in the measuring process
            print(f"warm-up stopped: {e!r}", flush=True)
        print(f"-- warm-up {time.time() - t_start:.0f}s", flush=True)
    for spec in suite:
        try:
            run_problem(spec, res)
        except Exception as e:   # keep going: report the problem
            res["rows"].append(dict(name=spec["name"], error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"{spec['name']}: ERROR {e!r}", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        add_solver_picks(res, suite)
        summarize(res)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"-- {time.time() - t_start:.0f}s", flush=True)
    print_table(res)


def run_problem(spec, res):
    s = setup(spec)
    p_fwd, nd, x, w, dy = s["p_fwd"], s["nd"], s["x"], s["w"], s["dy"]
    name = spec["name"]
    conv_kw = dict(stride=p_fwd.stride, padding=spec["padding"], dilation=p_fwd.dilation, groups=p_fwd.groups)
    if DEVICE == "cuda":
        torch.backends.cudnn.allow_tf32 = False
    with torch.no_grad():
        y_ref = CONV[nd](x.float(), w.float(), None, **conv_kw)
        dx_ref, dw_ref, _ = torch.ops.aten.convolution_backward(
            dy.float(), x.float(), w.float(), None, list(p_fwd.stride), [spec["padding"]] * nd,
            list(p_fwd.dilation), False, [0] * nd, p_fwd.groups, [True, True, False])
    if DEVICE == "cuda":
        torch.backends.cudnn.allow_tf32 = True
    refs = {"fwd": y_ref, "bwd_data": dx_ref, "bwd_weights": dw_ref}
    bw_args = (list(p_fwd.stride), [spec["padding"]] * nd, list(p_fwd.dilation), False, [0] * nd, p_fwd.groups)
    peers = {
        "fwd": lambda: CONV[nd](x, w, None, **conv_kw),
        "bwd_data": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw_args, [True, False, False]),
        "bwd_weights": lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *bw_args, [False, True, False]),
    }
    for d in ("fwd", "bwd_data", "bwd_weights"):
        p = p_fwd.with_direction(d)
        a = ConvArgs(x=x, w=w, dy=dy)
        with torch.no_grad():
            cudnn_ms = bench_eager(peers[d])
            try:
                cudnn_graph = bench_graph(peers[d])
            except Exception:
                cudnn_graph = float("nan")
        row = dict(name=name, direction=d, flops=p.flops(), bytes=p.bytes(), cudnn_ms=round(cudnn_ms, 4),
                   cudnn_graph_ms=round(cudnn_graph, 4), cudnn_tflops=round(p.flops() / cudnn_ms / 1e9, 1),
                   variants={})
        for label, mk in ours_plans(p):
            v = row["variants"][label] = {}
            try:
                fn = mk()
                err = rel(fn(a), refs[d])
                v.update(err=float(f"{err:.2e}"), ok=err < 1e-2)
                if not v["ok"]:
                    continue
                ms = bench_eager(lambda fn=fn, a=a: fn(a))
                v.update(ms=round(ms, 4), tflops=round(p.flops() / ms / 1e9, 1), tb_s=round(p.bytes() / ms / 1e9, 2),
                         host_us=round(host_us(lambda fn=fn, a=a: fn(a)), 1))
                gms = bench_graph(lambda fn=fn, a=a: fn(a))
                v.update(graph_ms=round(gms, 4), graph_tflops=round(p.flops() / gms / 1e9, 1),
                         graph_tb_s=round(p.bytes() / gms / 1e9, 2))
                err = rel(fn(a), refs[d])   # again, through the cached (fast-path) launch
                v.update(err_cached=float(f"{err:.2e}"), ok=err < 1e-2)
            except Exception as e:  # keep measuring the rest
                v["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        okv = {k: v for k, v in row["variants"].items() if v.get("ok") and "ms" in v}
        if okv:
            best = min(okv, key=lambda k: okv[k]["ms"])
            row.update(best=best, ms=okv[best]["ms"], tflops=okv[best]["tflops"],
                       graph_ms=okv[best].get("graph_ms"), ratio=round(cudnn_ms / okv[best]["ms"], 3))
            gbest = min(okv, key=lambda k: okv[k].get("graph_ms", 1e9))
            row.update(graph_best=gbest, graph_best_ms=okv[gbest].get("graph_ms"),
                       graph_ratio=round(cudnn_graph / okv[gbest].get("graph_ms", 1e9), 3))
        res["rows"].append(row)
        print(f"{name:18s} {d:11s} cudnn {cudnn_ms:8.4f}/{cudnn_graph:8.4f} ms | "
              + " ".join(f"{k}={v.get('ms', 'ERR')}/{v.get('graph_ms', '-')}({v.get('err', v.get('error', ''))})"
                         for k, v in row["variants"].items()), flush=True)
    # fused conv + bias + residual + relu vs torch eager
    if spec["groups"] == 1 or spec["name"] in GROUPED:
        fa, plans = fused_problem(spec, s)
        bias, resid = s["bias"], s["resid"]
        eager = lambda: torch.relu(CONV[nd](x, w, None, **conv_kw) + bias.view(1, -1, *([1] * nd)) + resid)  # noqa: E731
        exp = torch.relu(y_ref + bias.float().view(1, -1, *([1] * nd)) + resid.float())
        with torch.no_grad():
            e_ms, e_g = bench_eager(eager), bench_graph(eager)
        fr = dict(name=name, eager_ms=round(e_ms, 4), eager_graph_ms=round(e_g, 4), plans={})
        for label, plan in plans:
            try:
                with torch.no_grad():
                    err = rel(plan(fa), exp)
                    f_ms = bench_eager(lambda plan=plan: plan(fa))
                    f_g = bench_graph(lambda plan=plan: plan(fa))
                fr["plans"][label] = dict(ms=round(f_ms, 4), graph_ms=round(f_g, 4), err=float(f"{err:.2e}"),
                                          ok=err < 1e-2)
            except Exception as e:
                fr["plans"][label] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        okp = {k: v for k, v in fr["plans"].items() if v.get("ok")}
        if okp:
            best = min(okp, key=lambda k: okp[k]["ms"])
            f_ms, f_g = okp[best]["ms"], okp[best]["graph_ms"]
            fr.update(best=best, ours_ms=f_ms, ours_graph_ms=f_g, speedup=round(e_ms / f_ms, 3),
                      graph_speedup=round(e_g / f_g, 3), err=okp[best]["err"])
            print(f"{name:18s} fused       eager {e_ms:8.4f}/{e_g:8.4f} ms ours {f_ms:8.4f}/{f_g:8.4f} ms "
                  f"x{e_ms / f_ms:5.2f} ({best}) " + json.dumps(fr["plans"]), flush=True)
        res["fused"].append(fr)


def _geo(vals):
    return round(math.exp(sum(math.log(v) for v in vals) / len(vals)), 3) if vals else None


def solver_choices(p: ConvProblem, labels) -> list[str]:
    """The measured labels that are what the solvers run with the current configs
    (each family's own tile pick); find picks the fastest of them."""
    d = p.direction
    if p.groups > 1 and not direct.DirectFwd().not_supported_reasons(p.with_direction("fwd")):
        t = configs.pick_direct(p)
        kind = "direct_tiles" if d == "bwd_weights" and configs.direct_bwd_w_tiles(p) else "direct"
        return [lab for lab in labels if lab == f"{kind}:{t.BP}x{t.BC}w{t.warps}"]
    pick = configs.pick(p)
    if d == "bwd_weights":
        tma = configs.use_tma_conv(p) and (configs.tma_conv_eligible(p) or configs.plain_gemm_eligible(p))
        kind = "tmaconv" if tma else "igemm"
    else:
        kind = ("tma" if configs.plain_gemm_eligible(p) else
                "tmaconv" if configs.tma_conv_eligible(p) and configs.use_tma_conv(p) else "igemm")
    key = fitted(p, pick, kind == "tma")
    out = []
    for lab in labels:
        k, _, rest = lab.partition(":")
        if k == kind and rest:
            bm, bn, rest = rest.split("x")
            bk, rest = rest.split("w")
            w, st = rest.split("s")
            if fitted(p, T(int(bm), int(bn), int(bk), int(w), int(st)), kind == "tma") == key:
                out.append(lab)
    if p.groups == 1 and "gemm" in labels:
        out.append("gemm")
    return out


def add_solver_picks(res, suite):
    """Per row: the fastest of what the solvers run by default (pick_*), next to the
    best of every measured variant."""
    specs = {s["name"]: s for s in suite}
    for r in res["rows"]:
        if "variants" not in r or r["name"] not in specs:
            continue
        p, _ = make_problem(specs[r["name"]], r["direction"])
        okv = {k: v for k, v in r["variants"].items() if v.get("ok") and "ms" in v}
        ch = solver_choices(p, list(okv))
        if ch:
            best = min(ch, key=lambda k: okv[k]["ms"])
            r.update(pick=best, pick_ms=okv[best]["ms"], pick_graph_ms=okv[best].get("graph_ms"),
                     pick_ratio=round(r["cudnn_ms"] / okv[best]["ms"], 3))


def summarize(res):
    gm = {}
    rows = [r for r in res["rows"] if "ratio" in r]
    for d in ("fwd", "bwd_data", "bwd_weights"):
        rs = [r for r in rows if r["direction"] == d and r["name"] not in GROUPED and "pick_ratio" in r]
        if rs:
            gm[f"{d}_nongrouped_pick_ratio"] = _geo([r["pick_ratio"] for r in rs])
        for n in GROUPED:
            rs = [r for r in rows if r["direction"] == d and r["name"] == n and "pick_ratio" in r]
            if rs:
                gm[f"{d}_{n}_pick_ratio"] = rs[0]["pick_ratio"]
    for d in ("fwd", "bwd_data", "bwd_weights"):
        rs = [r for r in rows if r["direction"] == d and r["name"] not in GROUPED]
        if rs:
            gm[f"{d}_nongrouped_ratio"] = _geo([r["ratio"] for r in rs])
            gm[f"{d}_nongrouped_graph_ratio"] = _geo([r["graph_ratio"] for r in rs])
        for n in GROUPED:
            rs = [r for r in rows if r["direction"] == d and r["name"] == n]
            if rs:
                gm[f"{d}_{n}_ratio"] = rs[0]["ratio"]
    rn = [f for f in res["fused"] if f["name"].startswith("rn50") and "speedup" in f]
    if rn:
        gm["fused_rn50_speedup_geomean"] = _geo([f["speedup"] for f in rn])
        gm["fused_rn50_graph_speedup_geomean"] = _geo([f["graph_speedup"] for f in rn])
    res["geomeans"] = gm
    res["best_per_problem"] = {f"{r['direction']}:{r['name']}": r["best"] for r in rows}


def print_table(res):
    print(f"\n{'problem':18s} {'dir':11s} {'ours ms':>8s} {'graph':>8s} {'TF/s':>6s} {'host us':>7s} "
          f"{'cuDNN ms':>8s} {'graph':>8s} {'TF/s':>6s} {'ratio':>6s} {'g.ratio':>7s} {'pick':>6s}  best")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['name']:18s} ERROR {r['error']}")
            continue
        v = r["variants"].get(r.get("best"), {})
        print(f"{r['name']:18s} {r['direction']:11s} {r.get('ms', float('nan')):8.4f} "
              f"{r.get('graph_ms') or float('nan'):8.4f} {r.get('tflops', float('nan')):6.1f} "
              f"{v.get('host_us', float('nan')):7.1f} {r['cudnn_ms']:8.4f} {r['cudnn_graph_ms']:8.4f} "
              f"{r['cudnn_tflops']:6.1f} {r.get('ratio', float('nan')):6.3f} {r.get('graph_ratio', float('nan')):7.3f}"
              f" {r.get('pick_ratio', float('nan')):6.3f}  {r.get('best', '-')} | {r.get('pick', '-')}")
    for f in res["fused"]:
        if "speedup" not in f:
            print(f"fused {f['name']:18s} no valid plan {f['plans']}")
            continue
        print(f"fused {f['name']:18s} ours {f['ours_ms']:.4f}/{f['ours_graph_ms']:.4f} "
              f"eager {f['eager_ms']:.4f}/{f['eager_graph_ms']:.4f} x{f['speedup']:.2f} (graph x{f['graph_speedup']:.2f})")
    print("geomeans", json.dumps(res.get("geomeans", {})))


if __name__ == "__main__":
    main()
