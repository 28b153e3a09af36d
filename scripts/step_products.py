"""One decode step's products alone: every packed linear of a model called back to back, as a
step calls them (the whole model's weights stream from memory once a pass: no cache holds them
between passes once the model outgrows the last-level cache), at 1 and 8 rows, with 16- and
8-bit activations. Prints each arm's median time and the bytes it read per second, beside the
host's read floor, so the share of a step that is its products, and their distance from the
floor, can be read off against the step time `compilebench.py scale` reports. Then each distinct
linear shape alone, called again and again so its weights stay in the last-level cache: what the
kernel does when memory is not the limit (a shape far below the others is the kernel's fault).
With ``--in-pass``, instead each shape's calls timed inside whole passes (its weights from memory,
after the rest of the model's, as in a step) against its own bytes at the read floor measured
beside them: where a pass's distance from the floor lies, in the large products or in the fixed
cost of the many small ones. Its table is written as step-products-<model>[-TAG].csv under --out.

    python scripts/step_products.py MODEL.gguf [--repeats 15] [--rows 1,8] [--passes-only]
        [--in-pass [--x-bits 16] [--out DIR] [--tag WHAT]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from compile.common import RUNS, format_table, host_description, result_stem, write_results
from compile.floor import SAMPLE_BYTES, packed_read_bytes, read_bandwidth, read_buffer
from nanoserve.engine import build_engine
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.linear import GroupLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=lambda text: [int(r) for r in text.split(",")], default=[1, 8],
                        help="the row counts of the passes and shapes, e.g. 1,2,4,8,16 for a tier's 8-bit crossover")
    parser.add_argument("--passes-only", action="store_true", help="the whole-model passes, not each shape alone")
    parser.add_argument("--in-pass", action="store_true", help="each shape's calls timed inside whole passes")
    parser.add_argument("--x-bits", type=int, choices=(8, 16), default=16, help="--in-pass: the activations' bits")
    parser.add_argument("--out", type=Path, default=RUNS)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = build_engine(args.model, max_batch_size=1, max_model_len=256, compile=False).model
    linears = [m for m in model.modules() if isinstance(m, GroupLinear) and m.handle is not None]
    if args.in_pass:
        rows = calls_in_pass(linears, model.norm.weight.dtype, args.rows, args.x_bits, 4 * args.repeats)
        columns = ["cpu", "kernels", "rows", "x_bits", "shape", "mb", "calls", "us_per_call", "gb_s", "floor_us",
                   "over_floor", "share_of_pass"]
        print(format_table(rows, columns))
        write_results(rows, args.out, result_stem("step-products", args.model, args.tag))
        return
    read = sum(map(packed_read_bytes, linears))
    floor = read_bandwidth()
    dtype = model.norm.weight.dtype
    print(f"tier {cpu_kernels.resolve_tier()}, {dtype}; "
          f"{len(linears)} packed linears, {read / 1e6:.0f} MB a pass; read floor {floor / 1e9:.1f} GB/s "
          f"({read / floor * 1e3:.1f} ms a pass)")
    for x_bits in (16, 8):
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {m.in_features for m in linears}}
            median = median_seconds(args.repeats, one_pass, linears, inputs, x_bits)
            print(f"x_bits {x_bits:2d}, {rows} row(s): {median * 1e3:6.1f} ms, {read / median / 1e9:5.1f} GB/s "
                  f"({median * floor / read:.2f}x the floor)")
    if args.passes_only:
        return
    shapes = {(m.in_features, m.out_features): m for m in linears}
    print("each shape alone, its weights in cache (K x N: time, multiply-adds a second)")
    for (k, n), m in shapes.items():
        for rows in args.rows:
            cells = []
            for x_bits in (16, 8):
                x = torch.randn(rows, k, dtype=dtype)
                median = median_seconds(5 * args.repeats, product, m, x, x_bits)
                cells.append(f"x_bits {x_bits}: {median * 1e6:7.1f} us {rows * k * n / median / 1e9:6.1f} G/s")
            print(f"{k:6d} x {n:6d}, {rows} row(s): " + "; ".join(cells))


def calls_in_pass(linears: list[GroupLinear], dtype: torch.dtype, rows_list: list[int], x_bits: int,
                  passes: int) -> list[dict]:
    """Per distinct weight (shape and bytes: a K x N in two formats is two), the median time of
    its calls inside ``passes`` whole passes, each pass followed by a read of compile/floor.py's
    buffer; the floor is the weight's bytes at the median of those reads."""
    host = host_description()
    buffer = read_buffer(SAMPLE_BYTES)
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {m.in_features for m in linears}}
        one_pass(linears, inputs, x_bits)
        seconds: list[list[float]] = [[] for _ in linears]
        reads, totals = [], []
        for _ in range(passes):
            begun = time.perf_counter()
            for m, times in zip(linears, seconds):
                started = time.perf_counter()
                product(m, inputs[m.in_features], x_bits)
                times.append(time.perf_counter() - started)
            totals.append(time.perf_counter() - begun)
            started = time.perf_counter()
            buffer.sum()
            reads.append(time.perf_counter() - started)
        rate = buffer.nbytes / statistics.median(reads)
        shapes: dict[tuple[int, int, int], list[float]] = {}
        for m, times in zip(linears, seconds):
            shapes.setdefault((m.in_features, m.out_features, packed_read_bytes(m)), []).append(statistics.median(times))
        total = statistics.median(totals)
        base = dict(cpu=host["cpu"], kernels=host["kernels"], rows=rows, x_bits=x_bits)
        for (k, n, nbytes), medians in shapes.items():
            call = statistics.median(medians)
            results.append(in_pass_row(base, rate, f"{k} x {n}", nbytes, len(medians), call, call * len(medians) / total))
        results.append(in_pass_row(base, rate, "pass", sum(map(packed_read_bytes, linears)), len(linears), total, 1.0))
    return results


def in_pass_row(base: dict, rate: float, shape: str, nbytes: int, calls: int, seconds: float, share: float) -> dict:
    """One line of --in-pass: a weight's (or the pass's) median time a call against its bytes at ``rate``."""
    return dict(base, shape=shape, mb=nbytes / 1e6, calls=calls, us_per_call=seconds * 1e6, gb_s=nbytes / seconds / 1e9,
                floor_us=nbytes / rate * 1e6, over_floor=seconds * rate / nbytes, share_of_pass=share)


def product(m: GroupLinear, x: torch.Tensor, x_bits: int) -> torch.Tensor:
    return torch.ops.nanoserve.group_mm(x, m.codes, m.scales, m.mins, m.zero_point, m.handle, x_bits)


def one_pass(linears: list[GroupLinear], inputs: dict[int, torch.Tensor], x_bits: int) -> None:
    for m in linears:
        product(m, inputs[m.in_features], x_bits)


def median_seconds(repeats: int, call, *args) -> float:
    call(*args)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    main()
