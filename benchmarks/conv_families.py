"""The FFT and Winograd families (issue 17) against cuDNN on one GPU, through the public API.

Problems
  FFT       long causal depthwise conv1d, B 8, C 768, L = filter = 8192 and 32768,
            padding [(L-1, 0)], groups 768, bf16 (Hyena / S4 long convolutions; issue 11's
            case at 8192); RepLKNet-like 31x31 depthwise 2D, N 32, C 384, 56x56, padding 15,
            bf16. Directions fwd, bwd_data, bwd_weights.
  Winograd  the stride-1 3x3 layers of ResNet-50 (N 32: 64 @ 56x56, 128 @ 28x28,
            256 @ 14x14, 512 @ 7x7, padding 1), f32 with TF32 off (NCHW) and bf16
            (channels-last). Directions fwd, bwd_data, bwd_weights.
For each problem and direction:
  1. correctness at the real size, before any timing: each forced solver's output (and
     cuDNN's) against a float64 reference on a slice that depends on nothing else: the
     first channels of a depthwise problem, the first images of a dense one (all images
     for bwd_weights);
     relative norm error, limit 1e-5 (f32) / 1e-2 (bf16);
  2. time (CUDA events around each call, a warm-up call, median of 10; when 10 calls
     would take over CASE_S = 8 s, at least 3 -- 1 for a call over 4 s --, recorded as
     `reps`) of
       ours     nnprim.conv_forward / conv_backward_data / conv_backward_weights with
                solver= each of the family's solvers (prepared on the first call);
       default  the same calls without solver=, in a child process with a fresh find-db
                (find budget NNPRIM_FIND_BUDGET_MS, 10 s unless set): the first call runs
                find (recorded as find_s), the timed calls reuse its choice (`chosen`); a
                crash of the child (e.g. a solver faulting during find, issue 11) is
                recorded, not fatal; not run for L = 32768 (its find would run the float64
                reference and every slow candidate of a 13-TFLOP problem);
       cudnn    torch.nn.functional.conv1d/conv2d (cudnn.benchmark=True) and, for the
                backward directions, aten.convolution_backward with one output (what
                autograd calls); causal padding is applied to x beforehand (not timed:
                cuDNN gets the bare convolution);
     plus, for ours, the peak of memory allocated during a call beyond its inputs and
     output, against the solver's workspace_size;
  3. ratio = cudnn ms / ours ms (> 1: ours faster); TFLOP/s counts the direct
     convolution's 2*N*K*C/groups*out*filter flops for every implementation.
Winograd f32 is also timed under torch.set_float32_matmul_precision("high") (3xTF32 GEMM,
f32-accurate; plan-level call, marked `plan`). Results go to --out (rewritten after every
step: a timeout keeps what was measured) and a table on stdout. Steps are ordered by
importance and skipped, with the reason, once --budget-s is spent.

  python3 benchmarks/conv_families.py --out $OUT/conv_families.json          # H200, ~4 min
  python3 benchmarks/conv_families.py --device cpu --out /tmp/cf.json         # dry run, tiny shapes
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nnprim  # noqa: E402
from nnprim.args import ConvArgs  # noqa: E402
from nnprim.conv import reference as ref  # noqa: E402
from nnprim.conv import winograd as wg  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402

DIRS3 = ("fwd", "bwd_data", "bwd_weights")
FFT_SOLVERS = {"fwd": ["fft_fwd"], "bwd_data": ["fft_bwd_data"], "bwd_weights": ["fft_bwd_weights"]}
WINO_SOLVERS = {"fwd": ["winograd_f2_fwd", "winograd_f4_fwd", "winograd_f4_nonfused_fwd"],
                "bwd_data": ["winograd_f2_bwd_data", "winograd_f4_bwd_data", "winograd_f4_nonfused_bwd_data"],
                "bwd_weights": ["winograd_f2_bwd_weights", "winograd_f4_bwd_weights"]}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DT = {"f32": torch.float32, "bf16": torch.bfloat16}


def problems(tiny: bool) -> list[dict]:
    """Problem specs: x/w shapes, padding (pairs), groups, dtype, layout, directions,
    solvers, the reference slice (channels for depthwise, images for dense)."""
    def long_dw(L, name):
        n, c = (2, 4) if tiny else (8, 768)
        L = 40 if tiny else L
        return dict(name=name, family="fft", x=(n, c, L), w=(c, 1, L), pad=[(L - 1, 0)], groups=c, dtype="bf16",
                    layout="nchw", dirs=DIRS3, solvers=FFT_SOLVERS,
                    slice=("c", 2, 2) if tiny else (("c", 8, 8) if L < 16384 else ("c", 2, 2)))
    n, c, hw = (2, 4, 12) if tiny else (32, 384, 56)
    specs = [long_dw(8192, "long_dw_8k"),
             dict(name="replk_dw31", family="fft", x=(n, c, hw, hw), w=(c, 1, 31 if not tiny else 9, 31 if not tiny else 9),
                  pad=[(15, 15), (15, 15)] if not tiny else [(4, 4), (4, 4)], groups=c, dtype="bf16", layout="nchw",
                  dirs=DIRS3, solvers=FFT_SOLVERS, slice=("c", 2, 2) if tiny else ("c", 8, 32))]
    layers = [(16, 6)] if tiny else [(64, 56), (128, 28), (256, 14), (512, 7)]
    for dt in ("f32", "bf16"):
        for ch, hw in layers:
            n = 2 if tiny else 32
            specs.append(dict(name=f"rn50_{ch}x{hw}_{dt}", family="winograd", x=(n, ch, hw, hw), w=(ch, ch, 3, 3),
                              pad=[(1, 1), (1, 1)], groups=1, dtype=dt, layout="nchw" if dt == "f32" else "nhwc",
                              dirs=DIRS3, solvers=WINO_SOLVERS, slice=("n", 0, 1 if tiny else 2)))
    specs.append(long_dw(32768, "long_dw_32k"))
    return specs


# ---- helpers -------------------------------------------------------------------------------------
class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.time(), budget_s

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


CASE_S = 8.0      # seconds of timed calls one implementation may take (10 repeats when they fit)


def time_ms(fn, dev: str, reps: int = 10) -> tuple[float, int]:
    """(median ms, repeats): a warm-up call, then `reps` timed calls (CUDA events); fewer
    when they would take over CASE_S: at least 3, or 1 for a call over CASE_S / 2."""
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    first = time.perf_counter() - t
    if first * reps > CASE_S:
        reps = 1 if first > CASE_S / 2 else max(3, int(CASE_S / first))
    times = []
    for _ in range(reps):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), reps


def conv_kw(spec: dict) -> dict:
    return dict(padding=spec["pad"], groups=spec["groups"])


def make_problem(spec: dict, direction: str, dev: str) -> ConvProblem:
    return ConvProblem.create(direction, spec["x"], spec["w"], dtype=DT[spec["dtype"]], layout=spec["layout"],
                              device=dev, **conv_kw(spec))


def inputs(spec: dict, dev: str) -> dict:
    p = make_problem(spec, "fwd", dev)
    g = torch.Generator(device=dev).manual_seed(0)
    dt = DT[spec["dtype"]]
    fan = p.w_shape[1] * math.prod(p.filter)
    mk = lambda s, scale=1.0: to_layout((torch.randn(s, device=dev, generator=g) * scale).to(dt), p.layout)  # noqa: E731
    return dict(x=mk(p.x_shape), w=mk(p.w_shape, fan ** -0.5), dy=mk(p.y_shape))


def public_call(spec: dict, direction: str, t: dict, solver: str | None):
    kw = conv_kw(spec)
    if direction == "fwd":
        return lambda: nnprim.conv_forward(t["x"], t["w"], solver=solver, **kw)
    if direction == "bwd_data":
        return lambda: nnprim.conv_backward_data(t["dy"], t["w"], t["x"].shape, solver=solver, **kw)
    return lambda: nnprim.conv_backward_weights(t["dy"], t["x"], t["w"].shape, solver=solver, **kw)


def cudnn_call(spec: dict, direction: str, t: dict):
    """cuDNN's bare convolution: x padded beforehand (asymmetric padding), one output."""
    nd = len(spec["x"]) - 2
    pads = spec["pad"]
    sym = all(a == b for a, b in pads)
    x = t["x"]
    if not sym:
        flat = [v for a, b in reversed(pads) for v in (a, b)]
        x = F.pad(x, flat).contiguous(memory_format=torch.channels_last) if spec["layout"] == "nhwc" and nd == 2 \
            else F.pad(x, flat)
    padding = [a for a, _ in pads] if sym else [0] * nd
    conv = F.conv1d if nd == 1 else F.conv2d
    g = spec["groups"]
    if direction == "fwd":
        return lambda: conv(x, t["w"], None, 1, padding, 1, g), None
    mask = [direction == "bwd_data", direction == "bwd_weights", False]

    def run():
        r = torch.ops.aten.convolution_backward(t["dy"], x, t["w"], None, [1] * nd, padding, [1] * nd, False,
                                                [0] * nd, g, mask)
        return r[0] if direction == "bwd_data" else r[1]
    crop = None
    if direction == "bwd_data" and not sym:   # dx of the padded input: the inner window is dx
        crop = tuple([slice(None), slice(None)] + [slice(a, a + s) for (a, _), s in zip(pads, spec["x"][2:])])
    return run, crop


def reference_slice(spec: dict, direction: str, t: dict, dev: str):
    """(float64 reference, index of the output it covers): the first c channels of a
    depthwise problem (of its first n images, or all of them for bwd_weights), or the
    first n images of a dense one. spec["slice"] = (kind "c" | "n", c, n)."""
    kind, c, n = spec["slice"]
    if kind == "c":
        n = spec["x"][0] if direction == "bwd_weights" else n
        sub = dict(spec, x=(n, c, *spec["x"][2:]), w=(c, 1, *spec["w"][2:]), groups=c)
        ts = dict(x=t["x"][:n, :c], w=t["w"][:c], dy=t["dy"][:n, :c])
        idx = (slice(0, c),) if direction == "bwd_weights" else (slice(0, n), slice(0, c))
    else:
        n = spec["x"][0] if direction == "bwd_weights" else n      # dw needs every image
        sub = dict(spec, x=(n, *spec["x"][1:]))
        ts = dict(x=t["x"][:n], w=t["w"], dy=t["dy"][:n])
        idx = (slice(None),) if direction == "bwd_weights" else (slice(0, n),)
    p = make_problem(sub, direction, dev)
    if direction == "fwd":
        r = ref.conv_fwd_f64(p, ts["x"], ts["w"])
    elif direction == "bwd_data":
        r = ref.conv_bwd_data_f64(p, ts["dy"], ts["w"])
    else:
        r = ref.conv_bwd_weights_f64(p, ts["dy"], ts["x"])
    return r, idx


def rel_err(out: torch.Tensor, r: torch.Tensor, idx) -> float:
    o = out[idx].double()
    return ((o - r).norm() / r.norm()).item()


def flops(spec: dict) -> float:
    n, c, *sp = spec["x"]
    k, cg, *f = spec["w"]
    out = [s + a + b - ff + 1 for s, (a, b), ff in zip(sp, spec["pad"], f)]
    return 2.0 * n * k * cg * math.prod(out) * math.prod(f)


# ---- steps ---------------------------------------------------------------------------------------
def run_ours_and_cudnn(spec: dict, dev: str, res: dict, clock: Clock, with_cudnn: bool = True) -> None:
    t = inputs(spec, dev)
    fl = flops(spec)
    for d in spec["dirs"]:
        p = make_problem(spec, d, dev)
        r, idx = reference_slice(spec, d, t, dev)
        tol = TOL[DT[spec["dtype"]]]
        impls = [(s, public_call(spec, d, t, s), None) for s in spec["solvers"][d]]
        if with_cudnn:
            impls.append(("cudnn",) + cudnn_call(spec, d, t))
        if spec["family"] == "winograd" and spec["dtype"] == "f32" and d == "fwd":
            impls.append(("winograd_f4_nonfused_fwd@tf32x3(plan)", _tf32x3_plan(p, t), None))
        for name, fn, crop in impls:
            if clock.left() < 5:
                res["rows"].append(dict(problem=spec["name"], dir=d, impl=name, skipped="time budget"))
                continue
            row = dict(problem=spec["name"], dir=d, impl=name, dtype=spec["dtype"])
            try:
                sync(dev)
                t0 = time.perf_counter()
                out = fn()
                sync(dev)
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                if crop is not None:
                    out = out[crop]
                row["err"] = rel_err(out, r, idx)
                row["ok"] = row["err"] <= tol
                del out
                if name != "cudnn" and "(plan)" not in name:
                    row["workspace"] = nnprim.workspace_size(p, name)
                    row["peak_extra"] = _peak_extra(fn, dev)
                ms, reps = time_ms(fn, dev)
                row.update(ms=round(ms, 4), reps=reps, tflops=round(fl / ms / 1e9, 2))
            except Exception as e:   # record and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["rows"].append(row)
            print(_fmt_row(row), flush=True)
        del r
        if dev == "cuda":
            torch.cuda.empty_cache()


def _tf32x3_plan(p: ConvProblem, t: dict):
    plan = wg.WinogradPlan(p, 4, fused=False, precision="tf32x3")
    a = ConvArgs(x=t["x"], w=t["w"])
    return lambda: plan(a)


def _peak_extra(fn, dev: str) -> int | None:
    """Peak bytes allocated during one call beyond what was allocated before it and the
    output it returns (CUDA caching-allocator statistics)."""
    if dev != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    del out
    return int(peak)


def run_default_child(spec: dict, dev: str, res: dict, clock: Clock, timeout: float) -> None:
    """The default call of each direction in a child process with a fresh find-db."""
    if clock.left() < 20:
        for d in spec["dirs"]:
            res["rows"].append(dict(problem=spec["name"], dir=d, impl="default", skipped="time budget"))
        return
    env = dict(os.environ, NNPRIM_CACHE_DIR=tempfile.mkdtemp(prefix="nnprim-cf-"),
               NNPRIM_FIND_BUDGET_MS=os.environ.get("NNPRIM_FIND_BUDGET_MS", "10000"))
    cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--device", dev]
    try:
        cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=min(timeout, clock.left() - 5))
        rows = [json.loads(line[5:]) for line in cp.stdout.splitlines() if line.startswith("ROW: ")]
        if cp.returncode != 0:
            rows.append(dict(problem=spec["name"], impl="default", error=f"child exit {cp.returncode}: "
                             f"{cp.stderr.strip().splitlines()[-1][:300] if cp.stderr.strip() else ''}"))
    except subprocess.TimeoutExpired:
        rows = [dict(problem=spec["name"], impl="default", error=f"child timed out after {timeout:.0f} s")]
    for row in rows:
        res["rows"].append(row)
        print(_fmt_row(row), flush=True)


def child(spec: dict, dev: str) -> None:
    t = inputs(spec, dev)
    fl = flops(spec)
    for d in spec["dirs"]:
        row = dict(problem=spec["name"], dir=d, impl="default", dtype=spec["dtype"])
        try:
            r, idx = reference_slice(spec, d, t, dev)
            fn = public_call(spec, d, t, None)
            sync(dev)
            t0 = time.perf_counter()
            out = fn()
            sync(dev)
            row["find_s"] = round(time.perf_counter() - t0, 2)
            row["err"] = rel_err(out, r, idx)
            row["ok"] = row["err"] <= TOL[DT[spec["dtype"]]]
            del out
            p = make_problem(spec, d, dev)
            found = nnprim.find(p)      # the find-db answers: what the default call chose
            row["chosen"] = found[0].solver
            row["find"] = [(f.solver, round(f.time_ms, 4)) for f in found[:6]]
            ms, reps = time_ms(fn, dev)
            row.update(ms=round(ms, 4), reps=reps, tflops=round(fl / ms / 1e9, 2))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"ROW: {json.dumps(row)}", flush=True)


# ---- report --------------------------------------------------------------------------------------
def _fmt_row(row: dict) -> str:
    if "skipped" in row or "error" in row:
        return f"{row.get('problem', ''):<20} {row.get('dir', ''):<12} {row.get('impl', ''):<40} " \
               f"{row.get('skipped') or row.get('error')}"
    extra = f" chosen={row['chosen']}" if "chosen" in row else ""
    ws = f" ws={row['workspace'] / 2**20:.0f}MiB peak={row['peak_extra'] / 2**20:.0f}MiB" \
        if row.get("peak_extra") is not None else ""
    return (f"{row['problem']:<20} {row['dir']:<12} {row['impl']:<40} {row.get('ms', float('nan')):10.3f} ms "
            f"{row.get('tflops', 0):8.2f} TFLOP/s  err {row.get('err', float('nan')):.1e}"
            f"{'' if row.get('ok', True) else ' FAIL'} x{row.get('reps', 0)}{extra}{ws}")


def summarize(res: dict) -> list[dict]:
    """Per (problem, direction): the best forced solver of ours, the default call, cuDNN,
    and the ratios cudnn/ours (> 1: ours faster)."""
    out = {}
    for r in res["rows"]:
        if "ms" not in r or not r.get("ok", False):
            continue
        k = (r["problem"], r["dir"])
        s = out.setdefault(k, dict(problem=r["problem"], dir=r["dir"]))
        if r["impl"] == "cudnn":
            s["cudnn_ms"] = r["ms"]
        elif r["impl"] == "default":
            s["default_ms"], s["chosen"] = r["ms"], r.get("chosen")
        elif "(plan)" in r["impl"]:
            s["tf32x3_ms"] = r["ms"]
        elif r["ms"] < s.get("ours_ms", float("inf")):
            s["ours_ms"], s["ours"] = r["ms"], r["impl"]
    for s in out.values():
        if "cudnn_ms" in s:
            for key in ("ours", "default", "tf32x3"):
                if f"{key}_ms" in s:
                    s[f"{key}_vs_cudnn"] = round(s["cudnn_ms"] / s[f"{key}_ms"], 3)
    res["summary"] = list(out.values())
    return res["summary"]


def print_table(res: dict) -> None:
    print(f"\n{'problem':<20} {'dir':<12} {'best of ours':<30} {'ms':>9} {'default':>9} {'cudnn':>10} "
          f"{'ours/cudnn':>10} {'default':>8}  chosen by find")
    for s in summarize(res):
        f = lambda k, s=s: f"{s[k]:9.3f}" if k in s else f"{'-':>9}"  # noqa: E731
        r = lambda k, s=s: f"{s[k]:7.2f}x" if k in s else f"{'-':>8}"  # noqa: E731
        print(f"{s['problem']:<20} {s['dir']:<12} {s.get('ours', '-'):<30} {f('ours_ms')} {f('default_ms')} "
              f"{f('cudnn_ms'):>10} {r('ours_vs_cudnn'):>10} {r('default_vs_cudnn')}  {s.get('chosen') or '-'}"
              + (f"   3xTF32 {s['tf32x3_vs_cudnn']:.2f}x" if "tf32x3_vs_cudnn" in s else ""))
    print("ratio = cuDNN ms / ours ms (> 1: ours faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         f"conv_families_{datetime.date.today().isoformat()}.json"))
    ap.add_argument("--device", default="cuda", help="cpu: dry run, tiny shapes, TRITON_INTERPRET=1")
    ap.add_argument("--only", default="", help="comma-separated problem names")
    ap.add_argument("--budget-s", type=float, default=225.0, help="stop starting steps after this many seconds")
    ap.add_argument("--no-default", action="store_true", help="skip the default (find) calls")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dev = args.device
    if args.child:
        if dev == "cuda":
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        child(json.loads(args.child), dev)
        return
    clock = Clock(args.budget_s)
    tiny = dev == "cpu"
    specs = problems(tiny)
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        specs = [s for s in specs if s["name"] in keep]
    if dev == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    import triton
    gpu = torch.cuda.get_device_properties(0) if dev == "cuda" else None
    res = dict(date=datetime.date.today().isoformat(), machine=gpu.name if gpu else "cpu (dry run)",
               env=dict(torch=torch.__version__, triton=triton.__version__,
                        cudnn=torch.backends.cudnn.version() if dev == "cuda" else None),
               settings="cudnn.benchmark=True, allow_tf32=False (cudnn and matmul); ratio = cudnn ms / ours ms",
               rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        summarize(res)
        out.write_text(json.dumps(res, indent=1))

    # forced solvers + cuDNN first (the long 32k convolution's cuDNN last: it is the slowest)
    for spec in specs:
        try:
            run_ours_and_cudnn(spec, dev, res, clock, with_cudnn=spec["name"] != "long_dw_32k")
        except Exception as e:
            res["rows"].append(dict(problem=spec["name"], error=f"{type(e).__name__}: {str(e)[:300]}"))
        save()
        print(f"-- {time.time() - clock.t0:.0f} s", flush=True)
    if not args.no_default:
        for spec in specs:
            if spec["name"] != "long_dw_32k":
                run_default_child(spec, dev, res, clock, timeout=90.0)
                save()
        print(f"-- {time.time() - clock.t0:.0f} s", flush=True)
    for spec in specs:
        if spec["name"] == "long_dw_32k":
            t = inputs(spec, dev)
            for d in spec["dirs"]:
                if clock.left() < 10:
                    res["rows"].append(dict(problem=spec["name"], dir=d, impl="cudnn", skipped="time budget"))
                    continue
                row = dict(problem=spec["name"], dir=d, impl="cudnn", dtype=spec["dtype"])
                try:
                    fn, crop = cudnn_call(spec, d, t)
                    r, idx = reference_slice(spec, d, t, dev)
                    o = fn()
                    row["err"] = rel_err(o[crop] if crop else o, r, idx)
                    row["ok"] = row["err"] <= TOL[DT[spec["dtype"]]]
                    del o, r
                    ms, reps = time_ms(fn, dev)
                    row.update(ms=round(ms, 4), reps=reps, tflops=round(flops(spec) / ms / 1e9, 2))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["rows"].append(row)
                print(_fmt_row(row), flush=True)
                save()
    save()
    print_table(res)
    print(f"-- total {time.time() - clock.t0:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
