"""The system find-db: build-system over suites and model layers, its sorted text export
and import, consulted after the user db, never written by calls; model-check."""
import json

from search_helpers import PROBLEM, resolve, run

import nnprim
from nnprim.cli import main as cli_main
from nnprim.search import finddb
from nnprim.search.random_args import random_args


def _rec(problem, sid, name, t, fp=None):
    fp = fp or finddb.device_fingerprint(problem.device)
    return finddb.Record(fp, finddb.SOLVER_SET_VERSION, problem.key(), problem.class_key(), sid, name, "t_a", t, 0,
                         "ok", 1.0)


def test_build_system_with_model_layers_and_text_export(solvers, clean, capsys):
    solvers.add(1000, "t_a", directions=("fwd", "bwd_data", "bwd_weights"))
    out = clean / "sys.sqlite"
    assert cli_main(["db", "build-system", "--suite", "conv_cpu", "--direction", "fwd", "--models", "resnet,unet",
                     "--count", "3", "--scale", "tiny", "--device", "cpu", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "find 10/10" in err  # 7 suite problems + 3 model layers
    db = finddb.FindDb(out, readonly=True)
    recs = db.all()
    assert {r.device for r in recs} == {finddb.device_fingerprint("cpu")}
    keys = {r.problem_key for r in recs}
    assert len(keys) == 10
    tsv = clean / "sys.tsv"
    lines = tsv.read_text().splitlines()
    assert lines[0].split("\t") == list(finddb.FindDb.TSV_COLUMNS) and len(lines) == len(recs) + 1
    assert lines[1:] == sorted(lines[1:], key=lambda ln: (ln.split("\t")[0], ln.split("\t")[1], ln.split("\t")[2],
                                                          int(ln.split("\t")[4])))
    # a second build merges: records of other problems stay
    assert cli_main(["db", "build-system", "--suite", "conv_cpu", "--direction", "fwd", "--models", "none",
                     "--device", "cpu", "--out", str(out)]) == 0
    assert {r.problem_key for r in finddb.FindDb(out, readonly=True).all()} == keys
    # the text export rebuilds the same db
    again = clean / "again.sqlite"
    assert cli_main(["db", "import", str(tsv), "--into", str(again)]) == 0
    a = sorted((r.problem_key, r.solver_id, r.status) for r in finddb.FindDb(again, readonly=True).all())
    assert a == sorted((r.problem_key, r.solver_id, r.status) for r in recs)
    assert not (clean / "again.sqlite-wal").exists()  # sealed: one self-contained file


def test_build_system_refind_solver_finds_again_the_problems_it_holds(solvers, clean, capsys):
    solvers.add(1000, "t_a", directions=("fwd",), estimate=1.0)
    solvers.add(1001, "t_b", directions=("fwd",), estimate=2.0)
    out = clean / "sys.sqlite"
    assert cli_main(["db", "build-system", "--suite", "conv_cpu", "--direction", "fwd", "--models", "none",
                     "--device", "cpu", "--out", str(out)]) == 0
    capsys.readouterr()
    db = finddb.FindDb(out)
    recs = db.all()
    stale = sorted({r.problem_key for r in recs})[:2]
    # t_b's kernel "changed" on two problems; the others lose their t_b records (not to be refound)
    db.delete()
    db.write([r for r in recs if r.solver_id == 1000 or r.problem_key in stale])
    db.seal()
    before = {(r.problem_key, r.solver_id): r.timestamp for r in finddb.FindDb(out, readonly=True).all()}
    assert cli_main(["db", "build-system", "--refind-solver", "t_b", "--device", "cpu", "--out", str(out)]) == 0
    assert "find 2/2" in capsys.readouterr().err
    after = {(r.problem_key, r.solver_id): r.timestamp for r in finddb.FindDb(out, readonly=True).all()}
    assert after.keys() == before.keys()
    assert {k for k in after if after[k] > before[k]} == {(k, s) for k in stale for s in (1000, 1001)}
    # by key: the problems whose keys contain the part, whatever their records hold
    part = stale[0].split("-n")[1][:12]
    assert cli_main(["db", "build-system", "--refind-key", part, "--device", "cpu", "--out", str(out)]) == 0
    assert "find 1/1" in capsys.readouterr().err
    again = {(r.problem_key, r.solver_id): r.timestamp for r in finddb.FindDb(out, readonly=True).all()}
    assert {k for k in again if again[k] > after[k]} == {(stale[0], s) for s in (1000, 1001)}


def test_build_system_time_budget_keeps_what_it_found(solvers, clean, capsys):
    solvers.add(1000, "t_a", directions=("fwd",))
    out = clean / "budget.sqlite"
    assert cli_main(["db", "build-system", "--suite", "conv_cpu", "--direction", "fwd", "--models", "none",
                     "--device", "cpu", "--time-budget", "0", "--out", str(out)]) == 0
    assert "time budget spent: 7 problems not found" in capsys.readouterr().err
    assert finddb.FindDb(out, readonly=True).all() == []  # a valid, sealed, empty db
    assert (clean / "budget.tsv").read_text().splitlines() == ["\t".join(finddb.FindDb.TSV_COLUMNS)]


def test_tsv_round_trip_and_bad_files(clean, capsys):
    db = finddb.user_db()
    db.write([_rec(PROBLEM, 1000, "t_a", 0.123456789), _rec(PROBLEM, 1001, "t_b", None)])
    path = clean / "x.tsv"
    assert cli_main(["db", "export", str(path)]) == 0
    assert "0.123457" in path.read_text()
    db.delete()
    assert cli_main(["db", "import", str(path)]) == 0
    assert {(r.solver_id, r.time_ms) for r in db.all()} == {(1000, 0.123457), (1001, None)}
    bad = clean / "bad.tsv"
    bad.write_text("device\tnope\n")
    assert cli_main(["db", "import", str(bad)]) == 2
    assert "not a find-db export" in capsys.readouterr().err


def test_system_db_consulted_after_user_db_and_never_written(solvers, clean, monkeypatch):
    solvers.add(1000, "t_a", estimate=1.0)
    solvers.add(1001, "t_b", estimate=2.0)
    path = clean / "sys.sqlite"
    finddb.create_empty(path)
    sdb = finddb.FindDb(path)
    sdb.write([_rec(PROBLEM, 1001, "t_b", 0.1), _rec(PROBLEM, 1000, "t_a", 0.5)])
    sdb.seal()
    before = path.read_bytes()
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", str(path))
    finddb.forget_dbs()
    sols = nnprim.get_solutions(PROBLEM)
    assert [(s.solver, s.source) for s in sols] == [("t_b", "system-db"), ("t_a", "system-db")]
    run(PROBLEM, random_args(PROBLEM))  # hybrid: a system-db hit, no find
    assert resolve(PROBLEM).name == "t_b" and finddb.user_db().count() == 0
    finddb.user_db().write([_rec(PROBLEM, 1000, "t_a", 0.05)])  # the user db comes first
    assert [(s.solver, s.source) for s in nnprim.get_solutions(PROBLEM)] == [("t_a", "user-db")]
    nnprim.find(PROBLEM, refind=True)  # records go to the user db only
    assert path.read_bytes() == before


def test_model_check_cli(clean, capsys):
    import torch

    from nnprim.problems.conv import ConvProblem
    fp = finddb.device_fingerprint("cpu")
    recs = []
    for n in (1, 2, 4, 8, 16):
        p = ConvProblem.create("fwd", (n, 8, 16, 16), (8, 8, 3, 3), dtype=torch.float32, padding=1)
        recs += [_rec(p, 10, "a", 1.0 * n, fp), _rec(p, 11, "b", 0.5 * n, fp)]
    finddb.user_db().write(recs)
    assert cli_main(["db", "model-check"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["problems"] == 5 and v["rank_accuracy"] == 1.0 and v["regret_max"] == 0.0
