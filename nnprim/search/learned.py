"""The learned immediate mode: per-solver time predicted from find-db records by k nearest
neighbours in log-feature space (MIOpen's immediate-mode model, in numpy).

Features come from the problem key, so db records (which hold keys, not problems) and live
problems are described alike:
  conv       group: ndim, direction, layout, dtypes; numbers: log2 of N, C, K, the input's
             spatial sizes, the filter, stride, dilation, groups, C/groups, K/groups, and a
             depthwise flag
  attention  group: direction, dtype, K/V quantization, dropout, other key parts; numbers:
             log2 of B, Hq, Hkv, Hq/Hkv, Sq, Sk, D, Dv; causal, mask kind, kv_lens
Records only inform problems of their own group (same device fingerprint and solver set).

Prediction of solver s on problem p: s's own heuristic `estimate(p)` (the problem is rebuilt
from its key by keys.problem_from_key; the roofline of the features when s has no estimate)
times a correction: the k nearest records (weighted Euclidean distance of the numbers) that
timed s ("ok") each give log(measured / estimate) of their problem; their mean weighted by
1 / (0.25 + d)^2, with the solver's mean correction in the group as one more, faint term
(it decides only when every neighbour is far). So a neighbour informs about what the
estimate misses, not about raw time, and the estimate carries the size scaling.
A solver with no record in the group has no prediction: `place` then ranks it by its
estimate, calibrated against the predicted solvers and penalised (UNKNOWN_PENALTY), unless it
is a variant priced as another solver (`Solver.priced_as`: the ordered-dQ 129 / 132 as 127 /
130): that one's prediction times the ratio of their estimates. Records older than their
solver's `revised` time are left out (the kernel they timed is gone: 129's were 1.4-1.6x 127's,
the dQ writer made it 1.06x; priced as 127 instead, its predictions came within 4.9 % geomean
of 13 times measured on the H200 on 2026-12-02).

`leave_one_out(records)` validates: each recorded problem ranked from the other problems'
records as immediate mode would; rank accuracy (the pick is the measured best) and the
regret of the pick, plus a hash split and a held-out-class split (see its doc).
Leave-one-out over the shipped H200 db (156 problems): regret geomean 13.6% (heuristic) ->
6.2% (roofline-scaled kNN) -> 4.8% (this model); see benchmarks/REGRET.md."""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field, replace

import numpy as np

K_NEIGHBOURS = 4
_WEIGHT_EPS = 0.25
# The solver's mean correction in the group weighs as a neighbour at distance ~10: it only
# matters when every neighbour is far (a problem unlike any recorded one)
PRIOR_WEIGHT = 0.01
PRIOR_RECORDS = 2.0    # pseudo-records of correction 0 in that mean: few records, little trust
# The correction shrinks towards none (the solver's own estimate) as wsum / (wsum + this):
# neighbours at distance ~3 (weight ~0.1) keep half of theirs. Chosen on 2026-12-01 data:
# leave-one-out 2.3% -> 1.8%, held-out class 2.7% -> 2.0%, and the 45 held-out H200 problems
# of results/regret_2026-12-01.json (replayed) 10.0% / 177% -> 4.2% / 59% (the last also
# chose it, so it is not an independent check)
SHRINK_WEIGHT = 0.1
# A solver with no record in the group is placed by its calibrated estimate times this: an
# estimate never checked against a measurement must promise clearly more to be picked
UNKNOWN_PENALTY = 1.5
_ESIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8}
# roofline constants per device type: (peak FLOP/s, bytes/s, latency s); only ratios matter
_ROOF = {"cuda": (5e14, 4e12, 5e-6), "cpu": (1e12, 5e10, 1e-5)}


@dataclass(frozen=True)
class Features:
    group: str
    x: np.ndarray      # weighted log features
    flops: float
    bytes: float
    device: str

    def roofline_ms(self) -> float:
        peak, bw, lat = _ROOF.get(self.device, _ROOF["cpu"])
        return (max(self.flops / peak, self.bytes / bw) + lat) * 1e3


def _ints(s: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", s)]


def _pad3(v: list[int]) -> list[int]:
    return (v + [1, 1, 1])[:3]


def _log(v) -> np.ndarray:
    return np.log2(np.maximum(np.asarray(v, dtype=np.float64), 1.0))


def _conv(parts: list[str]) -> Features | None:
    if len(parts) < 12:
        return None
    nd = int(parts[0][4:-1])
    m = re.fullmatch(r"n(\d+)c(\d+)i([\dx]+)", parts[2])
    mk = re.fullmatch(r"k(\d+)f([\dx]+)", parts[3])
    if m is None or mk is None:
        return None
    N, C = int(m.group(1)), int(m.group(2))
    ins, K, flt = _ints(m.group(3)), int(mk.group(1)), _ints(mk.group(2))
    out, st, dil = _ints(parts[4]), _ints(parts[5]), _ints(parts[7])
    g = _ints(parts[8])[0]
    Cg, Kg = C // max(g, 1), K // max(g, 1)
    dtypes = parts[10]
    m_dt = re.match(r"bf16|f16|f32|f64", dtypes)
    e = _ESIZE[m_dt.group(0)] if m_dt else 2
    P, pin, taps = math.prod(out), math.prod(ins), math.prod(flt)
    macs = N * K * P * Cg * taps
    nbytes = e * (N * C * pin + K * Cg * taps + N * K * P)
    sizes = _log([N, C, K, *_pad3(ins)])
    shape = _log([*_pad3(flt), *_pad3(st), *_pad3(dil), g, Cg, Kg])
    dw = np.array([4.0 if g == C == K and g > 1 else 0.0])
    x = np.concatenate([sizes, 2.0 * shape, dw])
    group = "-".join([parts[0], parts[1], parts[9], dtypes, str(nd)])
    return Features(group, x, 2.0 * macs, float(nbytes), parts[11])


_CAUSAL = {"cnone": 0.0, "ctop_left": 1.0, "cbottom_right": 1.5}
_MASK = {"none": 0.0, "bool": 1.0, "additive": 1.5}


def _causal_fraction(causal: str, Sq: int, Sk: int) -> float:
    if causal == "cnone":
        return 1.0
    shift = Sk - Sq if causal == "cbottom_right" else 0
    i = np.arange(Sq, dtype=np.float64) if Sq <= 1 << 16 else np.linspace(0, Sq - 1, 1 << 16)
    return float(np.clip(i + shift + 1, 0, Sk).mean() / Sk)


def _attn(parts: list[str]) -> Features | None:
    if len(parts) < 8:
        return None
    mb = re.fullmatch(r"b(\d+)hq(\d+)hkv(\d+)", parts[2])
    ms = re.fullmatch(r"sq(\d+)sk(\d+)", parts[3])
    md = re.fullmatch(r"d(\d+)dv(\d+)", parts[4])
    if mb is None or ms is None or md is None:
        return None
    B, Hq, Hkv = map(int, mb.groups())
    Sq, Sk = map(int, ms.groups())
    D, Dv = map(int, md.groups())
    dtype, device, causal = parts[5], parts[6], parts[7]
    mask, kvlens, extra = "none", 0.0, []
    for part in parts[8:]:
        if part.startswith("m") and not part.startswith("mask"):
            mask = re.match(r"m([a-z]+)", part).group(1)
        elif part == "kvlens":
            kvlens = 1.0
        elif part.startswith("sc") or part in ("infz", "lse"):
            continue  # cost next to nothing
        else:
            extra.append(part)  # dropout, quantization, layouts other helpers add: their own group
    e = _ESIZE.get(dtype, 2)
    bwd = parts[1] == "bwd"
    flops = 2.0 * B * Hq * Sq * Sk * (D + Dv) * _causal_fraction(causal, Sq, Sk) * (2.5 if bwd else 1.0)
    nbytes = e * (B * Hq * Sq * (D + Dv) + B * Hkv * Sk * (D + Dv)) * (2.0 if bwd else 1.0)
    x = np.concatenate([_log([B, Hq, Hkv, Sq, Sk]), 2.0 * _log([Hq // max(Hkv, 1), D, Dv]),
                        [2.0 * _CAUSAL.get(causal, 1.0), 2.0 * _MASK.get(mask, 1.0), 2.0 * kvlens]])
    return Features("-".join(["attn", parts[1], dtype, *extra]), x, flops, float(nbytes), device)


def features(key: str) -> Features | None:
    """Features of a problem key (a find-db key; '|deterministic' ignored); None when the key
    is of no form this model knows."""
    parts = key.split("|")[0].split("-")
    try:
        if re.fullmatch(r"conv\dd", parts[0]):
            return _conv(parts)
        if parts[0] == "attn":
            return _attn(parts)
    except (ValueError, IndexError, AttributeError):
        return None
    return None


@dataclass(frozen=True)
class Prediction:
    time_ms: float
    neighbours: int
    nearest_key: str
    nearest_distance: float
    base_ms: float = 0.0      # the solver's own estimate (or the roofline) the correction scales
    confidence: float = 1.0   # share of the correction from the neighbours (the rest: the solver's mean)
    shared: float = 0.0       # share of the correction taken from the other solvers' (predict_many)
    priced_as: int | None = None   # the solver whose records the correction came from (Solver.priced_as)

    def why(self) -> str:
        also = f", {self.shared:.0%} from the other solvers' correction" if self.shared >= 0.005 else ""
        whose = f" of solver {self.priced_as}" if self.priced_as is not None else ""
        return (f"base {self.base_ms:.4g} ms x correction from {self.neighbours} nearest records{whose} "
                f"({self.confidence:.0%}{also}), nearest {self.nearest_key} at distance {self.nearest_distance:.2f}")


def base_ms(key: str, solver_id: int, feats: Features | None = None, problem=None) -> float | None:
    """What the model corrects: the solver's own `estimate` of the problem (rebuilt from the
    key), else the roofline of the key's features; None when neither exists."""
    from .keys import problem_from_key
    from .solver import REGISTRY
    s = REGISTRY.find_id(solver_id)
    if s is not None:
        p = problem if problem is not None else problem_from_key(key)
        if p is not None:
            try:
                est = s.estimate(p)
            except Exception:  # an estimate of a problem this solver would not take
                est = None
            if est is not None and math.isfinite(est) and est > 0:
                return float(est)
    f = feats if feats is not None else features(key)
    return f.roofline_ms() if f is not None else None


@dataclass
class _Table:
    keys: list[str] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    resid: list[float] = field(default_factory=list)   # log(measured / base)

    def freeze(self) -> None:
        self.X = np.stack(self.rows)
        self.r = np.asarray(self.resid)
        self.index = {k: i for i, k in enumerate(self.keys)}


class Model:
    """kNN tables per (group, solver id) built from find-db records of one device."""

    def __init__(self, records, k: int = K_NEIGHBOURS) -> None:
        self.k = k
        self.tables: dict[tuple[str, int], _Table] = {}
        best: dict[tuple[str, int], float] = {}
        feats: dict[str, Features | None] = {}
        revised = _revision_times()
        self.stale = 0     # records older than their solver's revision, left out
        for r in records:
            if r.status != "ok" or r.time_ms is None or not r.time_ms > 0:
                continue
            if r.timestamp < revised.get(r.solver_id, 0.0):
                self.stale += 1
                continue
            key = r.problem_key.split("|")[0]
            if key not in feats:
                feats[key] = features(key)
            if feats[key] is None:
                continue
            sk = (key, r.solver_id)  # a deterministic and a free record of one problem: keep the faster
            if sk in best and best[sk] <= r.time_ms:
                continue
            best[sk] = r.time_ms
        for (key, sid), t in best.items():
            f = feats[key]
            base = base_ms(key, sid, f)
            if base is None:
                continue
            tab = self.tables.setdefault((f.group, sid), _Table())
            tab.keys.append(key)
            tab.rows.append(f.x)
            tab.resid.append(math.log(t / base))
        for tab in self.tables.values():
            tab.freeze()
        self.problems = len(feats)

    def __len__(self) -> int:
        return sum(len(t.keys) for t in self.tables.values())

    def solvers(self, group: str) -> set[int]:
        return {sid for g, sid in self.tables if g == group}

    def predict(self, key: str, solver_id: int, *, exclude_key: str | None = None,
                feats: Features | None = None, problem=None, exclude=None) -> Prediction | None:
        """The solver's prediction on its own records alone (see _raw); immediate mode ranks
        with predict_many."""
        got = self._raw(key, solver_id, exclude_key=exclude_key, feats=feats, problem=problem, exclude=exclude)
        if got is None:
            return None
        pred, raw, trust = got
        return replace(pred, time_ms=pred.base_ms * math.exp(raw * trust))

    def predict_many(self, key: str, solver_ids, *, feats: Features | None = None, problem=None,
                     exclude=None) -> dict[int, Prediction | None]:
        """Predictions of several solvers of one problem, ranked against each other. A solver
        whose own records are farther than the others' (its trust below their mean trust)
        takes that difference of trust from the others' mean correction instead of shrinking
        it towards its bare estimate: the records of a problem region share what no estimate
        sees (the machine's host speed near the host floor), and a solver never recorded
        there must not look faster merely because its estimate went uncorrected (a Gluon
        kernel's bare floor against flash_fwd's measured one). Solvers recorded alike keep
        their own corrections."""
        f = feats or features(key)
        raws = {sid: self._raw(key, sid, feats=f, problem=problem, exclude=exclude) if f is not None else None
                for sid in solver_ids}
        out: dict[int, Prediction | None] = {}
        for sid, got in raws.items():
            if got is None:
                out[sid] = self._priced_as(key, sid, f, problem, exclude, raws)
                continue
            pred, raw, trust = got
            others = [(g[2], g[1]) for o, g in raws.items() if o != sid and g is not None]  # (trust, correction)
            tsum = sum(t for t, _ in others)
            shared, common = 0.0, 0.0
            if tsum > 0:
                common = sum(t * r for t, r in others) / tsum
                shared = max(0.0, sum(t * t for t, _ in others) / tsum - trust)
            corr = trust * raw + shared * common
            out[sid] = replace(pred, time_ms=pred.base_ms * math.exp(corr), shared=shared)
        return out

    def _priced_as(self, key: str, solver_id: int, f: Features | None, problem, exclude,
                   raws: dict) -> Prediction | None:
        """A solver without records of its own, priced as the solver it declares `priced_as`
        (a variant of it: the ordered dQ of 127 / 130): that one's prediction times the ratio
        of their bases (their estimates), e.g. 129 = 127's prediction x ORDERED_COST."""
        from .solver import REGISTRY
        s = REGISTRY.find_id(solver_id)
        base_id = getattr(s, "priced_as", None)
        if base_id is None or f is None:
            return None
        got = raws.get(base_id) or self._raw(key, base_id, feats=f, problem=problem, exclude=exclude)
        own = base_ms(key, solver_id, f, problem)
        if got is None or own is None:
            return None
        pred, raw, trust = got
        return replace(pred, time_ms=own * math.exp(raw * trust), base_ms=own, priced_as=base_id)

    def _raw(self, key: str, solver_id: int, *, exclude_key: str | None = None,
             feats: Features | None = None, problem=None, exclude=None) -> tuple[Prediction, float, float] | None:
        """(prediction, correction, trust) of `solver_id` on the problem of `key` (`problem`
        saves rebuilding it): its base (`base_ms`) times exp of the neighbours' log corrections
        (the solver's mean correction in the group when all neighbours are far), times `trust`
        (wsum / (wsum + SHRINK_WEIGHT): far neighbours, back towards the estimate); None when
        the group holds no record of the solver (or it has no base). `exclude_key` / `exclude`
        (a set of keys) leave records out (validation)."""
        f = feats or features(key)
        if f is None:
            return None
        tab = self.tables.get((f.group, solver_id))
        if tab is None:
            return None
        keep = np.ones(len(tab.keys), dtype=bool)
        for k in ([exclude_key] if exclude_key is not None else []) + list(exclude or ()):
            i = tab.index.get(k)
            if i is not None:
                keep[i] = False
        n_in = int(keep.sum())
        if n_in == 0:
            return None
        base = base_ms(key, solver_id, f, problem)
        if base is None:
            return None
        d = np.where(keep, np.sqrt(((tab.X - f.x) ** 2).sum(axis=1)), np.inf)
        prior = float(tab.r[keep].sum() / (n_in + PRIOR_RECORDS))
        idx = np.argsort(d, kind="stable")[:min(self.k, n_in)]
        w = 1.0 / (_WEIGHT_EPS + d[idx]) ** 2
        wsum = float(w.sum())
        corr = (float((w * tab.r[idx]).sum()) + PRIOR_WEIGHT * prior) / (wsum + PRIOR_WEIGHT)
        trust = wsum / (wsum + SHRINK_WEIGHT)   # far neighbours: back towards the estimate
        nearest = int(np.argmin(d))
        return (Prediction(base * math.exp(corr * trust), len(idx), tab.keys[nearest], float(d[nearest]), base,
                           wsum / (wsum + PRIOR_WEIGHT)), corr, trust)


def _revision_times() -> dict[int, float]:
    """Solver id -> when it was last revised (Solver.revised), for the solvers that say."""
    from .solver import REGISTRY
    return {s.id: s.revised_at() for s in REGISTRY.all() if s.revised}


# ---- the model of the current dbs -----------------------------------------------------------
_MODELS: dict[tuple, Model] = {}
_LOCK = threading.Lock()


def model_for(fingerprint: str) -> Model | None:
    """The model over the user and system dbs' records of one device and solver set (rebuilt
    when either db changes); None when they hold no record of it."""
    from . import finddb
    dbs = [db for db in (finddb.user_db(), finddb.system_db()) if db is not None]
    try:
        stamp = tuple((repr(db), db.version(fingerprint, finddb.SOLVER_SET_VERSION)) for db in dbs)
    except Exception:
        return None
    key = (fingerprint, finddb.SOLVER_SET_VERSION, stamp)
    m = _MODELS.get(key)
    if m is None:
        recs = []
        for db in dbs:
            try:
                recs += db.for_device(fingerprint, finddb.SOLVER_SET_VERSION)
            except Exception:
                continue
        m = Model(recs)
        with _LOCK:
            if len(_MODELS) > 16:
                _MODELS.clear()
            _MODELS[key] = m
    return m if len(m) else None


def forget() -> None:
    with _LOCK:
        _MODELS.clear()


# ---- ranking and validation ------------------------------------------------------------------
def place(preds: dict[int, float | None], ests: dict[int, float | None]) -> dict[int, tuple[float, str]]:
    """Times to rank solvers by: a predicted solver its prediction ("model"); one without a
    prediction its estimate times the geometric mean of prediction / estimate over the
    predicted solvers, times UNKNOWN_PENALTY ("model-heuristic"), or inf without an estimate.
    Empty when no solver is predicted."""
    known = {s: t for s, t in preds.items() if t is not None}
    if not known:
        return {}
    ratios = [math.log(t / ests[s]) for s, t in known.items() if (ests.get(s) or 0) > 0]
    scale = math.exp(sum(ratios) / len(ratios)) if ratios else None
    out: dict[int, tuple[float, str]] = {s: (t, "model") for s, t in known.items()}
    for s in preds:
        if s not in known:
            est = ests.get(s)
            ok = scale is not None and est is not None and est > 0
            out[s] = (est * scale * UNKNOWN_PENALTY if ok else math.inf, "model-heuristic")
    return out


def _estimates(key: str, sids) -> dict[int, float | None]:
    from .keys import problem_from_key
    from .solver import REGISTRY
    p = problem_from_key(key)
    out: dict[int, float | None] = {}
    for sid in sids:
        s = REGISTRY.find_id(sid)
        try:
            out[sid] = s.estimate(p) if s is not None and p is not None else None
        except Exception:
            out[sid] = None
    return out


def _summary(rows: list[tuple[str, int, float, bool]]) -> dict:
    if not rows:
        return dict(problems=0, rank_accuracy=None, regret_geomean=None, regret_max=None)
    regrets = np.array([r[2] for r in rows])
    return dict(problems=len(rows), rank_accuracy=float(np.mean([r[3] for r in rows])),
                regret_geomean=float(np.exp(np.log1p(regrets).mean()) - 1.0), regret_max=float(regrets.max()))


def _split_class(key: str) -> str:
    from .keys import problem_from_key
    p = problem_from_key(key)
    if p is not None:
        return p.class_key()
    f = features(key)
    return f.group if f is not None else key


def leave_one_out(records, k: int = K_NEIGHBOURS) -> dict:
    """Validation over records: each problem with two or more "ok" solvers ranked as
    immediate mode would (the model's predictions, solvers without one placed by `place`,
    the heuristic estimates when nothing is predicted) from the other problems' records;
    rank accuracy (the pick is the measured best), regret of the pick (geomean, max), the
    worst picks, `model_problems` (ranked by the model, not the heuristic fallback), and
    the same numbers for:
      heuristic    the solvers' estimates alone
      hash_split   two folds by a hash of the key: each half predicted from the other
      class_split  each problem class (`class_key()`: the sizes dropped) predicted from
                   the records of the other classes (shapes of a kind never recorded)"""
    import zlib
    model = Model(records, k)
    by_key: dict[str, dict[int, float]] = {}
    for r in records:
        if r.status == "ok" and r.time_ms is not None and r.time_ms > 0:
            key = r.problem_key.split("|")[0]
            cur = by_key.setdefault(key, {})
            cur[r.solver_id] = min(r.time_ms, cur.get(r.solver_id, math.inf))
    by_key = {key: t for key, t in sorted(by_key.items()) if len(t) >= 2}
    ests = {key: _estimates(key, t) for key, t in by_key.items()}
    fold = {key: zlib.crc32(key.encode()) % 2 for key in by_key}
    cls = {key: _split_class(key) for key in by_key}
    folds = {h: {key for key in by_key if fold[key] == h} for h in (0, 1)}
    classes: dict[str, set[str]] = {}
    for key, c in cls.items():
        classes.setdefault(c, set()).add(key)

    def pick(key: str, times: dict[int, float], exclude: set[str] | None) -> tuple[int, bool] | None:
        est = ests[key]
        f = features(key)
        placed = {}
        if exclude is not None and f is not None:
            placed = place({s: p and p.time_ms
                            for s, p in model.predict_many(key, list(times), feats=f, exclude=exclude).items()}, est)
        ranked = {s: t for s, (t, _) in placed.items()} if placed else \
            {s: e if e is not None and e >= 0 else math.inf for s, e in est.items()}
        if all(math.isinf(t) for t in ranked.values()):
            return None
        return min(ranked, key=lambda s: (ranked[s], s)), bool(placed)

    def run(exclude_of) -> tuple[list, int]:
        rows, by_model = [], 0
        for key, times in by_key.items():
            got = pick(key, times, exclude_of(key))
            if got is None:
                continue
            s, from_model = got
            by_model += from_model
            best = min(times.values())
            rows.append((key, s, times[s] / best - 1.0, times[s] == best))
        return rows, by_model

    rows, by_model = run(lambda key: {key})
    out = dict(_summary(rows), model_problems=by_model,
               worst=[dict(key=key, picked=s, regret=round(g, 4))
                      for key, s, g, _ in sorted(rows, key=lambda r: -r[2])[:5]])
    out["heuristic"] = _summary(run(lambda key: None)[0])
    out["hash_split"] = _summary(run(lambda key: folds[fold[key]])[0])
    out["class_split"] = _summary(run(lambda key: classes[cls[key]])[0])
    return out
