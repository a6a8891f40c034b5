"""Find-db: round trip across processes, concurrent writers, corrupt file recovery,
unwritable cache dir, a writer killed mid-write, export/import, system db."""
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from search_helpers import PROBLEM, resolve

import nnprim
from nnprim.search import context, finddb

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FINDDB_FILE = finddb.__file__

# loads finddb.py on its own (standard library only): fast subprocesses without torch
_LOAD = textwrap.dedent(f"""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("finddb_standalone", {FINDDB_FILE!r})
    fdb = importlib.util.module_from_spec(spec)
    sys.modules["finddb_standalone"] = fdb
    spec.loader.exec_module(fdb)
""")


def _rec(key: str, sid: int, t: float = 1.0, status: str = "ok", device: str = "cpu:test") -> finddb.Record:
    return finddb.Record(device, finddb.SOLVER_SET_VERSION, key, "class", sid, f"s{sid}", "gemm", t, 0, status,
                         time.time())


def test_roundtrip_across_processes(solvers, clean):
    """A subprocess finds and records; this process reads it (immediate mode, no benchmark)."""
    fast = solvers.add(1000, "t_fast")
    solvers.add(1001, "t_slow", sleep_ms=5)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import nnprim
        from search_helpers import PROBLEM, REAL_FAMILIES, SolverSet
        reg = SolverSet()
        reg.add(1000, "t_fast")
        reg.add(1001, "t_slow", sleep_ms=5)
        nnprim.set_disabled(REAL_FAMILIES)
        print(nnprim.find(PROBLEM)[0].solver)
    """)
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "t_fast"
    sols = nnprim.get_solutions(PROBLEM)
    assert [s.solver for s in sols] == ["t_fast", "t_slow"]
    assert {s.source for s in sols} == {"user-db"}
    assert sols[0].time_ms <= sols[1].time_ms
    # hybrid (default): the db hit answers, nothing is benchmarked here
    assert resolve(PROBLEM).name == "t_fast" and fast.calls == 0


def test_eight_processes_fifty_writes_each_lose_nothing(tmp_path):
    path = str(tmp_path / "c" / "finddb.sqlite")
    script = _LOAD + textwrap.dedent(f"""
        db = fdb.FindDb({path!r})
        w = int(sys.argv[1])
        for i in range(50):
            db.write([fdb.Record("cpu:test", "1", f"p{{w}}-{{i}}", "c", 1000 + i % 3, "s", "gemm", 1.0 + i, 0, "ok",
                                 time.time())])
            if i % 10 == 0:
                db.lookup("cpu:test", "1", f"p{{w}}-{{i}}")  # readers interleave with writers
        print("done", w)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for w in range(8)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    db = finddb.FindDb(path)
    recs = db.all()
    assert len(recs) == 400
    assert {r.problem_key for r in recs} == {f"p{w}-{i}" for w in range(8) for i in range(50)}
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_corrupt_file_is_moved_aside_and_rebuilt(clean):
    cache = clean / "cache"
    cache.mkdir()
    (cache / "finddb.sqlite").write_bytes(os.urandom(8192))
    db = finddb.user_db()
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert db.lookup("cpu:test", "1", "k") == []
    db.write([_rec("k", 1000)])
    assert [r.solver_id for r in db.lookup("cpu:test", finddb.SOLVER_SET_VERSION, "k")] == [1000]
    assert any(p.name.startswith("finddb.sqlite.corrupt-") for p in cache.iterdir())


def test_corrupt_file_rebuilt_by_another_process_is_kept(tmp_path):
    """Two connections (as two processes) on a file whose pages go bad: the first to hit it
    moves it aside and rebuilds; the second, hitting the corruption on its old connection,
    must reopen the rebuilt file, not move it aside too (its records were lost that way)."""
    path = str(tmp_path / "finddb.sqlite")
    db0 = finddb.FindDb(path)
    db0.write([_rec(f"old{i}", 1000 + j) for i in range(200) for j in range(5)])
    db0.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    with open(path, "r+b") as f:
        for off in range(4096 * 2, os.path.getsize(path), 4096):
            f.seek(off + 50)
            f.write(os.urandom(500))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        b = finddb.FindDb(path)
        b._run(lambda c: None)                 # B opened the file before anyone saw it corrupt
        a = finddb.FindDb(path)
        a.write([_rec("A", 1000)])             # A: corrupt, moved aside, rebuilt
        b.lookup("cpu:test", finddb.SOLVER_SET_VERSION, "old3")
        b.write([_rec("B", 1000)])
        a.write([_rec("A2", 1000)])
    keys = {r[0] for r in sqlite3.connect(path).execute("SELECT problem_key FROM records")}
    assert {"A", "B", "A2"} <= keys
    assert len([p for p in os.listdir(tmp_path) if p.endswith(tuple("0123456789"))]) == 1   # one move aside


def test_a_connection_follows_its_file(tmp_path):
    """A file moved aside under an open connection: the next write goes to the file at the
    path, not to the moved one."""
    path = str(tmp_path / "finddb.sqlite")
    db = finddb.FindDb(path)
    db.write([_rec("first", 1000)])
    os.replace(path, path + ".elsewhere")
    db.write([_rec("second", 1000)])
    assert [r[0] for r in sqlite3.connect(path).execute("SELECT problem_key FROM records")] == ["second"]


def test_corrupt_pages_midway(clean, solvers):
    """A valid db whose pages are overwritten later: recovered while nnprim is in use."""
    solvers.add(1000, "t_fast")
    nnprim.find(PROBLEM)
    path = finddb.user_db_path()
    finddb.forget_dbs()
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(os.urandom(4096 * 2))
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    context.reset()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = nnprim.find(PROBLEM)  # db unreadable: benchmark again, rebuild, record
    assert res[0].solver == "t_fast"
    assert any("corrupt" in str(x.message) for x in w)
    assert [s.source for s in nnprim.get_solutions(PROBLEM)] == ["user-db"]


def test_unwritable_cache_dir_falls_back_to_memory(solvers, clean, monkeypatch):
    blocker = clean / "not-a-dir"
    blocker.write_text("a file where the cache dir should be")
    monkeypatch.setenv("NNPRIM_CACHE_DIR", str(blocker / "cache"))
    finddb.forget_dbs()
    solvers.add(1000, "t_fast")
    with pytest.warns(RuntimeWarning, match="in-memory"):
        res = nnprim.find(PROBLEM)
    assert res[0].solver == "t_fast"
    assert finddb.user_db().in_memory
    assert [s.source for s in nnprim.get_solutions(PROBLEM)] == ["user-db"]  # the memory db answers
    import torch
    y = nnprim.conv_forward(torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), padding=1)
    assert y.shape == (1, 3, 5, 5)


def test_readonly_db_file_falls_back_to_memory(clean):
    """A db file the process may not write (chmod has no effect as root: use a read-only
    open of an existing file via an unwritable journal instead)."""
    path = clean / "ro" / "finddb.sqlite"
    path.parent.mkdir()
    db = finddb.FindDb(path)
    db.write([_rec("k", 1000)])
    db.close()
    db2 = finddb.FindDb(path)
    db2._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
    db2._pid, db2._ident = os.getpid(), db2._file_id()
    with pytest.warns(RuntimeWarning, match="not writable"):
        db2.write([_rec("k2", 1001)])
    assert db2.in_memory
    assert [r.solver_id for r in db2.lookup("cpu:test", finddb.SOLVER_SET_VERSION, "k2")] == [1001]


def test_unwritable_file_is_still_read(tmp_path, monkeypatch):
    """A db the process can read but not open for writing (a read-only cache dir: WAL set-up
    fails): the in-memory stand-in starts with the file's records."""
    path = tmp_path / "finddb.sqlite"
    db = finddb.FindDb(path)
    db.write([_rec("k", 1000)])
    db.close()

    def refuse(self):
        raise sqlite3.OperationalError("unable to open database file")
    monkeypatch.setattr(finddb.FindDb, "_open_file", refuse)
    db2 = finddb.FindDb(path)
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert [r.solver_id for r in db2.lookup("cpu:test", finddb.SOLVER_SET_VERSION, "k")] == [1000]
    assert db2.in_memory
    db2.write([_rec("k2", 1001)])
    assert {r.problem_key for r in db2.all()} == {"k", "k2"}


def test_writer_killed_mid_write_leaves_readable_db(tmp_path):
    path = str(tmp_path / "finddb.sqlite")
    db = finddb.FindDb(path)
    db.write([_rec(f"seed{i}", 1000) for i in range(20)])
    db.close()
    script = _LOAD + textwrap.dedent(f"""
        db = fdb.FindDb({path!r})
        n = 0
        while True:
            db.write([fdb.Record("cpu:test", "1", f"bulk{{n}}-{{i}}", "c", 1000, "s", "gemm", 1.0, 0, "ok", time.time())
                      for i in range(500)])
            n += 1
            if n == 1:
                print("started", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "started"
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    db = finddb.FindDb(path)
    recs = db.all()
    keys = {r.problem_key for r in recs}
    assert {f"seed{i}" for i in range(20)} <= keys
    assert (len(recs) - 20) % 500 == 0 and len(recs) >= 520  # whole transactions only
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.write([_rec("after", 1000)])  # still writable
    assert len(db.all()) == len(recs) + 1
    db.close()


def test_export_import_clear(clean):
    db = finddb.user_db()
    db.write([_rec("a", 1000), _rec("b", 1001, status="wrong")])
    out = clean / "dump.json"
    assert db.export_json(out) == 2
    assert db.delete() == 2 and db.count() == 0
    assert db.import_json(out) == 2
    assert {r.problem_key: r.status for r in db.all()} == {"a": "ok", "b": "wrong"}
    assert db.delete(problem_key="a") == 1
    assert [r.problem_key for r in db.all()] == ["b"]


@pytest.mark.parametrize("bad", [dict(time_ms="fast"), dict(time_ms=-1.0), dict(status="great"),
                                 dict(solver_id="7"), dict(solver_id=True), dict(problem_key=None),
                                 dict(workspace=1.5), "not a record"])
def test_import_json_checks_every_record(clean, bad):
    """A bad field in a JSON import is refused with the record's index, and nothing of the
    file is written (a string time once broke every later call of that problem)."""
    db = finddb.user_db()
    db.write([_rec("a", 1000), _rec("b", 1001)])
    out = clean / "dump.json"
    db.export_json(out)
    import json
    data = json.loads(out.read_text())
    if isinstance(bad, dict):
        data["records"][1].update(bad)
    else:
        data["records"][1] = bad
    out.write_text(json.dumps(data))
    db.delete()
    with pytest.raises(ValueError, match="record 1"):
        db.import_json(out)
    assert db.count() == 0
    for top in ("5", "null", '{"records": 5}', "[1, 2"):
        out.write_text(top)
        with pytest.raises(ValueError):
            db.import_json(out)


def test_malformed_rows_are_skipped_when_read(tmp_path):
    """A row an older, unchecked import wrote (a text time): skipped with a log line, the
    others served (it raised in every later call of its problem)."""
    path = str(tmp_path / "finddb.sqlite")
    db = finddb.FindDb(path)
    db.write([_rec("k", 1000), _rec("k", 1001)])
    conn = sqlite3.connect(path)
    conn.execute("UPDATE records SET time_ms='fast' WHERE solver_id=1001")
    conn.commit()
    conn.close()
    assert [r.solver_id for r in db.lookup("cpu:test", finddb.SOLVER_SET_VERSION, "k")] == [1000]


def test_system_db_consulted_after_user_db(solvers, clean, monkeypatch):
    solvers.add(1000, "t_a")
    solvers.add(1001, "t_b")
    sys_path = clean / "system.sqlite"
    finddb.create_empty(sys_path)
    fp = finddb.device_fingerprint("cpu")
    w = finddb.FindDb(sys_path)
    w.write([finddb.Record(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key(), PROBLEM.class_key(), 1001, "t_b", "t_a",
                           0.5, 0, "ok", time.time())])
    w._connection().execute("PRAGMA journal_mode=DELETE")
    w.close()
    monkeypatch.setenv("NNPRIM_SYSTEM_DB", str(sys_path))
    finddb.forget_dbs()
    sols = nnprim.get_solutions(PROBLEM)
    assert [(s.solver, s.source) for s in sols] == [("t_b", "system-db")]
    # user db wins once it has the problem
    finddb.user_db().write([finddb.Record(fp, finddb.SOLVER_SET_VERSION, PROBLEM.key(), PROBLEM.class_key(), 1000,
                                          "t_a", "t_a", 0.9, 0, "ok", time.time())])
    assert [(s.solver, s.source) for s in nnprim.get_solutions(PROBLEM)] == [("t_a", "user-db")]
    with pytest.raises(PermissionError):
        finddb.system_db().write([_rec("x", 1)])


def test_shipped_system_db_opens():
    path = finddb.SYSTEM_DB_PATH
    assert path.exists()
    db = finddb.FindDb(path, readonly=True)
    assert db.count() >= 0
    db.close()
