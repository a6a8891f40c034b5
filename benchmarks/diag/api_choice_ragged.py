"""Which solver the public call runs on a ragged-batch decode (b8 x 32k, s4 g64, contiguous and
16-key pages, kv_lens uniform in [1, Sk]) with an empty user cache, why (nnprim.explain after
the first call), and its time against solvers 133 and 128 forced, interleaved.

Usage: NNPRIM_CACHE_DIR=$(mktemp -d) python benchmarks/diag/api_choice_ragged.py"""
from __future__ import annotations

import os
import statistics
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import quantize_kv  # noqa: E402
from nnprim.search.timing import interleaved_samples  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from paged_q4_probe import paginate  # noqa: E402


def ragged_inputs(dev: str = "cuda", B: int = 8, Sk: int = 32768):
    """(q, k, v bf16, s4 g64 k and v, kv_lens uniform in [1, Sk]) of the ragged b8 x 32k decode."""
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, 8, Sk, 128, device=dev, dtype=torch.bfloat16, generator=g)
    kq = quantize_kv(k, "s4", group_size=64, scale_dtype=torch.bfloat16)
    vq = quantize_kv(v, "s4", group_size=64, scale_dtype=torch.bfloat16)
    lens = torch.randint(1, Sk + 1, (B,), generator=torch.Generator().manual_seed(1)).to(torch.int32).to(dev)
    return q, k, v, kq, vq, lens


def main() -> None:
    q, _, _, kq, vq, lens = ragged_inputs()
    for page in (0, 16):
        kk, vv, bt = (kq, vq, None) if page == 0 else paginate(kq, vq, page)
        kw = dict(kv_lens=lens) if page == 0 else dict(kv_lens=lens, block_table=bt)
        nnprim.sdpa(q, kk, vv, **kw)
        torch.cuda.synchronize()
        p = AttentionProblem.from_tensors(q, kk, vv, kv_lens=lens, block_table=bt)
        print(nnprim.explain(p, file=None).splitlines()[-1], flush=True)
        fns = {"api": partial(nnprim.sdpa, q, kk, vv, **kw),
               "133": partial(nnprim.sdpa, q, kk, vv, solver="gluon_decode_q4", **kw),
               "128": partial(nnprim.sdpa, q, kk, vv, solver="decode_swap_ab_quant", **kw)}
        s = interleaved_samples(list(fns.values()), "cuda", rounds=15, warmup=3)
        print(f"p{page}", {lab: round(statistics.median(x), 4) for lab, x in zip(fns, s)}, flush=True)


if __name__ == "__main__":
    main()
