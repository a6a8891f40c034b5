"""First calls: the Triton kernels take image and sequence sizes as runtime arguments that
Triton does not specialise (no recompile per shape). The interpreter (CI) drops jit options,
so the decorators are read from the source."""
import ast
import inspect

import pytest

from nnprim.attention import decode, decode_quant, flash_bwd, flash_bwd_atomic, flash_fwd
from nnprim.conv import implicit_gemm, implicit_gemm_bwd

SHAPE_ARGS = [
    (implicit_gemm, "_conv_fwd_kernel", ("M", "H", "W", "OH", "OW")),
    (implicit_gemm, "_gemm_tma_kernel", ("M",)),
    (implicit_gemm, "_conv_tma_kernel", ("NSL", "OH", "OW")),
    (implicit_gemm, "_conv_bwd_data_kernel", ("M", "H", "W", "OH", "OW", "QH", "QW")),
    (implicit_gemm_bwd, "_conv_bwd_w_kernel", ("PT", "H", "W", "OH", "OW")),
    (implicit_gemm_bwd, "_conv_bwd_w_tma_kernel", ("NT", "OH", "OW")),
    (flash_fwd, "_flash_fwd_kernel", ("Hq", "Sq", "Sk", "seed", "offset")),
    (decode, "_decode_fwd_kernel", ("Hq", "Hkv", "Sk", "SPLITS", "seed", "offset")),
    (decode_quant, "_decode_quant_kernel", ("Hq", "Hkv", "Sk", "SPLITS", "seed", "offset")),
    (decode, "_decode_combine_kernel", ("n_rows", "Hq", "Sq", "SPLITS")),
    # backward: head counts and the dropout RNG state (a fresh seed every step: 1 in 16 is
    # divisible by 16, which Triton would otherwise compile a variant for)
    (flash_bwd, "_flash_bwd_dkdv_kernel", ("Hq", "Hkv", "seed", "offset")),
    (flash_bwd, "_flash_bwd_dq_kernel", ("Hq", "seed", "offset")),
    (flash_bwd, "_flash_bwd_dkdv_split_kernel", ("Hq", "Hkv", "seed", "offset")),
    (flash_bwd, "_flash_bwd_dq_split_kernel", ("Hq", "seed", "offset")),
    (flash_bwd_atomic, "_bwd_kernel", ("Hq", "Hkv", "seed", "offset")),
]


@pytest.mark.parametrize("module,name,sizes", SHAPE_ARGS, ids=[n for _, n, _ in SHAPE_ARGS])
def test_shape_sizes_are_not_specialised(module, name, sizes):
    tree = ast.parse(inspect.getsource(module))
    fn = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name)
    args = {a.arg: a for a in fn.args.args}
    dns = set()
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call):
            for kw in dec.keywords:
                if kw.arg == "do_not_specialize":
                    dns |= {e.value for e in kw.value.elts}
    assert set(sizes) <= dns, (name, dns)
    for s in sizes:
        assert s in args and args[s].annotation is None, (name, s)  # a runtime int, not a tl.constexpr
