"""A problem's first call made inside CUDA-graph capture (its kernels compile and load
there when the process's caches are empty), replayed and checked against float64:
    python3 -m nnprim.testing.capture_first_call CASE
CASE conv | sdpa | decode (kv_lens: its value checks must not read the device there).
Prints one line `RESULT {json}`. Run by
tests/gpu/test_integration_gpu.py and benchmarks/diag/capture_first_call.py in fresh
processes with empty TRITON_CACHE_DIR and NNPRIM_CACHE_DIR."""
from __future__ import annotations

import json
import sys
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import nnprim


def _case(case: str) -> tuple[Callable, Callable]:
    """(the nnprim call, its float64 reference)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    if case == "conv":
        x = rnd(8, 48, 13, 13).contiguous(memory_format=torch.channels_last)
        w = (rnd(48, 48, 3, 3) / 20).contiguous(memory_format=torch.channels_last)
        b = rnd(48)
        return (lambda: nnprim.conv_forward(x, w, b, padding=1),
                lambda: F.conv2d(x.double(), w.double(), b.double(), padding=1))
    if case == "sdpa":
        q, k, v = rnd(2, 8, 333, 64), rnd(2, 2, 333, 64), rnd(2, 2, 333, 64)
        return (lambda: nnprim.sdpa(q, k, v, causal="top_left"),
                lambda: F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                                       v.double().repeat_interleave(4, 1), is_causal=True))
    if case == "decode":
        q, k, v = rnd(4, 32, 1, 128), rnd(4, 8, 4096, 128), rnd(4, 8, 4096, 128)
        lens = torch.tensor([4096, 17, 1000, 2048], device="cuda", dtype=torch.int32)

        def ref():
            return torch.cat([F.scaled_dot_product_attention(
                q[i:i + 1].double(), k[i:i + 1, :, :n].double().repeat_interleave(4, 1),
                v[i:i + 1, :, :n].double().repeat_interleave(4, 1)) for i, n in enumerate(lens.tolist())])
        return lambda: nnprim.sdpa(q, k, v, kv_lens=lens), ref
    raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    case = sys.argv[1]
    fn, ref = _case(case)
    graph = torch.cuda.CUDAGraph()
    res: dict = {"case": case}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.cuda.graph(graph):
                y = fn()
            graph.replay()
            torch.cuda.synchronize()
            r = ref()
            res.update(ok=True, rel_err=float((y.double() - r).norm() / r.norm()))
        except Exception as e:  # capture_end's error hides the one raised during capture
            res.update(ok=False, error=f"{type(e).__name__}: {e}"[:400],
                       during=repr(e.__context__)[:400] if e.__context__ else None,
                       tb=traceback.format_exc()[-1500:])
    res["warned"] = [str(c.message)[:160] for c in caught if "capture" in str(c.message)]
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
