"""Decode attention on the GPU: correctness at real sizes and speed vs the peers.

For each decode problem of nnprim/data/suites/attention_gpu.json (bf16), and quantized
K/V variants of two of them, this script
1. checks nnprim's decode solvers against an f32 torch reference (first batch entries),
2. times several tile configs / split counts of nnprim's kernel, and in the same run
   torch SDPA with the CUDNN_ATTENTION and FLASH_ATTENTION backends (enable_gqa=True)
   and, for quantized K/V, "dequantize then cuDNN SDPA",
3. writes $OUT/decode_<date>.json and prints a table (ms, TB/s of K/V bytes read).

Usage: PYTHONUNBUFFERED=1 OUT=/tmp python benchmarks/decode.py [--quick]
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention.decode import DecodeConfig, choose_splits, decode_forward, default_config  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import KVQuant, quantize_kv  # noqa: E402

DATE = "2026-11-29"
OUT = os.environ.get("OUT", ".")
T0 = time.time()
BUDGET_S = float(os.environ.get("DECODE_BENCH_BUDGET_S", "170"))
SMOKE = "--smoke" in sys.argv  # CPU + TRITON_INTERPRET=1: tiny shapes, one call per timing
dev = torch.device("cpu" if SMOKE else "cuda")
HERE = os.path.dirname(__file__)
SUITE = os.path.join(HERE, "..", "nnprim", "data", "suites", "attention_gpu.json")


def bench(fn, rep=40):
    if SMOKE:
        fn()
        return 1.0
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def kv_bytes(t) -> int:
    if isinstance(t, KVQuant):
        n = t.data.numel() * t.data.element_size() + t.scales.numel() * t.scales.element_size()
        if t.zero_points is not None:
            n += t.zero_points.numel() * t.zero_points.element_size()
        return n
    return t.numel() * t.element_size()


def reference_f32(q, k, v, causal, nb=2):
    """f32 torch attention on the first nb batch entries (dequantized K/V, GQA expanded)."""
    kf = k.dequantize(torch.float32)[:nb] if isinstance(k, KVQuant) else k[:nb].float()
    vf = v.dequantize(torch.float32)[:nb] if isinstance(v, KVQuant) else v[:nb].float()
    qf = q[:nb].float()
    G = q.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1)
    s = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        Sq, Sk = q.shape[2], kf.shape[2]
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    return torch.softmax(s, -1) @ vf


def sdpa_peer(backend, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bk = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    mask_kw = {}
    if causal:
        from torch.nn.attention.bias import causal_lower_right
        mask_kw = dict(attn_mask=causal_lower_right(q.shape[2], k.shape[2]))

    def f():
        with sdpa_kernel([bk]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **mask_kw)
    return f


def our_fn(problem, q, k, v, cfg):
    args = AttnArgs(q=q, k=k, v=v)
    return lambda: decode_forward(problem, args, cfg)


def timed(row, key, fn):
    try:
        ms = bench(fn)
        row[key] = round(ms, 4)
        return ms
    except Exception as e:  # record and go on: one failing peer must not lose the run
        row[key] = "ERR " + str(e).split("\n")[0][:100]
        return None


def run_problem(name, B, Hq, Hkv, Sq, Sk, D, causal, quant=None, configs=(), split_scan=True):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device=dev, dtype=torch.bfloat16, generator=g)
    row = dict(name=name + (f"_{quant[0]}g{quant[1]}{'zp' if not quant[2] else ''}" if quant else ""),
               B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal, quant=quant)
    bf16_bytes = kv_bytes(k) + kv_bytes(v)
    if quant:
        qdt, grp, sym = quant
        kk = quantize_kv(k, qdt, group_size=grp, symmetric=sym, scale_dtype=torch.bfloat16)
        vv = quantize_kv(v, qdt, group_size=grp, symmetric=sym, scale_dtype=torch.bfloat16)
    else:
        kk, vv = k, v
    nbytes = kv_bytes(kk) + kv_bytes(vv)
    row["kv_bytes"] = nbytes
    problem = AttentionProblem.from_tensors(q, kk, vv, causal="bottom_right" if causal else None)
    # correctness
    o, _ = decode_forward(problem, AttnArgs(q=q, k=kk, v=vv))
    ref = reference_f32(q, kk, vv, causal)
    row["rel_err"] = float((o[:2].float() - ref).norm() / ref.norm())
    row["ok"] = row["rel_err"] < 1e-2
    row["default_cfg"] = list(default_config(problem).__dict__.values())
    row["auto_splits"] = choose_splits(problem, default_config(problem))
    # nnprim: the solver's default config, then the variants
    timed(row, "ours_default_ms", our_fn(problem, q, kk, vv, default_config(problem)))
    best = (None, None)
    for cfg in configs:
        if time.time() - T0 > BUDGET_S:
            break
        key = f"ours_bn{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
        ms = timed(row, key, our_fn(problem, q, kk, vv, cfg))
        if ms is not None and (best[0] is None or ms < best[0]):
            best = (ms, cfg)
    if split_scan and best[1] is not None and time.time() - T0 < BUDGET_S:
        s0 = choose_splits(problem, best[1])
        for s in sorted({max(1, s0 // 2), s0 * 2, s0 * 4}):
            cfg = DecodeConfig(**{**best[1].__dict__, "splits": s})
            ms = timed(row, f"ours_best_splits{s}", our_fn(problem, q, kk, vv, cfg))
            if ms is not None and ms < best[0]:
                best = (ms, cfg)
    if best[1] is not None:
        row["ours_ms"] = round(best[0], 4)
        row["ours_cfg"] = list(best[1].__dict__.values())
        row["ours_tb_s"] = round(nbytes / best[0] / 1e9, 2)
        try:
            g_ = torch.cuda.CUDAGraph()
            fn = our_fn(problem, q, kk, vv, best[1])
            fn()
            with torch.cuda.graph(g_):
                fn()
            row["ours_graph_ms"] = round(bench(g_.replay), 4)
        except Exception as e:
            row["ours_graph_ms"] = "ERR " + str(e).split("\n")[0][:80]
    # peers (bf16 K/V), and dequantize-then-SDPA for quantized K/V
    for peer in ("cudnn", "flash"):
        ms = timed(row, f"{peer}_bf16_ms", sdpa_peer(peer, q, k, v, causal))
        if ms is not None:
            row[f"{peer}_bf16_tb_s"] = round(bf16_bytes / ms / 1e9, 2)
    if quant:
        def deq_sdpa():
            kd, vd = kk.dequantize(torch.bfloat16), vv.dequantize(torch.bfloat16)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True)
        timed(row, "dequant_cudnn_ms", deq_sdpa)
    if isinstance(row.get("ours_ms"), float) and isinstance(row.get("cudnn_bf16_ms"), float):
        row["speedup_vs_cudnn_bf16"] = round(row["cudnn_bf16_ms"] / row["ours_ms"], 3)
    if isinstance(row.get("ours_ms"), float) and isinstance(row.get("flash_bf16_ms"), float):
        row["speedup_vs_flash_bf16"] = round(row["flash_bf16_ms"] / row["ours_ms"], 3)
    print(json.dumps(row), flush=True)
    return row


def ceilings() -> dict:
    """Copy (read + write) and read-only bandwidth of 1 GiB bf16 buffers."""
    x = torch.empty(2**10 if SMOKE else 2**29, device=dev, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    copy = bench(lambda: y.copy_(x), rep=100)
    read = bench(lambda: x.sum(dtype=torch.float32), rep=100)
    return dict(copy_tb_s=round(2 * x.numel() * 2 / copy / 1e9, 2), read_tb_s=round(x.numel() * 2 / read / 1e9, 2))


def main():
    quick = "--quick" in sys.argv
    p = None if SMOKE else torch.cuda.get_device_properties(0)
    res = dict(date=DATE, env=dict(gpu=getattr(p, "name", "cpu"), sms=getattr(p, "multi_processor_count", 0),
                                   torch=torch.__version__, triton=triton.__version__), rows=[])
    res.update(ceilings())
    print("ceilings", res["copy_tb_s"], res["read_tb_s"], flush=True)
    suite = json.load(open(SUITE))["problems"]
    dec = [pr for pr in suite if pr["mode"] == "decode"]
    if SMOKE:
        dec = [dict(pr, B=2, Sk=pr["Sk"] // 256) for pr in dec]
    C = DecodeConfig
    bf_cfgs = [C(128, 64, 4, 3), C(64, 64, 4, 3), C(32, 64, 4, 3), C(64, 64, 4, 4), C(64, 64, 8, 3),
               C(128, 64, 8, 2)]
    q_cfgs = [C(64, 64, 4, 3), C(32, 64, 4, 3), C(64, 64, 8, 3), C(128, 64, 8, 3)]
    if quick or SMOKE:
        bf_cfgs, q_cfgs = bf_cfgs[:2], q_cfgs[:1]
    out_path = os.path.join(OUT, f"decode_{DATE}.json")
    for pr in dec:
        args = (pr["name"], pr["B"], pr["Hq"], pr["Hkv"], pr["Sq"], pr["Sk"], pr["D"], pr["causal"])
        res["rows"].append(run_problem(*args, configs=bf_cfgs))
        torch.cuda.empty_cache()
        json.dump(res, open(out_path, "w"), indent=1)
    quants = [("s8", 32, True), ("s8", 128, True), ("s4", 32, True), ("u4", 64, False), ("s4", 128, True)]
    for pr in dec[:2]:
        for qt in quants:
            if time.time() - T0 > BUDGET_S:
                break
            args = (pr["name"], pr["B"], pr["Hq"], pr["Hkv"], pr["Sq"], pr["Sk"], pr["D"], pr["causal"])
            res["rows"].append(run_problem(*args, quant=qt, configs=q_cfgs, split_scan=False))
            json.dump(res, open(out_path, "w"), indent=1)
    res["elapsed_s"] = round(time.time() - T0, 1)
    json.dump(res, open(out_path, "w"), indent=1)
    print(f"\n{'problem':34s} {'ok':>3s} {'default':>8s} {'ours':>8s} {'TB/s':>6s} {'graph':>8s} {'cudnn':>8s} {'flash':>8s} "
          f"{'deq+cudnn':>9s} {'x cudnn':>7s} {'x flash':>7s}  cfg")
    for r in res["rows"]:
        def f(key, r=r):
            v = r.get(key)
            return f"{v:8.4f}" if isinstance(v, float) else f"{'-':>8s}"
        print(f"{r['name']:34s} {str(r['ok'])[0]:>3s} {f('ours_default_ms')} {f('ours_ms')} {r.get('ours_tb_s', 0):6.2f} "
              f"{f('ours_graph_ms')} {f('cudnn_bf16_ms')} {f('flash_bf16_ms')} {f('dequant_cudnn_ms'):>9s} "
              f"{r.get('speedup_vs_cudnn_bf16', 0):7.3f} {r.get('speedup_vs_flash_bf16', 0):7.3f}  "
              f"{r.get('ours_cfg')}")
    print("copy TB/s", res["copy_tb_s"], "read TB/s", res["read_tb_s"], "elapsed", res["elapsed_s"])


if __name__ == "__main__":
    main()
