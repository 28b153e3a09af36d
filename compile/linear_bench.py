"""Where a bf16 GEMM overtakes the weight-only int4/int8 kernels, per linear shape of the
default model: ``python -m compile.linear_bench`` writes ``compile/results/linear_crossover.csv``.
``int4`` and ``int8g`` (group-wise int8, the LM head's format) run the packed linears' default
kernel (nanoserve's vnni kernels where they build), ``int4_torch`` torch's int4 kernel.

Each shape holds as many distinct random weights as the model has layers, called in turn, so
the weights stream from memory as in a real step rather than sitting in cache. The arms run
interleaved (one pass of every arm, repeated), and each cell is the median over repeats:
on a shared machine the ratios between arms are the figure to read, not the times.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.model.quant import (
    GROUP_SIZE,
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
    quantize_int8_groups,
)

RESULTS = Path(__file__).parent / "results" / "linear_crossover.csv"
# [N, K] of the default model's linears (fused q/k/v, o, gate and up, down) and its LM head.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 24, 32, 64)
COLUMNS = ["shape", "n", "k", "rows", "threads", "fp32_us", "bf16_us", "int8_us", "int4_us", "int4_torch_us", "int8g_us",
           "bf16_vs_int4", "bf16_vs_int8g"]


def arms(n: int, k: int, copies: int) -> dict[str, list]:
    """Per arm, ``copies`` callables taking x (fp32 for fp32, bf16 for the rest)."""
    out: dict[str, list] = {"fp32": [], "bf16": [], "int8": [], "int4": [], "int4_torch": [], "int8g": []}
    for _ in range(copies):
        w = torch.randn(n, k) * k ** -0.5
        dense32, dense16 = w, w.bfloat16()
        out["fp32"].append(lambda x, w=dense32: F.linear(x.float(), w))
        out["bf16"].append(lambda x, w=dense16: F.linear(x, w))
        out["int8"].append(Int8Linear(*quantize_int8(w), None, torch.bfloat16))
        grouped = k % GROUP_SIZE == 0
        out["int4"].append(Int4Linear(quantize_int4(w), None, torch.bfloat16) if grouped else None)
        out["int4_torch"].append(Int4Linear(quantize_int4(w), None, torch.bfloat16, kernel="torch") if grouped else None)
        out["int8g"].append(Int8GroupLinear(*quantize_int8_groups(w), None, torch.bfloat16) if grouped else None)
    return out


@torch.inference_mode()
def measure(shape: str, rows: int, repeats: int, layers: int) -> dict:
    n, k = SHAPES[shape]
    copies = 1 if shape == "head" else layers
    calls = arms(n, k, copies)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    times: dict[str, list[float]] = {arm: [] for arm in calls}
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        for arm, fns in calls.items():
            start = time.perf_counter()
            for fn in fns:
                fn(x)
            times[arm].append((time.perf_counter() - start) / copies * 1e6)
    us = {arm: statistics.median(t[1:]) for arm, t in times.items()}
    return dict(shape=shape, n=n, k=k, rows=rows, threads=torch.get_num_threads(),
                **{f"{arm}_us": round(v, 1) for arm, v in us.items()},
                bf16_vs_int4=round(us["bf16"] / us["int4"], 3), bf16_vs_int8g=round(us["bf16"] / us["int8g"], 3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for shape in args.shapes:
        for rows in args.rows:
            results.append(measure(shape, rows, args.repeats, args.layers))
            print(", ".join(f"{c}={results[-1][c]}" for c in COLUMNS), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(results)


if __name__ == "__main__":
    main()
