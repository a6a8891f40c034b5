"""`nnprim db list|show|export|import|clear|path|build-system`: the find-db.

  list [--system]            one line per recorded problem: records, fastest solver, time
  show KEY [--system]        every record of the problems whose key contains KEY
  export FILE [--system]     dump the user (or system) db: JSON, or sorted text when FILE
                             ends in .tsv
  import FILE [--into DB]    merge a JSON or .tsv export into the user db (or the sqlite
                             file DB, e.g. to rebuild the shipped system db from its .tsv)
  clear [--key KEY] [--device FP]   delete records (all by default)
  path                       where the user and system dbs are
  build-system [--suite S]... [--models F,...]  run find on suite problems and held-out
                             model layers (nnprim.testing.heldout) and merge the records
                             into the system db (nnprim/data/system_finddb.sqlite, or
                             --out FILE) and its text export (same path, .tsv);
                             --refind-solver S,...: instead, find again the db's problems
                             whose records hold those solvers (their kernels changed);
                             --refind-key K,...: ... whose keys contain one of these
                             (e.g. conv3d: problems a solver newly covers)
  model-check [--system] [--device FP]  leave-one-out (and hash / held-out-class split) validation of the learned model"""
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


def _is_tsv(path: str) -> bool:
    return str(path).endswith(".tsv")


def cmd_export(args) -> int:
    db = _db(args)
    n = db.export_tsv(args.file) if _is_tsv(args.file) else db.export_json(args.file)
    print(f"exported {n} records to {args.file}")
    return 0


def cmd_import(args) -> int:
    if not os.path.exists(args.file):
        raise BadParameterError(f"file {args.file!r} does not exist")
    if args.into:
        if not os.path.exists(args.into):
            finddb.create_empty(args.into)
        db = finddb.FindDb(args.into)
    else:
        db = finddb.user_db()
    try:
        n = db.import_tsv(args.file, timestamp=0.0 if args.into else None) if _is_tsv(args.file) \
            else db.import_json(args.file)
    except (ValueError, KeyError) as e:
        raise BadParameterError(f"{args.file} is not a find-db export: {e}") from None
    target = args.into or finddb.user_db_path()
    if db.in_memory:        # the file could not be written: the records went to this process's memory only
        print(f"nnprim: error: find-db {target} is not writable; nothing was imported", file=sys.stderr)
        return 2
    if args.into:
        db.seal()
    print(f"imported {n} records into {target}")
    return 0


def cmd_clear(args) -> int:
    n = finddb.user_db().delete(problem_key=args.key, device=args.device)
    print(f"deleted {n} records from {finddb.user_db_path()}")
    return 0


def cmd_path(args) -> int:
    print(f"user:   {finddb.user_db_path()}")
    print(f"system: {finddb.SYSTEM_DB_PATH}")
    return 0


def build_problems(suites, models, *, count: int, seed: int, dtype, device: str, direction=None,
                   scale: str = "full") -> list:
    """(name, problem) of the suites' problems (conv: every direction unless `direction`)
    and of `count` held-out model layers of the families `models`."""
    from ..testing.heldout import generate
    from .problem_args import attn_problem, conv_problem, default_dtype, pick_device, suite_problems
    from .suites import load_suite
    probs = []
    for suite in suites:
        kind, _ = load_suite(suite)
        dirs = direction or ("fwd,bwd_data,bwd_weights" if kind == "conv" else None)
        probs += suite_problems(suite, dtype=dtype, device=device, directions=dirs)
    if models:
        dev = pick_device(device)
        dt = default_dtype(dtype, dev)
        for h in generate(count, seed, models, scale=scale):
            make = conv_problem if h.kind == "conv" else attn_problem
            probs.append((h.name, make(h.spec, dtype=dt, device=dev, direction=h.direction)))
    return probs


def refind_problems(db: finddb.FindDb, solvers: str | None, device: str, key_parts: str | None = None) -> list:
    """(key, problem) of every problem of `db` on this machine whose records hold one of the
    solver names or ids in `solvers` (a comma list): what to find again when those solvers'
    kernels changed, so that their old times no longer decide; or whose key contains one of
    `key_parts` (a comma list): problems a solver newly covers, whose records lack it."""
    from ..search.context import context
    from ..search.keys import problem_from_key
    from ..search.solver import REGISTRY
    ids = {REGISTRY.get(int(t) if t.strip().isdigit() else t.strip()).id
           for t in (solvers or "").split(",") if t.strip()}
    parts = [t.strip() for t in (key_parts or "").split(",") if t.strip()]
    fp = context(device).fingerprint
    keys = sorted({r.problem_key for r in db.for_device(fp, finddb.SOLVER_SET_VERSION)
                   if r.solver_id in ids or any(t in r.problem_key for t in parts)})
    out = []
    for key in keys:
        p = problem_from_key(key)
        if p is None:
            print(f"  {key}: not a problem this version can build; skipped", file=sys.stderr)
            continue
        out.append((key, p))
    return out


def cmd_build_system(args) -> int:
    import time

    from ..search.context import find
    from ..testing.heldout import FAMILIES
    from ..warmup import Progress, warmup
    from .problem_args import pick_device
    dev = pick_device(args.device)
    suites = args.suite
    if suites is None:
        suites = ["conv_gpu", "attention_gpu", "decode_quant_gpu"] if dev == "cuda" else ["conv_cpu"]
    models = None if args.models == "none" else (list(FAMILIES) if args.models in (None, "all")
                                                 else args.models.split(","))
    out = args.out or str(finddb.SYSTEM_DB_PATH)
    if not os.path.exists(out):
        finddb.create_empty(out)
    target = finddb.FindDb(out)
    if args.refind_solver or args.refind_key:
        probs = refind_problems(target, args.refind_solver, dev, args.refind_key)
    else:
        probs = build_problems(suites, models, count=args.count, seed=args.seed, dtype=args.dtype, device=dev,
                               direction=args.direction, scale=args.scale)
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    old = os.environ.get("NNPRIM_CACHE_DIR")
    ok = written = 0
    with tempfile.TemporaryDirectory(prefix="nnprim-build-") as tmp:
        os.environ["NNPRIM_CACHE_DIR"] = tmp  # find records into a scratch user db
        finddb.forget_dbs()
        try:
            bar = Progress("nnprim db build-system: find", len(probs))
            chunk = max(1, 3 * args.workers)  # compile a chunk in parallel, then find it
            for start in range(0, len(probs), chunk):
                part = probs[start:start + chunk]
                if deadline is not None and time.monotonic() > deadline:
                    print(f"\ntime budget spent: {len(probs) - start} problems not found", file=sys.stderr)
                    break
                if dev == "cuda" and args.workers > 1:
                    warmup([p for _, p in part], workers=args.workers, find=False, progress=False)
                for name, p in part:
                    t_find = time.time()
                    try:
                        res = find(p, refind=True, exhaustive=args.exhaustive)
                        ok += 1
                        bar.step(f"{name} {res[0].solver}")
                    except Exception as e:  # one problem failing must not lose the others
                        bar.step(name)
                        print(f"\n  {name}: skipped: {type(e).__name__}: {str(e).splitlines()[0]}",
                              file=sys.stderr)
                    recs = [r for r in finddb.user_db().all() if r.timestamp >= t_find]
                    target.write(recs)  # per problem, one transaction: a killed build keeps what it found
                    written += len(recs)
            bar.close()
        finally:
            finddb.forget_dbs()
            if old is None:
                os.environ.pop("NNPRIM_CACHE_DIR", None)
            else:
                os.environ["NNPRIM_CACHE_DIR"] = old
    target.seal()
    tsv = os.path.splitext(out)[0] + ".tsv"
    n = finddb.FindDb(out, readonly=True).export_tsv(tsv)
    print(f"wrote {written} records ({ok} of {len(probs)} problems found) to {out}; {n} records in {tsv}")
    return 0


def cmd_model_check(args) -> int:
    import json

    from ..search import learned
    db = _db(args)
    fp = args.device or finddb.device_fingerprint("cuda" if _cuda() else "cpu")
    recs = db.for_device(fp, finddb.SOLVER_SET_VERSION)
    v = learned.leave_one_out(recs)
    print(json.dumps(dict(device=fp, records=len(recs), **v), indent=1))
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


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
    p = dsub.add_parser("export", help="write the user db as JSON (or sorted text: FILE.tsv)")
    p.add_argument("file")
    p.add_argument("--system", action="store_true")
    p.set_defaults(func=cmd_export)
    p = dsub.add_parser("import", help="merge a JSON or .tsv export into the user db (or --into FILE)")
    p.add_argument("file")
    p.add_argument("--into", default=None, help="an sqlite find-db file to merge into instead (created if absent)")
    p.set_defaults(func=cmd_import)
    p = dsub.add_parser("clear", help="delete user-db records (all, or one key / device)")
    p.add_argument("--key", default=None)
    p.add_argument("--device", default=None, help="device fingerprint")
    p.set_defaults(func=cmd_clear)
    p = dsub.add_parser("path", help="where the dbs are")
    p.set_defaults(func=cmd_path)
    p = dsub.add_parser("build-system", help="find suite problems and model layers into the system db")
    p.add_argument("--suite", action="append", default=None,
                   help="suite name or JSON file (repeatable; default conv_gpu + attention_gpu + decode_quant_gpu on "
                        "CUDA, conv_cpu on CPU)")
    p.add_argument("--models", default=None, help="held-out families (comma list), 'all' (default) or 'none'")
    p.add_argument("--count", type=int, default=120, help="model layers to generate (default 120)")
    p.add_argument("--seed", type=int, default=1000, help="their seed (benchmarks/regret.py uses others)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--direction", default=None, help="comma list (default: every conv direction; attention "
                                                      "train: fwd,bwd)")
    p.add_argument("--scale", default="full", choices=("full", "tiny"), help="model layers' sizes (tiny: tests)")
    p.add_argument("--exhaustive", action="store_true", help="more repeats per candidate")
    p.add_argument("--refind-solver", default=None,
                   help="instead of suites and models: find again every problem of the db whose records hold "
                        "these solvers (comma list of names or ids; after a kernel change)")
    p.add_argument("--refind-key", default=None,
                   help="instead of suites and models: find again every problem of the db whose key contains "
                        "one of these (comma list; e.g. conv3d after a solver newly covers 3-D)")
    p.add_argument("--out", default=None, help="output file (default: the package's system db)")
    p.add_argument("--workers", type=int, default=8, help="parallel compile processes on a GPU (1: none)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which no new problem is found (what was found is kept)")
    p.set_defaults(func=cmd_build_system)
    p = dsub.add_parser("model-check", help="leave-one-out validation of the learned model over a db")
    p.add_argument("--system", action="store_true")
    p.add_argument("--device", default=None, help="device fingerprint (default: this machine's)")
    p.set_defaults(func=cmd_model_check)
