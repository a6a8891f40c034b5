"""Exceptions raised by nnprim. Every message names the offending argument and value."""


class NnprimError(Exception):
    """Base class of nnprim's own errors."""


class BadParameterError(NnprimError, ValueError):
    """An argument is invalid: wrong shape, dtype, device, layout or option value."""


class NotSupportedError(NnprimError, NotImplementedError):
    """A valid combination that no solver (or the forced solver) supports."""


class SolverUnavailableError(NotSupportedError):
    """A chosen solver cannot run here after all (its native library failed to build): a default
    call falls back to the next solver; a forced one raises this."""


class NumericsError(NnprimError, ArithmeticError):
    """NNPRIM_CHECK_NUMERICS found NaN or Inf in a named tensor."""


def check(cond: bool, msg: str) -> None:
    """Raise BadParameterError(msg) unless cond. Used instead of `assert` (kept under -O)."""
    if not cond:
        raise BadParameterError(msg)
