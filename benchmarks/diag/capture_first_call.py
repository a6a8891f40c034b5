"""A problem's first call made inside CUDA-graph capture, in a fresh process with empty
Triton and nnprim caches (so its kernels compile and load inside the capture). Prints one
JSON line per case:
    python3 benchmarks/diag/capture_first_call.py [--out F]"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cases", default="conv,sdpa,decode")
    a = ap.parse_args()
    rows = []
    for case in a.cases.split(","):
        with tempfile.TemporaryDirectory() as tc, tempfile.TemporaryDirectory() as nc:
            env = dict(os.environ, TRITON_CACHE_DIR=tc, NNPRIM_CACHE_DIR=nc)
            r = subprocess.run([sys.executable, "-m", "nnprim.testing.capture_first_call", case],
                               env=env, capture_output=True, text=True, timeout=300)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        row = json.loads(line[0][7:]) if line else {"case": case, "ok": False,
                                                    "error": f"rc {r.returncode}: {r.stderr[-800:]}"}
        print(json.dumps({k: v for k, v in row.items() if k != "tb"}), flush=True)
        rows.append(row)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
