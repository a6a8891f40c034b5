"""Host time per public call against torch's own call for the same primitive.

Tiny problems, so that the GPU always waits for the host: a loop of `--calls` calls, wall
time / calls after a warm-up, the median of `--repeats` loops. Rows: forward, and forward
+ backward through autograd, of conv (nnprim.conv_forward vs F.conv2d) and attention
(nnprim.sdpa vs F.scaled_dot_product_attention), a decode step, and the default call
against forcing the solver it chose (`solver=`). Peers run in the same process.

    python3 benchmarks/host_overhead.py --out $OUT/host_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nnprim  # noqa: E402
from nnprim.search.context import context  # noqa: E402


def per_call_us(fn, calls: int, repeats: int, sync, peer=None, clock=time.perf_counter
                ) -> tuple[float, float | None]:
    """Median us per call of `fn` (and of `peer`) by `clock` (wall time by default): loops of
    `calls` calls, the two alternating loop by loop, so that the machine's drift falls on
    both alike."""
    fns = [fn] if peer is None else [fn, peer]
    for f in fns:
        for _ in range(50):
            f()
    sync()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t0 = clock()
            for _ in range(calls):
                f()
            sync()
            out[i].append((clock() - t0) / calls * 1e6)
    meds = [statistics.median(o) for o in out]
    return meds[0], (meds[1] if peer is not None else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/host_overhead.json")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev = a.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    cl = torch.channels_last
    x = torch.randn(1, 8, 8, 8, device=dev, dtype=dt).contiguous(memory_format=cl)
    w = torch.randn(8, 8, 3, 3, device=dev, dtype=dt).contiguous(memory_format=cl)
    b = torch.randn(8, device=dev, dtype=dt)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    xg = xg.detach().contiguous(memory_format=cl).requires_grad_()
    gy = torch.randn(1, 8, 8, 8, device=dev, dtype=dt).contiguous(memory_format=cl)
    q = torch.randn(1, 2, 16, 64, device=dev, dtype=dt)
    k = torch.randn(1, 2, 16, 64, device=dev, dtype=dt)
    v = torch.randn(1, 2, 16, 64, device=dev, dtype=dt)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    qd = torch.randn(1, 8, 1, 128, device=dev, dtype=dt)
    kd = torch.randn(1, 2, 256, 128, device=dev, dtype=dt)
    vd = torch.randn(1, 2, 256, 128, device=dev, dtype=dt)

    def conv_fb(fn):
        def run():
            fn(xg, wg, bg, padding=1).backward(gy)
        return run

    def sdpa_fb(fn):
        def run():
            fn(qg, kg, vg).backward(do)
        return run

    with torch.no_grad():
        nnprim.conv_forward(x, w, b, padding=1)
        nnprim.sdpa(q, k, v)
        nnprim.sdpa(qd, kd, vd)
    ctx = context(torch.device(dev, 0) if dev == "cuda" else torch.device("cpu"))
    chosen = {b_.problem.key(): b_.solver.name for b_ in ctx.chosen.values()}

    def forced(prefix: str) -> str:
        return next(name for key, name in chosen.items() if key.startswith(prefix))

    conv_solver, attn_solver = forced("conv2d-fwd"), forced("attn-fwd-b1hq2")
    dec_solver = forced("attn-fwd-b1hq8")
    rows = []

    def pair(name, ours, theirs, peer_name):
        with torch.no_grad() if "fwd+bwd" not in name else torch.enable_grad():
            o, t = per_call_us(ours, a.calls, a.repeats, sync, theirs)
        row = dict(case=name, nnprim_us=round(o, 2), peer=peer_name, peer_us=None if t is None else round(t, 2),
                   ratio=None if t is None else round(o / t, 3))
        rows.append(row)
        print(f"{name:<34} nnprim {o:8.2f} us   {peer_name:<28} {'' if t is None else f'{t:8.2f} us'}"
              f"   {'' if t is None else f'x{o / t:.2f}'}", flush=True)

    pair("conv fwd", lambda: nnprim.conv_forward(x, w, b, padding=1), lambda: F.conv2d(x, w, b, padding=1),
         "F.conv2d")
    pair("conv fwd (forced solver)", lambda: nnprim.conv_forward(x, w, b, padding=1, solver=conv_solver),
         lambda: nnprim.conv_forward(x, w, b, padding=1), "nnprim default call")
    pair("conv fwd+bwd (x, w, bias)", conv_fb(nnprim.conv_forward), conv_fb(F.conv2d), "F.conv2d")
    pair("sdpa fwd", lambda: nnprim.sdpa(q, k, v), lambda: F.scaled_dot_product_attention(q, k, v),
         "F.scaled_dot_product_attention")
    pair("sdpa fwd (forced solver)", lambda: nnprim.sdpa(q, k, v, solver=attn_solver),
         lambda: nnprim.sdpa(q, k, v), "nnprim default call")
    pair("sdpa fwd+bwd", sdpa_fb(nnprim.sdpa), sdpa_fb(F.scaled_dot_product_attention),
         "F.scaled_dot_product_attention")
    pair("decode step (GQA 8/2, Sk 256)", lambda: nnprim.sdpa(qd, kd, vd),
         lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), "F.sdpa(enable_gqa)")
    pair("decode step (forced solver)", lambda: nnprim.sdpa(qd, kd, vd, solver=dec_solver),
         lambda: nnprim.sdpa(qd, kd, vd), "nnprim default call")
    chosen = {b_.problem.key(): b_.solver.name for b_ in ctx.chosen.values()}  # backward problems too
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                torch=torch.__version__, calls=a.calls, repeats=a.repeats, solvers=chosen)
    for key, name in chosen.items():
        print(f"  {name:<28} {key}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
