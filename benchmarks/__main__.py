"""``python -m benchmarks NAME [ARGS]``: one benchmark, from a checkout (``--help``: the list)."""

from __future__ import annotations

import argparse
import sys

from benchmarks import BENCHMARKS, load


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark ``argv[0]`` with the rest of ``argv`` as its arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}; known: {known}", file=sys.stderr)
            return 2
        print(
            f"usage: python -m benchmarks NAME [ARGS]  (NAME: {known}; NAME --help for its options)"
        )
        return 0
    name, rest = argv[0], argv[1:]
    module = load(name)
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}", description=(module.__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--catalog", default=None, help="the catalog to use (default: a scratch one)"
    )
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)))


if __name__ == "__main__":
    raise SystemExit(main())
