"""The least work inductor gives each thread of a CPU kernel (its ``cpp.min_chunk_size``, which
the engine sets to ``graph_build.CPU_MIN_CHUNK`` unless TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE says
otherwise), several values against each other in one process: an engine built per value, each
with its own graphs (the value keys them), all decoding the same prompts one step each in turn,
so that a shared VM's phases fall on every arm alike (compile.interleave's rotation). Per arm the median decode step, and the
median over steps of each arm's step over the first arm's neighbouring one.

    PYTHONPATH=. python scripts/min_chunk_ab.py MODEL.gguf [--batch 1] [--tokens 300]
        [--chunks 512,16384] [--out DIR] [--tag WHAT]

Prints a table and writes min-chunk-ab-<model>[-WHAT].csv under --out (default compile/results/runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from compile.common import (
    RUNS,
    format_table,
    host_description,
    int_list,
    make_prompts,
    result_stem,
    write_results,
)
from compile.e2e import paired_ratios
from compile.interleave import EngineSteps, interleaved_run
from nanoserve.engine import build_engine
from nanoserve.worker.graph_build import MIN_CHUNK_ENV

COLUMNS = ["cpu", "kernels", "batch", "min_chunk", "step_ms", "over_first", "over_first_p10", "over_first_p90",
           "same_tokens_as_first"]


def engine_with(model: str, chunk: int, batch: int):
    """An engine whose graphs are built with inductor's min_chunk_size at ``chunk``."""
    before = os.environ.get(MIN_CHUNK_ENV)
    os.environ[MIN_CHUNK_ENV] = str(chunk)
    try:
        return build_engine(model, max_batch_size=batch, max_model_len=512, compile=True, warmup="eager",
                            enable_prefix_caching=False, max_num_batched_tokens=batch * 32)
    finally:
        if before is None:
            del os.environ[MIN_CHUNK_ENV]
        else:
            os.environ[MIN_CHUNK_ENV] = before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--chunks", type=int_list, default=(512, 16384), help="the values compared; the first is the base")
    parser.add_argument("--out", type=Path, default=RUNS)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    engines = {chunk: engine_with(args.model, chunk, args.batch) for chunk in args.chunks}
    vocab = next(iter(engines.values())).model.config.vocab_size
    prompts = make_prompts(args.batch, 32, vocab, seed=3)
    arms = {chunk: EngineSteps(engine, prompts, args.tokens) for chunk, engine in engines.items()}
    result = interleaved_run(arms, prompts, args.tokens)
    host, first = host_description(), args.chunks[0]
    rows = []
    for chunk, steps in result.decode_steps.items():
        ratios = paired_ratios(steps, result.decode_steps[first])
        rows.append(dict(cpu=host["cpu"], kernels=host["kernels"], batch=args.batch, min_chunk=chunk,
                         step_ms=statistics.median(steps) * 1e3, over_first=statistics.median(ratios),
                         over_first_p10=ratios[len(ratios) // 10], over_first_p90=ratios[9 * len(ratios) // 10],
                         same_tokens_as_first=result.tokens[chunk] == result.tokens[first]))
    print(format_table(rows, COLUMNS))
    write_results(rows, args.out, result_stem("min-chunk-ab", args.model, args.tag), None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
