"""FP8 attention forward (solver 125 flash_fwd_fp8) through `nnprim.sdpa` against cuDNN's bf16
forward (torch SDPA, CUDNN_ATTENTION backend) on the same dequantised data, in the same run.

    PYTHONUNBUFFERED=1 python benchmarks/attention_fp8.py --out benchmarks/results/attention_fp8_<date>.json
        [--dims 64,128,256] [--seqs 4096,8192,16384] [--causal none,top_left] [--reps 30]
        [--tune "128,128,8,3;128,64,8,3"]

Per (head dim D, sequence S, causal): B*H fills the GPU (H = 2048 / D heads, B = 16384 / S, so
every problem has 16k query rows per head group and ~2000 programs); q, k, v random with a
different magnitude per head, quantised to e4m3 with per-head amax / 448 descales (what an FP8
recipe produces). Peers on the dequantised values cast to bf16: cuDNN (SDPBackend.CUDNN_ATTENTION)
and nnprim's bf16 forward (solver 110), both through their public calls.
Timing: CUDA events around each call, warm-up first, median of --reps. TFLOP/s with
4*B*H*S*S*D FLOPs (x0.5 causal). Error: relative norm error against an f32 reference of the
dequantised inputs (one batch entry, two heads: heads are independent) for ours and cuDNN.
`--tune`: the FP8 solver's plan with each given tile config (BM,BN,WARPS,STAGES), timed the
same way (solver-level, for the tile table in flash_fwd_fp8.FP8_TABLE).
Writes JSON to --out and prints a table.
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
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import flash_fwd_fp8  # noqa: E402
from nnprim.attention.configs import TileConfig  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.search.context import context  # noqa: E402

DEV = "cuda"
E4 = torch.float8_e4m3fn


def timed(fn, reps: int, warmup: int = 5) -> float:
    """Median ms of `reps` calls, each between CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def quantised(shape, gen):
    x = torch.randn(shape, generator=gen, device=DEV) * (0.5 + 2 * torch.rand(shape[:2] + (1, 1), generator=gen,
                                                                               device=DEV))
    d = (x.abs().amax(dim=(2, 3)) / 448.0).float()
    return (x / d[:, :, None, None]).to(E4), d


def deq(x, d, dtype):
    return (x.float() * d[:, :, None, None]).to(dtype)


def ref_slice(q, k, v, causal: str | None, heads=2) -> torch.Tensor:
    """f32 attention of batch entry 0, the first `heads` heads (row blocks: no S x S matrix
    beyond 2k rows at a time)."""
    q, k, v = q[:1, :heads], k[:1, :heads], v[:1, :heads]
    Sq, Sk, D = q.shape[2], k.shape[2], q.shape[3]
    out = torch.empty(q.shape[:3] + (v.shape[3],), device=DEV)
    for r0 in range(0, Sq, 2048):
        r1 = min(Sq, r0 + 2048)
        s = torch.matmul(q[:, :, r0:r1], k.transpose(-1, -2)) * D ** -0.5
        if causal:
            shift = 0 if causal == "top_left" else Sk - Sq
            i = torch.arange(r0, r1, device=DEV)[:, None]
            j = torch.arange(Sk, device=DEV)[None, :]
            s = s.masked_fill(j > i + shift, float("-inf"))
        out[:, :, r0:r1] = torch.matmul(torch.softmax(s, dim=-1), v)
    return out


def rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm()).item()


def run(D: int, S: int, causal: str | None, reps: int, tune: list[TileConfig]) -> dict:
    H, B = max(1, 2048 // D), max(1, 16384 // S)
    g = torch.Generator(device=DEV).manual_seed(D * 7 + S)
    (q, dq), (k, dk), (v, dv) = (quantised((B, H, S, D), g) for _ in range(3))
    qb, kb, vb = deq(q, dq, torch.bfloat16), deq(k, dk, torch.bfloat16), deq(v, dv, torch.bfloat16)
    flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    row = dict(D=D, S=S, B=B, H=H, causal=causal or "none", flops=flops)

    def ours():
        return nnprim.sdpa(q, k, v, q_descale=dq, k_descale=dk, v_descale=dv, causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal == "top_left")

    def ours_bf16():
        return nnprim.sdpa(qb, kb, vb, causal=causal)

    o = ours()
    ref = ref_slice(deq(q, dq, torch.float32), deq(k, dk, torch.float32), deq(v, dv, torch.float32), causal)
    row["err_fp8"] = rel(o[:1, :2], ref)
    row["solver"] = next((b.solver.name for key, b in context(torch.device(DEV)).chosen.items()
                          if b.problem.dtype == E4 and b.problem.Sq == S and b.problem.D == D), "?")
    peers = {"fp8": ours, "nnprim_bf16": ours_bf16}
    if causal in (None, "top_left"):
        peers["cudnn_bf16"] = cudnn
    for name, fn in peers.items():
        try:
            if name == "cudnn_bf16":
                row["err_cudnn_bf16"] = rel(fn()[:1, :2], ref)
            ms = timed(fn, reps)
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this problem
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    if "cudnn_bf16_tflops" in row:
        row["vs_cudnn"] = round(row["fp8_tflops"] / row["cudnn_bf16_tflops"], 3)
    if tune:
        p = AttentionProblem.from_tensors(q, k, v, q_descale=dq, k_descale=dk, v_descale=dv, causal=causal)
        a = AttnArgs(q, k, v, q_descale=dq, k_descale=dk, v_descale=dv)
        row["tune"] = {}
        for cfg in tune:
            label = ",".join(map(str, cfg.as_tuple()))
            try:
                plan = flash_fwd_fp8.Fp8ForwardPlan(p, cfg)
                ms = timed(lambda plan=plan: plan(a), reps)
                row["tune"][label] = dict(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                                          err=rel(plan(a)[0][:1, :2], ref))
            except Exception as e:  # noqa: BLE001
                row["tune"][label] = dict(error=f"{type(e).__name__}: {e}"[:200])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--dims", default="128,64,256")
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--causal", default="none,top_left")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tune", default="", help="tile configs 'BM,BN,WARPS,STAGES;...' timed at solver level")
    a = ap.parse_args()
    tune = [TileConfig(*map(int, t.split(","))) for t in a.tune.split(";") if t.strip()]
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
               cudnn=torch.backends.cudnn.version(), rows=[])
    import triton
    res["triton"] = triton.__version__
    for D in map(int, a.dims.split(",")):
        for S in map(int, a.seqs.split(",")):
            for c in a.causal.split(","):
                row = run(D, S, None if c == "none" else c, a.reps, tune)
                res["rows"].append(row)
                print(f"d{D:<4d} s{S:<6d} {row['causal']:10s} fp8 {row.get('fp8_tflops', 0):7.1f}  "
                      f"cudnn bf16 {row.get('cudnn_bf16_tflops', 0):7.1f}  nnprim bf16 "
                      f"{row.get('nnprim_bf16_tflops', 0):7.1f}  x{row.get('vs_cudnn', 0):.3f}  "
                      f"err fp8 {row['err_fp8']:.2e} cudnn {row.get('err_cudnn_bf16', float('nan')):.2e}  "
                      f"[{row['solver']}]", flush=True)
                if row.get("tune"):
                    for label, t in row["tune"].items():
                        print(f"      tile {label:16s} {t.get('tflops', 0):7.1f} {t.get('error', '')}")
    ratios = [r["vs_cudnn"] for r in res["rows"] if r.get("vs_cudnn")]
    if ratios:
        res["geomean_vs_cudnn"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
        d128 = [r["vs_cudnn"] for r in res["rows"] if r.get("vs_cudnn") and r["D"] == 128]
        if d128:
            res["geomean_vs_cudnn_d128"] = round(math.exp(sum(map(math.log, d128)) / len(d128)), 3)
        print("geomean vs cuDNN bf16:", res["geomean_vs_cudnn"], " d128:", res.get("geomean_vs_cudnn_d128"))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
