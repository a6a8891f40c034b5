"""Incremental find: a user-db record made before a solver existed (or was enabled) gets
that solver timed alone, merged in, and the choice made again; fast mode never times;
solvers that are not candidates are never missing; schema-1 files migrate losslessly."""
import os
import sqlite3
import threading
import time

import torch
from search_helpers import PROBLEM, REAL_FAMILIES, resolve

import nnprim
from nnprim.search import context, finddb, modes
from nnprim.search.find import missing
from nnprim.search.immediate import Constraints


def _recs(key=PROBLEM.key()):
    fp = finddb.device_fingerprint("cpu")
    return {r.solver_name: r for r in finddb.user_db().lookup(fp, finddb.SOLVER_SET_VERSION, key)}


def _c(deterministic=False):
    return Constraints(finddb.device_fingerprint("cpu"), None, deterministic)


def _new_process():
    context.reset()
    finddb.forget_dbs()


def test_solver_added_after_the_record_is_timed_alone_and_wins(solvers):
    a = solvers.add(1000, "t_a", sleep_ms=4)
    b = solvers.add(1001, "t_b", sleep_ms=8)
    assert nnprim.find(PROBLEM)[0].solver == "t_a"
    assert {s.id for s in missing(PROBLEM, _c())} == set()
    _new_process()
    new = solvers.add(1002, "t_new")  # an upgrade registers a faster solver
    assert [s.name for s in missing(PROBLEM, _c())] == ["t_new"]
    b_calls = b.calls
    assert resolve(PROBLEM).name == "t_new"  # hybrid: the record is completed, then re-chosen
    assert b.calls == b_calls  # the other recorded solvers are not timed again
    assert new.calls > 0 and a.calls > 0  # the new one, interleaved with the recorded fastest
    recs = _recs()
    assert set(recs) == {"t_a", "t_b", "t_new"} and all(r.status == "ok" for r in recs.values())
    assert missing(PROBLEM, _c()) == []
    _new_process()  # the next process: a plain db hit, nothing timed
    calls = new.calls
    assert resolve(PROBLEM).name == "t_new" and new.calls == calls


def test_normal_mode_find_adds_missing_and_fast_mode_never_times(solvers):
    solvers.add(1000, "t_a", sleep_ms=4)
    nnprim.find(PROBLEM)
    _new_process()
    new = solvers.add(1001, "t_new")
    modes.set_find_mode("fast")
    assert resolve(PROBLEM).name == "t_a" and new.calls == 0  # the record as is
    modes.set_find_mode("normal")
    res = nnprim.find(PROBLEM)
    assert [r.solver for r in res] == ["t_new", "t_a"] and new.calls > 0
    assert set(_recs()) == {"t_a", "t_new"}


def test_not_applicable_disabled_or_interpreted_solvers_are_not_missing(solvers):
    solvers.add(1000, "t_a")
    nnprim.find(PROBLEM)
    _new_process()
    solvers.add(1001, "t_f16_only", dtypes=(torch.float16,))  # not applicable to an f32 problem
    off = solvers.add(1002, "t_off", family="t_off")
    modes.disable_families("t_off")
    assert missing(PROBLEM, _c()) == []
    assert resolve(PROBLEM).name == "t_a" and off.calls == 0
    modes.enable_families("t_off")  # enabled since the find: now missing
    modes.disable_families(*REAL_FAMILIES)
    assert [s.name for s in missing(PROBLEM, _c())] == ["t_off"]
    trit = solvers.add(1003, "t_triton")
    type(trit).uses_triton = True  # would run in the Triton interpreter on CPU: never timed
    assert [s.name for s in missing(PROBLEM, _c())] == ["t_off"]


def test_deterministic_records_kept_apart(solvers):
    solvers.add(1000, "t_a", sleep_ms=3)
    nnprim.set_deterministic(True)
    try:
        nnprim.find(PROBLEM)
        _new_process()
        nd = solvers.add(1001, "t_nondet")
        type(nd).deterministic = False
        assert missing(PROBLEM, _c(True)) == []  # not deterministic: not a candidate here
        assert resolve(PROBLEM).name == "t_a" and nd.calls == 0
    finally:
        nnprim.set_deterministic(False)
    assert missing(PROBLEM, _c()) == []  # no record of the free problem: a full find is due


def test_threads_add_a_missing_solver_once(solvers):
    solvers.add(1000, "t_a", sleep_ms=2)
    nnprim.find(PROBLEM)
    _new_process()
    new = solvers.add(1001, "t_new")
    got, errs = [], []

    def work():
        try:
            got.append(resolve(PROBLEM).name)
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs and got == ["t_new"] * 4
    calls = new.calls
    _new_process()
    assert resolve(PROBLEM).name == "t_new" and new.calls == calls


def test_schema_1_file_migrates_without_losing_records(solvers, clean):
    solvers.add(1000, "t_a", sleep_ms=3)
    solvers.add(1001, "t_b")
    path = finddb.user_db_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    conn = sqlite3.connect(path)  # a file as nnprim's schema 1 wrote it
    conn.executescript("""
        CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE records (device TEXT NOT NULL, solver_set TEXT NOT NULL, problem_key TEXT NOT NULL,
            class_key TEXT NOT NULL, solver_id INTEGER NOT NULL, solver_name TEXT NOT NULL, family TEXT NOT NULL,
            time_ms REAL, workspace INTEGER NOT NULL DEFAULT 0, status TEXT NOT NULL, timestamp REAL NOT NULL,
            PRIMARY KEY (device, solver_set, problem_key, solver_id));
        INSERT INTO meta VALUES ('schema_version', '1');""")
    fp = finddb.device_fingerprint("cpu")
    rows = [(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key(), PROBLEM.class_key(), 1000, "t_a", "t_a", 3.0, 0, "ok",
             time.time()), (fp, finddb.SOLVER_SET_VERSION, "other-key", "class", 7, "gone", "gemm", 1.0, 0, "ok",
                            time.time())]
    conn.executemany("INSERT INTO records VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.commit()
    conn.close()
    _new_process()
    db = finddb.user_db()
    assert db.count() == 2  # opened, migrated, nothing lost
    assert db.considered(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key()) is None  # unknown: the recorded ids
    assert [s.name for s in missing(PROBLEM, _c())] == ["t_b"]
    assert resolve(PROBLEM).name == "t_b"
    assert set(_recs()) == {"t_a", "t_b"} and db.count() == 3
    assert db.considered(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key()) >= {1000, 1001}
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()[0] == "2"
    conn.close()
    # a writer that does not keep the table (an older nnprim) rewrites the records: the row
    # is stale and ignored (the recorded ids count)
    old = finddb.Record(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key(), PROBLEM.class_key(), 1000, "t_a", "t_a",
                        3.0, 0, "ok", time.time() + 5)
    db.write([old])
    assert db.considered(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key()) is None
    assert db.delete(PROBLEM.key()) == 2


def test_readonly_schema_1_db_has_no_considered(clean):
    path = clean / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE records (device TEXT, solver_set TEXT, problem_key TEXT, solver_id INTEGER,"
                       " timestamp REAL);")
    conn.close()
    db = finddb.FindDb(path, readonly=True)
    assert db.considered("cpu:x", "1", "k") is None


def test_two_connections_merge_without_losing_records(clean):
    """Two processes completing one record at once: every solver's record survives."""
    path = clean / "shared.sqlite"
    one, two = finddb.FindDb(path), finddb.FindDb(path)

    def rec(sid, t):
        return finddb.Record("cpu:x", "1", "k", "c", sid, f"s{sid}", "gemm", t, 0, "ok", time.time())
    one.replace_problem("cpu:x", "1", "k", [rec(1, 2.0)], considered=[1])
    errs = []

    def work(db, sid):
        try:
            for i in range(20):
                db.merge_problem("cpu:x", "1", "k", [rec(sid, 1.0 + i)], [sid])
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)
    ts = [threading.Thread(target=work, args=(db, sid)) for db, sid in ((one, 2), (two, 3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs
    assert {r.solver_id for r in two.lookup("cpu:x", "1", "k")} == {1, 2, 3}
    assert one.considered("cpu:x", "1", "k") == {1, 2, 3}


def test_dynamic_hybrid_keeps_the_long_compile_records_it_skips(solvers):
    solvers.add(1000, "t_long", long_compile=True)
    nnprim.find(PROBLEM)
    _new_process()
    solvers.add(1001, "t_new", sleep_ms=2)
    modes.set_find_mode("dynamic_hybrid")
    assert [s.name for s in missing(PROBLEM, _c(), dynamic_only=True)] == ["t_new"]
    resolve(PROBLEM)
    assert set(_recs()) == {"t_long", "t_new"}  # the skipped solver's record is not lost
    assert missing(PROBLEM, _c()) == [] and missing(PROBLEM, _c(), dynamic_only=True) == []


def test_system_record_missing_a_solver_is_adopted_and_completed(solvers, tmp_path, monkeypatch):
    """A shipped system record made before a solver existed: hybrid copies it into the user
    db and times only the new solver with the recorded fastest (not a full find)."""
    solvers.add(1000, "t_a", sleep_ms=4)
    slow = solvers.add(1001, "t_b", sleep_ms=8)
    nnprim.find(PROBLEM)
    system = finddb.user_db_path()             # this db becomes the "shipped" one
    _new_process()
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", system)
    monkeypatch.setenv("NNPRIM_CACHE_DIR", str(tmp_path / "fresh-cache"))
    assert resolve(PROBLEM).name == "t_a" and not _recs()   # the system record answers as is
    _new_process()
    new = solvers.add(1002, "t_new")
    slow_calls = slow.calls
    assert resolve(PROBLEM).name == "t_new"
    assert slow.calls == slow_calls and new.calls > 0        # incremental, not a full find
    assert set(_recs()) == {"t_a", "t_b", "t_new"}           # the merged record lives in the user db
    fp = finddb.device_fingerprint("cpu")
    assert len(finddb.system_db().lookup(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key())) == 2   # untouched
