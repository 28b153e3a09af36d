"""Whole compiled decode steps of this working tree against another revision's, for a change
outside the kernel tiers (the op library, the graph, the engine loop), where `kernel_ab.py`
cannot load both arms into one process.

    PYTHONPATH=. python scripts/revision_ab.py MODEL [--base REV] [--rows 1,2,4] [--rounds 6]

The base revision's tree comes from `git archive`. Each arm runs in a process of its own, the arms
alternating (the first arm of a round swapping every round); a process builds a compiled engine
(its graphs from the compile cache once built), then for each row count decodes `--tokens` greedy
tokens `--repeats` times, timing a read of four times the last-level cache after each decode, so
that every step time has a read of the same machine state beside it (a shared VM's memory moves
between phases for tens of seconds: see compile/floor.py). A step is compared as its time over
the read beside it, arm against arm, and as raw milliseconds. Writes revision-ab-<model>[-tag].csv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compile.common import RUNS, format_table, host_description, write_results  # noqa: E402

COLUMNS = ["rows", "new_ms", "base_ms", "new_over_base", "new_over_base_vs_read", "samples"]


def measure(model: str, rows: list[int], tokens: int, repeats: int) -> dict:
    """In this process, with whichever nanoserve is first on the path: per row count, each decode's
    time per step and the read timed after it."""
    from compile.floor import SAMPLE_BYTES, read_buffer
    from nanoserve.engine import SamplingParams, build_engine

    engine = build_engine(model, max_batch_size=max(rows), row_buckets=sorted(set(rows)), max_model_len=256,
                          width_buckets=[64, 256], compile=True, warmup="eager", enable_prefix_caching=False)
    read = read_buffer(SAMPLE_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    result = {}
    for count in rows:
        prompts = [[100 + j, 200 + j, 300 + j, 400 + j] for j in range(count)]
        engine.generate(prompts, params, use_tqdm=False)
        steps, reads = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            steps.append((time.perf_counter() - started) / tokens)
            started = time.perf_counter()
            read.sum()
            reads.append(time.perf_counter() - started)
        result[str(count)] = dict(steps=steps, reads=reads)
    return result


def base_tree(revision: str, into: Path) -> Path:
    """The tracked files of ``revision`` under ``into``."""
    archive = into / "base.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), revision], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--base", default="HEAD", help="the revision to compare against (default HEAD)")
    parser.add_argument("--rows", type=lambda text: [int(r) for r in text.split(",")], default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=6, help="processes per arm")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="decodes per row count in a process")
    parser.add_argument("--out", type=Path, default=RUNS)
    parser.add_argument("--tag", default="")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.model, args.rows, args.tokens, args.repeats)))
        return 0
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {"new": {}, "base": {}}
    with tempfile.TemporaryDirectory(prefix="nanoserve-revision-ab-") as scratch:
        trees = {"new": ROOT, "base": base_tree(args.base, Path(scratch))}
        for round_ in range(args.rounds):
            for arm in ("new", "base") if round_ % 2 == 0 else ("base", "new"):
                env = dict(os.environ, PYTHONPATH=str(trees[arm]))
                command = [sys.executable, __file__, model, "--rows", ",".join(map(str, args.rows)),
                           "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--measure"]
                done = subprocess.run(command, env=env, cwd=trees[arm], capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"the {arm} arm failed:\n{done.stderr[-2000:]}")
                for count, got in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    samples[arm].setdefault(count, []).extend(zip(got["steps"], got["reads"]))
                print(f"round {round_ + 1}/{args.rounds}, {arm}: done", flush=True)
    rows = []
    for count in map(str, args.rows):
        new, base = samples["new"][count], samples["base"][count]
        new_ms, base_ms = (statistics.median(s for s, _ in arm) * 1e3 for arm in (new, base))
        vs_read = statistics.median(s / r for s, r in new) / statistics.median(s / r for s, r in base)
        rows.append(dict(host_description(), model=Path(args.model).name, base=args.base, rows=int(count),
                         new_ms=round(new_ms, 2), base_ms=round(base_ms, 2),
                         new_over_base=round(new_ms / base_ms, 3), new_over_base_vs_read=round(vs_read, 3),
                         samples=len(new)))
    print(format_table(rows, COLUMNS))
    write_results(rows, args.out, f"revision-ab-{Path(args.model).stem}" + (f"-{args.tag}" if args.tag else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
