"""What autograd itself costs around sdpa's backward: host us of the backward called directly,
through SdpaFunction.backward with a stand-in ctx, through torch.autograd.grad (no gradient
accumulation) and .backward (accumulating into .grad), against a trivial autograd.Function of the
same arity (the engine and Python Function overhead alone, with and without materialised zero
gradients for the unused lse output).

    NNPRIM_CACHE_DIR=$(mktemp -d) python benchmarks/diag/autograd_parts.py [--device cuda] [--out F]"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402
import nnprim.ops.attention as attn_ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from host_clock import host_us, profile_text  # noqa: E402


def _trivial(materialize: bool):
    class Trivial(torch.autograd.Function):
        """sdpa's arity (q, k, v in; o, lse out; three gradients) with no work."""

        @staticmethod
        def forward(ctx, q, k, v):
            ctx.set_materialize_grads(materialize)
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)
            ctx.mark_non_differentiable(lse)
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q), lse

        @staticmethod
        def backward(ctx, do, dlse):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return Trivial


class _Ctx:
    """What SdpaFunction.backward reads from its ctx."""

    def __init__(self, saved, options, key):
        self.saved_tensors = saved
        self.options = options
        self.key = key


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfiles (calling thread) into --out")
    a = ap.parse_args()
    dev = torch.device(a.device)
    shape = (4, 16, 512, 64) if dev.type == "cuda" else (1, 2, 64, 32)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v = (torch.randn(shape, device=dev, dtype=dt) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = nnprim.sdpa(q, k, v, causal="top_left", return_lse=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    kept = nnprim.sdpa(qg, kg, vg, causal="top_left")
    kept.backward(do, retain_graph=True)          # the backward's find, .grad allocated
    opts = kept.grad_fn.options
    ctx = _Ctx((q, k, v, o, lse, None, None, None), opts, kept.grad_fn.key)
    row = {
        "bwd_direct": host_us(lambda: attn_ops._sdpa_backward(do, q, k, v, o, lse, None, None, None, *opts, None)),
        "function_backward_direct": host_us(lambda: attn_ops.SdpaFunction.backward(ctx, do, None)),
        "autograd_grad": host_us(lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True)),
        "backward_accumulate": host_us(lambda: kept.backward(do, retain_graph=True)),
        "fwd_nograd": host_us(lambda: nnprim.sdpa(q, k, v, causal="top_left")),
        "fwd_apply": host_us(lambda: nnprim.sdpa(qg, kg, vg, causal="top_left")),
        "fwd_bwd_grad": host_us(lambda: torch.autograd.grad(nnprim.sdpa(qg, kg, vg, causal="top_left"),
                                                            (qg, kg, vg), do)),
    }
    kept_torch = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    row["torch_fwd_apply"] = host_us(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True))
    row["torch_grad"] = host_us(lambda: torch.autograd.grad(kept_torch, (qg, kg, vg), do, retain_graph=True))
    row["torch_fwd_bwd_grad"] = host_us(lambda: torch.autograd.grad(
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), do))
    for materialize in (True, False):
        fn = _trivial(materialize)
        kept_t = fn.apply(qg, kg, vg)[0]
        tag = "materialized" if materialize else "unmaterialized"
        row[f"trivial_fwd_{tag}"] = host_us(lambda fn=fn: fn.apply(qg, kg, vg))
        row[f"trivial_grad_{tag}"] = host_us(lambda t=kept_t: torch.autograd.grad(t, (qg, kg, vg), do,
                                                                          retain_graph=True))
        row[f"trivial_fwd_bwd_{tag}"] = host_us(lambda fn=fn: torch.autograd.grad(fn.apply(qg, kg, vg)[0],
                                                                            (qg, kg, vg), do))
    torch.autograd.set_multithreading_enabled(False)
    try:
        row["autograd_grad_calling_thread"] = host_us(
            lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True))
        row["trivial_grad_calling_thread"] = host_us(
            lambda: torch.autograd.grad(kept_t, (qg, kg, vg), do, retain_graph=True))
        row["fwd_bwd_grad_calling_thread"] = host_us(lambda: torch.autograd.grad(
            nnprim.sdpa(qg, kg, vg, causal="top_left"), (qg, kg, vg), do))
        row["torch_grad_calling_thread"] = host_us(
            lambda: torch.autograd.grad(kept_torch, (qg, kg, vg), do, retain_graph=True))
        if a.profile:
            profiles = {
                "function_backward_direct": profile_text(
                    lambda: attn_ops.SdpaFunction.backward(ctx, do, None), 300, 30, "cumulative"),
                "autograd_grad": profile_text(lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True),
                                              300, 30, "cumulative"),
                "fwd_nograd": profile_text(lambda: nnprim.sdpa(q, k, v, causal="top_left"), 300, 30, "cumulative"),
                "fwd_apply": profile_text(lambda: nnprim.sdpa(qg, kg, vg, causal="top_left"), 300, 30, "cumulative"),
                "fwd_bwd_grad": profile_text(lambda: torch.autograd.grad(
                    nnprim.sdpa(qg, kg, vg, causal="top_left"), (qg, kg, vg), do), 300, 40, "cumulative"),
            }
    finally:
        torch.autograd.set_multithreading_enabled(True)
    print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(row, profiles=profiles) if a.profile else row, f, indent=1)


if __name__ == "__main__":
    main()
