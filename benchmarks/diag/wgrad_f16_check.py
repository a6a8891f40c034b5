"""Backward weights of test_api_gpu's f16 NCHW 8x64x56x56 3x3 case: every applicable solver
forced through the public API and the default call, error against float64; solver 29's plan
on NHWC f16 with its default tile and with 64-pixel steps (a diagnosis of one failure)."""
from __future__ import annotations

import os
import sys

import torch

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv import gluon_conv_wgrad as gw
from nnprim.conv.reference import conv_bwd_weights_f64
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


g = torch.Generator(device="cuda").manual_seed(0)
xs, ws = (8, 64, 56, 56), (64, 64, 3, 3)
CASES = ((torch.float16, "nchw"), (torch.float16, "nhwc"), (torch.bfloat16, "nhwc"))
out_file = open(os.path.join(os.environ.get("OUT", "."), "wgrad_f16_check.txt"), "w")  # noqa: SIM115
sys.stdout = out_file
for dt, layout in CASES[:int(os.environ.get("CASES", "3"))]:
    x = torch.randn(xs, device="cuda", generator=g).to(dt)
    dy = torch.randn(xs, device="cuda", generator=g).to(dt)
    if layout == "nhwc":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=dt, layout=layout, device="cuda", padding=1)
    ref = conv_bwd_weights_f64(p, dy, x)
    theirs = torch.nn.grad.conv2d_weight(x, ws, dy, padding=1)
    print(f"{dt} {layout}: torch {rel(theirs, ref):.2e}")
    for s in REGISTRY.for_problem(p):
        if s.not_supported_reasons(p):
            continue
        try:
            out = nnprim.conv_backward_weights(dy, x, ws, padding=1, solver=s.name)
            print(f"  {s.name:<36} {rel(out, ref):.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {s.name:<36} {type(e).__name__}: {str(e)[:120]}")
    out = nnprim.conv_backward_weights(dy, x, ws, padding=1)
    print(f"  default {rel(out, ref):.2e}", flush=True)
    if layout == "nhwc":
        t0 = gw.tile_config(p)
        for name, t in (("default", t0), ("bp64", gw.WgradTile(1, 64, t0.BM, t0.BN, 6, t0.warps))):
            plan = gw.GluonWgradPlan(p, tile=t)
            out = plan(ConvArgs(dy=dy, x=x))
            print(f"  plan {name} {t} split={plan.split} {rel(out, ref):.2e}")
