"""How the paged key loop of the bf16 decode kernel (solver 120) compiles for sm_90 on a machine
without a GPU: per page size, the in-loop loads that went into the cp.async ring
(TTGIR `async_copy_global_to_local`), the synchronous loads left (`tt.load`), and the SASS
length of the main loop, next to the contiguous cache (page 0).

Usage: TRITON_INTERPRET=0 python benchmarks/diag/paged_ir.py [--pages 0,16,64,128,256] [--block-n 128]
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nnprim.testing.compile_check import install_compile_only  # noqa: E402

install_compile_only()
import torch  # noqa: E402

from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sass_count import loop_body  # noqa: E402


def compile_one(page: int, block_n: int, stages: int):
    B, Hq, Hkv, Sk, D = 2, 32, 8, 4096, 128
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16)
    if page:
        n = B * Sk // page
        k = torch.randn(n, Hkv, page, D, dtype=torch.bfloat16)
        bt = torch.arange(n, dtype=torch.int32).reshape(B, -1)
        lens = torch.full((B,), Sk, dtype=torch.int32)
    else:
        k, bt, lens = torch.randn(B, Hkv, Sk, D, dtype=torch.bfloat16), None, None
    p = AttentionProblem(direction="fwd", device="cuda", B=B, Hq=Hq, Hkv=Hkv, Sq=1, Sk=Sk, D=D, Dv=D,
                         dtype=torch.bfloat16, page_size=page, has_kv_lens=bool(page))
    args = AttnArgs(q=q, k=k, v=k, block_table=bt, kv_lens=lens)
    cfg = replace(decode.default_config(p), block_n=block_n, num_stages=stages, splits=2)
    kern = decode._decode_fwd_kernel
    before = {id(ck) for c in kern.device_caches.values() for ck in c[0].values()}
    main = decode.plan(p, args, cfg)[0]
    main(q, k, k, q, q, q, q, q, lens if page else q, q, q, q, q, q, bt if page else q)
    return [ck for c in kern.device_caches.values() for ck in c[0].values() if id(ck) not in before][-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="0,16,64,128,256")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--stages", type=int, default=3)
    a = ap.parse_args()
    for page in (int(x) for x in a.pages.split(",")):
        ck = compile_one(page, a.block_n, a.stages)
        ir = ck.asm["ttgir"]
        loop = ir[ir.find("scf.for"):]
        print(f"page {page:4d}: async copies {loop.count('async_copy_global_to_local')}, "
              f"sync loads {len(re.findall(r'tt.load ', loop))}, loop SASS {len(loop_body(ck.asm['cubin']))}, "
              f"smem {ck.metadata.shared}", flush=True)


if __name__ == "__main__":
    main()
