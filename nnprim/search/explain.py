"""`nnprim.explain(problem)`: for every solver of the problem's primitive, whether it
applies (and why not), its workspace, estimate, the learned model's prediction (and from
which records), measured time (find-db), and which solver a call would use now and why.
Explaining never benchmarks."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from . import finddb, learned
from .context import check_problem, for_problem
from .immediate import usable
from .modes import SETTINGS
from .ranking import heuristic_order, skip_reason
from .solver import REGISTRY


@dataclass(frozen=True)
class SolverRow:
    id: int
    name: str
    family: str
    applicable: bool
    disabled: bool
    reasons: tuple[str, ...]  # why not applicable; or, when applicable, why find skips it
    workspace_bytes: int | None
    estimate_ms: float | None
    measured_ms: float | None
    status: str | None  # find-db status of this solver for this problem
    predicted_ms: float | None = None  # the learned model's prediction (learned.py)
    predicted_why: str | None = None


def _safe(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


def rows(problem) -> list[SolverRow]:
    ctx = for_problem(problem)
    c = ctx.constraints(problem)
    key = finddb.db_key(problem, c.deterministic)
    recs = {r.solver_id: r for r in _safe(lambda: finddb.user_db().lookup(c.fingerprint, finddb.SOLVER_SET_VERSION,
                                                                          key), [])}
    sdb = finddb.system_db()
    if sdb is not None:
        for r in _safe(lambda: sdb.lookup(c.fingerprint, finddb.SOLVER_SET_VERSION, key), []):
            recs.setdefault(r.solver_id, r)
    model = _safe(lambda: learned.model_for(c.fingerprint))
    feats = learned.features(problem.key()) if model is not None else None
    # ranked together, as immediate mode ranks them (immediate.model_solutions)
    ranked = [s.id for s in REGISTRY.for_problem(problem) if s.family != "reference"
              and _safe(lambda s=s: usable(problem, s.id, "explain", c)) is not None]
    preds = _safe(lambda: model.predict_many(problem.key(), ranked, feats=feats, problem=problem), {}) \
        if feats is not None else {}
    out = []
    for s in REGISTRY.for_problem(problem):
        reasons = tuple(s.not_supported_reasons(problem))
        ok = not reasons
        if ok:
            why = _safe(lambda s=s: skip_reason(s, problem, workspace_limit=c.workspace_limit,
                                                deterministic=c.deterministic))
            if why is not None and not why.startswith("family"):
                reasons = (why,)
            if s.id in c.exclude:
                reasons += ("failed at run time in this process",)
        r = recs.get(s.id)
        pred = preds.get(s.id) if ok else None
        if ok and pred is None and s.id not in preds and feats is not None:
            pred = _safe(lambda s=s: model.predict(problem.key(), s.id, feats=feats, problem=problem))
        out.append(SolverRow(
            s.id, s.name, s.family, ok, SETTINGS.is_disabled(s.family), reasons,
            _safe(lambda s=s: int(s.workspace_size(problem))) if ok else None,
            _safe(lambda s=s: s.estimate(problem)) if ok else None,
            r.time_ms if r is not None else None, r.status if r is not None else None,
            pred.time_ms if pred is not None else None, pred.why() if pred is not None else None))
    return out


def decision(problem) -> str:
    """Which solver a call would use now, and why (without benchmarking)."""
    from .find import from_db
    from .immediate import db_solutions, get_solutions
    ctx = for_problem(problem)
    mode = SETTINGS.find_mode
    hit = ctx.chosen.get(problem)
    if hit is not None:
        return f"would run: {hit.solver.name} (already chosen in this process; mode {mode})"
    name = why = None
    try:
        c = ctx.constraints(problem)
        if mode == "fast":
            sols = get_solutions(problem, 1, constraints=c)
            if sols:
                name, why = sols[0].solver, f"mode fast, from {sols[0].source}"
                if sols[0].source.startswith("model") and sols[0].time_ms is not None:
                    why += f": predicted {sols[0].time_ms:.4g} ms"
        elif mode == "normal":
            res = from_db(problem, c)
            if res:
                name, why = res[0].solver, f"mode normal, user find-db hit: {res[0].time_ms:.4f} ms"
        else:
            sols = db_solutions(problem, c)
            if sols:
                name, why = sols[0].solver, f"mode {mode}, {sols[0].source} hit: {sols[0].time_ms:.4f} ms"
        if name is None:
            order = heuristic_order(problem, workspace_limit=c.workspace_limit, deterministic=c.deterministic,
                                    exclude=c.exclude)
            if not order:
                return "would run: nothing: no enabled solver applies (a call raises NotSupportedError)"
            if mode != "fast" and any(s.family != "reference" for s in order):
                from .immediate import model_solutions
                fav = model_solutions(problem, c)
                fav_s = f"; model favourite: {fav[0].solver}" if fav else ""
                return (f"would run: the fastest in a find on the first call (mode {mode}, no find-db record); "
                        f"heuristic favourite: {order[0].name}{fav_s}")
            name = order[0].name
            why = f"mode {mode}, " + ("nothing else applies" if order[0].family == "reference"
                                      else "first in the heuristic order (no estimate)")
    except Exception as e:
        return f"would run: undetermined ({type(e).__name__}: {e})"
    if REGISTRY.get(name).family == "reference" and SETTINGS.strict:
        return f"would run: nothing: {name} is the reference and NNPRIM_STRICT=1 (a call raises NotSupportedError)"
    return f"would run: {name} ({why})"


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}{unit}"
    return f"{v}{unit}"


_STDOUT = object()


def explain(problem, file=_STDOUT) -> str:
    """Print (to `file`, default sys.stdout; None prints nothing) and return the explanation."""
    check_problem(problem)
    lines = [f"problem: {problem.key()}", f"class:   {problem.class_key()}",
             f"device:  {for_problem(problem).fingerprint}",
             f"limit:   workspace {for_problem(problem).workspace_limit()} B",
             f"mode:    {SETTINGS.find_mode}" + (f"; disabled families: {','.join(sorted(SETTINGS.disabled))}"
                                                 if SETTINGS.disabled else "")
             + ("; strict" if SETTINGS.strict else ""),
             f"{'id':>5}  {'solver':<28} {'family':<14} {'applies':<8} {'workspace':>10} {'estimate':>10} "
             f"{'model':>10} {'measured':>10}  reasons"]
    table = rows(problem)
    for r in table:
        applies = ("disabled" if r.disabled else "skipped" if r.reasons else "yes") if r.applicable else "no"
        measured = _fmt(r.measured_ms, " ms") if r.status in (None, "ok") else r.status
        lines.append(f"{r.id:>5}  {r.name:<28} {r.family:<14} {applies:<8} {_fmt(r.workspace_bytes):>10} "
                     f"{_fmt(r.estimate_ms, ' ms'):>10} {_fmt(r.predicted_ms, ' ms'):>10} {measured:>10}  "
                     f"{'; '.join(r.reasons)}")
    for r in table:
        if r.predicted_why is not None:
            lines.append(f"model: {r.name}: {r.predicted_ms:.4g} ms from {r.predicted_why}")
    lines.append(decision(problem))
    text = "\n".join(lines)
    if file is not None:
        print(text, file=sys.stdout if file is _STDOUT else file)
    return text
