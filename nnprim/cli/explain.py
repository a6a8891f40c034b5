"""`nnprim explain conv|attn ...`: every solver of the problem with applicability,
reasons, workspace, estimate and measured time (find-db), and which would run and why."""
from __future__ import annotations

from .problem_args import add_problem_parsers, problem_from_args


def run_explain(args) -> int:
    from ..search.explain import explain
    explain(problem_from_args(args))
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("explain", help="why each solver does or does not apply to a problem")
    esub = e.add_subparsers(dest="kind", required=True, parser_class=type(e))
    add_problem_parsers(esub, run_explain)
