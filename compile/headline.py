"""headline: the default format's decode tokens/s per batch, eager and compiled, beside
transformers and llama.cpp (`python compilebench.py`, the default suite, `make bench`).

The e2e suite's workload (compile/e2e.py) cut to what a newcomer came for: the ``auto``
weights at batches 1, 8 and 32, every system interleaved step by step in one pass per batch;
llama.cpp as its users run it (weights repacked), beside it unrepacked, or unrepacked alone where
its default crashes on the host (the ``llama_cpp`` column says which).
A compiled engine builds its decode graphs before the timed steps (warmup="eager"): about 15 s a
bucket on 2 cores the first time, then loaded from the compile cache in a fraction of a second. The full grids are ``e2e`` and ``decode``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from compile.common import (
    DecodeWorkload,
    format_table,
    host_description,
    pyplot,
    result_stem,
    save_figure,
    write_results,
)
from compile.e2e import LLAMA_CPP, LLAMA_UNREPACKED, TRANSFORMERS, add_workload_options, run, workload_from
from nanoserve.model.quant import cpu_kernels

DEFAULTS = DecodeWorkload(weights=("auto",), batches=(1, 8, 32))
SYSTEMS = {"nanoserve eager": "eager_tok_s", "nanoserve compiled": "compile_tok_s",
           TRANSFORMERS + " fp32": "hf_tok_s", LLAMA_CPP: "llama_tok_s", LLAMA_UNREPACKED: "llama_norepack_tok_s"}


def headline_rows(results: list[dict], host: dict | None = None) -> list[dict]:
    """One row per (weights, batch): every system's tokens/s and the engine's ratios to the peers
    (each the median over neighbouring pairs of steps); ``host`` (cpu, kernel tier, compute
    dtype) leads every row."""
    table: dict[tuple, dict] = {}
    for r in results:
        row = table.setdefault((r["weights"], r["batch"]), dict(**(host or {}), weights=r["weights"],
                                                                 sampling=r.get("sampling", "greedy"),
                                                                 batch=r["batch"]))
        row[f"{r['mode']}_tok_s"] = r["tok_s"]
        row[f"{r['mode']}_x_bw_floor"] = r["x_bw_floor"]
        for key in ("hf_tok_s", "llama_tok_s", "llama_norepack_tok_s", "llama_cpp", "llama_x_bw_floor", "read_gb_s"):
            if key in r:
                row[key] = r[key]  # one pass for every mode: the same figure on each
        for key in ("vs_llama", "vs_llama_norepack", "vs_hf"):
            if key in r:
                row[f"{r['mode']}_{key}"] = r[key]
    return list(table.values())


def columns(rows: list[dict]) -> list[str]:
    present = dict.fromkeys(key for row in rows for key in row)
    order = ["cpu", "kernels", "dtype", "weights", "batch", "eager_tok_s", "compile_tok_s", "hf_tok_s", "llama_cpp",
             "llama_tok_s", "llama_norepack_tok_s", "compile_vs_llama", "eager_vs_llama", "compile_vs_llama_norepack",
             "compile_vs_hf", "eager_vs_hf",
             "compile_x_bw_floor", "eager_x_bw_floor", "llama_x_bw_floor", "read_gb_s"]
    return [key for key in order if key in present]


def write_plot(rows: list[dict], path: Path) -> None:
    """Grouped bars: tokens/s per batch, one bar per system."""
    plt = pyplot()
    systems = {label: key for label, key in SYSTEMS.items() if key in rows[0]}
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(systems)
    for i, (label, key) in enumerate(systems.items()):
        xs = [b + (i - (len(systems) - 1) / 2) * width for b in range(len(rows))]
        bars = ax.bar(xs, [r[key] for r in rows], width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize="x-small")
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}\nweights {r['weights']}" for r in rows])
    ax.set(ylabel="decode tokens/s (median step)", title="decode tokens/s, same prompts, systems interleaved")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py [headline]", description=__doc__.split("\n\n")[0])
    add_workload_options(parser, DEFAULTS)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    host = host_description()
    print(f"CPU: {host['cpu']}; nanoserve kernels: {host['kernels']} (forced with {cpu_kernels.ENV}=<tier>), "
          f"compute dtype {host['dtype']}")
    rows = headline_rows(run(workload_from(args, DEFAULTS)), host)
    print("\n" + format_table(rows, columns(rows)))
    write_results(rows, args.out, result_stem("headline", args.model, args.tag), None if args.no_plot else write_plot)
    return 0
