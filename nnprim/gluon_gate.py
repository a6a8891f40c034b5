"""Whether the Gluon (Hopper) solvers may run here: solver 126 `gluon_flash_fwd` and
solver 27 `gluon_implicit_gemm_fwd`.

They are opt-in, `NNPRIM_GLUON=1` (read on every applicability check, so a test or a
process can switch them), until the whole GPU test suite has passed with them on an H200:
on 2026-12-01 their own correctness runs passed (bf16 ping-pong attention at d64/d128, the
conv probe), but the last full tests/gpu run timed out with 4 failures it did not name.
Without the switch find never times them and the find-db records of them are skipped."""
from __future__ import annotations

import os

import torch

from .launch import interpreting

GLUON_ENV = "NNPRIM_GLUON"


def gluon_reasons(device: str, import_error: str | None) -> list[str]:
    """Why a Gluon Hopper kernel cannot run on `device`: Gluon missing (`import_error`),
    the opt-in switch off, the interpreter, no GPU of capability 9.x."""
    if import_error is not None:
        return [f"not applicable: Gluon cannot be imported ({import_error})"]
    if os.environ.get(GLUON_ENV, "0") != "1":
        return [f"not applicable: the Gluon solvers are opt-in ({GLUON_ENV}=1) until the GPU suite passes with them"]
    if interpreting():
        return ["not applicable under TRITON_INTERPRET=1 (Gluon kernels do not run in the interpreter)"]
    if device != "cuda" or not torch.cuda.is_available():
        return [f"not applicable on device {device}: needs a CUDA GPU of capability 9.x (Hopper)"]
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return [f"not applicable on capability {cap[0]}.{cap[1]}: the kernel uses Hopper's wgmma (9.x)"]
    return []
