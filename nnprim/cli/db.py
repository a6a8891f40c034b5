"""`nnprim db list|show|export|import|clear|path|build-system`: the find-db.

  list [--system]            one line per recorded problem: records, fastest solver, time
  show KEY [--system]        every record of the problems whose key contains KEY
  export FILE / import FILE  JSON dump of the user db / merge one into it
  clear [--key KEY] [--device FP]   delete records (all by default)
  path                       where the user and system dbs are
  build-system --suite S     run Find on every problem of a suite and write the
                             records to the system db (nnprim/data/system_finddb.sqlite
                             by default, or --out FILE)"""
from __future__ import annotations

import os
import sys
import tempfile

from ..errors import BadParameterError
from ..search import finddb


def _db(args) -> finddb.FindDb:
    if getattr(args, "system", False):
        db = finddb.system_db()
        if db is None:
            raise BadParameterError(f"no system db at {finddb.SYSTEM_DB_PATH}")
        return db
    return finddb.user_db()


def _fmt_t(t) -> str:
    return "-" if t is None else f"{t:.4f} ms"


def cmd_list(args) -> int:
    rows = _db(args).summary()
    for dev, ver, key, n, best, t in rows:
        print(f"{key}  [{n} records]  best {best or '-'} {_fmt_t(t)}  ({dev}, set {ver})")
    print(f"{len(rows)} problems", file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    recs = [r for r in _db(args).all() if args.key in r.problem_key]
    if not recs:
        print(f"no records match {args.key!r}", file=sys.stderr)
        return 1
    last = None
    for r in recs:
        if (r.device, r.problem_key) != last:
            print(f"{r.problem_key}  ({r.device}, set {r.solver_set})")
            last = (r.device, r.problem_key)
        print(f"  {r.solver_id:>5} {r.solver_name:<28} {r.family:<14} {r.status:<7} {_fmt_t(r.time_ms):>12} "
              f"ws {r.workspace}")
    return 0


def cmd_export(args) -> int:
    n = _db(args).export_json(args.file)
    print(f"exported {n} records to {args.file}")
    return 0


def cmd_import(args) -> int:
    if not os.path.exists(args.file):
        raise BadParameterError(f"file {args.file!r} does not exist")
    try:
        n = finddb.user_db().import_json(args.file)
    except (ValueError, KeyError) as e:
        raise BadParameterError(f"{args.file} is not a find-db export: {e}") from None
    print(f"imported {n} records into {finddb.user_db_path()}")
    return 0


def cmd_clear(args) -> int:
    n = finddb.user_db().delete(problem_key=args.key, device=args.device)
    print(f"deleted {n} records from {finddb.user_db_path()}")
    return 0


def cmd_path(args) -> int:
    print(f"user:   {finddb.user_db_path()}")
    print(f"system: {finddb.SYSTEM_DB_PATH}")
    return 0


def cmd_build_system(args) -> int:
    from ..search.context import find
    from .problem_args import suite_problems
    probs = []
    for suite in args.suite:
        probs += suite_problems(suite, dtype=args.dtype, device=args.device, directions=args.direction)
    out = args.out or str(finddb.SYSTEM_DB_PATH)
    old = os.environ.get("NNPRIM_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="nnprim-build-") as tmp:
        os.environ["NNPRIM_CACHE_DIR"] = tmp  # find records into a scratch user db
        try:
            for i, (name, p) in enumerate(probs):
                print(f"[{i + 1}/{len(probs)}] {name}", file=sys.stderr, flush=True)
                try:
                    res = find(p, refind=True)
                    print(f"  {res[0].solver} {res[0].time_ms:.4f} ms", file=sys.stderr)
                except Exception as e:  # one problem failing must not lose the others
                    print(f"  skipped: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            recs = finddb.user_db().all()
        finally:
            finddb.forget_dbs()
            if old is None:
                os.environ.pop("NNPRIM_CACHE_DIR", None)
            else:
                os.environ["NNPRIM_CACHE_DIR"] = old
    if not os.path.exists(out):
        finddb.create_empty(out)
    target = finddb.FindDb(out)
    target.write(recs)
    target._connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    target._connection().execute("PRAGMA journal_mode=DELETE")
    target.close()
    print(f"wrote {len(recs)} records for {len(probs)} problems to {out}")
    return 0


def add_parser(sub) -> None:
    d = sub.add_parser("db", help="inspect and manage the find-db")
    dsub = d.add_subparsers(dest="db_command", required=True, parser_class=type(d))
    p = dsub.add_parser("list", help="recorded problems")
    p.add_argument("--system", action="store_true", help="the shipped system db")
    p.set_defaults(func=cmd_list)
    p = dsub.add_parser("show", help="records of problems whose key contains KEY")
    p.add_argument("key")
    p.add_argument("--system", action="store_true")
    p.set_defaults(func=cmd_show)
    p = dsub.add_parser("export", help="write the user db as JSON")
    p.add_argument("file")
    p.add_argument("--system", action="store_true")
    p.set_defaults(func=cmd_export)
    p = dsub.add_parser("import", help="merge a JSON export into the user db")
    p.add_argument("file")
    p.set_defaults(func=cmd_import)
    p = dsub.add_parser("clear", help="delete user-db records (all, or one key / device)")
    p.add_argument("--key", default=None)
    p.add_argument("--device", default=None, help="device fingerprint")
    p.set_defaults(func=cmd_clear)
    p = dsub.add_parser("path", help="where the dbs are")
    p.set_defaults(func=cmd_path)
    p = dsub.add_parser("build-system", help="find every problem of suites into the system db")
    p.add_argument("--suite", action="append", required=True, help="suite name or JSON file (repeatable)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--direction", default=None, help="comma list (default fwd; attention train: fwd,bwd)")
    p.add_argument("--out", default=None, help="output file (default: the package's system db)")
    p.set_defaults(func=cmd_build_system)
