"""The benchmark entry point: `python compilebench.py [SUITE] [suite options]`.

Suites live in `compile/`, one module each; each takes the remaining arguments
and writes its CSV (and PNG) under `compile/results/`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from compile import (
    decode_bench,
    e2e,
    experts_bench,
    fidelity_suite,
    headline,
    linear_bench,
    sampling_bench,
    scale,
    serve_bench,
    slotbench,
    spec_bench,
    startup,
    structured_bench,
    tp_bench,
    ttft,
)

# name -> main(argv) -> exit status
SUITES: dict[str, Callable[[Sequence[str]], int]] = {
    "headline": headline.main,
    "decode": decode_bench.main,
    "e2e": e2e.main,
    "fidelity": fidelity_suite.main,
    "slots": slotbench.main,
    "serve": serve_bench.main,
    "ttft": ttft.main,
    "linear": linear_bench.main,
    "experts": experts_bench.main,
    "tp": tp_bench.main,
    "scale": scale.main,
    "structured": structured_bench.main,
    "sampling": sampling_bench.main,
    "spec": spec_bench.main,
    "startup": startup.main,
}
DEFAULT_SUITE = "headline"


def usage() -> str:
    names = ", ".join(f"{name}{' (default)' if name == DEFAULT_SUITE else ''}" for name in SUITES)
    return (f"usage: python compilebench.py [SUITE] [options]\n  suites: {names}\n"
            "  python compilebench.py SUITE --help  lists a suite's options")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and not argv[0].startswith("-"):
        suite, rest = argv[0], argv[1:]
        if suite not in SUITES:
            print(f"unknown suite {suite!r}\n{usage()}", file=sys.stderr)
            return 2
    else:
        suite, rest = DEFAULT_SUITE, argv
    return SUITES[suite](rest)


if __name__ == "__main__":
    sys.exit(main())
