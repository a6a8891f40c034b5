"""`nnprim` command-line driver (in the spirit of MIOpenDriver / benchdnn).

Subcommands live in small modules, each with `add_parser(subparsers)` that sets a
`func(args) -> int` default. Bad arguments exit with status 2 and one line."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import BadParameterError, NotSupportedError

_MODULES = ("run", "bench", "find", "explain", "db", "warmup")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        print(f"nnprim: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nnprim", description="nnprim: convolution and attention primitives with solver search")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in _MODULES:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (BadParameterError, NotSupportedError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"nnprim: error: {first}", file=sys.stderr)
        if args.verbose:
            print(str(e), file=sys.stderr)
        return 2
    except OSError as e:          # a path that is missing, a directory, not writable
        print(f"nnprim: error: {e.strerror or e}: {e.filename}" if e.filename else f"nnprim: error: {e}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
