"""Where sdpa's forward + backward through autograd spends its host time on the GPU machine.
2026-12-04 (H200, B4 H16 S512 D64 bf16 causal): the public forward cost 37 us of host and
sdpa_backward called directly 146 us, but forward + backward through autograd 592 us (torch's
own SDPA through autograd 287 us); cProfile of the main thread shows run_backward as one
opaque call, because CUDA backwards run on autograd's device thread. This measures each
part, then the same backward with autograd's multithreading off (backward in the calling
thread: what the device thread costs, and a cProfile that sees our backward).

    NNPRIM_CACHE_DIR=$(mktemp -d) python benchmarks/diag/attn_autograd_host.py [--out F]"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from host_clock import host_us, profile_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    q, k, v = (torch.randn(4, 16, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = nnprim.sdpa(q, k, v, causal="top_left", return_lse=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def ours():
        nnprim.sdpa(qg, kg, vg, causal="top_left").backward(do)

    def torchs():
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

    kept = nnprim.sdpa(qg, kg, vg, causal="top_left")
    row = {
        "fwd_nograd": host_us(lambda: nnprim.sdpa(q, k, v, causal="top_left")),
        "fwd_autograd_apply": host_us(lambda: nnprim.sdpa(qg, kg, vg, causal="top_left")),
        "bwd_direct": host_us(lambda: nnprim.sdpa_backward(do, q, k, v, o, lse, causal="top_left")),
        "backward_only": host_us(lambda: kept.backward(do, retain_graph=True)),
        "fwd_bwd_autograd": host_us(ours),
        "torch_fwd_bwd_autograd": host_us(torchs),
    }
    torch.autograd.set_multithreading_enabled(False)
    try:
        row["backward_only_calling_thread"] = host_us(lambda: kept.backward(do, retain_graph=True))
        row["fwd_bwd_autograd_calling_thread"] = host_us(ours)
        row["torch_fwd_bwd_calling_thread"] = host_us(torchs)
        prof = profile_text(ours)
    finally:
        torch.autograd.set_multithreading_enabled(True)
    print(json.dumps(row), flush=True)
    print(prof[:6000])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(row, profile=prof), f, indent=1)


if __name__ == "__main__":
    main()
