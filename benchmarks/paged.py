"""Paged K/V cache speed through the public API (nnprim.sdpa with block_table=) against the
same format's contiguous cache, and torch SDPA with the cuDNN backend on the bf16
contiguous cache, in one run on the GPU (Hq 32, Hkv 8, D 128).

Decode: B x Sk in {8 x 32k, 64 x 8k}, Sq 1, formats bf16 / s8 g64 / s4 g64 / u4 g64 / fp8
(per-tensor scale), pages
16 / 64 / 256 (target: paged >= 0.95x the contiguous time). Chunked prefill: Sq 2k / 8k
over a 16k cache, B 2, bf16, causal bottom-right (target: >= 0.9x the contiguous flash
forward). Pages are shuffled in a pool with spare pages; kv_lens = Sk (full caches) so
both sides read the same keys. append_kv is timed for one decode step and one 2k chunk.

Timing: CUDA events around each call, 10 warm-up calls (find runs on the first), median
of 50 (decode) / 15 (prefill). JSON to --out (default benchmarks/results/paged_<date>.json).

Usage: python benchmarks/paged.py [--out PATH] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import nnprim  # noqa: E402
from nnprim.paged import append_kv, to_pages  # noqa: E402
from nnprim.search.context import context  # noqa: E402

DEV = "cuda"
HQ, HKV, D = 32, 8, 128


def time_ms(fn, warmup: int = 10, reps: int = 50) -> float:
    """Median per-call ms called back to back (nnprim.search.timing's clock: a spin kernel ahead
    of each run, max(host enqueue, device time)), the clock find and decode_formats.py use."""
    from nnprim.search.timing import interleaved_samples
    return statistics.median(interleaved_samples([fn], DEV, rounds=reps, warmup=warmup)[0])


def paginate(k, v, page: int, seed: int = 0):
    B, _, S, _ = k.shape
    M = S // page
    n = B * M + 16
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(n, generator=g)[:B * M].reshape(B, M).to(torch.int32).to(DEV)
    return to_pages(k, bt, n), to_pages(v, bt, n), bt


def chosen(q, k, v, **kw) -> str:
    """The solver nnprim chose for this call (after its warm-up calls)."""
    p = nnprim.AttentionProblem.from_tensors(q, k, v, **kw)
    b = context(q.device).chosen.get(p)
    return b.solver.name if b is not None else "?"


def cudnn_ms(q, k, v, causal: bool, reps: int) -> float | None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            if causal:  # bottom-right alignment with Sq < Sk: an explicit mask would leave cuDNN's fast path
                return None
            return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps=reps)
    except RuntimeError:
        return None


def run_case(name, q, k, v, lens, pages, causal, reps, out, forced=()):
    """The default call on the contiguous cache and on each page size, then each `forced`
    solver (if it applies) the same way."""
    kw = dict(kv_lens=lens, causal="bottom_right" if causal else None)
    with torch.no_grad():
        t_contig = time_ms(lambda: nnprim.sdpa(q, k, v, **kw), reps=reps)
        s_contig = chosen(q, k, v, **kw)
        row = dict(problem=name, B=q.shape[0], Sq=q.shape[2], Sk=k.shape[2], contiguous_ms=t_contig,
                   contiguous_solver=s_contig, paged={})
        for page in pages:
            kp, vp, bt = paginate(k, v, page)

            def call(kp=kp, vp=vp, bt=bt):
                return nnprim.sdpa(q, kp, vp, block_table=bt, **kw)
            t = time_ms(call, reps=reps)
            row["paged"][str(page)] = dict(ms=t, vs_contiguous=t_contig / t,
                                           solver=chosen(q, kp, vp, block_table=bt, **kw))
        for sid in forced:
            try:
                f = {"contiguous": time_ms(lambda sid=sid: nnprim.sdpa(q, k, v, solver=sid, **kw), reps=reps)}
                for page in pages:
                    kp, vp, bt = paginate(k, v, page)
                    f[str(page)] = time_ms(lambda sid=sid, kp=kp, vp=vp, bt=bt: nnprim.sdpa(
                        q, kp, vp, block_table=bt, solver=sid, **kw), reps=reps)
                row.setdefault("forced", {})[str(sid)] = f
                print(f"  forced {sid}: " + " ".join(f"{p_}={t_:.4f}" for p_, t_ in f.items()), flush=True)
            except nnprim.NotSupportedError:
                pass
        if not isinstance(k, nnprim.KVQuant):
            row["cudnn_bf16_ms"] = cudnn_ms(q, k, v, causal, reps)
    out.append(row)
    ratios = " ".join(f"p{p}={r['ms']:.4f}ms({r['vs_contiguous']:.2f}x,{r['solver']})" for p, r in row["paged"].items())
    print(f"{name:28s} contiguous {t_contig:.4f} ms ({s_contig}) | {ratios} | cuDNN {row.get('cudnn_bf16_ms')}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  f"paged_{datetime.date.today()}.json"))
    ap.add_argument("--quick", action="store_true", help="one decode problem, one prefill")
    ap.add_argument("--formats", default="bf16,s8,s4,u4,fp8", help="decode formats to run (of bf16,s8,s4,u4,fp8)")
    ap.add_argument("--decode-only", action="store_true", help="no chunked prefill, no append")
    ap.add_argument("--forced", default="", help="solver ids also timed forced on the decode problems, e.g. 122,133")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    decode = [(8, 32768), (64, 8192)] if not a.quick else [(8, 32768)]
    known = {"bf16": None, "s8": ("s8", 64), "s4": ("s4", 64), "u4": ("u4", 64), "fp8": ("fp8_e4m3", None)}
    fmts = [known[f] for f in a.formats.split(",")]
    for B, Sk in decode:
        q = torch.randn(B, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(B, HKV, Sk, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(B, HKV, Sk, D, device=DEV, dtype=torch.bfloat16)
        lens = torch.full((B,), Sk, dtype=torch.int32, device=DEV)
        for f in fmts:
            extra = {"scale_per": "tensor"} if f is not None and f[0] == "fp8_e4m3" else {}  # pools share scales
            kk = k if f is None else nnprim.quantize_kv(k, f[0], f[1], **extra)
            vv = v if f is None else nnprim.quantize_kv(v, f[0], f[1], **extra)
            name = f"decode_b{B}_k{Sk // 1024}k_{'bf16' if f is None else f[0] + (f'g{f[1]}' if f[1] else '')}"
            run_case(name, q, kk, vv, lens, (16, 64, 256), False, 50, rows,
                     forced=[int(x) for x in a.forced.split(",") if x])
            if f is None:
                t = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))  # noqa: B023
                rows[-1]["torch_default_ms"] = t
        del q, k, v
    for Sq in [] if a.decode_only else [2048, 8192] if not a.quick else [2048]:
        B, Sk = 2, 16384
        q = torch.randn(B, HQ, Sq, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(B, HKV, Sk, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(B, HKV, Sk, D, device=DEV, dtype=torch.bfloat16)
        lens = torch.full((B,), Sk, dtype=torch.int32, device=DEV)
        run_case(f"prefill_sq{Sq // 1024}k_k16k_bf16", q, k, v, lens, (16, 64, 256), True, 15, rows)
    # append: one decode step (B 64) and a 2k chunk (B 2) into page-64 pools
    app = []
    for B, S, fmt in () if a.decode_only else ((64, 1, None), (64, 1, ("s4", 64)), (2, 2048, None)):
        n = B * 128
        kp = torch.zeros(n, HKV, 64, D, device=DEV, dtype=torch.bfloat16)
        vp = torch.zeros_like(kp)
        if fmt is not None:
            kp = nnprim.quantize_kv(kp, fmt[0], fmt[1])
            vp = nnprim.quantize_kv(vp, fmt[0], fmt[1])
        bt = torch.arange(n, device=DEV, dtype=torch.int32).reshape(B, 128)
        lens = torch.full((B,), 100, dtype=torch.int32, device=DEV)
        kn = torch.randn(B, HKV, S, D, device=DEV, dtype=torch.bfloat16)
        t = time_ms(lambda: append_kv(kp, vp, bt, lens, kn, kn))  # noqa: B023
        t_nc = time_ms(lambda: append_kv(kp, vp, bt, lens, kn, kn, check=False))  # noqa: B023
        app.append(dict(B=B, S_new=S, format="bf16" if fmt is None else f"{fmt[0]}g{fmt[1]}", ms=t,
                        ms_no_check=t_nc))
        print(f"append B={B} S_new={S} {app[-1]['format']}: {t:.4f} ms ({t_nc:.4f} ms with check=False)",
              flush=True)
    res = dict(date=str(datetime.date.today()), device=torch.cuda.get_device_name(), torch=torch.__version__,
               heads=dict(Hq=HQ, Hkv=HKV, D=D), cases=rows, append=app)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
