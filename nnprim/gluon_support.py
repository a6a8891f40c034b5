"""What the Gluon (Hopper) solvers share: Gluon's import, their applicability gate, the
unvalidated host TMA descriptor and the TMA bulk reduce-add (`tma_reduce_add`, which Gluon
3.6 does not wrap; None where this Triton's builder lacks it). The solvers: 126 `gluon_flash_fwd` (attention/gluon_fwd.py),
127 / 129 `gluon_flash_bwd(_ordered)` (attention/gluon_bwd.py), 130 / 132 `gluon_flash_bwd_d256(_ordered)`
(attention/gluon_bwd_d256.py) and 27 `gluon_implicit_gemm_fwd` (conv/gluon_conv.py).

They are on by default since the whole GPU test suite passed with 126 and 27 on an H200
(2026-12-01: 281 + 121 tests, results/gpu_tests_gluon_2026-12-01_*.log), and 127's module
after it (42 passed, results/gpu_tests_gluon_bwd_2026-12-01.log). `NNPRIM_GLUON=0`
switches them off (read on every applicability check): find then never times them and the
find-db records of them are skipped, so the Triton solvers take their problems."""
from __future__ import annotations

import functools
import os

import torch

from .launch import interpreting

GLUON_ENV = "NNPRIM_GLUON"

try:  # Gluon ships with triton >= 3.5; without it the Gluon solvers are not applicable
    from triton._C.libtriton import ir as _ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @_builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA bulk reduce-add (cp.reduce.async.bulk.tensor .add): global[box at coord] +=
        the shared-memory tile src (the descriptor's block shape and layout). Gluon 3.6 has no
        wrapper for it; this builds the same op as its TMA store, through the builder's
        binding of `ttng.async_tma_reduce`. Tracked like a TMA store (`tma.store_wait`)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
    GLUON_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any import failure makes the solvers not applicable
    gluon = gl = async_copy = mma_v2 = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = tma_reduce_add = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"


def gluon_reasons(device: str) -> list[str]:
    """Why a Gluon Hopper kernel cannot run on `device`: Gluon missing, switched off
    (NNPRIM_GLUON=0), the interpreter, no GPU of capability 9.x."""
    if GLUON_ERROR is not None:
        return [f"not applicable: Gluon cannot be imported ({GLUON_ERROR})"]
    if os.environ.get(GLUON_ENV, "1") == "0":
        return [f"not applicable: the Gluon solvers are switched off ({GLUON_ENV}=0)"]
    if interpreting():
        return ["not applicable under TRITON_INTERPRET=1 (Gluon kernels do not run in the interpreter)"]
    if device != "cuda" or not torch.cuda.is_available():
        return [f"not applicable on device {device}: needs a CUDA GPU of capability 9.x (Hopper)"]
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return [f"not applicable on capability {cap[0]}.{cap[1]}: the kernel uses Hopper's wgmma (9.x)"]
    return []


def host_descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int], layout):
    """A Gluon host TMA descriptor whose shape, strides, block and alignment the caller has
    checked (TensorDescriptor's __post_init__ validation costs ~5 us per call)."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = t, shape, strides, block, layout, "zero"
    return d


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a fresh contiguous copy when t is not contiguous or its base is not 16-byte
    aligned (what a TMA descriptor needs; `contiguous()` would keep an odd offset)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.cache
def sm_count(index: int | None) -> int:
    """SMs of CUDA device `index`: the persistent grids' size. None: compile-only runs on CPU
    tensors (testing/compile_check.py), which plan for an H200's 132."""
    if index is None:
        return 132
    return torch.cuda.get_device_properties(index).multi_processor_count
