"""linear: where a dense GEMM overtakes the weight-only int4/int8 kernels, per linear shape of the
default model and per kernel tier (`python compilebench.py linear [--tier T]`, also
`python -m compile.linear_bench`), written to ``compile/results/runs/linear_crossover-<tier>.csv``. ``int4`` and ``int8g`` (group-wise int8, the LM
head's format) run the tier's kernels with activations in its compute dtype (bf16 where the CPU
computes it natively, else fp32), ``dense`` is the dense copy ``auto`` would keep (that dtype),
``int4_torch`` torch's int4 kernel (bf16). ``int4`` runs from ``DEQUANT_FROM_ROWS`` rows on
through the dequantised weight and a dense GEMM, as the engine does; ``int4_a8`` is the tier's
kernel with 8-bit activations at every row count, never dequantised (``int4_vs_int4_a8``: what
``quant.linear.dequant_from_rows`` rests on).

Each shape holds as many distinct random weights as the model has layers, called in turn, so
the weights stream from memory as in a real step rather than sitting in cache. The arms run
interleaved (one pass of every arm, repeated), and each cell is the median over repeats:
on a shared machine the ratios between arms are the figure to read, not the times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from compile.common import (
    add_output_options,
    add_tier_options,
    apply_tier_options,
    format_table,
    result_stem,
    write_results,
)
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.group_codes import quantize_int4, quantize_int8_groups
from nanoserve.model.quant.linear import GroupLinear, Int8GroupLinear

# [N, K] of the default model's linears (fused q/k/v, o, gate and up, down) and its LM head.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 24, 32, 64)
COLUMNS = ["tier", "dtype", "shape", "n", "k", "rows", "threads", "fp32_us", "bf16_us", "int4_us", "int4_a8_us", "int4_torch_us",
           "int8g_us", "dense_vs_int4", "dense_vs_int8g",
           "int4_vs_int4_a8"]


def arms(n: int, k: int, copies: int, tier: str, dtype: torch.dtype) -> dict[str, list]:
    """Per arm, ``copies`` callables taking x in ``dtype``."""
    out: dict[str, list] = {"fp32": [], "bf16": [], "int4": [], "int4_a8": [], "int4_torch": [], "int8g": []}
    for _ in range(copies):
        w = torch.randn(n, k) * k ** -0.5
        dense32, dense16 = w, w.bfloat16()
        out["fp32"].append(lambda x, w=dense32: F.linear(x.float(), w))
        out["bf16"].append(lambda x, w=dense16: F.linear(x.bfloat16(), w))
        out["int4"].append(GroupLinear(quantize_int4(w), None, dtype, kernel=tier))
        a8 = GroupLinear(quantize_int4(w), None, dtype, kernel=tier, a8_from_rows=1)
        a8.dense_from_rows = None  # the kernel at every row count
        out["int4_a8"].append(a8)
        out["int4_torch"].append(lambda x, m=GroupLinear(quantize_int4(w), None, torch.bfloat16, kernel="torch"):  # noqa: B008
                                 m(x.bfloat16()))
        out["int8g"].append(Int8GroupLinear(*quantize_int8_groups(w), None, dtype, kernel=tier))
    return out


@torch.inference_mode()
def measure(shape: str, rows: int, repeats: int, layers: int, tier: str) -> dict:
    n, k = SHAPES[shape]
    dtype = cpu_kernels.compute_dtype(tier)
    copies = 1 if shape == "head" else layers
    calls = arms(n, k, copies, tier, dtype)
    x = torch.randn(rows, k, dtype=dtype)
    times: dict[str, list[float]] = {arm: [] for arm in calls}
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        for arm, fns in calls.items():
            start = time.perf_counter()
            for fn in fns:
                fn(x)
            times[arm].append((time.perf_counter() - start) / copies * 1e6)
    us = {arm: statistics.median(t[1:]) for arm, t in times.items()}
    dense = us["bf16" if dtype == torch.bfloat16 else "fp32"]
    return dict(tier=tier, dtype=str(dtype).removeprefix("torch."), shape=shape, n=n, k=k, rows=rows,
                threads=torch.get_num_threads(), **{f"{arm}_us": round(v, 1) for arm, v in us.items()},
                dense_vs_int4=round(dense / us["int4"], 3), dense_vs_int8g=round(dense / us["int8g"], 3),
                int4_vs_int4_a8=round(us["int4"] / us["int4_a8"], 3))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    add_tier_options(parser)
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    tier = apply_tier_options(args)
    print(format_table([], COLUMNS))
    results = []
    for shape in args.shapes:
        for rows in args.rows:
            results.append(measure(shape, rows, args.repeats, args.layers, tier))
            print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)
    write_results(results, args.out, result_stem("linear_crossover", tag=f"{tier}-{args.tag}" if args.tag else tier))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
