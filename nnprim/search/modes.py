"""Search settings: find mode, family switches, strictness, find budget, numerics
checking and log level (MIOpen's FindMode + MIOPEN_DEBUG_* switches).

Everything lives in one `SETTINGS` object, read from the environment when first
imported and settable from Python afterwards (`set_find_mode`, `disable_families`,
...); `SETTINGS.reload()` re-reads the environment. Changing a setting that affects
which solver runs notifies the subscribers (`SETTINGS.subscribe`): the per-device
search contexts drop their choices.

Environment:
  NNPRIM_FIND_MODE        normal | fast | hybrid (default) | dynamic_hybrid
  NNPRIM_DISABLE          comma-separated families (gemm,direct,implicit_gemm,flash,...)
  NNPRIM_STRICT           1: raise instead of falling back to the reference solver
  NNPRIM_FIND_BUDGET_MS   wall-time budget of one find (default 2000 ms on CPU, 20000 on CUDA)
  NNPRIM_FIND_MAX_CANDIDATES  at most this many solvers are benchmarked (default: all)
  NNPRIM_FIND_REPEATS     timed repeats per candidate (default 5 CUDA, 3 CPU)
  NNPRIM_CHECK_NUMERICS   1: scan inputs and outputs for NaN/Inf (NumericsError)
  NNPRIM_DETERMINISTIC    1: only deterministic solvers (as torch.use_deterministic_algorithms)
  NNPRIM_WORKSPACE_LIMIT  bytes a solver may allocate beyond its outputs (suffixes K, M, G;
                          default on CUDA: a quarter of the device's free memory at the
                          first call on it)
  NNPRIM_LOG_LEVEL        a `logging` level name or number for the "nnprim" logger

Find modes (DESIGN.md, "Solver search"):
  normal          find on a miss of the user find-db (its records answer a repeated find)
  fast            never benchmark: user db, system db, nearest record of the same
                  problem class, else the heuristic (estimate) ranking
  hybrid          user db or system db hit, else find (the default)
  dynamic_hybrid  like hybrid, but a find skips solvers with long compilation
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import BadParameterError

FIND_MODES = ("normal", "fast", "hybrid", "dynamic_hybrid")
_MODE_ALIASES = {"1": "normal", "2": "fast", "3": "hybrid", "5": "dynamic_hybrid",
                 "dynamic-hybrid": "dynamic_hybrid", "dynamichybrid": "dynamic_hybrid"}

log = logging.getLogger("nnprim")


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _flag(v: str | None, name: str = "") -> bool:
    """An on/off variable; another non-empty value (NNPRIM_STRICT=enabled, NNPRIM_DETERMINISTIC=2)
    is taken as on, with a warning: setting the variable says the user wants it."""
    t = (v or "").strip().lower()
    if t in _ON or t in _OFF:
        return t in _ON
    log.warning("%s=%r is not one of 1/0, true/false, yes/no, on/off; taken as on", name or "flag", v)
    return True


def _parse_mode(v: str, source: str) -> str:
    m = v.strip().lower()
    m = _MODE_ALIASES.get(m, m)
    if m not in FIND_MODES:
        raise BadParameterError(f"{source}={v!r} is not one of {', '.join(FIND_MODES)}")
    return m


def _parse_families(v, strict: bool = True) -> frozenset[str]:
    """Family names; one neither built in nor of a registered solver raises (a typo would
    otherwise disable nothing), or with strict=False (the environment at import, before any
    solver of a user's own family registers) is kept with a warning."""
    from .solver import ATTN_FAMILIES, CONV_FAMILIES, REGISTRY
    if v is None:
        return frozenset()
    if isinstance(v, str):
        v = v.split(",")
    out = frozenset(f.strip().lower() for f in v if f and f.strip())
    unknown = sorted(out - set(CONV_FAMILIES) - set(ATTN_FAMILIES) - {s.family for s in REGISTRY.all()})
    if unknown and not strict:
        log.warning("NNPRIM_DISABLE: unknown solver families %s (no built-in solver has them)", unknown)
        return out
    if unknown:
        raise BadParameterError(f"unknown solver families {unknown}; known: "
                                f"{sorted(set(CONV_FAMILIES) | set(ATTN_FAMILIES))}")
    return out


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_bytes(name: str, v: str | None) -> int | None:
    """A byte count with an optional binary suffix ("512M", "2G", "1048576")."""
    if v is None or not v.strip():
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", v)
    if m is None or m.group(2).upper() not in _UNITS:
        raise BadParameterError(f"{name}={v!r} must be a byte count such as 1073741824, 512M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _positive_float(name: str, v: str | None, default: float | None) -> float | None:
    if v is None or v.strip() == "":
        return default
    try:
        f = float(v)
    except ValueError:
        raise BadParameterError(f"{name}={v!r} must be a number") from None
    if f <= 0:
        raise BadParameterError(f"{name}={v!r} must be positive")
    return f


@dataclass
class Settings:
    find_mode: str = "hybrid"
    disabled: frozenset[str] = field(default_factory=frozenset)
    strict: bool = False
    find_budget_ms: float | None = None         # None: device default (see budget_ms)
    find_max_candidates: int | None = None
    find_repeats: int | None = None             # None: device default
    check_numerics: bool = False
    log_level: str | None = None
    workspace_limit: int | None = None          # None: device default (see Context.workspace_limit)
    deterministic: bool = False                 # or torch.use_deterministic_algorithms(True)
    _listeners: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def subscribe(self, fn: Callable[[], None]) -> None:
        """Call `fn()` whenever a setting that changes the choice of solver changes."""
        self._listeners.append(fn)

    def changed(self) -> None:
        for fn in self._listeners:
            fn()

    # ---- environment -----------------------------------------------------------------
    def reload(self, environ=None) -> Settings:
        """Re-read every setting from the environment (Python overrides are dropped); a bad value
        raises here (at import it warns: `import nnprim` must not fail on a typo)."""
        self._load(os.environ if environ is None else environ, strict=True)
        self.changed()
        return self

    def _load(self, env, strict: bool = False) -> None:
        """Each variable on its own: a bad value warns, naming it, and leaves that setting at its
        default; the others still apply (one typo dropped NNPRIM_DETERMINISTIC and NNPRIM_STRICT).
        strict: a bad value raises instead (reload, called from Python)."""
        self.log_level = env.get("NNPRIM_LOG_LEVEL") or None
        self.apply_log_level()

        def read(name: str, parse, default):
            v = env.get(name)
            try:
                return parse(v)
            except BadParameterError as e:
                if strict:
                    raise
                log.warning("ignoring %s: %s", name, e)
                return default

        self.find_mode = read("NNPRIM_FIND_MODE", lambda v: _parse_mode(v, "NNPRIM_FIND_MODE") if v else "hybrid",
                              "hybrid")
        self.disabled = _parse_families(env.get("NNPRIM_DISABLE"), strict=strict)
        self.strict = _flag(env.get("NNPRIM_STRICT"), "NNPRIM_STRICT")
        self.find_budget_ms = read("NNPRIM_FIND_BUDGET_MS", lambda v: _positive_float("NNPRIM_FIND_BUDGET_MS", v, None),
                                   None)
        mc = read("NNPRIM_FIND_MAX_CANDIDATES", lambda v: _positive_float("NNPRIM_FIND_MAX_CANDIDATES", v, None), None)
        self.find_max_candidates = None if mc is None else int(mc)
        rep = read("NNPRIM_FIND_REPEATS", lambda v: _positive_float("NNPRIM_FIND_REPEATS", v, None), None)
        self.find_repeats = None if rep is None else int(rep)
        self.check_numerics = _flag(env.get("NNPRIM_CHECK_NUMERICS"), "NNPRIM_CHECK_NUMERICS")
        self.deterministic = _flag(env.get("NNPRIM_DETERMINISTIC"), "NNPRIM_DETERMINISTIC")
        self.workspace_limit = read("NNPRIM_WORKSPACE_LIMIT", lambda v: parse_bytes("NNPRIM_WORKSPACE_LIMIT", v), None)

    def apply_log_level(self) -> None:
        if not self.log_level:
            return
        lv = self.log_level.strip().upper()
        level = int(lv) if lv.isdigit() else logging.getLevelName(lv)
        if not isinstance(level, int):
            log.warning("NNPRIM_LOG_LEVEL=%r is not a logging level; ignored", self.log_level)
            return
        log.setLevel(level)
        if not any(getattr(h, "_nnprim", False) for h in log.handlers):
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("nnprim %(levelname)s %(name)s: %(message)s"))
            h._nnprim = True
            log.addHandler(h)

    # ---- derived -----------------------------------------------------------------------
    def budget_ms(self, device: str) -> float:
        if self.find_budget_ms is not None:
            return self.find_budget_ms
        return 20000.0 if device == "cuda" else 2000.0

    def repeats(self, device: str) -> int:
        if self.find_repeats is not None:
            return self.find_repeats
        return 5 if device == "cuda" else 3

    def is_disabled(self, family: str) -> bool:
        return family in self.disabled


SETTINGS = Settings()
SETTINGS._load(os.environ)      # a typo in the environment warns (it must not break `import nnprim`)


def _changed() -> None:
    SETTINGS.changed()


# ---- Python setters (public API re-exports these) ---------------------------------------
def set_find_mode(mode: str) -> None:
    """Set the find mode: "normal", "fast", "hybrid" or "dynamic_hybrid"."""
    if not isinstance(mode, str):
        raise BadParameterError(f"find mode {mode!r} must be a string, one of {', '.join(FIND_MODES)}")
    SETTINGS.find_mode = _parse_mode(mode, "mode")
    _changed()


def get_find_mode() -> str:
    return SETTINGS.find_mode


def set_disabled(families) -> None:
    """Disable exactly these solver families (a comma-separated string or an iterable)."""
    SETTINGS.disabled = _parse_families(families)
    _changed()


def disable_families(*families: str) -> None:
    """Disable more families: `disable_families("gemm", "direct")` (or one "gemm,direct")."""
    SETTINGS.disabled = SETTINGS.disabled | _parse_families(",".join(families))
    _changed()


def enable_families(*families: str) -> None:
    """Re-enable families; with no argument, every family."""
    if not families:
        SETTINGS.disabled = frozenset()
    else:
        SETTINGS.disabled = SETTINGS.disabled - _parse_families(",".join(families))
    _changed()


def get_disabled() -> frozenset[str]:
    return SETTINGS.disabled


def set_strict(on: bool = True) -> None:
    SETTINGS.strict = bool(on)
    _changed()


def set_check_numerics(on: bool = True) -> None:
    SETTINGS.check_numerics = bool(on)


def set_workspace_limit(limit: int | str | None) -> None:
    """Bytes a solver may allocate beyond its outputs (None: the device default, a quarter
    of the free memory on CUDA). Find and the default call skip solvers over it."""
    if isinstance(limit, str):
        limit = parse_bytes("workspace limit", limit)
    elif limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise BadParameterError(f"workspace limit={limit!r} must be None or a non-negative int (bytes)")
    SETTINGS.workspace_limit = limit
    _changed()


def get_workspace_limit() -> int | None:
    return SETTINGS.workspace_limit


def set_deterministic(on: bool = True) -> None:
    """Choose only deterministic solvers (torch.use_deterministic_algorithms(True) does too)."""
    SETTINGS.deterministic = bool(on)
    _changed()


def set_find_budget(ms: float | None = None, max_candidates: int | None = None) -> None:
    """Bound find's wall time (ms) and the number of solvers it benchmarks (None: default)."""
    if ms is not None and not ms > 0:
        raise BadParameterError(f"find budget ms={ms!r} must be positive")
    if max_candidates is not None and (not isinstance(max_candidates, int) or max_candidates < 1):
        raise BadParameterError(f"max_candidates={max_candidates!r} must be a positive int")
    SETTINGS.find_budget_ms = ms
    SETTINGS.find_max_candidates = max_candidates
