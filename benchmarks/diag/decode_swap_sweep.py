"""Tile sweep of the quantized decode solvers (128 `decode_swap_ab_quant`, 122) on the H200:
each config of --configs launched through the solver's own plan (`decode_swap.plan`), checked
against an f32 reference of the dequantised cache (first two batch entries), and timed
interleaved with cuDNN on the bf16 cache and with `nnprim.sdpa` (find's choice) in the same
rounds (find's clock: a spin kernel ahead of each round, median). Formats: grouped scales as
the suite's, plus per-head scales (no scale loads in the key loop) to price those loads.

Usage: python benchmarks/diag/decode_swap_sweep.py --out /tmp/sweep.json
       [--formats s4:64,s8:64,s4:head,fp8:head] [--configs 128x4x3,64x4x3:2] [--rounds 100]
A config is [solver/]BLOCK_N x num_warps x num_stages[:split factor | :=splits][+pin][+asm]
(solver 128 unless 122/, 131/, 131k/ or 133/ lead; the split factor multiplies the solver's own split
count, =N sets it; +pin keeps 122's PTX conversion where the codes load (code_convert.py),
+asm converts 8-bit codes by PTX, +rN caps 133's registers per thread at N). 131 (`decode_scaled.py`) reads
V rows, 131k keys-contiguous
V; formats it does not serve are skipped for it.
Format bf16 times solver 120 (`decode.py`, the bf16 cache itself) with the configs that
120/ leads (the others are skipped for it)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode as dec  # noqa: E402
from nnprim.attention import decode_quant, decode_scaled, decode_swap, gluon_decode_quant  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import KVQuant, quantize_kv  # noqa: E402
from nnprim.search import explain  # noqa: E402
from nnprim.search.solver import REGISTRY  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

PROBLEMS = {"decode_b64_k8k": (64, 8192), "decode_b8_k32k": (8, 32768)}


def quant(x: torch.Tensor, spec: str, role: str | None) -> KVQuant:
    fmt, _, g = spec.partition(":")
    if fmt == "bf16":
        return x
    if fmt == "fp8":
        return quantize_kv(x, "fp8_e4m3", scale_per="head", order="keys" if role == "v" else None)
    if g == "head":
        return quantize_kv(x, fmt, scale_per="head", scale_dtype=torch.bfloat16, order="keys" if role == "v" else None)
    return quantize_kv(x, fmt, group_size=int(g), scale_dtype=torch.bfloat16, order="keys" if role == "v" else None)


def nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    n = t.data.numel() * t.data.element_size() + t.scales.numel() * t.scales.element_size()
    return n + (0 if t.zero_points is None else t.zero_points.numel() * t.zero_points.element_size())


def dequant(t) -> torch.Tensor:
    return t.float() if isinstance(t, torch.Tensor) else t.dequantize(torch.float32)


def reference(q, k, v, nb: int = 2) -> torch.Tensor:
    kd, vd = dequant(k)[:nb], dequant(v)[:nb]
    G = q.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    return torch.softmax(q[:nb].float() @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ vd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="s4:64,s8:64,s4:head,s8:head,fp8:head")
    ap.add_argument("--configs", default="128x4x3,64x4x3,64x4x4,128x8x3,128x8x4,64x8x3,256x8x3,128x4x3:2,64x4x3:2")
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, small shapes (checks the script)")
    a = ap.parse_args()
    dev = "cpu" if a.smoke else "cuda"
    problems = {"smoke": (2, 300)} if a.smoke else PROBLEMS
    res = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", rows=[])
    t0 = time.time()
    for name in (list(problems) if a.smoke else a.problems.split(",")):
        B, Sk = problems[name]
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)

        def cudnn(q=q, k=k, v=v):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            if q.device.type == "cpu":
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for spec in a.formats.split(","):
            kq, vq = quant(k, spec, None), quant(v, spec, "v")
            vr = quant(v, spec, None)
            ref = reference(q, kq, vq)
            plain = spec.startswith("bf16")
            sig = (lambda t: None) if plain else (lambda t: t.signature())
            p = AttentionProblem(direction="fwd", device=dev, B=B, Hq=32, Hkv=8, Sq=1, Sk=Sk, D=128, Dv=128,
                                 dtype=torch.bfloat16, k_quant=sig(kq), v_quant=sig(vq))
            args = AttnArgs(q=q, k=kq, v=vq)
            base_mod = dec if plain else decode_swap
            base_splits = base_mod.choose_splits(p, base_mod.default_config(p))
            fns, labels, errs, chosen = [cudnn], ["cudnn_bf16"], {}, {}
            for c in a.configs.split(","):
                sid, _, rest = c.rpartition("/")
                if plain != (sid == "120"):
                    continue
                mod = {"122": decode_quant, "120": dec, "131": decode_scaled, "131k": decode_scaled,
                       "133": gluon_decode_quant}.get(sid, decode_swap)
                p_rows = p if plain else replace(p, v_quant=vr.signature())    # V stored as rows
                if sid.startswith(("131", "133")) and REGISTRY.get(int(sid[:3])).not_supported_reasons(p_rows):
                    continue
                rest, *flags = rest.split("+")
                tiles, _, fac = rest.partition(":")
                bn, w, st = (int(x) for x in tiles.split("x"))
                rows = sid in ("122", "131", "131k", "133")     # these read V rows
                a_, pp = (AttnArgs(q=q, k=kq, v=vr), p_rows) if rows else (args, p)
                cfg = replace(mod.default_config(pp), block_n=bn, num_warps=w, num_stages=st)
                regs = [int(f[1:]) for f in flags if f.startswith("r")]
                if regs:     # 133: a register cap (+r168)
                    cfg = replace(cfg, maxnreg=regs[0])
                elif flags:
                    cfg = replace(cfg, pin_convert="pin" in flags, asm_convert=True if "asm" in flags else None)
                n_split = int(fac[1:]) if fac.startswith("=") else round(mod.choose_splits(pp, cfg) * float(fac or 1))
                cfg = replace(cfg, splits=max(1, n_split))
                try:
                    planned = mod.plan(pp, a_, cfg)
                    out = torch.full((B, 32, 1, 128), float("nan"), device=dev, dtype=torch.bfloat16)
                    dec.run_planned(pp, a_, planned, out)
                    errs[c] = float((out[:2].float() - ref).norm() / ref.norm())
                    fns.append(lambda planned=planned, a_=a_, pp=pp: dec.run_planned(pp, a_, planned))
                    labels.append(f"{sid or 128}:{rest}:s{cfg.splits}" + "".join("+" + f for f in flags))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded
                    errs[c] = f"{type(e).__name__}: {str(e)[:160]}"
            for sv, vv in ((None, vq),) if plain else ((122, vr), (None, vq), (None, vr)):
                f = (lambda vv=vv, sv=sv, q=q, kq=kq: nnprim.sdpa(q, kq, vv, solver=sv or None))
                try:
                    o = f()
                    for _ in range(10):
                        f()
                    lab = f"{sv or 'api'}:{'rows' if vv is vr else 'keys'}"
                    errs[lab] = float((o[:2].float() - ref).norm() / ref.norm())
                    if sv is None:   # what find chose for the public call, and the times it measured
                        pa = AttentionProblem.from_tensors(q, kq, vv)
                        chosen[lab] = dict(decision=explain.decision(pa), find_ms={
                            r.name: r.measured_ms for r in explain.rows(pa) if r.measured_ms is not None})
                    fns.append(f)
                    labels.append(lab)
                except Exception as e:  # noqa: BLE001
                    errs[str(sv)] = f"{type(e).__name__}: {str(e)[:160]}"
            samples = interleaved_samples(fns, dev, rounds=a.rounds, warmup=10)
            ms = {lab: statistics.median(s) for lab, s in zip(labels, samples)}
            kvb = nbytes(kq) + nbytes(vq)
            row = dict(problem=name, format=spec, base_splits=base_splits, kv_bytes=kvb, errors=errs, api=chosen,
                       ms={k2: round(v2, 4) for k2, v2 in ms.items()},
                       x_cudnn={k2: round(ms["cudnn_bf16"] / v2, 3) for k2, v2 in ms.items()},
                       tb_s={k2: round(kvb / v2 / 1e9, 2) for k2, v2 in ms.items()})
            res["rows"].append(row)
            best = min((v2, k2) for k2, v2 in ms.items() if k2 != "cudnn_bf16")
            print(f"{name} {spec}: cudnn {ms['cudnn_bf16']:.4f} best {best[1]} {best[0]:.4f} "
                  f"({ms['cudnn_bf16'] / best[0]:.2f}x) " + " ".join(f"{k2}={v2:.4f}" for k2, v2 in ms.items()),
                  flush=True)
            for lab, c in chosen.items():
                print(f"  {lab}: {c['decision']}; find " + " ".join(f"{k2}={v2:.4f}" for k2, v2 in c["find_ms"].items()))
            json.dump(res, open(a.out, "w"), indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
