"""Rows whose keys all carry a huge finite additive mask (Hugging Face's finfo.min, (1 - m) * -1e9)
through the public sdpa and its autograd on each applicable device solver, against softmax written
out in float64 (q = 0 on those rows, so the scores are the mask exactly in any precision; torch's
SDPA backward has such rows' P summing to Sk). Reports o / dq / dk / dv relative errors per solver.

  PYTHONPATH=$PWD python benchmarks/diag/huge_mask_probe.py --out results/huge_mask_DATE.json
"""
from __future__ import annotations

import argparse
import json

import torch

import nnprim


def case(dtype, value, dev):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g) for n in (128, 192, 192))
    mask = torch.zeros(2, 1, 128, 192)
    mask[:, :, 5, :] = value
    mask[:, :, 7, :100] = value
    q[:, :, 5] = 0
    q[:, :, 7] = 0
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.softmax(qd @ kd.transpose(-1, -2) / 8 + mask.double(), -1) @ vd
    do = torch.randn(ref.shape, generator=g)
    rg = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    return [t.to(dev, dtype) for t in (q, k, v, do)], mask.to(dev, dtype), ref.detach(), rg


def err(a, b):
    a = a.double().cpu()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for dtype in (torch.bfloat16, torch.float32) if dev == "cuda" else (torch.float32,):
        for value in (-1e9, -1e30, torch.finfo(dtype).min):
            (q, k, v, do), mask, ref, rg = case(dtype, value, dev)
            p = nnprim.AttentionProblem.from_tensors(q, k, v, attn_mask=mask)
            names = [s.solver for s in nnprim.get_solutions(p)] + [None]
            for name in names:
                try:
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    o = nnprim.sdpa(qg, kg, vg, attn_mask=mask, solver=name)
                    grads = torch.autograd.grad(o, (qg, kg, vg), do)
                    r = dict(dtype=str(dtype), mask=float(value), solver=name or "default", o=err(o, ref),
                             dq=err(grads[0], rg[0]), dk=err(grads[1], rg[1]), dv=err(grads[2], rg[2]))
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    r = dict(dtype=str(dtype), mask=float(value), solver=name or "default", error=str(e)[:160])
                rows.append(r)
                print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
