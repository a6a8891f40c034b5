"""Decode through the public API for every KV format (issue 14), peers in the same run.

For each decode problem of nnprim/data/suites/attention_gpu.json and each KV format (bf16;
s8/u8; s4/u4 with groups 32/64/128, with and without zero points; fp8 e4m3 per head), with
V stored rows or keys-contiguous (`quantize_kv(..., order="keys")`) for the quantized formats:
- nnprim.sdpa(q, k, v[, causal]) (find decides; the call is repeated until the choice settles),
- cuDNN SDPA (`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`) and torch's default SDPA on the bf16 cache,
timed in one interleaved run with the peers (CUDA events, warm-up, median of --reps rounds;
a spin kernel ahead of each round, so a run's time is max(host enqueue, device): its cost
called back to back), plus two more columns per side: serial latency (event, call, event,
sync: host launch time included) and the device time of a CUDA-graph replay; checked against an f32
reference of the dequantised cache (first two batch entries). Reports ms, ratio vs cuDNN and
bandwidth = bytes of K/V read (codes + scales + zero points) / time. JSON to --out.

--solvers 122,128 also times those solvers forced (`nnprim.sdpa(..., solver=...)`) in the same
interleaved rounds (columns solver_ms / solver_x_vs_cudnn / solver_rel_err); --v-order keys times
only keys-contiguous V; --problems names a subset of the suite's decode problems.

Usage: python benchmarks/decode_formats.py --out /tmp/decode_formats.json [--quick] [--reps 200]
       [--solvers 122,128] [--v-order keys] [--problems decode_b64_k8k,decode_b8_k32k]
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
from nnprim.quant import KVQuant, quantize_kv  # noqa: E402

SUITE = os.path.join(os.path.dirname(__file__), "..", "nnprim", "data", "suites", "attention_gpu.json")
FORMATS = ([("bf16", None, None)] + [("s8", 64, False), ("s8", 128, False), ("u8", 64, True)]
           + [(d, g, zp) for d in ("s4", "u4") for g in (32, 64, 128) for zp in (False, True)]
           + [("fp8_e4m3", "head", False)])


def paired_ms(fns, warmup: int, reps: int) -> list[float]:
    """Per-call ms of each of `fns` called back to back, interleaved round by round in one run
    (nnprim.search.timing: a spin kernel ahead of each round, so each run is max(host
    enqueue, device time), not the launch latency of an idle GPU)."""
    from nnprim.search.timing import interleaved_samples
    return [statistics.median(t) for t in interleaved_samples(fns, "cuda", rounds=reps, warmup=warmup)]


def graph_ms(fn, reps: int) -> float | None:
    """Device time of fn replayed from a CUDA graph (no host work at all); None if it cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return events_median(g.replay, 5, reps)
    except Exception:
        return None


def events_median(fn, warmup: int, reps: int) -> float:
    """Serial latency: each run between events with a sync after it (the GPU idles while the host enqueues)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kv_bytes(t) -> int:
    if isinstance(t, KVQuant):
        n = t.data.numel() * t.data.element_size() + t.scales.numel() * t.scales.element_size()
        if t.zero_points is not None:
            n += t.zero_points.numel() * t.zero_points.element_size()
        return n
    return t.numel() * t.element_size()


def quant(x, fmt, role):
    dt, g, zp = fmt
    if dt == "bf16":
        return x
    if dt == "fp8_e4m3":
        return quantize_kv(x, dt, scale_per=g, order="keys" if role == "v" else None)
    return quantize_kv(x, dt, group_size=g, symmetric=not zp, scale_dtype=torch.bfloat16, order="keys" if role == "v" else None)


def reference(q, k, v, causal, nb=2):
    kd = k.dequantize(torch.float32)[:nb] if isinstance(k, KVQuant) else k[:nb].float()
    vd = v.dequantize(torch.float32)[:nb] if isinstance(v, KVQuant) else v[:nb].float()
    G = q.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    s = q[:nb].float() @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        Sq, Sk = q.shape[2], kd.shape[2]
        i, j = torch.arange(Sq, device=q.device)[:, None], torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    return torch.softmax(s, -1) @ vd


def peer(backend, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kw = {}
    if causal:
        from torch.nn.attention.bias import causal_lower_right
        kw = dict(attn_mask=causal_lower_right(q.shape[2], k.shape[2]))
    if backend is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)

    def f():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    return f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="s8 g64, s4 g64, u4 g64 zp, fp8 only")
    ap.add_argument("--solvers", default="", help="comma list of solver ids / names also timed forced")
    ap.add_argument("--v-order", choices=("both", "keys", "rows"), default="both")
    ap.add_argument("--problems", default="", help="comma list of suite problem names (default: every decode one)")
    a = ap.parse_args()
    forced = [int(x) if x.strip().isdigit() else x.strip() for x in a.solvers.split(",") if x.strip()]
    roles = {"both": (None, "v"), "keys": ("v",), "rows": (None,)}[a.v_order]
    fmts = FORMATS if not a.quick else [f for f in FORMATS if f[0] in ("bf16", "fp8_e4m3") or f[1] == 64]
    p = torch.cuda.get_device_properties(0)
    import triton
    res = dict(env=dict(gpu=p.name, sms=p.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                        nnprim_find=os.environ.get("NNPRIM_FIND_MODE", "default")), rows=[])
    probs = [pr for pr in json.load(open(SUITE))["problems"] if pr["mode"] == "decode"
             and (not a.problems or pr["name"] in a.problems.split(","))]
    t0 = time.time()
    for pr in probs:
        g = torch.Generator(device="cuda").manual_seed(0)
        B, Hq, Hkv, Sq, Sk, D, causal = (pr[x] for x in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "causal"))
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
        cudnn_fn, default_fn = peer("cudnn", q, k, v, causal), peer(None, q, k, v, causal)
        cudnn_lat = events_median(cudnn_fn, a.warmup, a.reps // 2)
        cudnn_g = graph_ms(cudnn_fn, a.reps // 2)
        for fmt in fmts:
            for role in ((None,) if fmt[0] == "bf16" else roles):
                kk, vv = quant(k, fmt, None), quant(v, fmt, role)
                kw = dict(causal="bottom_right") if causal else {}
                fn = (lambda q=q, kk=kk, vv=vv, kw=kw: nnprim.sdpa(q, kk, vv, **kw))
                row = dict(problem=pr["name"], B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal,
                           format=f"{fmt[0]}" + (f"_g{fmt[1]}" if fmt[1] else "") + ("_zp" if fmt[2] else ""),
                           v_order="keys" if role == "v" else "rows",
                           layout=str(getattr(kk, "layout", None)), kv_bytes=kv_bytes(kk) + kv_bytes(vv))
                try:
                    o = fn()
                    ref = reference(q, kk, vv, causal)
                    row["rel_err"] = float((o[:2].float() - ref).norm() / ref.norm())
                    for _ in range(20):          # find settles on the first calls
                        fn()
                    fns = [fn, cudnn_fn, default_fn]
                    names = []
                    for sv in (forced if fmt[0] != "bf16" else []):
                        f_s = (lambda q=q, kk=kk, vv=vv, kw=kw, sv=sv: nnprim.sdpa(q, kk, vv, solver=sv, **kw))
                        try:
                            o_s = f_s()
                        except Exception as e:  # not applicable to this format: recorded
                            row.setdefault("solver_error", {})[str(sv)] = f"{type(e).__name__}: {str(e)[:120]}"
                            continue
                        row.setdefault("solver_rel_err", {})[str(sv)] = float((o_s[:2].float() - ref).norm() / ref.norm())
                        fns.append(f_s)
                        names.append(str(sv))
                    ms, cudnn, default, *solver_ms = paired_ms(fns, a.warmup, a.reps)
                    if names:
                        row["solver_ms"] = {n: round(t, 4) for n, t in zip(names, solver_ms)}
                        row["solver_x_vs_cudnn"] = {n: round(cudnn / t, 3) for n, t in zip(names, solver_ms)}
                    lat = events_median(fn, a.warmup, a.reps // 2)
                    g_ms = graph_ms(fn, a.reps // 2)
                    row.update(ms=round(ms, 4), cudnn_bf16_ms=round(cudnn, 4), torch_default_bf16_ms=round(default, 4),
                               x_vs_cudnn=round(cudnn / ms, 3), tb_s=round(row["kv_bytes"] / ms / 1e9, 3),
                               latency_ms=round(lat, 4), cudnn_latency_ms=round(cudnn_lat, 4),
                               graph_ms=None if g_ms is None else round(g_ms, 4),
                               cudnn_graph_ms=None if cudnn_g is None else round(cudnn_g, 4))
                except Exception as e:  # record and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                json.dump(res, open(a.out, "w"), indent=1)
        torch.cuda.empty_cache()
    res["elapsed_s"] = round(time.time() - t0, 1)
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"\n{'problem':22s} {'format':16s} {'V':5s} {'ms':>8s} {'cudnn':>8s} {'x cudnn':>7s} {'TB/s':>6s} {'err':>8s}"
          f" {'graph':>8s} {'cudnn gr':>8s}")
    for r in res["rows"]:
        if "ms" in r:
            forced_s = " ".join(f"{n}:{t:.4f}ms({r['solver_x_vs_cudnn'][n]:.2f}x)"
                                for n, t in r.get("solver_ms", {}).items())
            print(f"{r['problem']:22s} {r['format']:16s} {r['v_order']:5s} {r['ms']:8.4f} {r['cudnn_bf16_ms']:8.4f} "
                  f"{r['x_vs_cudnn']:7.3f} {r['tb_s']:6.2f} {r['rel_err']:8.2e} {r['graph_ms'] or 0:8.4f} "
                  f"{r['cudnn_graph_ms'] or 0:8.4f} {forced_s}")
        else:
            print(f"{r['problem']:22s} {r['format']:16s} {r['v_order']:5s} {r.get('error')}")


if __name__ == "__main__":
    main()
