"""Probe (issue 13): does Triton's automatic warp specialisation and/or a persistent tile
loop lift the stride-1 NHWC TMA convolution on Hopper? A stripped copy of
implicit_gemm._conv_tma_kernel (no epilogue, 2-D, in-kernel descriptors, which autoWS
needs) timed against solver 20 through the public API and cuDNN in the same run.

    PYTHONUNBUFFERED=1 python benchmarks/conv_ws_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

import nnprim


@triton.jit
def _conv_ws_kernel(x_ptr, w_ptr, y_ptr, N, H, W, C, K, R, S, PH, PW, NUM_PROGS,
                    BH: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    WS: tl.constexpr, PERSIST: tl.constexpr, GROUP_M: tl.constexpr):
    BM: tl.constexpr = BH * BW
    xd = tl.make_tensor_descriptor(x_ptr, shape=[N, H, W, C], strides=[H * W * C, W * C, C, 1],
                                   block_shape=[1, BH, BW, BK])
    wd = tl.make_tensor_descriptor(w_ptr, shape=[K, R * S * C], strides=[R * S * C, 1],
                                   block_shape=[BN, BK])
    n_tw = tl.cdiv(W, BW)
    n_th = tl.cdiv(H, BH)
    num_m = N * n_th * n_tw
    num_n = tl.cdiv(K, BN)
    n_tiles = num_m * num_n
    nk = tl.cdiv(C, BK)
    steps = R * S * nk
    if PERSIST:
        start = tl.program_id(0)
        step = NUM_PROGS
    else:
        start = tl.program_id(0)
        step = n_tiles
    for pid in tl.range(start, n_tiles, step, flatten=PERSIST, warp_specialize=WS and PERSIST):
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        tw = pid_m % n_tw
        tmp = pid_m // n_tw
        th = tmp % n_th
        n = tmp // n_th
        oh0 = th * BH
        ow0 = tw * BW
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in tl.range(0, steps, warp_specialize=WS and not PERSIST):
            tap = it // nk
            c0 = (it - tap * nk) * BK
            ss = tap % S
            rr = tap // S
            a = xd.load([n, oh0 - PH + rr, ow0 - PW + ss, c0])
            b = wd.load([off_n, tap * C + c0])
            acc = tl.dot(tl.reshape(a, (BM, BK)), tl.trans(b), acc)
        ri = tl.arange(0, BM)
        oh = oh0 + ri // BW
        ow = ow0 + ri % BW
        rn = off_n + tl.arange(0, BN)
        mask = ((oh < H) & (ow < W))[:, None] & (rn < K)[None, :]
        y_off = ((n.to(tl.int64) * H + oh) * W + ow)[:, None] * K + rn[None, :]
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


def run_variant(x, w, cfg, sms):
    N, H, W, C = x.shape
    K, R, S, _ = w.shape
    BM, BN, BK, warps, stages, ws, persist = cfg
    BW = min(triton.next_power_of_2(W), BM)
    BH = min(triton.next_power_of_2(H), max(BM // BW, 1))
    y = torch.empty((N, H, W, K), device=x.device, dtype=x.dtype)
    n_tiles = N * triton.cdiv(H, BH) * triton.cdiv(W, BW) * triton.cdiv(K, BN)
    progs = min(n_tiles, sms) if persist else n_tiles

    def f():
        _conv_ws_kernel[(progs,)](x, w, y, N, H, W, C, K, R, S, R // 2, S // 2, progs,
                                  BH=BH, BW=BW, BN=BN, BK=BK, WS=ws, PERSIST=persist, GROUP_M=8,
                                  num_warps=warps, num_stages=stages)
        return y
    return f


CANDS = [  # BM, BN, BK, warps, stages, WS, persistent
    (128, 128, 64, 8, 3, False, False), (128, 128, 64, 4, 3, False, False),
    (128, 128, 64, 4, 3, True, False), (128, 128, 64, 8, 3, True, False),
    (128, 128, 64, 4, 4, True, False), (128, 256, 64, 8, 3, True, False),
    (128, 128, 64, 8, 3, False, True), (128, 128, 64, 4, 3, True, True), (128, 128, 64, 8, 3, True, True),
    (128, 256, 64, 8, 3, True, True), (128, 64, 64, 4, 4, True, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    suite = json.load(open(Path(__file__).resolve().parents[1] / "nnprim/data/suites/conv_gpu.json"))["problems"]
    probs = [p for p in suite if p["filter"] == [3, 3] and p["stride"] == 1 and p["groups"] == 1
             and p["layout"] == "nhwc"]
    rows = []
    for p in probs:
        t0 = time.time()
        torch.manual_seed(0)
        N, C, (H, W), K = p["N"], p["C"], p["spatial"], p["K"]
        xc = torch.randn(N, C, H, W, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        wc = torch.randn(K, C, 3, 3, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        x, w = xc.permute(0, 2, 3, 1), wc.permute(0, 2, 3, 1)   # NHWC / KRSC views, contiguous
        fl = 2.0 * N * H * W * K * C * 9
        ref = F.conv2d(xc, wc, padding=1)
        row = dict(name=p["name"])
        row["cudnn_tflops"] = round(fl / do_bench(lambda xc=xc, wc=wc: F.conv2d(xc, wc, padding=1), rep=60,
                                                  return_mode="median") / 1e9, 1)
        nnprim.conv_forward(xc, wc, padding=1, solver="implicit_gemm_fwd")
        row["ours_api_tflops"] = round(fl / do_bench(lambda xc=xc, wc=wc: nnprim.conv_forward(xc, wc, padding=1,
                                                                                 solver="implicit_gemm_fwd"),
                                                     rep=60, return_mode="median") / 1e9, 1)
        row["cands"] = {}
        for c in CANDS:
            try:
                f = run_variant(x, w, c, sms)
                y = f()
                err = ((y.permute(0, 3, 1, 2).float() - ref.float()).norm() / ref.float().norm()).item()
                ms = do_bench(f, rep=60, return_mode="median")
                row["cands"][str(c)] = dict(tflops=round(fl / ms / 1e9, 1), err=float(f"{err:.1e}"))
            except Exception as e:  # noqa: BLE001
                row["cands"][str(c)] = "ERR " + str(e).split("\n")[0][:150]
        ok = [(v["tflops"], k) for k, v in row["cands"].items() if isinstance(v, dict)]
        if ok:
            row["best"], row["best_tflops"] = max(ok)[1], max(ok)[0]
            row["best_vs_cudnn"] = round(row["best_tflops"] / row["cudnn_tflops"], 3)
        rows.append(row)
        print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
    (Path(a.out) / f"conv_ws_probe_{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
