"""How long the command line takes to answer, each in a fresh process from a checkout: `--help`,
a missing model file, and the default model's first streamed token of `generate` (after one
unmeasured run of each, so the page cache and compile cache are warm). Prints medians.
Meaningful only on an otherwise idle machine.

    python scripts/start_time.py [CHECKOUT] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENTRY = "import sys; from nanoserve.launch import main; sys.exit(main())"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = args.checkout.resolve()
    env = {**os.environ, "PYTHONPATH": str(root)}

    def command(*argv: str) -> list[str]:
        return [sys.executable, "-c", ENTRY, *argv]

    def until_exit(*argv: str) -> float:
        started = time.perf_counter()
        subprocess.run(command(*argv), cwd=root, env=env, capture_output=True)
        return time.perf_counter() - started

    def until_first_byte(*argv: str) -> float:
        started = time.perf_counter()
        proc = subprocess.Popen(command(*argv), cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        proc.stdout.read(1)
        seconds = time.perf_counter() - started
        proc.stdout.read()
        proc.wait()
        return seconds

    cases: dict[str, Callable[[], float]] = {
        "--help": lambda: until_exit("--help"),
        "generate, missing model file": lambda: until_exit("generate", "--model", "missing.gguf", "hi"),
        "generate, default model, first token": lambda: until_first_byte(
            "generate", "--max-tokens", "4", "The capital of France is"),
    }
    for name, run in cases.items():
        run()
        times = [run() for _ in range(args.repeats)]
        print(f"{name}: median {statistics.median(times):.2f} s, all {' '.join(f'{t:.2f}' for t in times)}",
              flush=True)


if __name__ == "__main__":
    main()
