"""Why chunked prefill over 16-key pages is slow (issue 14): the flash forward (solver 110) on
B 2 x Sq 2k over a 16k cache (Hq 32, Hkv 8, D 128, bf16, causal bottom-right) through its plan,
per tile config, on the contiguous cache (TMA and pointer loads) and on pools of 16- and
64-key pages, interleaved; the config each plan ended with (shrunk where shared memory ran
out). Also the suite's Sq 4 decode (b16 x 16k, causal) of solver 120 at several split counts
next to cuDNN: the split model's choice there was not measured.

Usage: python benchmarks/diag/paged_prefill_probe.py --out /tmp/probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402
from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import configs, decode, flash_fwd  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from paged import paginate  # noqa: E402  (benchmarks/paged.py: pages shuffled in a pool with spares)

DEV = "cuda"


def med(fns, labels, rounds=20):
    s = interleaved_samples(fns, DEV, rounds=rounds, warmup=3)
    return {lab: round(statistics.median(x), 4) for lab, x in zip(labels, s)}


def qkv(B: int, Sq: int, Sk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 q (B, 32, Sq, 128), k and v (B, 8, Sk, 128)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(B, h, s, 128, device=DEV, dtype=torch.bfloat16, generator=g)
                 for h, s in ((32, Sq), (8, Sk), (8, Sk)))


def prefill(res: dict) -> None:
    B, Sk = 2, 16384
    q, k, v = qkv(B, 2048, Sk, 0)
    lens = torch.full((B,), Sk, dtype=torch.int32, device=DEV)
    ref = nnprim.sdpa(q, k, v, causal="bottom_right", kv_lens=lens, solver="flash_fwd")
    fns, labels, cfgs, errs = [], [], {}, {}
    tiles = [configs.TileConfig(*t) for t in ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 3),
                                               (128, 32, 8, 3), (64, 16, 4, 3), (128, 64, 8, 2), (64, 64, 4, 4))]
    for page in (0, 16, 64):
        kp, vp, bt = paginate(k, v, page) if page else (k, v, None)
        p = AttentionProblem.from_tensors(q, kp, vp, causal="bottom_right", kv_lens=lens, block_table=bt)
        args = AttnArgs(q=q, k=kp, v=vp, kv_lens=lens, block_table=bt)
        res.setdefault("default_cfg", {})[str(page)] = str(configs.choose(p)[0])
        for t in tiles if page != 64 else tiles[:2]:
            plan = flash_fwd.ForwardPlan(p, t)
            lab = f"p{page}:{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}"
            try:
                o = plan(args)
                o = o[0] if isinstance(o, tuple) else o
                errs[lab] = float((o.float() - ref.float()).abs().max())
                cfgs[lab] = str(plan.cfg)
                fns.append(lambda plan=plan, a=args: plan(a))
                labels.append(lab)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded
                errs[lab] = f"{type(e).__name__}: {str(e)[:160]}"
        if page == 0:
            for t in tiles[:2]:
                lab = f"p0_ptr:{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}"
                fns.append(lambda t=t, a=args, p=p: flash_fwd.flash_forward(p, a, t, use_tma=False))
                labels.append(lab)
        fns.append(lambda kp=kp, vp=vp, bt=bt: nnprim.sdpa(q, kp, vp, causal="bottom_right", kv_lens=lens,
                                                          block_table=bt))
        labels.append(f"p{page}:api")
    res["prefill"] = dict(ms=med(fns, labels), errors=errs, final_cfg=cfgs)
    print(json.dumps(res["prefill"]["ms"]), flush=True)


def decode_q4(res: dict) -> None:
    Sq, Sk = 4, 16384
    q, k, v = qkv(16, Sq, Sk, 1)
    p = AttentionProblem.from_tensors(q, k, v, causal="bottom_right")
    args = AttnArgs(q=q, k=k, v=v)
    base = decode.default_config(p)
    fns, labels = [], []
    for s in (1, 2, 3, 4, 5, 8):
        planned = decode.plan(p, args, replace(base, splits=s))
        fns.append(lambda planned=planned: decode.run_planned(p, args, planned))
        labels.append(f"120:s{s}")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(Sq, Sk)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    fns += [cudnn, lambda: nnprim.sdpa(q, k, v, causal="bottom_right")]
    labels += ["cudnn", "api"]
    res["decode_b16_q4_k16k"] = dict(model_splits=decode.choose_splits(p, base), ms=med(fns, labels, 60))
    print(json.dumps(res["decode_b16_q4_k16k"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res: dict = dict(gpu=torch.cuda.get_device_name())
    decode_q4(res)
    json.dump(res, open(a.out, "w"), indent=1)
    prefill(res)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
