"""Time to load GGUF files as the engine does (``load_model`` with the default CPU plan), each
file read into the page cache first, then loaded ``--repeats`` times in a fresh process each:
prints the median wall seconds, the load's stages and the peak resident size. Meaningful only
on an otherwise idle machine.

    python scripts/load_time.py FILE.gguf [FILE.gguf ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ONE_LOAD = """
import json, sys, time
from nanoserve.engine.build import auto_cpu_plan
from nanoserve.model.formats.loader import load_model
plan = auto_cpu_plan()  # builds or loads the kernels before the clock starts
started = time.perf_counter()
model, _ = load_model(sys.argv[1], weights=plan)
wall = time.perf_counter() - started
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps(dict(load_s=wall, stages=model.load_stages, peak_rss_gb=peak_kb / 1e6)))
"""


def load_once(path: Path) -> dict:
    """One load in a fresh interpreter (this one's, run from the repository root)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", ONE_LOAD, str(path)], cwd=root, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for path in args.files:
        started = time.perf_counter()
        with open(path, "rb") as f:  # into the page cache
            while f.read(1 << 24):
                pass
        runs = sorted((load_once(path) for _ in range(args.repeats)), key=lambda r: r["load_s"])
        median = runs[len(runs) // 2]
        stages = ", ".join(f"{k} {v:.2f}" for k, v in median["stages"].items())
        every = " ".join(f"{r['load_s']:.2f}" for r in runs)
        print(f"{path.name}: median {statistics.median(r['load_s'] for r in runs):.2f} s ({stages}), all {every}, "
              f"peak RSS {median['peak_rss_gb']:.2f} GB ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
