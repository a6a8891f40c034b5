"""The find-db: SQLite records of find's measurements (MIOpen's user/system find-db).

One row per (device fingerprint, solver-set version, problem key, solver id):
class key (for nearest-match), solver name and family, time_ms, workspace bytes,
status ("ok", "wrong": disagreed with the reference, "failed": raised) and a timestamp.
Since schema 2 a second table, `considered`, keeps per problem the solver ids its find
considered (its candidates, timed or cut by the budget), so that a solver registered
later (or enabled later) is known to be missing from the record and can be timed alone
(find.missing). Schema-1 files gain the table when opened; their problems have no row
and count as having considered exactly the solvers they hold records of.

- User db: `$NNPRIM_CACHE_DIR/finddb.sqlite` (default `~/.cache/nnprim`). Many processes
  may read and write at once: WAL journal, a busy timeout, every write one short
  `BEGIN IMMEDIATE` transaction retried while the file is locked. A writer killed
  mid-transaction leaves the previous records intact (SQLite's atomic commit).
- A corrupt or unreadable file is reported once, moved aside to `*.corrupt-<time>`
  and rebuilt empty; an unwritable cache directory falls back to an in-memory db,
  with a warning. Neither ever crashes the caller.
- System db: `nnprim/data/system_finddb.sqlite`, shipped read-only (opened immutable:
  normal calls never write it), consulted after the user db; its sorted text export
  `nnprim/data/system_finddb.tsv` is what review diffs (build both with
  `nnprim db build-system`, see nnprim/data/README.md).

This module needs only the standard library (torch is imported lazily for the
device fingerprint), so tools and tests can load it on its own."""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import sqlite3
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("nnprim.finddb")

SCHEMA_VERSION = 2
SOLVER_SET_VERSION = "1"  # bump when solvers change meaning so that old records are ignored
DB_NAME = "finddb.sqlite"
SYSTEM_DB_PATH = Path(__file__).resolve().parent.parent / "data" / "system_finddb.sqlite"
BUSY_TIMEOUT_MS = 15000
STATUSES = ("ok", "wrong", "failed")

_COLUMNS = ("device", "solver_set", "problem_key", "class_key", "solver_id", "solver_name", "family",
            "time_ms", "workspace", "status", "timestamp")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    device      TEXT NOT NULL,
    solver_set  TEXT NOT NULL,
    problem_key TEXT NOT NULL,
    class_key   TEXT NOT NULL,
    solver_id   INTEGER NOT NULL,
    solver_name TEXT NOT NULL,
    family      TEXT NOT NULL,
    time_ms     REAL,
    workspace   INTEGER NOT NULL DEFAULT 0,
    status      TEXT NOT NULL,
    timestamp   REAL NOT NULL,
    PRIMARY KEY (device, solver_set, problem_key, solver_id)
);
CREATE INDEX IF NOT EXISTS records_class ON records (device, solver_set, class_key);
""" + """
CREATE TABLE IF NOT EXISTS considered (
    device      TEXT NOT NULL,
    solver_set  TEXT NOT NULL,
    problem_key TEXT NOT NULL,
    solver_ids  TEXT NOT NULL,
    timestamp   REAL NOT NULL,
    PRIMARY KEY (device, solver_set, problem_key)
);
"""


@dataclass(frozen=True)
class Record:
    device: str
    solver_set: str
    problem_key: str
    class_key: str
    solver_id: int
    solver_name: str
    family: str
    time_ms: float | None
    workspace: int
    status: str
    timestamp: float

    def row(self) -> tuple:
        return tuple(getattr(self, c) for c in _COLUMNS)


def checked_record(r: Record, where: str) -> Record:
    """r, its fields' types and values checked (imports: a bad value must not reach the db)."""
    for c in ("device", "solver_set", "problem_key", "class_key", "solver_name", "family", "status"):
        v = getattr(r, c)
        if not isinstance(v, str) or (c in ("device", "solver_set", "problem_key") and not v):
            raise ValueError(f"{where}: {c}={v!r} must be a non-empty string" if c in ("device", "solver_set",
                             "problem_key") else f"{where}: {c}={v!r} must be a string")
    if r.status not in STATUSES:
        raise ValueError(f"{where}: status {r.status!r} is not one of {STATUSES}")
    for c in ("solver_id", "workspace"):
        v = getattr(r, c)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: {c}={v!r} must be a non-negative int")
    t = r.time_ms
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
        raise ValueError(f"{where}: time_ms={t!r} must be a non-negative number or null")
    if isinstance(r.timestamp, bool) or not isinstance(r.timestamp, (int, float)):
        raise ValueError(f"{where}: timestamp={r.timestamp!r} must be a number")
    return r


def _ids_text(ids) -> str:
    return ",".join(str(i) for i in sorted({int(i) for i in ids}))


def _parse_ids(text: str) -> frozenset[int]:
    return frozenset(int(v) for v in text.split(",") if v.strip().lstrip("-").isdigit())


def _is_busy(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg)


def _is_corrupt(e: BaseException) -> bool:
    """SQLITE_CORRUPT / SQLITE_NOTADB surface as DatabaseError (not its OperationalError child)."""
    if isinstance(e, sqlite3.DatabaseError) and not isinstance(e, sqlite3.OperationalError):
        return True
    msg = str(e).lower()
    return "malformed" in msg or "not a database" in msg


class FindDb:
    """A find-db file (or memory). Thread-safe; one connection per process (re-opened
    after a fork). `readonly` opens an existing file immutably (the system db)."""

    def __init__(self, path: str | os.PathLike | None, *, readonly: bool = False) -> None:
        self.path = None if path is None else str(path)
        self.readonly = readonly
        self.in_memory = self.path is None
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._ident: tuple[int, int] | None = None     # (device, inode) of the file the connection opened
        self._reported: set[str] = set()

    def __repr__(self) -> str:
        return f"<FindDb {self.path or ':memory:'}{' ro' if self.readonly else ''}>"

    # ---- connection ----------------------------------------------------------------------
    def _warn_once(self, what: str, msg: str) -> None:
        if what in self._reported:
            log.debug(msg)
            return
        self._reported.add(what)
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _file_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _open_file(self) -> sqlite3.Connection:
        if self.readonly:
            uri = Path(self.path).as_uri() + "?mode=ro&immutable=1"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            conn.execute("SELECT count(*) FROM records").fetchone()
            return conn
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"records", "considered"} <= tables:
                # a new file, or a schema-1 file gaining the considered table: additive and
                # idempotent (IF NOT EXISTS), existing records untouched; safe when processes race
                conn.executescript(_SCHEMA)
                old = conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
                version = max(SCHEMA_VERSION, int(old[0])) if old and str(old[0]).isdigit() else SCHEMA_VERSION
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(version),))
        except BaseException:
            conn.close()
            raise
        self._ident = self._file_id()
        return conn

    def _open(self) -> sqlite3.Connection:
        if self.in_memory:
            conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            conn.executescript(_SCHEMA)
            if self.path is not None:
                self._copy_readable_file(conn)
            return conn
        for attempt in range(40):
            found = None if self.readonly else self._file_id()
            try:
                return self._open_file()
            except sqlite3.Error as e:
                if _is_busy(e):
                    time.sleep(min(0.5, 0.01 * 2 ** attempt))
                    continue
                if self.readonly:
                    raise
                if _is_corrupt(e):
                    self._move_aside(e, found)
                    continue
                self._to_memory(e)
                return self._open()
            except OSError as e:
                if self.readonly:
                    raise
                self._to_memory(e)
                return self._open()
        raise sqlite3.OperationalError(f"find-db {self.path} stayed locked")

    def _copy_readable_file(self, conn: sqlite3.Connection) -> None:
        """The memory db that stands in for a file this process cannot write starts with the
        file's records when it can read them (a read-only cache dir once hid every record)."""
        if not os.path.isfile(self.path):
            return
        uri = Path(self.path).as_uri() + "?mode=ro&immutable=1"
        try:
            src = sqlite3.connect(uri, uri=True)
            try:
                for table in ("records", "considered"):
                    rows = src.execute(f"SELECT * FROM {table}").fetchall()
                    if rows:
                        conn.executemany(f"INSERT OR REPLACE INTO {table} VALUES "
                                         f"({', '.join('?' * len(rows[0]))})", rows)
            finally:
                src.close()
        except sqlite3.Error as e:
            log.debug("find-db %s not readable either: %s", self.path, e)

    def _to_memory(self, why: BaseException) -> None:
        self._warn_once("memory", f"nnprim find-db {self.path} is not writable ({why}); "
                                  "using an in-memory find-db for this process")
        self.in_memory = True

    def _move_aside(self, why: BaseException, ident: tuple[int, int] | None) -> None:
        """Move the corrupt file `ident` (the one this process found corrupt) aside; when the
        path holds another file by now (another process moved it aside and rebuilt it), that
        healthy file stays and is reopened (moving it lost its records)."""
        self.close()
        if ident is not None and self._file_id() != ident:
            log.debug("find-db %s was replaced since it read as corrupt here (%s); reopening", self.path, why)
            return
        dest = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self._warn_once("corrupt", f"nnprim find-db {self.path} is corrupt or unreadable ({why}); "
                                   f"moved aside to {dest} and rebuilt")
        self.close()
        try:
            os.replace(self.path, dest)
        except FileNotFoundError:
            pass  # another process moved it first
        except OSError as e:
            self._to_memory(e)
            return
        for suffix in ("-wal", "-shm", "-journal"):
            try:
                os.replace(self.path + suffix, dest + suffix)
            except OSError:
                pass

    def _connection(self) -> sqlite3.Connection:
        if (self._conn is not None and self._pid == os.getpid() and not self.in_memory and not self.readonly
                and self._file_id() != self._ident):
            self.close()      # moved aside (or replaced) by another process: its writes would be lost there
        if self._conn is None or self._pid != os.getpid():
            self._conn = self._open()
            self._pid = os.getpid()
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                try:
                    self._conn.close()
                except sqlite3.Error:
                    pass
            self._conn = None

    def _run(self, op, *, write: bool = False):
        """Run op(conn); retry while locked; recover once from a corrupt file."""
        with self._lock:
            recovered = False
            for attempt in range(60):
                try:
                    conn = self._connection()
                    if not write:
                        return op(conn)
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        out = op(conn)
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                        raise
                    return out
                except sqlite3.Error as e:
                    if _is_busy(e):
                        time.sleep(min(0.25, 0.005 * 2 ** min(attempt, 6)))
                        continue
                    if self.readonly:
                        log.debug("read-only find-db %s unusable: %s", self.path, e)
                        return op(None) if not write else None
                    if _is_corrupt(e) and not recovered and not self.in_memory:
                        recovered = True
                        self._move_aside(e, self._ident)
                        continue
                    if not self.in_memory and isinstance(e, sqlite3.OperationalError) and write:
                        # e.g. "attempt to write a readonly database", disk full: keep going in memory
                        self.close()
                        self._to_memory(e)
                        continue
                    raise
            raise sqlite3.OperationalError(f"find-db {self.path} stayed locked")

    # ---- queries ---------------------------------------------------------------------------
    @staticmethod
    def _records(conn, where: str = "", params: tuple = ()) -> list[Record]:
        if conn is None:
            return []
        cur = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM records {where}", params)
        out = []
        for row in cur.fetchall():
            try:
                out.append(checked_record(Record(*row), "find-db record"))
            except ValueError as e:     # written by an older import that did not check: skipped
                log.warning("%s; skipped", e)
        return out

    def lookup(self, device: str, solver_set: str, problem_key: str) -> list[Record]:
        return self._run(lambda c: self._records(
            c, "WHERE device=? AND solver_set=? AND problem_key=? ORDER BY time_ms",
            (device, solver_set, problem_key)))

    def by_class(self, device: str, solver_set: str, class_key: str) -> list[Record]:
        return self._run(lambda c: self._records(
            c, "WHERE device=? AND solver_set=? AND class_key=?", (device, solver_set, class_key)))

    def for_device(self, device: str, solver_set: str) -> list[Record]:
        return self._run(lambda c: self._records(c, "WHERE device=? AND solver_set=?", (device, solver_set)))

    def version(self, device: str, solver_set: str) -> tuple:
        """(records, latest timestamp) of one device: changes whenever its records do."""
        return self._run(lambda c: () if c is None else tuple(c.execute(
            "SELECT count(*), max(timestamp) FROM records WHERE device=? AND solver_set=?",
            (device, solver_set)).fetchone()))

    def all(self) -> list[Record]:
        return self._run(lambda c: self._records(c, "ORDER BY device, solver_set, problem_key, time_ms"))

    def summary(self) -> list[tuple[str, str, str, int, str | None, float | None]]:
        """(device, solver_set, problem_key, n records, fastest ok solver, its time)."""
        def q(c):
            if c is None:
                return []
            return c.execute(
                "SELECT device, solver_set, problem_key, count(*), "
                "(SELECT solver_name FROM records r2 WHERE r2.device=r.device AND r2.solver_set=r.solver_set "
                " AND r2.problem_key=r.problem_key AND r2.status='ok' ORDER BY time_ms LIMIT 1), "
                "min(CASE WHEN status='ok' THEN time_ms END) "
                "FROM records r GROUP BY device, solver_set, problem_key ORDER BY problem_key").fetchall()
        return self._run(q)

    def considered(self, device: str, solver_set: str, problem_key: str) -> frozenset[int] | None:
        """The solver ids the last find of a problem considered; None when unknown (a record
        of schema 1, an import, a db without the table, or records written after the row by
        a writer that does not keep it)."""
        def q(c):
            if c is None:
                return None
            try:
                row = c.execute("SELECT solver_ids, timestamp FROM considered WHERE device=? AND solver_set=? "
                                "AND problem_key=?", (device, solver_set, problem_key)).fetchone()
            except sqlite3.OperationalError as e:  # a read-only db of schema 1
                if "no such table" in str(e):
                    return None
                raise
            if row is None:
                return None
            newest = c.execute("SELECT max(timestamp) FROM records WHERE device=? AND solver_set=? AND problem_key=?",
                               (device, solver_set, problem_key)).fetchone()[0]
            if newest is not None and newest > row[1]:
                return None
            return _parse_ids(row[0])
        return self._run(q)

    def count(self) -> int:
        return self._run(lambda c: 0 if c is None else c.execute("SELECT count(*) FROM records").fetchone()[0])

    # ---- writes ------------------------------------------------------------------------------
    def write(self, records: list[Record]) -> None:
        """Insert or replace records in one short transaction."""
        if self.readonly:
            raise PermissionError(f"{self!r} is read-only")
        rows = [r.row() for r in records]
        if not rows:
            return
        sql = f"INSERT OR REPLACE INTO records ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
        self._run(lambda c: c.executemany(sql, rows), write=True)

    def replace_problem(self, device: str, solver_set: str, problem_key: str, records: list[Record],
                        considered=None) -> None:
        """Atomically replace every record of one problem (a re-find); `considered`: the
        solver ids its find considered (None: unknown, the row is dropped)."""
        sql = f"INSERT OR REPLACE INTO records ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
        rows = [r.row() for r in records]
        where = (device, solver_set, problem_key)

        def op(c):
            c.execute("DELETE FROM records WHERE device=? AND solver_set=? AND problem_key=?", where)
            c.execute("DELETE FROM considered WHERE device=? AND solver_set=? AND problem_key=?", where)
            c.executemany(sql, rows)
            if considered is not None:
                stamp = max((r.timestamp for r in records), default=time.time())
                c.execute("INSERT INTO considered VALUES (?, ?, ?, ?, ?)", (*where, _ids_text(considered), stamp))
        self._run(op, write=True)

    def merge_problem(self, device: str, solver_set: str, problem_key: str, records: list[Record],
                      considered) -> None:
        """Atomically add (or replace, per solver) records of one problem and add `considered`
        to the ids its finds considered (an incremental find: the other records stay)."""
        sql = f"INSERT OR REPLACE INTO records ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
        rows = [r.row() for r in records]
        where = (device, solver_set, problem_key)

        def op(c):
            old = c.execute("SELECT solver_ids, timestamp FROM considered WHERE device=? AND solver_set=? "
                            "AND problem_key=?", where).fetchone()
            ids = {int(i) for i in considered}
            ids |= {r[0] for r in c.execute("SELECT solver_id FROM records WHERE device=? AND solver_set=? "
                                            "AND problem_key=?", where)}
            if old is not None:
                ids |= _parse_ids(old[0])
            c.executemany(sql, rows)
            newest = c.execute("SELECT max(timestamp) FROM records WHERE device=? AND solver_set=? "
                               "AND problem_key=?", where).fetchone()[0]
            stamp = time.time() if newest is None else newest  # not older than any record (see considered)
            c.execute("INSERT OR REPLACE INTO considered VALUES (?, ?, ?, ?, ?)", (*where, _ids_text(ids), stamp))
        self._run(op, write=True)

    def delete(self, problem_key: str | None = None, device: str | None = None) -> int:
        """Delete the records of one problem key and/or device (everything when both None)."""
        conds, params = [], []
        if problem_key is not None:
            conds.append("problem_key=?")
            params.append(problem_key)
        if device is not None:
            conds.append("device=?")
            params.append(device)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""

        def op(c):
            c.execute(f"DELETE FROM considered {where}", tuple(params))
            return c.execute(f"DELETE FROM records {where}", tuple(params)).rowcount
        return self._run(op, write=True)

    def export_json(self, path: str | os.PathLike) -> int:
        recs = self.all()
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"schema_version": SCHEMA_VERSION, "records": [asdict(r) for r in recs]}, f, indent=1)
        os.replace(tmp, path)
        return len(recs)

    def import_json(self, path: str | os.PathLike) -> int:
        """Merge a JSON export ({"records": [...]} or a list of records), every field checked
        first: nothing is written when one record is bad (a string time once broke every
        later call of that problem)."""
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
        rows = data.get("records") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a list of records or {{\"records\": [...]}}")
        recs = []
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise ValueError(f"{path}: record {i} is not an object")
            missing = [c for c in _COLUMNS if c not in r]
            if missing:
                raise ValueError(f"{path}: record {i} lacks field(s) {missing}")
            recs.append(checked_record(Record(**{c: r[c] for c in _COLUMNS}), f"{path}: record {i}"))
        self.write(recs)
        return len(recs)


    # ---- text export: one record a line, sorted, no timestamps (diffs well in review) ----------
    TSV_COLUMNS = tuple(c for c in _COLUMNS if c != "timestamp")

    def export_tsv(self, path: str | os.PathLike) -> int:
        """Every record as tab-separated text sorted by (device, solver set, problem key,
        solver id); times with 6 significant digits; no timestamps."""
        recs = sorted(self.all(), key=lambda r: (r.device, r.solver_set, r.problem_key, r.solver_id))
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("\t".join(self.TSV_COLUMNS) + "\n")
            for r in recs:
                vals = []
                for c in self.TSV_COLUMNS:
                    v = getattr(r, c)
                    vals.append("-" if v is None else f"{v:.6g}" if c == "time_ms" else str(v))
                f.write("\t".join(vals) + "\n")
        os.replace(tmp, path)
        return len(recs)

    def import_tsv(self, path: str | os.PathLike, timestamp: float | None = None) -> int:
        """Merge a TSV export (records replace those of the same key and solver)."""
        now = time.time() if timestamp is None else timestamp
        recs = []
        with open(path) as f:
            header = f.readline().rstrip("\n").split("\t")
            if tuple(header) != self.TSV_COLUMNS:
                raise ValueError(f"{path}: header {header} is not {list(self.TSV_COLUMNS)}")
            for i, line in enumerate(f, 2):
                if not line.strip():
                    continue
                vals = line.rstrip("\n").split("\t")
                if len(vals) != len(header):
                    raise ValueError(f"{path}:{i}: {len(vals)} fields, expected {len(header)}")
                d = dict(zip(header, vals))
                try:
                    recs.append(Record(d["device"], d["solver_set"], d["problem_key"], d["class_key"],
                                       int(d["solver_id"]), d["solver_name"], d["family"],
                                       None if d["time_ms"] == "-" else float(d["time_ms"]), int(d["workspace"]),
                                       d["status"], now))
                except ValueError as e:
                    raise ValueError(f"{path}:{i}: {e}") from None
                checked_record(recs[-1], f"{path}:{i}")
        self.write(recs)
        return len(recs)

    def seal(self) -> None:
        """Fold the WAL into the file and leave it self-contained (journal_mode=DELETE), as the
        shipped system db must be."""
        conn = self._connection()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
        self.close()


# ---- the process's dbs ----------------------------------------------------------------
_DBS: dict[str, FindDb] = {}
_DBS_LOCK = threading.Lock()


def cache_dir() -> str:
    return os.environ.get("NNPRIM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nnprim")


def default_triton_cache() -> None:
    """Keep Triton's compiled kernels under the nnprim cache dir (`<cache>/triton`) unless the
    user set TRITON_CACHE_DIR. Called when nnprim is imported, before anything compiles
    (Triton reads the variable at each compile)."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir(), "triton")


def user_db_path() -> str:
    return os.path.join(cache_dir(), DB_NAME)


def user_db() -> FindDb:
    """The user find-db of the current NNPRIM_CACHE_DIR (one FindDb per path and process)."""
    path = user_db_path()
    db = _DBS.get(path)
    if db is None:
        with _DBS_LOCK:
            db = _DBS.setdefault(path, FindDb(path))
    return db


def system_db() -> FindDb | None:
    path = os.environ.get("NNPRIM_SYSTEM_DB") or str(SYSTEM_DB_PATH)
    if not os.path.exists(path):
        return None
    key = "system:" + path
    db = _DBS.get(key)
    if db is None:
        with _DBS_LOCK:
            db = _DBS.setdefault(key, FindDb(path, readonly=True))
    return db


def forget_dbs() -> None:
    """Close every open db (tests switch NNPRIM_CACHE_DIR; the next use reopens)."""
    with _DBS_LOCK:
        for db in _DBS.values():
            db.close()
        _DBS.clear()


def create_empty(path: str | os.PathLike) -> None:
    """Write an empty db file with the schema (how the shipped system db starts)."""
    db = FindDb(path)
    db._run(lambda c: None, write=True)
    conn = db._connection()
    conn.execute("PRAGMA journal_mode=DELETE")  # a single self-contained file to ship
    db.close()


# ---- device fingerprint -----------------------------------------------------------------
_FINGERPRINTS: dict[str, str] = {}
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve")


def _cpu_model() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
                    model = v.strip()
                elif k in ("flags", "Features") and not flags:
                    have = set(v.split())
                    flags = [fl for fl in _ISA_FLAGS if fl in have]
    except OSError:
        pass
    return model, flags


def device_fingerprint(device) -> str:
    """'cuda:<name>:sm<major><minor>' or 'cpu:<model>:<isa flags>'. `device` is a device
    type ("cuda" = the current CUDA device), an indexed name ("cuda:1") or a torch.device."""
    name = str(device)
    fp = _FINGERPRINTS.get(name)
    if fp is None:
        if name.startswith("cuda"):
            import torch
            index = torch.device(name).index
            if index is None:
                index = torch.cuda.current_device()
                return device_fingerprint(f"cuda:{index}")
            major, minor = torch.cuda.get_device_capability(index)
            fp = f"cuda:{torch.cuda.get_device_name(index)}:sm{major}{minor}"
        else:
            model, flags = _cpu_model()
            fp = f"cpu:{model}:{'+'.join(flags) or platform.machine()}"
        _FINGERPRINTS[name] = fp
    return fp


def db_key(problem, deterministic: bool = False) -> str:
    """The problem's find-db key; choices made under deterministic algorithms are kept apart."""
    return problem.key() + ("|deterministic" if deterministic else "")
