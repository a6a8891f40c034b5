"""Tile probe of solver 29 `gluon_implicit_gemm_bwd_weights` on the suite's 3x3 layers
(issue 13: backward weights at 0.48-0.79x cuDNN). A 128 x 128 tile reduces 64 pixels per
step from two 16 KB boxes: 64 FLOP per byte read from L2, which at ~6 TB/s caps a kernel
near 380 TFLOP/s; 256 x 128 or 128 x 256 tiles (two consumer warpgroups, 128 f32
accumulators a thread) read 85 FLOP per byte. Per problem: each tile's plan captured in a
CUDA graph (device time only), cuDNN's backward weights likewise, results checked against
cuDNN in f32. JSON to --out.

    PYTHONPATH=$PWD python benchmarks/diag/wgrad_tile_probe.py --out $OUT/wgrad_tiles.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gluon_bench_common import graph_us  # noqa: E402

from nnprim.args import ConvArgs
from nnprim.cli.suites import load_suite
from nnprim.conv import gluon_conv_wgrad as gw
from nnprim.problems.conv import ConvProblem

NAMES = ["rn50_r2_3x3", "rn50_r3_3x3s2", "rn50_r3_3x3", "rn50_r4_3x3", "rn50_r5_3x3", "unet_320_64x64",
         "unet_640_32x32"]


def tiles(p: ConvProblem) -> dict:
    t0 = gw.tile_config(p)
    out = {"default": t0}
    for name, bm, bn in (("256x128", 256, 128), ("128x256", 128, 256)):
        if bm > 128 and p.K < 256 or bn > 128 and p.C < 256:
            continue
        t = gw.WgradTile(t0.BH, t0.BW, bm, bn, 1, 8)
        out[name] = gw.WgradTile(t0.BH, t0.BW, bm, bn, min(gw.MAX_STAGES, (gw.SMEM_BYTES - 2048) // t.stage_bytes()),
                                 8)
    return out


def split_sweep(p: ConvProblem, args: ConvArgs, ref: torch.Tensor, cud: float) -> dict:
    """The default tile with the split forced (plan_split's choice marked), the main kernel
    and the reduce timed together and the reduce alone; the Triton solver 22 for reference."""
    from nnprim.conv.implicit_gemm_bwd import BwdWeightsPlan
    out = {}
    t = gw.tile_config(p)
    chosen = gw.plan_split(p, t, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    real = gw.plan_split
    for split in sorted({1, 2, 3, 4, 6, 8, 12, chosen}):
        def forced(p_, t_, sms, split=split):
            gm = gw.geom(p_)
            nt = gm.N * -(-gm.out[1] // t_.BH) * -(-gm.out[2] // t_.BW)
            tps = -(-nt // split)
            sp = -(-nt // tps)
            tiles_ = -(-gm.K // t_.BM) * gm.taps * -(-gm.C // t_.BN)
            return sp, tps, tiles_ * sp
        gw.plan_split = forced
        try:
            plan = gw.GluonWgradPlan(p, t)
            o = plan(args)
            torch.cuda.synchronize()
            err = ((o.float() - ref).norm() / ref.norm()).item()
            us = graph_us(lambda plan=plan: plan(args))
            red = None
            if plan.split > 1:
                ws = torch.randn(plan.ws_shape, device="cuda")
                red = graph_us(lambda plan=plan, ws=ws, o=o: plan.reduce(ws, o))
            out[f"split{split}"] = dict(us=round(us, 2), reduce_us=red and round(red, 2), err=err, split=plan.split,
                                        chosen=split == chosen, vs_cudnn=round(cud / us, 3))
        except Exception as e:  # noqa: BLE001
            out[f"split{split}"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            gw.plan_split = real
    tp = BwdWeightsPlan(p)
    out["triton22"] = dict(us=round(graph_us(lambda: tp(args)), 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="wgrad_tiles.json")
    ap.add_argument("--splits", action="store_true", help="sweep the split of the default tile instead")
    ap.add_argument("--stream", action="store_true", help="the default tile only, split and stream-K schedules")
    ap.add_argument("--only", default="", help="comma-separated problem names")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    _, probs = load_suite("conv_gpu")
    specs = {p["name"]: p for p in probs}
    rows = []
    for name in (a.only.split(",") if a.only else NAMES):
        s = specs[name]
        N, C, K, (H, W), st, pad = s["N"], s["C"], s["K"], s["spatial"], s["stride"], s["padding"]
        x = torch.randn(N, C, H, W, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        w_shape = (K, C, 3, 3)
        p = ConvProblem.create("bwd_weights", x.shape, w_shape, dtype=torch.bfloat16, layout="nhwc", device="cuda",
                               stride=st, padding=pad)
        dy = torch.randn(p.y_shape, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        bw = ([st, st], [pad, pad], [1, 1], False, [0, 0], 1, [False, True, False])
        w_dummy = torch.empty(w_shape, device="cuda", dtype=torch.bfloat16)
        ref = torch.ops.aten.convolution_backward(dy.float(), x.float(), w_dummy.float(), None, *bw)[1]
        row = dict(name=name, flops=p.flops())
        cud = graph_us(lambda: torch.ops.aten.convolution_backward(dy, x, w_dummy, None, *bw))  # noqa: B023
        row["cudnn_us"] = cud
        args = ConvArgs(dy=dy, x=x)
        if a.splits:
            row.update(split_sweep(p, args, ref, cud))
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        variants = [(f"{tn}/{'sk' if sk else 'split'}", t, sk) for tn, t in tiles(p).items() for sk in (False, True)
                    if tn == "default" or not a.stream]
        for tn, t, sk in variants:
            try:
                plan = gw.GluonWgradPlan(p, t, stream=sk)
                out = plan(args)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = graph_us(lambda plan=plan: plan(args))  # noqa: B023
                row[tn] = dict(us=round(us, 2), err=err, split=plan.split, stream=plan.stream,
                               tflops=round(p.flops() / us / 1e6, 1),
                               vs_cudnn=round(cud / us, 3), tile=str(t))
            except Exception as e:  # noqa: BLE001 - report and go on
                row[tn] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
