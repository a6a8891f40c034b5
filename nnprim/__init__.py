"""nnprim: deep-learning primitives (convolution, scaled dot-product attention) with
MIOpen-style solver search; Triton kernels on NVIDIA GPUs, vectorised torch on CPU."""
from . import _solvers, nn, ops, warmup
from .api import (
                  conv_backward_bias,
                  conv_backward_data,
                  conv_backward_weights,
                  conv_forward,
                  sdpa,
                  sdpa_backward,
)
from .errors import BadParameterError, NotSupportedError, NumericsError
from .paged import append_kv
from .post_ops import Binary, Eltwise, Sum
from .problems import AttentionProblem, ConvProblem
from .quant import KVQuant, quantize_kv
from .search.context import compile, find, get_solutions, workspace_size
from .search.explain import explain
from .search.find import PerfResult
from .search.finddb import default_triton_cache
from .search.immediate import Solution
from .search.modes import (
                  disable_families,
                  enable_families,
                  get_disabled,
                  get_find_mode,
                  get_workspace_limit,
                  set_check_numerics,
                  set_deterministic,
                  set_disabled,
                  set_find_budget,
                  set_find_mode,
                  set_strict,
                  set_workspace_limit,
)
from .search.solver import REGISTRY

default_triton_cache()  # Triton's kernels under $NNPRIM_CACHE_DIR/triton (it reads the variable at each compile)
_solvers.load_all()

from . import distributed  # noqa: E402  (after the primitives it calls)

__version__ = "0.1.0"

__all__ = [
    "AttentionProblem", "BadParameterError", "append_kv", "Binary", "ConvProblem", "Eltwise", "KVQuant",
    "NotSupportedError", "NumericsError", "REGISTRY", "Sum", "conv_backward_bias", "distributed", "nn", "ops", "warmup",
    "conv_backward_data", "conv_backward_weights", "conv_forward", "quantize_kv", "sdpa",
    "sdpa_backward",
    # solver search
    "PerfResult", "Solution", "compile", "disable_families", "enable_families", "explain", "find",
    "get_disabled", "get_find_mode", "get_solutions", "get_workspace_limit", "set_check_numerics",
    "set_deterministic", "set_disabled", "set_find_budget", "set_find_mode", "set_strict",
    "set_workspace_limit", "workspace_size",
]
