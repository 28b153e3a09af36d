"""What inductor's C++ wrapper (the graph's calls of its kernels in C++ rather than Python: the
engine's default on a CPU, ``compile_cpp_wrapper``) does to a batch-1 compiled decode step, and to
a cold build.

    PYTHONPATH=. python scripts/cpp_wrapper_ab.py MODEL [--rounds 3] [--tokens 64]

Each arm runs in its own process with its own graph cache (so a later round of an arm loads its
graph: warm), the arms alternating; a process times ``--tokens`` greedy tokens five times and
reports the median. Prints a table and writes cpp-wrapper-ab-<model>.csv under --out (default
compile/results/runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compile.common import RUNS, format_table, host_description, write_results

COLUMNS = ["arm", "round", "tok_s", "build_s", "graphs_built"]


def measure(model: str, tokens: int, cpp_wrapper: bool) -> dict:
    """In this process: build a compiled batch-1 engine, time ``tokens`` greedy tokens five times."""
    from nanoserve.engine import SamplingParams, build_engine

    started = time.perf_counter()
    engine = build_engine(model, max_batch_size=1, row_buckets=[1], compile=True, warmup="eager",
                          enable_prefix_caching=False, compile_cpp_wrapper=cpp_wrapper)
    build = time.perf_counter() - started
    prompt = list(range(100, 140))
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        engine.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return dict(tok_s=tokens / statistics.median(times), build_s=build, graphs_built=engine.stats().graphs_built)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RUNS)
    parser.add_argument("--measure", choices=("python", "cpp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.model, args.tokens, args.measure == "cpp")))
        return 0
    host = host_description()
    caches = {arm: tempfile.mkdtemp(prefix=f"nanoserve-{arm}-") for arm in ("python", "cpp")}
    rows = []
    for round_ in range(1, args.rounds + 1):
        for arm in ("python", "cpp"):
            env = dict(os.environ, NANOSERVE_CACHE_DIR=caches[arm])
            command = [sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--measure", arm]
            out = subprocess.run(command, env=env, capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            rows.append(dict(host, arm=arm, round=round_, model=Path(args.model).name, **json.loads(out)))
            print(format_table(rows[-1:], COLUMNS))
    write_results(rows, args.out, f"cpp-wrapper-ab-{Path(args.model).stem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
