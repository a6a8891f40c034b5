"""CPU convolution and attention against torch (oneDNN / CPU SDPA), interleaved in one
process, with the machine's measured GEMM peak (issue 16).

Ours is the solver the heuristic ranks first for each problem (what `nnprim` runs
without a find-db), so new solvers show up here as soon as they register. Every
measurement alternates ours and torch call by call (--rounds pairs after a warm-up),
reports the median of each and the median of the per-pair ratios torch/ours (> 1: ours
faster). Other jobs share this machine's cores: the per-pair ratio is the steadier
number. Threads: torch's default unless --threads.

Conv modes (nnprim/data/suites/conv_cpu.json):
  fwd_f32, fwd_bf16        forward                vs F.conv*d (no grad)
  bwd_data_bf16/_f32       backward data          vs torch.nn.grad.conv*d_input
  bwd_weights_bf16/_f32    backward weights       vs torch.nn.grad.conv*d_weight
  bwd_bf16, bwd_f32        both backward passes   vs torch's autograd (dx and dw)
  fused_f32                conv+bias+Sum+ReLU     vs torch eager conv(bias) + res, relu
Attention modes: attn_fwd / attn_fwd_bwd, f32 and bf16, vs F.scaled_dot_product_attention;
attn_fwd_drop / attn_fwd_bwd_drop the same with dropout 0.1 (each side its own mask).

  PYTHONUNBUFFERED=1 python benchmarks/cpu_speed.py --out benchmarks/results/cpu_speed_DATE.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnprim.args import AttnArgs, ConvArgs  # noqa: E402
from nnprim.attention.reference import reference_forward  # noqa: E402
from nnprim.post_ops import Eltwise, Sum  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.problems.conv import ConvProblem, to_layout  # noqa: E402
from nnprim.search.ranking import heuristic_order  # noqa: E402

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
GRAD_IN = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
GRAD_W = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}
CONV_MODES = ("fwd_f32", "fwd_bf16", "bwd_data_bf16", "bwd_weights_bf16", "bwd_bf16", "fused_f32",
              "bwd_data_f32", "bwd_weights_f32", "bwd_f32")
DEFAULT_MODES = CONV_MODES[:6]
ATTN = [dict(B=1, H=8, S=1024, D=64), dict(B=1, H=8, S=2048, D=128)]
BF16, F32 = torch.bfloat16, torch.float32


def interleaved(ours, peer, rounds: int) -> dict:
    """Alternate ours() and peer() `rounds` times after a warm-up of each."""
    ours(), peer()
    to, tp = [], []
    for i in range(rounds):
        for fn, ts in ((ours, to), (peer, tp)) if i % 2 == 0 else ((peer, tp), (ours, to)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return dict(ours_ms=statistics.median(to) * 1e3, torch_ms=statistics.median(tp) * 1e3,
                ratio=statistics.median(p / o for p, o in zip(tp, to)),
                ours_min_ms=min(to) * 1e3, torch_min_ms=min(tp) * 1e3)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def gemm_peak(rounds: int) -> dict:
    """torch.mm of 2048^3 (f32: MKL, bf16: oneDNN native), GFLOP/s of the median call."""
    out = {}
    for name, dt in (("f32", F32), ("bf16", BF16)):
        a, b = torch.randn(2048, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        torch.mm(a, b)
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            torch.mm(a, b)
            ts.append(time.perf_counter() - t0)
        out[name] = dict(median_gflops=2 * 2048 ** 3 / statistics.median(ts) / 1e9,
                         best_gflops=2 * 2048 ** 3 / min(ts) / 1e9)
    return out


EXCLUDE: set[int] = set()   # solver ids left out of the ranking (--exclude: the "before")


def invoker(p):
    s = next(s for s in heuristic_order(p) if s.id not in EXCLUDE)
    return s.name, s.prepare(p)


def conv_case(spec: dict, mode: str):
    """(ours name, ours fn, peer fn, check fn, flops)."""
    dt = BF16 if "bf16" in mode else F32
    nd, G, lay = len(spec["spatial"]), spec["groups"], spec["layout"]
    g = torch.Generator().manual_seed(0)
    C, K = spec["C"], spec["K"]
    kw = dict(stride=spec["stride"], padding=spec["padding"], dilation=spec["dilation"], groups=G)
    x = to_layout(torch.randn(spec["N"], C, *spec["spatial"], generator=g).to(dt), lay)
    w = to_layout((torch.randn(K, C // G, *spec["filter"], generator=g)
                   / math.sqrt(C // G * math.prod(spec["filter"]))).to(dt), lay)
    conv = CONV[nd]
    args_t = (kw["stride"], kw["padding"], kw["dilation"], G)

    def prob(direction, **extra):
        return ConvProblem.create(direction, x.shape, w.shape, dtype=dt, layout=lay, **kw, **extra)

    p = prob("fwd")
    dy = to_layout(torch.randn(p.y_shape, generator=g).to(dt), lay)
    xf, wf, dyf = x.float(), w.float(), dy.float()
    if mode in ("fwd_f32", "fwd_bf16"):
        name, inv = invoker(p)
        a = ConvArgs(x=x, w=w)
        ref = conv(xf, wf, None, *args_t)
        return name, lambda: inv(a), lambda: conv(x, w, None, *args_t), lambda o: rel_err(o, ref), p.flops()
    if mode == "fused_f32":
        b = torch.randn(K, generator=g)
        res = to_layout(torch.randn(p.y_shape, generator=g), lay)
        ops = (Sum(res), Eltwise("relu"))
        pf = prob("fwd", has_bias=True, post_ops=tuple(o.signature() for o in ops))
        name, inv = invoker(pf)
        a = ConvArgs(x=x, w=w, bias=b, post_ops=ops)
        ref = torch.relu(conv(xf, wf, b, *args_t) + res)
        return (name, lambda: inv(a), lambda: torch.relu(conv(x, w, b, *args_t) + res),
                lambda o: rel_err(o, ref), p.flops())
    if mode.startswith("bwd_data_"):
        pd = prob("bwd_data")
        name, inv = invoker(pd)
        a = ConvArgs(x=x, w=w, dy=dy)
        ref = GRAD_IN[nd](x.shape, wf, dyf, *args_t)
        return (name, lambda: inv(a), lambda: GRAD_IN[nd](x.shape, w, dy, *args_t),
                lambda o: rel_err(o, ref), p.flops())
    if mode.startswith("bwd_weights_"):
        pw = prob("bwd_weights")
        name, inv = invoker(pw)
        a = ConvArgs(x=x, w=w, dy=dy)
        ref = GRAD_W[nd](xf, w.shape, dyf, *args_t)
        return (name, lambda: inv(a), lambda: GRAD_W[nd](x, w.shape, dy, *args_t),
                lambda o: rel_err(o, ref), p.flops())
    # bwd_bf16 / bwd_f32: both directions vs torch's autograd backward
    (nd_, id_), (nw, iw) = invoker(prob("bwd_data")), invoker(prob("bwd_weights"))
    a = ConvArgs(x=x, w=w, dy=dy)
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yb = conv(xb, wb, None, *args_t)
    xr, wr = xf.clone().requires_grad_(), wf.clone().requires_grad_()
    ref = torch.autograd.grad(conv(xr, wr, None, *args_t), (xr, wr), dyf)
    return (f"{nd_}+{nw}", lambda: (id_(a), iw(a)),
            lambda: torch.autograd.grad(yb, (xb, wb), dy, retain_graph=True),
            lambda o: max(rel_err(o[0], ref[0]), rel_err(o[1], ref[1])), 2 * p.flops())


DROP_P = 0.1        # the *_drop attention modes


def attn_drop_case(spec: dict, dt: torch.dtype, mode: str):
    """attn_fwd_drop / attn_fwd_bwd_drop: dropout 0.1, a new seed per call; checked against the
    float64 reference with the same seed (torch's SDPA draws its own mask: no error for it)."""
    B, H, S, D = spec["B"], spec["H"], spec["S"], spec["D"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dt) for _ in range(3))
    do = torch.randn(B, H, S, D, generator=g).to(dt)
    bwd = mode == "attn_fwd_bwd_drop"
    pf = AttentionProblem.from_tensors(q, k, v, dropout_p=DROP_P, return_lse=bwd)
    nf, fwd = invoker(pf)
    nb, bwd_inv = invoker(pf.with_direction("bwd")) if bwd else ("", None)
    seeds = iter(range(1, 1 << 30))
    ref_o, _ = reference_forward(pf, AttnArgs(q=q, k=k, v=v, seed=7))
    flops = 4.0 * B * H * S * S * D * (3.5 if bwd else 1.0)

    def ours(seed=None):
        a = AttnArgs(q=q, k=k, v=v, seed=next(seeds) if seed is None else seed)
        o, lse = fwd(a)
        if bwd:
            bwd_inv(AttnArgs(q=q, k=k, v=v, o=o, lse=lse, do=do, seed=a.seed))
        return "ours", o

    def peer():
        if not bwd:
            return "torch", F.scaled_dot_product_attention(q, k, v, dropout_p=DROP_P)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, dropout_p=DROP_P)
        torch.autograd.grad(o, (qq, kk, vv), do)
        return "torch", o.detach()

    def check(out) -> float:   # ours: the forward at seed 7 against the reference's mask
        return rel_err(ours(7)[1], ref_o) if out[0] == "ours" else float("nan")
    return nf + (f"+{nb}" if bwd else ""), ours, peer, check, flops


def attn_case(spec: dict, dt: torch.dtype, mode: str):
    if mode.endswith("_drop"):
        return attn_drop_case(spec, dt, mode)
    B, H, S, D = spec["B"], spec["H"], spec["S"], spec["D"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dt) for _ in range(3))
    do = torch.randn(B, H, S, D, generator=g).to(dt)
    pf = AttentionProblem.from_tensors(q, k, v, return_lse=True)
    nf, fwd = invoker(pf)
    flops = 4.0 * B * H * S * S * D
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    o_ref = F.scaled_dot_product_attention(qr, kr, vr)
    if mode == "attn_fwd":
        return (nf, lambda: fwd(AttnArgs(q=q, k=k, v=v)),
                lambda: F.scaled_dot_product_attention(q, k, v), lambda o: rel_err(o[0], o_ref), flops)
    pb = pf.with_direction("bwd")
    nb, bwd = invoker(pb)
    gref = torch.autograd.grad(o_ref, (qr, kr, vr), do.double())

    def ours():
        o, lse = fwd(AttnArgs(q=q, k=k, v=v))
        return bwd(AttnArgs(q=q, k=k, v=v, o=o, lse=lse, do=do))

    def peer():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv)
        return torch.autograd.grad(o, (qq, kk, vv), do)
    return (f"{nf}+{nb}", ours, peer, lambda o: max(rel_err(a, b) for a, b in zip(o, gref)), 3.5 * flops)


def run_case(label: dict, case, rounds: int, log) -> dict:
    name, ours, peer, check, flops = case
    err, peer_err = check(ours()), check(peer())
    t = interleaved(ours, peer, rounds)
    rec = dict(**label, solver=name, gflop=flops / 1e9, **t, ours_gflops=flops / t["ours_ms"] / 1e6,
               torch_gflops=flops / t["torch_ms"] / 1e6, rel_err=err, torch_rel_err=peer_err)
    log(f"{' '.join(str(v) for v in label.values()):<34} {name:<36} torch {t['torch_ms']:8.2f} ms  ours "
        f"{t['ours_ms']:8.2f} ms  x{t['ratio']:.2f}  GF/s {rec['torch_gflops']:5.0f} / {rec['ours_gflops']:5.0f}"
        f"  err {err:.1e} (torch {peer_err:.1e})")
    return rec


def geomean(v):
    v = list(v)
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(Path(__file__).parents[1] / "nnprim" / "data" / "suites" / "conv_cpu.json"))
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES) + ",attn_fwd,attn_fwd_bwd")
    ap.add_argument("--problems", default="", help="comma-separated conv problem names (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--exclude", default="", help="solver ids to leave out (e.g. 13: the state before it)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    EXCLUDE.update(int(i) for i in a.exclude.split(",") if i)
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    suite = json.loads(Path(a.suite).read_text())["problems"]
    if a.problems:
        suite = [s for s in suite if s["name"] in a.problems.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
          f"load {os.getloadavg()[0]:.1f}")
    peak = gemm_peak(max(3, a.rounds))
    print("GEMM peak (torch.mm 2048^3):", {k: round(v["median_gflops"]) for k, v in peak.items()})
    recs = []
    with torch.no_grad():
        for spec in suite:
            for m in (m for m in modes if m in CONV_MODES):
                if m in ("bwd_bf16", "bwd_f32"):
                    continue
                recs.append(run_case(dict(problem=spec["name"], mode=m), conv_case(spec, m), a.rounds, print))
    for spec in suite:     # autograd peers need grad mode
        for m in (m for m in ("bwd_bf16", "bwd_f32") if m in modes):
            recs.append(run_case(dict(problem=spec["name"], mode=m), conv_case(spec, m), a.rounds, print))
    for m in (m for m in modes if m.startswith("attn")):
        for spec in ATTN:
            for dn, dt in (("f32", F32), ("bf16", BF16)):
                lbl = dict(problem=f"S{spec['S']}_D{spec['D']}", mode=f"{m}_{dn}")
                with torch.set_grad_enabled(m in ("attn_fwd_bwd", "attn_fwd_bwd_drop")):
                    recs.append(run_case(lbl, attn_case(spec, dt, m), max(3, a.rounds // 2), print))
    summary = {}
    for m in dict.fromkeys(r["mode"] for r in recs):
        rs = [r for r in recs if r["mode"] == m]
        summary[m] = dict(geomean_ratio=geomean(r["ratio"] for r in rs),
                          geomean_ratio_of_medians=geomean(r["torch_ms"] / r["ours_ms"] for r in rs))
        print(f"{m:<22} geomean x{summary[m]['geomean_ratio']:.2f}")
    out = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=f"{platform.machine()}, {os.cpu_count()} cores",
               torch=torch.__version__, threads=torch.get_num_threads(), rounds=a.rounds,
               excluded=sorted(EXCLUDE),
               load_avg_end=os.getloadavg(), gemm_peak=peak, summary=summary, results=recs)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
        print("wrote", a.out)


if __name__ == "__main__":
    main()
