"""Quantized-K/V decode on the GPU: solver 122 (decode_split_k_quant_grouped) vs 121
(decode_split_k_quant) vs cuDNN SDPA on bf16 K/V, in one run.

For decode B=64 / B=8, Hq=32, Hkv=8 (GQA 4), D=128, bf16 q, K and V quantized with bf16
scales, this script
1. checks every timed kernel (121, each 122 variant) against an f32 torch reference of the
   dequantized K/V on the first two batch entries,
2. times 121's default config, several 122 tile / conversion variants and a split scan of
   the best one (CUDA-graph replay too), and cuDNN SDPA on the bf16 K/V (enable_gqa=True),
3. writes $OUT/decode_quant_<date>.json after every problem and prints a table.

Compilation of every variant is spread over worker processes first (Triton's disk cache),
so the timed process mostly loads kernels. A wall-clock budget stops starting new work.

Usage: PYTHONUNBUFFERED=1 OUT=/tmp python benchmarks/decode_quant.py
       TRITON_INTERPRET=1 python benchmarks/decode_quant.py --smoke   (CPU, tiny shapes)
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _import_without_all_solvers():
    """Load nnprim's submodules without nnprim/__init__ (which imports every solver module):
    this benchmark needs only the decode solvers, and must not depend on the others importing."""
    import types
    if "nnprim" not in sys.modules:
        pkg = types.ModuleType("nnprim")
        pkg.__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nnprim")]
        sys.modules["nnprim"] = pkg


_import_without_all_solvers()
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode_quant as dq  # noqa: E402
from nnprim.attention.decode import decode_forward  # noqa: E402
from nnprim.attention.decode import default_config as default_121  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import KVQuant, quantize_kv  # noqa: E402

DATE = "2026-11-29"
OUT = os.environ.get("OUT", ".")
T0 = time.time()
BUDGET_S = float(os.environ.get("DQ_BENCH_BUDGET_S", "125"))
SMOKE = "--smoke" in sys.argv
dev = "cpu" if SMOKE else "cuda"
C = dq.QuantDecodeConfig

# (name, B, Hq, Hkv, Sk, D)
PROBLEMS = [("b64_k8k", 64, 32, 8, 8192, 128), ("b8_k32k", 8, 32, 8, 32768, 128)]
# (qdtype, group, symmetric); in order of priority
FORMATS = [("s8", 32, True), ("s4", 32, True), ("u4", 64, False), ("s8", 128, True), ("s4", 128, True)]
PLAN = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (0, 4), (1, 2)]  # (problem, format) in run order

V8 = [C(128, 16, 4, 3), C(128, 16, 8, 3), C(64, 16, 4, 3), C(64, 16, 8, 4), C(128, 16, 4, 3, asm_convert=True),
      C(256, 16, 8, 3), C(128, 16, 4, 4)]
V4 = [C(128, 16, 4, 3), C(128, 16, 8, 3, v_join=True), C(128, 16, 4, 3, v_join=True), C(64, 16, 4, 3),
      C(256, 16, 8, 3), C(128, 16, 4, 3, asm_convert=False), C(128, 16, 8, 3)]


def variants(fmt):
    return V4 if fmt[0] in ("s4", "u4") else V8


def cfg_key(cfg) -> str:
    a = {None: "auto", True: "asm", False: "cvt"}[cfg.asm_convert]
    return f"bn{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}_{a}{'_join' if cfg.v_join else ''}" + \
        (f"_sp{cfg.splits}" if cfg.splits else "")


def bench(fn, rep=30):
    if SMOKE:
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def kv_bytes(t) -> int:
    if isinstance(t, KVQuant):
        n = t.data.numel() * t.data.element_size() + t.scales.numel() * t.scales.element_size()
        if t.zero_points is not None:
            n += t.zero_points.numel() * t.zero_points.element_size()
        return n
    return t.numel() * t.element_size()


def make(B, Hq, Hkv, Sk, D, fmt):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=dev, dtype=torch.bfloat16, generator=g)
    if fmt is None:
        return q, k, v
    qdt, grp, sym = fmt
    kq = quantize_kv(k, qdt, group_size=grp, symmetric=sym, scale_dtype=torch.bfloat16)
    vq = quantize_kv(v, qdt, group_size=grp, symmetric=sym, scale_dtype=torch.bfloat16)
    return q, kq, vq


def reference_f32(q, k, v, nb=2):
    kf, vf = k.dequantize(torch.float32)[:nb], v.dequantize(torch.float32)[:nb]
    G = q.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1)
    s = q[:nb].float() @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ vf


def warm_compile():
    """Compile every (format, variant) and 121 in worker processes (fills Triton's disk cache)."""
    if SMOKE:
        return 0.0
    import concurrent.futures as cf
    import multiprocessing as mp
    t = time.time()
    tasks = []
    for _, fi in PLAN:
        fmt = FORMATS[fi]
        tasks.append((fmt, None))
        for i in range(len(variants(fmt))):
            tasks.append((fmt, i))
    tasks = list(dict.fromkeys(tasks))
    workers = min(len(tasks), max(1, (os.cpu_count() or 4) - 2))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        errs = [e for e in ex.map(_compile_one, tasks) if e]
    for e in errs:
        print("warm compile:", e, flush=True)
    return time.time() - t


def _compile_one(task):
    fmt, vi = task
    try:
        q, k, v = make(2, 32, 8, 1024, 128, fmt)
        p = AttentionProblem.from_tensors(q, k, v)
        if vi is None:
            decode_forward(p, AttnArgs(q=q, k=k, v=v))
        else:
            cfg = variants(fmt)[vi]
            for s in (2, 9):  # split counts of the two problems' defaults (not 1, not a multiple of 16)
                dq.decode_quant_forward(p, AttnArgs(q=q, k=k, v=v), C(**{**cfg.__dict__, "splits": s}))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # report, the timed process compiles again
        return f"{fmt} {vi}: {type(e).__name__}: {str(e)[:300]}"


def run(pname, B, Hq, Hkv, Sk, D, fmt, cudnn_cache):
    q, k, v = make(B, Hq, Hkv, Sk, D, fmt)
    row = dict(name=f"{pname}_{fmt[0]}g{fmt[1]}{'' if fmt[2] else 'zp'}", B=B, Hq=Hq, Hkv=Hkv, Sk=Sk, D=D,
               fmt=list(fmt), kv_bytes=kv_bytes(k) + kv_bytes(v))
    nbytes = row["kv_bytes"]
    problem = AttentionProblem.from_tensors(q, k, v)
    ref = reference_f32(q, k, v)

    def err(o):
        return float((o[:2].float() - ref).norm() / ref.norm())

    def record(key, fn):
        try:
            e = err(fn()[0])
            ms = bench(fn)
            row[key] = dict(ms=round(ms, 4), err=round(e, 5), tb_s=round(nbytes / ms / 1e9, 3))
            return ms, e
        except Exception as ex:  # one failing variant must not lose the run
            row[key] = "ERR " + str(ex).split("\n")[0][:160]
            return None, None

    args = AttnArgs(q=q, k=k, v=v)
    record("121_default", lambda: decode_forward(problem, args, default_121(problem)))
    best = (None, None)
    for cfg in variants(fmt):
        if time.time() - T0 > BUDGET_S:
            row["budget_cut"] = True
            break
        ms, e = record("122_" + cfg_key(cfg), lambda cfg=cfg: dq.decode_quant_forward(problem, args, cfg))
        if ms is not None and e < 1e-2 and (best[0] is None or ms < best[0]):
            best = (ms, cfg)
    if best[1] is not None and time.time() - T0 < BUDGET_S:
        s0 = dq.choose_splits(problem, best[1])
        for s in sorted({max(1, s0 // 2), 2 * s0, 4 * s0} - {s0}):
            cfg = C(**{**best[1].__dict__, "splits": s})
            ms, e = record("122_" + cfg_key(cfg), lambda cfg=cfg: dq.decode_quant_forward(problem, args, cfg))
            if ms is not None and e < 1e-2 and ms < best[0]:
                best = (ms, cfg)
    if best[1] is not None:
        row["122_best"] = dict(ms=round(best[0], 4), cfg=cfg_key(best[1]), tb_s=round(nbytes / best[0] / 1e9, 3))
        if not SMOKE:
            try:
                fn = lambda: dq.decode_quant_forward(problem, args, best[1])  # noqa: E731
                fn()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    fn()
                row["122_best"]["graph_ms"] = round(bench(gr.replay), 4)
            except Exception as ex:
                row["122_best"]["graph_ms"] = "ERR " + str(ex)[:80]
    # cuDNN on the bf16 K/V of the same shape (once per shape)
    if pname not in cudnn_cache:
        qb, kb, vb = make(B, Hq, Hkv, Sk, D, None)

        def cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
        try:
            cudnn_cache[pname] = round(bench(cudnn), 4)
        except Exception as ex:
            cudnn_cache[pname] = "ERR " + str(ex)[:100]
        del qb, kb, vb
    row["cudnn_bf16_ms"] = cudnn_cache[pname]
    if isinstance(row["cudnn_bf16_ms"], float) and "122_best" in row:
        row["speedup_122_vs_cudnn_bf16"] = round(row["cudnn_bf16_ms"] / row["122_best"]["ms"], 3)
    if isinstance(row.get("121_default"), dict) and "122_best" in row:
        row["speedup_122_vs_121"] = round(row["121_default"]["ms"] / row["122_best"]["ms"], 3)
    print(json.dumps(row), flush=True)
    return row


def main():
    p = None if SMOKE else torch.cuda.get_device_properties(0)
    res = dict(date=DATE, env=dict(gpu=getattr(p, "name", "cpu"), sms=getattr(p, "multi_processor_count", 0),
                                   torch=torch.__version__, triton=triton.__version__), rows=[])
    res["warm_compile_s"] = round(warm_compile(), 1)
    print("warm compile s", res["warm_compile_s"], flush=True)
    out_path = os.path.join(OUT, f"decode_quant_{DATE}.json")
    cudnn_cache = {}
    for pi, fi in (PLAN[:3] if SMOKE else PLAN):
        if time.time() - T0 > BUDGET_S:
            break
        name, B, Hq, Hkv, Sk, D = PROBLEMS[pi]
        if SMOKE:
            B, Sk = 2, 256
        res["rows"].append(run(name, B, Hq, Hkv, Sk, D, FORMATS[fi], cudnn_cache))
        torch.cuda.empty_cache() if not SMOKE else None
        res["elapsed_s"] = round(time.time() - T0, 1)
        json.dump(res, open(out_path, "w"), indent=1)
    print(f"\n{'problem':18s} {'MB':>6s} {'121':>8s} {'122 def':>8s} {'122 best':>8s} {'TB/s':>6s} {'graph':>8s} "
          f"{'cudnn bf16':>10s} {'x cudnn':>7s} {'x 121':>6s}  best cfg")
    for r in res["rows"]:
        def ms(key, r=r):
            v = r.get(key)
            return f"{v['ms']:8.4f}" if isinstance(v, dict) else f"{'-':>8s}"
        b = r.get("122_best", {})
        d = ms("122_" + cfg_key(variants(tuple(r["fmt"]))[0]))
        gms = b.get("graph_ms")
        print(f"{r['name']:18s} {r['kv_bytes'] / 1e6:6.0f} {ms('121_default')} {d} {ms('122_best')} "
              f"{b.get('tb_s', 0):6.2f} {gms if isinstance(gms, float) else '-':>8} {str(r['cudnn_bf16_ms']):>10s} "
              f"{r.get('speedup_122_vs_cudnn_bf16', 0):7.3f} {r.get('speedup_122_vs_121', 0):6.3f}  {b.get('cfg')}")
    print("elapsed", res.get("elapsed_s"))


if __name__ == "__main__":
    main()
