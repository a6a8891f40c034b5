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

Prediction of solver s on problem p: the k nearest records (weighted Euclidean distance of
the numbers) that timed s ("ok"); each gives log t_i + log(rf(p) / rf(i)), where rf is a
roofline time (max of FLOPs / peak and bytes / bandwidth, plus a launch latency), so a
neighbour twice as large predicts half the time; their mean weighted by 1 / (0.25 + d)^2.
A solver with no record in the group has no prediction: `immediate` then places it by its
heuristic estimate, calibrated against the predicted solvers (see immediate.py).

`leave_one_out(records)` validates: each recorded problem predicted from the others; rank
accuracy (the predicted best is the measured best) and the regret of the predicted choice."""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field

import numpy as np

K_NEIGHBOURS = 4
_WEIGHT_EPS = 0.25
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
    dtypes = parts[10]
    m_dt = re.match(r"bf16|f16|f32|f64", dtypes)
    e = _ESIZE[m_dt.group(0)] if m_dt else 2
    macs = N * K * math.prod(out) * (C // max(g, 1)) * math.prod(flt)
    nbytes = e * (N * C * math.prod(ins) + K * (C // max(g, 1)) * math.prod(flt) + N * K * math.prod(out))
    sizes = _log([N, C, K, *_pad3(ins)])
    shape = _log([*_pad3(flt), *_pad3(st), *_pad3(dil), g, C // max(g, 1), K // max(g, 1)])
    dw = np.array([4.0 if g == C == K and g > 1 else 0.0])
    x = np.concatenate([sizes, 2.0 * shape, dw])
    return Features("-".join([parts[0], parts[1], parts[9], dtypes, str(nd)]), x, 2.0 * macs, float(nbytes),
                    parts[11])


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

    def why(self) -> str:
        return (f"{self.neighbours} nearest records, nearest {self.nearest_key} at distance "
                f"{self.nearest_distance:.2f}")


@dataclass
class _Table:
    keys: list[str] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    logt: list[float] = field(default_factory=list)
    logrf: list[float] = field(default_factory=list)
    X: np.ndarray | None = None

    def freeze(self) -> None:
        self.X = np.stack(self.rows)
        self.logt_a = np.asarray(self.logt)
        self.logrf_a = np.asarray(self.logrf)


class Model:
    """kNN tables per (group, solver id) built from find-db records of one device."""

    def __init__(self, records, k: int = K_NEIGHBOURS) -> None:
        self.k = k
        self.tables: dict[tuple[str, int], _Table] = {}
        best: dict[tuple[str, int], float] = {}
        feats: dict[str, Features | None] = {}
        for r in records:
            if r.status != "ok" or r.time_ms is None or not r.time_ms > 0:
                continue
            key = r.problem_key.split("|")[0]
            if key not in feats:
                feats[key] = features(key)
            f = feats[key]
            if f is None:
                continue
            sk = (key, r.solver_id)  # a deterministic and a free record of one problem: keep the faster
            if sk in best and best[sk] <= r.time_ms:
                continue
            best[sk] = r.time_ms
        for (key, sid), t in best.items():
            f = feats[key]
            tab = self.tables.setdefault((f.group, sid), _Table())
            tab.keys.append(key)
            tab.rows.append(f.x)
            tab.logt.append(math.log(t))
            tab.logrf.append(math.log(f.roofline_ms()))
        for tab in self.tables.values():
            tab.freeze()
        self.problems = len(feats)

    def __len__(self) -> int:
        return sum(len(t.keys) for t in self.tables.values())

    def solvers(self, group: str) -> set[int]:
        return {sid for g, sid in self.tables if g == group}

    def predict(self, key: str, solver_id: int, *, exclude_key: str | None = None,
                feats: Features | None = None) -> Prediction | None:
        f = feats or features(key)
        if f is None:
            return None
        tab = self.tables.get((f.group, solver_id))
        if tab is None:
            return None
        d = np.sqrt(((tab.X - f.x) ** 2).sum(axis=1))
        if exclude_key is not None:
            d = np.where(np.asarray([k == exclude_key for k in tab.keys]), np.inf, d)
        n = min(self.k, int(np.isfinite(d).sum()))
        if n == 0:
            return None
        idx = np.argsort(d, kind="stable")[:n]
        w = 1.0 / (_WEIGHT_EPS + d[idx]) ** 2
        logrf = math.log(f.roofline_ms())
        est = float((w * (tab.logt_a[idx] + logrf - tab.logrf_a[idx])).sum() / w.sum())
        return Prediction(math.exp(est), n, tab.keys[idx[0]], float(d[idx[0]]))


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


# ---- validation --------------------------------------------------------------------------------
def leave_one_out(records, k: int = K_NEIGHBOURS) -> dict:
    """Each recorded problem with two or more "ok" solvers, predicted from the other problems'
    records: rank accuracy, regret of the predicted choice (geomean, max) and the worst ones.
    Solvers the model cannot predict for that problem are left out of its ranking."""
    model = Model(records, k)
    by_key: dict[str, dict[int, float]] = {}
    for r in records:
        if r.status == "ok" and r.time_ms is not None and r.time_ms > 0:
            key = r.problem_key.split("|")[0]
            cur = by_key.setdefault(key, {})
            cur[r.solver_id] = min(r.time_ms, cur.get(r.solver_id, math.inf))
    rows = []
    for key, times in sorted(by_key.items()):
        if len(times) < 2:
            continue
        f = features(key)
        if f is None:
            continue
        preds = {sid: model.predict(key, sid, exclude_key=key, feats=f) for sid in times}
        preds = {sid: p.time_ms for sid, p in preds.items() if p is not None}
        if not preds:
            continue
        pick = min(preds, key=lambda s: (preds[s], s))
        best = min(times.values())
        rows.append((key, pick, times[pick] / best - 1.0, times[pick] == best))
    if not rows:
        return dict(problems=0, rank_accuracy=None, regret_geomean=None, regret_max=None, worst=[])
    regrets = np.array([r[2] for r in rows])
    worst = sorted(rows, key=lambda r: -r[2])[:5]
    return dict(problems=len(rows), rank_accuracy=float(np.mean([r[3] for r in rows])),
                regret_geomean=float(np.exp(np.log1p(regrets).mean()) - 1.0), regret_max=float(regrets.max()),
                worst=[dict(key=k, picked=s, regret=round(g, 4)) for k, s, g, _ in worst])
