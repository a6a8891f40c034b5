"""GPU fuzz of issue 11 (nnprim.testing.fuzz): a few hundred random valid problems plus the
huge and degenerate ones, every applicable solver forced in turn through the public API and
the default call, each result checked against float64; a CUDA fault stops the run.

Selection by environment: NNPRIM_FUZZ_SUBSET = all (default) | small | huge | sanitizer,
NNPRIM_FUZZ_SHARD = "i/n", NNPRIM_FUZZ_COUNT (random problems, default 300),
NNPRIM_FUZZ_DEADLINE (epoch seconds: later cases are skipped), NNPRIM_FUZZ_LOG (JSON lines,
one per case). `bash benchmarks/fuzz_gpu.sh OUT` runs the whole thing on an H200: the
plain fuzz over parallel shards, then the sanitizer subset under compute-sanitizer."""
from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the GPU fuzz needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 (tests/conftest.py's default): run with TRITON_INTERPRET=0, "
                "as benchmarks/fuzz_gpu.sh does", allow_module_level=True)

from nnprim.testing import fuzz  # noqa: E402

_count = os.environ.get("NNPRIM_FUZZ_COUNT")
CASES = fuzz.shard(fuzz.suite("gpu", os.environ.get("NNPRIM_FUZZ_SUBSET", "all"),
                              count=int(_count) if _count else None),
                   os.environ.get("NNPRIM_FUZZ_SHARD"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fuzz(case: fuzz.Case) -> None:
    deadline = os.environ.get("NNPRIM_FUZZ_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("past NNPRIM_FUZZ_DEADLINE (time budget)")
    r = fuzz.run_case(case, "cuda")
    fuzz.write_record(r, os.environ.get("NNPRIM_FUZZ_LOG"))
    print(r.report())
    if r.fatal:
        pytest.exit(f"CUDA fault (context lost) in {case.name}:\n{r.report()}", returncode=3)
    assert not r.failures, r.report()
