"""`nnprim warmup [--suite NAME]... [--models FAMILIES] [--direction ...] [--workers N] [--no-find]`:
compile every candidate solver of a suite's problems (or of model layers,
nnprim.testing.heldout) in parallel processes, then find each (so that the find-db answers
the first real call), with a progress line on stderr. Triton's kernels land in its cache
under the nnprim cache dir ($NNPRIM_CACHE_DIR/triton unless TRITON_CACHE_DIR is set)."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    w = sub.add_parser("warmup", help="compile and find ahead of time for a suite's problems")
    w.add_argument("--suite", action="append", default=None,
                   help="suite name (conv_gpu, attention_gpu, ...) or JSON file (repeatable)")
    w.add_argument("--models", default=None, help="held-out model families (comma list or 'all')")
    w.add_argument("--count", type=int, default=40, help="model layers (with --models)")
    w.add_argument("--seed", type=int, default=1000)
    w.add_argument("--scale", default="full", choices=("full", "tiny"), help="model layers' sizes (--models only)")
    w.add_argument("--direction", default=None, help="comma list (default: every conv direction; fwd,bwd for training "
                                                      "attention problems)")
    w.add_argument("--dtype", default=None)
    w.add_argument("--device", default="auto")
    w.add_argument("--workers", type=int, default=None, help="compile processes (default min(8, problems))")
    w.add_argument("--no-find", dest="find", action="store_false", help="compile only")
    w.add_argument("--quiet", action="store_true", help="no progress line")
    w.set_defaults(func=run_warmup)


def run_warmup(args) -> int:
    from ..errors import BadParameterError
    from ..testing.heldout import FAMILIES
    from ..warmup import warmup
    from .db import build_problems
    if not args.suite and not args.models:
        raise BadParameterError("give --suite and/or --models")
    if args.scale != "full" and not args.models:    # a suite's problems have their own sizes
        raise BadParameterError(f"--scale {args.scale} applies to --models only; a suite's problems keep their sizes")
    models = None if not args.models else (list(FAMILIES) if args.models == "all" else args.models.split(","))
    probs = [p for _, p in build_problems(args.suite or [], models, count=args.count, seed=args.seed,
                                          dtype=args.dtype, device=args.device, direction=args.direction,
                                          scale=args.scale)]
    info = warmup(probs, workers=args.workers, find=args.find, progress=not args.quiet)
    print(f"warmup: {info}", file=sys.stderr)
    return 0
