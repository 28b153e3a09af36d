"""decode: eager vs compiled decode steps over bucketed [rows, width] shapes
(`python compilebench.py decode`; `--quick` for a short version).

For each bucket, every row holds ``width - 1`` tokens and the step writes its ``width``-th,
so the forward reads full windows. Each arm owns a ``DecodeStep`` over the same cache and
weights; its first calls are the warm-up (compile, and on a GPU graph recording), timed
apart, then the median of ``--steps`` calls is the step latency. Ratios compare arms
measured in this run on this machine. The matrix-product floor (compile/floor.py) is what
the step's weights alone cost.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from compile.common import (
    add_output_options,
    format_table,
    int_list,
    median_seconds,
    pyplot,
    result_stem,
    save_figure,
    write_results,
)
from compile.floor import matmul_floor_seconds
from nanoserve.cache.block_manager import BlockManager
from nanoserve.worker.bucketing import Buckets
from nanoserve.worker.decode_step import DecodeStep
from nanoserve.worker.kv_cache import DecodePlan, KVCache
from nanoserve.worker.plan import DecodeBatch

# arm -> (compiled, mode, the graph's calls in C++ on a CPU: DecodeStep's cpp_wrapper, the engine's default)
ARMS: dict[str, tuple[bool, str | None, bool]] = {
    "eager": (False, None, False),
    "compile": (True, None, False),
    "reduce-overhead": (True, "reduce-overhead", False),
    "cpp-wrapper": (True, "reduce-overhead", True),
}
COLUMNS = ["arm", "rows", "width", "step_ms", "tokens_per_s", "vs_eager", "floor_ms", "x_floor",
           "warmup_s", "cache_hits", "graphs", "recompiles", "cudagraph_skips"]


def load(model: str, dtype: torch.dtype, device: str):
    if model == "random":  # the default model's exact shape, random weights (speed only)
        from nanoserve.model.network.synthetic import random_model, smollm2_135m_config
        return random_model(smollm2_135m_config(), seed=0, dtype=dtype, device=device)
    from nanoserve.model.formats.loader import load_model
    return load_model(model, dtype=dtype, device=device)[0]


def fill_rows(blocks: BlockManager, cache: KVCache, rows: int, width: int) -> DecodePlan:
    """Rows 0..rows-1 each holding width - 1 tokens of random K/V; returns the step's addressing,
    each row writing its width-th token, in the [rows, width] window."""
    for row in blocks.live_rows:
        blocks.free(row)
        cache.free(row)
    for row in range(rows):
        blocks.grow(row, width - 1)
        cache.adopt(row, torch.tensor(blocks.slots_of(row, width - 1), device=cache.device))
    layers, everything = cache.layers, torch.arange(cache.num_blocks * cache.block_size, device=cache.device)
    for layer, cells in enumerate(layers.k_cells):
        k, v = (torch.randn(everything.shape[0], *cells.shape[1:], device=cache.device) for _ in range(2))
        layers.write(layer, everything, k, v)
    positions, write_slots = blocks.advance(range(rows))
    return cache.plan_decode(DecodeBatch(tuple(map(str, range(rows))), tuple(range(rows)), (0,) * rows,
                                         tuple(positions), tuple(write_slots), rows, width))


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = load(args.model, dtype, args.device)
    config = model.config
    buckets = Buckets(tuple(args.rows), tuple(args.widths))
    num_blocks = max(args.rows) * (max(args.widths) // 16 + 1) + 1
    blocks = BlockManager(num_blocks, 16, max(args.rows), max(args.widths))
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, num_blocks, 16, max(args.rows),
                    blocks.max_model_len, blocks.scratch_slot, dtype=dtype, device=device)
    steps = {arm: DecodeStep(model, cache, max(args.rows), buckets, compile=ARMS[arm][0], mode=ARMS[arm][1],
                             cpp_wrapper=ARMS[arm][2], device=device) for arm in args.arms}
    results = []
    for rows in args.rows:
        floor = matmul_floor_seconds(model, rows)
        for width in args.widths:
            plan = fill_rows(blocks, cache, rows, width)
            eager_ms = None
            for arm, step in steps.items():
                skips, hits = _cudagraph_skips(), _fx_cache_hits()
                started = time.perf_counter()
                # The first call loads this bucket's addressing and compiles; on a GPU the next
                # two are cudagraph trees' warm-up run and recording. All of it is warm-up.
                step.load(plan, rows)
                step.run(plan, rows)
                for _ in range(2):
                    step._call(rows, width)
                warmup = time.perf_counter() - started
                seconds = median_seconds(lambda s=step, r=rows, w=width: s._call(r, w), args.steps, device)
                step_ms = seconds * 1e3
                eager_ms = step_ms if arm == "eager" else eager_ms
                results.append(dict(
                    arm=arm, rows=rows, width=width, step_ms=step_ms, tokens_per_s=rows / seconds,
                    vs_eager=(eager_ms / step_ms) if eager_ms else float("nan"), floor_ms=floor * 1e3,
                    x_floor=seconds / floor, warmup_s=warmup, cache_hits=_fx_cache_hits() - hits,
                    graphs=step.graphs_built,
                    recompiles=step.stats.recompiles_after_warmup,
                    cudagraph_skips=_cudagraph_skips() - skips, device=str(device),
                    dtype=args.dtype, model=args.model))
                print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)
    return results


def _cudagraph_skips() -> int:
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def _fx_cache_hits() -> int:
    """Inductor's on-disk graph cache: a warm-up that hit it did not really compile. For a cold
    measurement run with TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)."""
    return torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]


def write_plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    widths = sorted({r["width"] for r in results})
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4), squeeze=False)
    for ax, width in zip(axes[0], widths):
        for arm in dict.fromkeys(r["arm"] for r in results):
            points = [(r["rows"], r["step_ms"]) for r in results if r["arm"] == arm and r["width"] == width]
            ax.plot(*zip(*points), marker="o", label=arm)
        floor = sorted({(r["rows"], r["floor_ms"]) for r in results if r["width"] == width})
        ax.plot(*zip(*floor), linestyle="--", color="grey", label="matmul floor")
        ax.set(xscale="log", yscale="log", xlabel="rows", ylabel="decode step (ms, median)",
               title=f"width {width} ({results[0]['device']}, {results[0]['dtype']})")
        ax.legend()
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py decode", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help='"smollm2", a .gguf/HF path, or "random" (its shape)')
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--rows", type=int_list, default=(1, 8, 32, 64))
    parser.add_argument("--widths", type=int_list, default=(128, 512))
    parser.add_argument("--steps", type=int, default=20, help="timed calls per arm and bucket")
    parser.add_argument("--arms", type=lambda t: t.split(","),
                        default=["eager", "compile", "reduce-overhead", "cpp-wrapper"])
    parser.add_argument("--quick", action="store_true", help="rows 1,8,32 at width 128, 8 steps")
    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.widths, args.steps = (1, 8, 32), (128,), 8
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    if "eager" in args.arms:
        args.arms.remove("eager")
    args.arms.insert(0, "eager")  # the baseline runs first in every bucket
    torch.set_grad_enabled(False)
    if not args.device.startswith("cuda"):
        print("note: no CUDA here: reduce-overhead records no CUDA graphs on CPU, so its arm is "
              "inductor's CPU code without graph replay (the same kernels as 'compile').")
    print(format_table([], COLUMNS))
    results = run(args)
    print("\n" + format_table(results, COLUMNS))
    write_results(results, args.out, result_stem("decode", args.model, args.tag), None if args.no_plot else write_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
