"""experts: one mixture-of-experts layer's step of packed experts, expert by expert (each active
expert's packed products called from Python, as before the grouped kernel) against the grouped
kernel (every routed pair's gate and up in one call, down in another; in a prompt, experts with
DEQUANT_FROM_ROWS rows or more dequantised as before), on Qwen3-30B-A3B's layer shape (hidden
2048, 128 experts of 768, 8 a token) with random Q4_K experts packed from their blocks
(`python compilebench.py experts [--tier T] [--rows 1 8 64 512]`, also
`python -m compile.experts_bench`), written to ``compile/results/runs/experts_step-<tier>.csv``.

Every step draws a new routing, so the experts' codes stream from memory as in a real decode
(one layer's experts are ~340 MB, far past the last-level cache). The arms run interleaved and
each cell is the median over repeats: on a shared machine read the ratio, not the times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from compile.common import (
    add_output_options,
    add_tier_options,
    apply_tier_options,
    format_table,
    result_stem,
    write_results,
)
from compile.model_files import random_blocks
from nanoserve.model.network.experts import PackedStep, _packed_step, _per_expert_step
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.gguf_blocks import BlockTensor, StackedBlocks
from nanoserve.model.quant.linear import DEQUANT_FROM_ROWS

HIDDEN, EXPERTS, WIDTH, TOP_K = 2048, 128, 768, 8  # Qwen3-30B-A3B's expert layers
COLUMNS = ["tier", "dtype", "rows", "threads", "per_expert_ms", "grouped_ms", "speedup"]


def packed_experts(qtype: Q, experts: int, n: int, k: int, seed: int) -> tuple:
    """``experts`` random experts of [n, k] in ``qtype``, packed and stacked as the loader does."""
    rng = np.random.default_rng(seed)
    packs = [StackedBlocks((BlockTensor(qtype, random_blocks(qtype, n, k, rng), n, k),)).pack()
             for _ in range(experts)]
    return (*(torch.stack([p[i] for p in packs]) for i in range(3)), packs[0][3])


@torch.inference_mode()
def measure(rows: int, repeats: int, tier: str, experts: int, qtype: Q) -> dict:
    dtype, handle = cpu_kernels.compute_dtype(tier), cpu_kernels.handle(tier)
    gate_up = packed_experts(qtype, experts, 2 * WIDTH, HIDDEN, seed=0)
    down = packed_experts(qtype, experts, HIDDEN, WIDTH, seed=1)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    experts_ = PackedStep(gate_up, down, WIDTH, handle, "silu", None, None, 0.0, 1.0)
    dequant_from_rows = DEQUANT_FROM_ROWS[tier]
    arms = {
        "per_expert": lambda ids, w: _per_expert_step(x, ids, w, experts_, dequant_from_rows),
        "grouped": lambda ids, w: _packed_step(x, ids, w, experts_, dequant_from_rows),
    }
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        ids = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K] for _ in range(rows)])
        weights = torch.softmax(torch.randn(rows, TOP_K, generator=generator), -1).to(dtype)
        for arm, step in arms.items():
            start = time.perf_counter()
            step(ids, weights)
            times[arm].append((time.perf_counter() - start) * 1e3)
    ms = {arm: statistics.median(t[1:]) for arm, t in times.items()}
    return dict(tier=tier, dtype=str(dtype).removeprefix("torch."), rows=rows, threads=torch.get_num_threads(),
                per_expert_ms=round(ms["per_expert"], 3), grouped_ms=round(ms["grouped"], 3),
                speedup=round(ms["per_expert"] / ms["grouped"], 3))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--experts", type=int, default=EXPERTS, help="experts in the layer (fewer: less memory)")
    parser.add_argument("--type", default="Q4_K", choices=["Q4_0", "Q4_K", "Q6_K", "Q8_0", "MXFP4"])
    add_tier_options(parser)
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    tier = apply_tier_options(args)
    print(format_table([], COLUMNS))
    results = []
    for rows in args.rows:
        results.append(measure(rows, args.repeats, tier, args.experts, Q[args.type]))
        print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)
    write_results(results, args.out, result_stem("experts_step", tag=f"{tier}-{args.tag}" if args.tag else tier))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
