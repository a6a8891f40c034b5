from .solver import REGISTRY, Solver, register

__all__ = ["REGISTRY", "Solver", "register"]
