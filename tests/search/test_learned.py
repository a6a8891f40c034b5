"""The learned immediate mode: features from keys, kNN predictions, leave-one-out validation
on synthetic records, its use by immediate mode and explain."""
import math
import random

import torch
from search_helpers import PROBLEM, resolve

import nnprim
from nnprim.problems.attention import AttentionProblem
from nnprim.problems.conv import ConvProblem
from nnprim.search import finddb, learned


def _rec(key, sid, t, fp="test-fp", status="ok"):
    return finddb.Record(fp, finddb.SOLVER_SET_VERSION, key, "c", sid, f"s{sid}", "t", t, 0, status, 0.0)


def _conv(n, c, k, hw, f, s=1, g=1, direction="fwd"):
    return ConvProblem.create(direction, (n, c, hw, hw), (k, c // g, f, f), dtype=torch.bfloat16, stride=s,
                              padding=f // 2, groups=g, device="cuda")


def test_features_of_conv_and_attention_keys():
    a = learned.features(_conv(2, 64, 128, 28, 3).key())
    b = learned.features(_conv(2, 64, 128, 28, 3).key() + "|deterministic")
    assert a.group == b.group and (a.x == b.x).all() and a.flops == _conv(2, 64, 128, 28, 3).flops()
    assert learned.features(_conv(2, 64, 128, 28, 3, direction="bwd_data").key()).group != a.group
    dw = learned.features(_conv(2, 64, 64, 28, 7, g=64).key())
    assert dw.x[-1] > 0 and a.x[-1] == 0  # depthwise flag
    q = torch.empty(2, 8, 128, 64)
    kv = torch.empty(2, 2, 256, 64)
    p = AttentionProblem.from_tensors(q, kv, kv, causal="bottom_right", return_lse=True)
    f = learned.features(p.key())
    assert f.group == "attn-fwd-f32" and abs(f.flops - p.flops()) / p.flops() < 1e-9
    assert learned.features("nonsense-key") is None and learned.features("conv2d-fwd-garbage") is None


def _synthetic(seed=0, count=60):
    """Three solvers: a plain one, one that wins on 1x1 filters, one that wins on batch 1."""
    rnd = random.Random(seed)
    recs = []
    for _ in range(count):
        n = rnd.choice([1, 4, 16])
        c, k = rnd.choice([32, 64, 128, 256]), rnd.choice([32, 64, 128, 256])
        f, hw = rnd.choice([1, 3]), rnd.choice([14, 28, 56])
        key = _conv(n, c, k, hw, f).key()
        rf = learned.features(key).roofline_ms()
        noise = lambda: math.exp(rnd.gauss(0, 0.03))  # noqa: E731
        recs.append(_rec(key, 1, rf * noise()))
        recs.append(_rec(key, 2, rf * (0.5 if f == 1 else 2.0) * noise()))
        recs.append(_rec(key, 3, rf * (0.7 if n == 1 else 1.5) * noise()))
    return recs


def test_predictions_follow_the_records():
    m = learned.Model(_synthetic())
    key = _conv(1, 96, 96, 20, 1).key()  # in no record
    rf = learned.features(key).roofline_ms()
    preds = {sid: m.predict(key, sid) for sid in (1, 2, 3)}
    assert min(preds, key=lambda s: preds[s].time_ms) == 2
    assert 0.3 < preds[2].time_ms / rf < 0.8 and 1.5 > preds[1].time_ms / rf > 0.6
    assert preds[2].neighbours == learned.K_NEIGHBOURS and "distance" in preds[2].why()
    assert m.predict(key, 99) is None  # never timed
    assert m.predict(_conv(1, 96, 96, 20, 1, direction="bwd_data").key(), 1) is None  # other group


def test_leave_one_out_on_synthetic_records():
    recs = _synthetic()
    recs.append(_rec(recs[0].problem_key, 4, 1e-9, status="failed"))  # ignored
    v = learned.leave_one_out(recs)
    assert v["problems"] > 30
    assert v["rank_accuracy"] >= 0.85, v
    assert v["regret_geomean"] < 0.05 and v["regret_max"] < 1.5, v
    assert learned.leave_one_out([])["problems"] == 0


def test_model_serves_fast_mode_and_explain(solvers):
    a = solvers.add(1000, "t_a", estimate=1.0)
    b = solvers.add(1001, "t_b", estimate=2.0)
    solvers.add(1002, "t_new", estimate=1.0)  # no record: placed by its estimate, calibrated
    fp = finddb.device_fingerprint("cpu")
    near = ConvProblem.create("fwd", (1, 2, 7, 7), (3, 2, 3, 3), dtype=torch.float32, padding=1)
    finddb.user_db().write([_rec(near.key(), 1000, 0.8, fp), _rec(near.key(), 1001, 0.2, fp)])
    sols = nnprim.get_solutions(PROBLEM)
    assert [(s.solver, s.source) for s in sols] == [("t_b", "model"), ("t_new", "model-heuristic"),
                                                    ("t_a", "model")]
    # t_new: estimate 1.0 x geomean(prediction / estimate) of t_a and t_b
    pa, pb = sols[2].time_ms, sols[0].time_ms
    assert math.isclose(sols[1].time_ms, 1.0 * math.sqrt(pa / 1.0 * pb / 2.0), rel_tol=1e-9)
    nnprim.set_find_mode("fast")
    text = nnprim.explain(PROBLEM, file=None)
    assert "model: t_b:" in text and near.key() in text
    assert "would run: t_b (mode fast, from model: predicted" in text
    assert resolve(PROBLEM).name == "t_b" and a.calls == 0 and b.calls == 0


def test_system_db_records_train_the_model(clean, monkeypatch):
    """Records in the system db (read-only) feed the model; the user db comes first for exact hits."""
    path = clean / "sys.sqlite"
    finddb.create_empty(path)
    fp = "test-fp"
    key = _conv(4, 64, 64, 28, 3).key()
    db = finddb.FindDb(path)
    db.write([_rec(key, 1, 1.0, fp)])
    db.close()
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", str(path))
    finddb.forget_dbs()
    m = learned.model_for(fp)
    assert m is not None and m.predict(_conv(4, 64, 64, 32, 3).key(), 1).time_ms > 1.0
    assert learned.model_for("other-fp") is None
