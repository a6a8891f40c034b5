"""Import every solver module so that its solvers register (explicit, in id order).
A module whose import fails (e.g. a missing optional dependency) is logged and skipped."""
import importlib
import logging

from .search.solver import REGISTRY, Placeholder

# Retired solvers: their ids and names stay taken (find-db records and `solver=` arguments
# name them; a forced one explains itself as retired)
_RETIRED = (
    (36, "conv3d_via_2d_bwd_weights", "conv", "implicit_gemm"),   # slower than 22 everywhere (2026-12-02)
)

_MODULES = (
    "nnprim.conv.reference",
    "nnprim.conv.cpu_gemm",
    "nnprim.conv.cpu_tap",
    "nnprim.conv.cpu_brgemm",
    "nnprim.conv.cpu_winograd",
    "nnprim.conv.cpu_group",
    "nnprim.conv.cpu_group_direct",
    "nnprim.conv.implicit_gemm",
    "nnprim.conv.implicit_gemm_bwd",
    "nnprim.conv.gluon_conv",
    "nnprim.conv.gluon_conv_wgrad",
    "nnprim.conv.im2col_gemm",
    "nnprim.conv.pointwise_blas",
    "nnprim.conv.direct",
    "nnprim.conv.depthwise",
    "nnprim.conv.depthwise_walk",
    "nnprim.conv.layout_change",
    "nnprim.conv.winograd",
    "nnprim.conv.fft",
    "nnprim.conv.stem",
    "nnprim.attention.reference",
    "nnprim.attention.flash_fwd",
    "nnprim.attention.flash_fwd_fp8",
    "nnprim.attention.gluon_fwd",
    "nnprim.attention.flash_bwd",
    "nnprim.attention.flash_bwd_atomic",
    "nnprim.attention.gluon_bwd",
    "nnprim.attention.gluon_bwd_d256",
    "nnprim.attention.cpu_flash_native",
    "nnprim.attention.decode",
    "nnprim.attention.decode_quant",
    "nnprim.attention.decode_swap",
    "nnprim.attention.decode_scaled",
    "nnprim.attention.gluon_decode_quant",
    "nnprim.attention.cpu_flash",
)


def load_all() -> None:
    for id_, name, primitive, family in _RETIRED:
        if REGISTRY.find_id(id_) is None:
            REGISTRY.add(Placeholder(id_, name, primitive, family))
    for name in _MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            logging.getLogger("nnprim").debug("solver module %s not present", name)
