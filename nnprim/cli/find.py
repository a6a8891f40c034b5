"""`nnprim find conv|attn ...` and `nnprim find suite --suite FILE`: run Find for one
problem (or every problem of a suite) and print every solver's time, fastest first,
with progress on stderr. Results are recorded in the user find-db.

"""
from __future__ import annotations

import sys

from .problem_args import add_problem_parsers, positive_int, problem_from_args, suite_problems


# ---- the command ------------------------------------------------------------------------------
def _progress(i: int, n: int, name: str, outcome: str) -> None:
    print(f"  [{i}/{n}] {name}: {outcome}", file=sys.stderr, flush=True)


def find_and_print(problem, *, workspace_limit=None, exhaustive=False, refind=True, label=None) -> int:
    from ..search.context import find
    print(f"find {label or ''} {problem.key()}".replace("  ", " "), file=sys.stderr, flush=True)
    res = find(problem, workspace_limit=workspace_limit, exhaustive=exhaustive, refind=refind, progress=_progress)
    print(f"{label + '  ' if label else ''}{problem.key()}")
    for r in res:
        print(f"  {r.solver:<28} {r.family:<14} {r.time_ms:10.4f} ms  workspace {r.workspace_bytes} B")
    return 0


def run_find(args) -> int:
    kw = dict(workspace_limit=args.workspace_limit, exhaustive=args.exhaustive, refind=not args.use_db)
    if args.kind == "suite":
        probs = suite_problems(args.suite, dtype=args.dtype, device=args.device, directions=args.direction)
        if args.limit is not None:
            probs = probs[:args.limit]
        for i, (name, p) in enumerate(probs):
            find_and_print(p, label=f"[{i + 1}/{len(probs)}] {name}", **kw)
        return 0
    return find_and_print(problem_from_args(args), **kw)


def add_parser(sub) -> None:
    f = sub.add_parser("find", help="benchmark every applicable solver of a problem and record the fastest")
    fsub = f.add_subparsers(dest="kind", required=True, parser_class=type(f))
    add_problem_parsers(fsub, run_find)
    s = fsub.add_parser("suite", help="every problem of a benchmark suite")
    s.add_argument("--suite", required=True, help="suite name or JSON file")
    s.add_argument("--dtype", default=None, help="f32, f16 or bf16 (default bf16 on cuda, f32 on cpu)")
    s.add_argument("--device", default="auto")
    s.add_argument("--direction", default=None, help="comma list (default fwd; attention train: fwd,bwd)")
    s.add_argument("--limit", type=positive_int, default=None, help="only the first N problems")
    s.set_defaults(func=run_find, kind="suite")
    for p in fsub.choices.values():
        p.add_argument("--workspace-limit", type=int, default=None, help="bytes; solvers needing more are skipped")
        p.add_argument("--exhaustive", action="store_true", help="benchmark every candidate, more repeats")
        p.add_argument("--use-db", action="store_true", help="answer from the find-db when it has the problem")
