from .attention import AttentionProblem
from .conv import ConvProblem

__all__ = ["AttentionProblem", "ConvProblem"]
