"""nnprim: deep-learning primitives (convolution, scaled dot-product attention) with
MIOpen-style solver search; Triton kernels on NVIDIA GPUs, vectorised torch on CPU."""
from . import _solvers
from .api import (
                  conv_backward_bias,
                  conv_backward_data,
                  conv_backward_weights,
                  conv_forward,
                  sdpa,
                  sdpa_backward,
)
from .errors import BadParameterError, NotSupportedError, NumericsError
from .post_ops import Binary, Eltwise, Sum
from .problems import AttentionProblem, ConvProblem
from .quant import KVQuant, quantize_kv
from .search.solver import REGISTRY

_solvers.load_all()

__version__ = "0.1.0"

__all__ = [
    "AttentionProblem", "BadParameterError", "Binary", "ConvProblem", "Eltwise", "KVQuant",
    "NotSupportedError", "NumericsError", "REGISTRY", "Sum", "conv_backward_bias",
    "conv_backward_data", "conv_backward_weights", "conv_forward", "quantize_kv", "sdpa",
    "sdpa_backward",
]
