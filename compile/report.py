"""What every suite does with its results: a printed table, a CSV, and medians."""

from __future__ import annotations

import csv
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def host_description() -> dict:
    """What a recorded figure ran on: the CPU's model name, nanoserve's kernel tier and the
    compute dtype that tier uses (the kernels detect features through cpuid, not this name)."""
    from nanoserve.model import cpu_kernels

    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith(("model name", "Model"))]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    tier = cpu_kernels.resolve_tier()
    return dict(cpu=cpu, kernels=tier, dtype=str(cpu_kernels.compute_dtype(tier)).removeprefix("torch."))


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain aligned table of ``columns`` (floats to 3 decimals, or 3 significant digits below 0.1)."""
    def cell(value) -> str:
        if isinstance(value, float):
            if 0 < abs(value) < 0.1:  # a KL divergence of 0.0004 must not print as 0.000
                return f"{value:.3g}"
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)
    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in body]
    return "\n".join(lines)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, synchronising a GPU around each."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
