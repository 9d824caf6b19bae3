"""``python -m benchmarks NAME [ARGS]``: one benchmark, from a checkout (``--help``: the list)."""

from __future__ import annotations

import argparse
import sys

from benchmarks import BENCHMARKS, load
from benchmarks._cpu import cpu_line, force_avx2


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
    parser.add_argument(
        "--simd",
        choices=("native", "avx2"),
        default="native",
        help="avx2: the processes it starts run at AVX2 where the CPU has AVX-512 "
        "(benchmarks._cpu.force_avx2; users' CPUs differ)",
    )
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    if args.simd == "avx2":
        force_avx2()
    print(cpu_line())
    return int(module.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
