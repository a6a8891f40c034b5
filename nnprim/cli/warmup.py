"""`nnprim warmup --suite NAME [--direction ...] [--workers N] [--no-find]`: compile every
candidate solver of a suite's problems in parallel processes, then find each (so that the
find-db answers the first real call), with progress on stderr."""
from __future__ import annotations

import sys

from .problem_args import suite_problems


def add_parser(sub) -> None:
    w = sub.add_parser("warmup", help="compile and find ahead of time for a suite's problems")
    w.add_argument("--suite", required=True, help="suite name (conv_gpu, attention_gpu, ...) or JSON file")
    w.add_argument("--direction", default=None, help="comma list (default: fwd for conv; fwd,bwd for training "
                                                      "attention problems)")
    w.add_argument("--dtype", default=None)
    w.add_argument("--device", default="auto")
    w.add_argument("--workers", type=int, default=None, help="compile processes (default min(8, problems))")
    w.add_argument("--no-find", dest="find", action="store_false", help="compile only")
    w.set_defaults(func=run_warmup)


def run_warmup(args) -> int:
    from ..warmup import warmup
    probs = [p for _, p in suite_problems(args.suite, dtype=args.dtype, device=args.device,
                                          directions=args.direction)]
    info = warmup(probs, workers=args.workers, find=args.find)
    print(f"warmup: {info}", file=sys.stderr)
    return 0
