"""Decode step time per weight format on the default model: ``python -m compile.format_steps``
writes ``compile/results/format_steps.csv``; ``--profile int4`` prints where a 1-row step of
that format spends its time, by op (``--profile int4 --compile``: the compiled step).

Each format owns a model, a K/V cache in its dtype and an eager ``DecodeStep``; every row
holds ``width - 1`` tokens. The formats run interleaved (one step of each, repeated) and each
figure is the median, so a busy machine slows every arm alike; read the ratios. ``--compile``
adds each arm compiled (its first step per row count is the compile, left out of the median).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

from compile.decode_bench import fill_rows
from nanoserve.cache.paged_cache import BatchedPagedKVCache
from nanoserve.engine.bucketing import Buckets
from nanoserve.engine.build import AUTO_CPU
from nanoserve.engine.decode import DecodeStep
from nanoserve.model.loader import load_model
from nanoserve.model.quant import DENSE_FROM_ROWS, WeightPlan, tensor_bytes

RESULTS = Path(__file__).parent / "results" / "format_steps.csv"
ARMS = {
    "fp32": WeightPlan("fp32"), "bf16": WeightPlan("bf16"), "int8": WeightPlan("int8"),
    "int4": WeightPlan("int4"), "int4-int8head": WeightPlan("int4", int8_head=True),
    "int4-bf16copy": WeightPlan("int4", dense_from_rows=DENSE_FROM_ROWS), "auto": AUTO_CPU,
}


def build_step(model_name: str, plan: WeightPlan, rows: list[int], width: int, compile: bool = False) -> DecodeStep:
    model = load_model(model_name, weights=plan)[0]
    config = model.config
    cache = BatchedPagedKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                num_blocks=max(rows) * (width // 16 + 1) + 1, block_size=16,
                                max_batch_size=max(rows), max_model_len=width, dtype=plan.dtype)
    buckets = Buckets(tuple(rows), (width,)) if compile else None
    return DecodeStep(model, cache, max(rows), buckets, compile=compile)


@torch.inference_mode()
def measure(steps: dict[str, DecodeStep], rows: int, width: int, repeats: int) -> dict[str, float]:
    for step in steps.values():
        step.run(rows, width, rows * width, *fill_rows(step.cache, rows, width))
        step._call(rows, width)
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    for _ in range(repeats):
        for arm, step in steps.items():
            start = time.perf_counter()
            step._call(rows, width)
            times[arm].append(time.perf_counter() - start)
    return {arm: statistics.median(t) * 1e3 for arm, t in times.items()}


@torch.inference_mode()
def profile(step: DecodeStep, width: int) -> None:
    step.run(1, width, width, *fill_rows(step.cache, 1, width))
    for _ in range(3):  # a compiled step's first calls compile and warm up
        step._call(1, width)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step._call(1, width)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a busy machine)")
    parser.add_argument("--compile", action="store_true", help="add a compiled twin of every arm (a compile per row count); with --profile, profile it compiled")
    parser.add_argument("--profile", choices=list(ARMS), default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile(build_step(args.model, ARMS[args.profile], [1], args.width, compile=args.compile), args.width)
        return
    steps = {arm: build_step(args.model, ARMS[arm], args.rows, args.width) for arm in args.arms}
    for arm in args.arms if args.compile else ():
        steps[f"{arm} compiled"] = build_step(args.model, ARMS[arm], args.rows, args.width, compile=True)
    results = []
    for rows in args.rows:
        ms = measure(steps, rows, args.width, args.repeats)
        for arm, step_ms in ms.items():
            results.append(dict(arm=arm, rows=rows, width=args.width, threads=torch.get_num_threads(),
                                step_ms=round(step_ms, 2), vs_fp32=round(ms.get("fp32", float("nan")) / step_ms, 2),
                                weight_mb=round(tensor_bytes(steps[arm].model) / 1e6, 1)))
            print(results[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, list(results[0]))
        writer.writeheader()
        writer.writerows(results)


if __name__ == "__main__":
    main()
