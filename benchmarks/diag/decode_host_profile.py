"""Host time of a quantized decode's public call (b8 x 32k, s4 g64, ragged kv_lens;
contiguous and 16-key pages): microseconds per call issued back to back without syncs
(the GPU runs behind), the forced solver's, and where the time goes (cProfile, top
functions by own time).

Usage: NNPRIM_CACHE_DIR=$(mktemp -d) python benchmarks/diag/decode_host_profile.py [--out F]"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nnprim  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from api_choice_ragged import ragged_inputs  # noqa: E402
from host_clock import host_us, profile_text  # noqa: E402
from paged_q4_probe import paginate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    q, k, v, kq, vq, lens = ragged_inputs()
    rows = []
    for page in (0, 16):
        kk, vv, bt = (kq, vq, None) if page == 0 else paginate(kq, vq, page)
        kw = dict(kv_lens=lens) if page == 0 else dict(kv_lens=lens, block_table=bt)
        fns = {"api": partial(nnprim.sdpa, q, kk, vv, **kw),
               "api_133": partial(nnprim.sdpa, q, kk, vv, solver="gluon_decode_q4", **kw),
               "bf16_api": partial(nnprim.sdpa, q, k, v, kv_lens=lens) if page == 0 else None,
               "torch_sdpa_bf16": partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                          enable_gqa=True) if page == 0 else None}
        row = {"page": page}
        for lab, fn in fns.items():
            if fn is not None:
                fn()
                row[lab] = host_us(fn, calls=300)
        row["profile"] = profile_text(fns["api"], calls=300, top=22)[-6000:]
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        print(row["profile"][-4500:], flush=True)
        rows.append(row)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
