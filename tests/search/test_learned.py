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


def _conv(n, c, k, hw, f, s=1, g=1, direction="fwd", layout="nchw"):
    return ConvProblem.create(direction, (n, c, hw, hw), (k, c // g, f, f), dtype=torch.bfloat16, stride=s,
                              padding=f // 2, groups=g, device="cuda", layout=layout)


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
    # t_new: estimate 1.0 x geomean(prediction / estimate) of t_a and t_b x the unknown penalty
    pa, pb = sols[2].time_ms, sols[0].time_ms
    assert math.isclose(sols[1].time_ms, learned.UNKNOWN_PENALTY * math.sqrt(pa / 1.0 * pb / 2.0), rel_tol=1e-9)
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
    key = _conv(64, 256, 256, 28, 3).key()
    measured = 3.0 * learned.base_ms(key, 1)          # the solver 3x slower than its estimate
    db = finddb.FindDb(path)
    db.write([_rec(key, 1, measured, fp)])
    db.close()
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", str(path))
    finddb.forget_dbs()
    m = learned.model_for(fp)
    assert m is not None
    at, bigger = m.predict(key, 1).time_ms, m.predict(_conv(64, 256, 256, 56, 3).key(), 1).time_ms
    # the record itself, and 4x the work predicted slower (the estimate's scaling, the correction
    # shrunk towards none as the neighbour gets farther)
    assert 0.9 * measured < at < 1.1 * measured and 2 * at < bigger < 4 * at
    assert learned.model_for("other-fp") is None


def _corrected(seed=1, count=50):
    """Two registered GPU solvers whose real times are their estimates times a factor that
    depends on the filter: gemm_fwd (30) 2.5x slower than its estimate on 3x3 filters, exact
    on 1x1; implicit_gemm_fwd (20) exact on 3x3, 2.5x slower on 1x1 (3x would tie the two at
    their host floors: 3 x 0.025 ms = 0.075 ms)."""
    from nnprim.search.solver import REGISTRY
    rnd = random.Random(seed)
    recs, ig, gm = [], REGISTRY.get(20), REGISTRY.get(30)
    for _ in range(count):
        p = _conv(rnd.choice([1, 8, 32]), rnd.choice([64, 128, 256]), rnd.choice([64, 128, 256]),
                  rnd.choice([14, 28, 56]), rnd.choice([1, 3]), layout="nhwc")
        f3 = p.filter == (3, 3)
        recs.append(_rec(p.key(), 20, ig.estimate(p) * (1.0 if f3 else 2.5)))
        recs.append(_rec(p.key(), 30, gm.estimate(p) * (2.5 if f3 else 1.0)))
    return recs


def test_prediction_is_the_estimate_corrected_by_neighbours():
    from nnprim.search.solver import REGISTRY
    m = learned.Model(_corrected())
    for f, fac20, fac30 in ((3, 1.0, 2.5), (1, 2.5, 1.0)):
        p = _conv(4, 96, 192, 20, f, layout="nhwc")  # in no record: sizes between the recorded ones
        for sid, fac in ((20, fac20), (30, fac30)):
            pred = m.predict(p.key(), sid)
            est = REGISTRY.get(sid).estimate(p)
            assert math.isclose(pred.base_ms, est, rel_tol=1e-12)
            assert 0.8 * fac < pred.time_ms / est < 1.25 * fac, (f, sid, pred)
            assert "nearest records" in pred.why()
    v = learned.leave_one_out(_corrected())
    assert v["rank_accuracy"] == 1.0 and v["regret_max"] == 0.0 and v["model_problems"] == v["problems"] > 30
    for split in ("hash_split", "class_split", "heuristic"):
        assert set(v[split]) == {"problems", "rank_accuracy", "regret_geomean", "regret_max"}
    assert v["hash_split"]["rank_accuracy"] == 1.0
    # each filter size is its own class: held out, nothing tells the model about the factor
    assert v["class_split"]["problems"] == v["problems"]


def test_place_ranks_unpredicted_solvers_by_calibrated_estimates():
    placed = learned.place({1: 2.0, 2: 8.0, 3: None, 4: None}, {1: 1.0, 2: 2.0, 3: 1.0, 4: None})
    assert placed[1] == (2.0, "model") and placed[2] == (8.0, "model")
    assert math.isclose(placed[3][0], 1.0 * math.sqrt(2.0 * 4.0) * learned.UNKNOWN_PENALTY)
    assert placed[3][1] == "model-heuristic" and math.isinf(placed[4][0])
    assert learned.place({1: None}, {1: 1.0}) == {}


def test_model_of_cuda_records_explains_on_cpu(monkeypatch, clean):
    """The shipped H200 db's records serve a "cuda" problem on a machine without a GPU: the
    estimates read the problem's device, not this machine's."""
    import pathlib
    db = finddb.FindDb(str(pathlib.Path(nnprim.__file__).parent / "data" / "system_finddb.sqlite"),
                       readonly=True)
    recs = db.for_device("cuda:NVIDIA H200:sm90", finddb.SOLVER_SET_VERSION)
    if not recs:
        import pytest
        pytest.skip("no H200 records shipped")
    m = learned.Model(recs)
    p = _conv(16, 128, 128, 28, 3)  # not in the db
    preds = {sid: m.predict(p.key(), sid) for sid in (20, 30, 50)}
    assert all(v is not None and v.time_ms > 0 and v.base_ms > 0 for v in preds.values()), preds


def test_predict_many_lends_a_far_solver_the_others_correction():
    """Solver 20 recorded next to the problem at 2x its estimate, solver 30 only far away:
    ranked together, 30 takes the difference of trust from 20's correction (the region's
    shared slowness) instead of falling back to its bare estimate; alone it does not."""
    near = [_conv(n, 128, 128, 28, 3, layout="nhwc") for n in (4, 8, 16)]
    far = _conv(128, 1024, 1024, 7, 1, layout="nhwc")
    from nnprim.search.solver import REGISTRY
    recs = [_rec(p.key(), 20, 2.0 * REGISTRY.get(20).estimate(p)) for p in near]
    recs.append(_rec(far.key(), 30, REGISTRY.get(30).estimate(far)))
    m = learned.Model(recs)
    key = _conv(8, 128, 128, 32, 3, layout="nhwc").key()
    alone = m.predict(key, 30)
    both = m.predict_many(key, [20, 30])
    assert both[20].time_ms == m.predict(key, 20).time_ms and both[20].shared == 0.0
    assert both[30].shared > 0.3 and both[30].time_ms > 1.3 * alone.time_ms
    assert "other solvers' correction" in both[30].why()


def test_revised_solvers_records_are_left_out_and_variants_priced_as_their_base():
    """129 (127 with ordered dQ adds) was revised after its records were made: they no longer
    describe it and the model leaves them out; 129 is then priced as 127 (Solver.priced_as):
    127's prediction times the ratio of their estimates (ORDERED_COST)."""
    from nnprim.search.solver import REGISTRY
    s127, s129 = REGISTRY.get(127), REGISTRY.get(129)
    assert s129.priced_as == 127 and s129.revised_at() > 0 and s127.revised_at() == 0.0

    def bwd(b, s, causal=None):
        q, kv = torch.empty(b, 16, s, 128), torch.empty(b, 4, s, 128)
        return AttentionProblem.from_tensors(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), causal=causal,
                                             direction="bwd").key().replace("-cpu-", "-cuda-")

    keys = [bwd(b, s) for b, s in ((1, 2048), (2, 4096), (4, 1024))]
    recs = [_rec(k, 127, 1.3 * learned.base_ms(k, 127)) for k in keys]
    recs += [_rec(k, 129, 2.0 * learned.base_ms(k, 127)) for k in keys]    # made before the revision
    m = learned.Model(recs)
    assert m.stale == len(keys)
    key = bwd(2, 2048)
    preds = m.predict_many(key, [129, 111])
    base = m.predict(key, 127)
    ratio = learned.base_ms(key, 129) / learned.base_ms(key, 127)
    assert preds[111] is None and preds[129].priced_as == 127
    assert math.isclose(preds[129].time_ms, base.time_ms * ratio, rel_tol=1e-9)
    assert "records of solver 127" in preds[129].why()
    assert m.predict(key, 129) is None   # alone (predict): its own records only
