"""Start-up of the compiled engine: cold (an empty compile cache) and warm (the cache filled),
each in a fresh process, against the eager engine (``python compilebench.py startup``).

Each arm builds the engine, times its first token for one prompt, then runs a burst of
``--clients`` requests decoding together (the engine's own step loop, as the server drives it)
and records every decode step's time: in the cold arm that burst runs while the graphs build in
the background, so its slowest steps are what a serving user would feel. The cold arm then
waits until every graph is ready (each bucket's build time as the builder measured it); the warm
arm says how long loading every graph took and what dynamo and inductor compiled (nothing,
when the cache serves). Rows: one per arm, plus one per bucket built in the cold arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from compile.common import (
    add_output_options,
    format_table,
    host_description,
    pyplot,
    result_stem,
    save_figure,
    write_results,
)

DEFAULT_MODEL = "smollm2"
COLUMNS = ["arm", "bucket", "build_s", "ready_s", "graphs_loaded", "graphs_built", "load_s", "first_token_s",
           "step_median_ms", "step_p99_ms", "step_max_ms", "eager_steps", "dynamo_frames", "inductor_compiles"]


def run_arm(arm: str, model: str, max_batch_size: int, clients: int, tokens: int, timeout: float) -> dict:
    """One arm, measured in this process (called in a fresh one by ``main``)."""
    import torch

    from nanoserve import SamplingParams, build_engine

    started = time.perf_counter()
    options = dict(max_batch_size=max_batch_size, max_model_len=1024, enable_prefix_caching=False)
    engine = build_engine(model, compile=arm != "eager", warmup="lazy", **options)
    built_s = time.perf_counter() - started
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    first = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first_token_s = time.perf_counter() - first
    steps = burst(engine, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), clients)
    row = dict(arm=arm, build_engine_s=built_s, first_token_s=first_token_s,
               step_median_ms=1e3 * statistics.median(steps), step_p99_ms=1e3 * percentile(steps, 0.99),
               step_max_ms=1e3 * max(steps))
    step = engine.worker.decode_step
    if arm == "cold" and step.builder is not None:
        all_ready = step.wait_for_graphs(timeout)
        row.update(ready_s=time.perf_counter() - started, all_ready=all_ready,
                   buckets={f"{r}x{w}x{q}": s for (r, w, q), s in step.builder.build_seconds.items()})
    counters = torch._dynamo.utils.counters
    stats = engine.stats()
    row.update(graphs_loaded=stats.graphs_loaded, graphs_built=stats.graphs_built, load_s=stats.graph_load_seconds,
               eager_steps=stats.eager_steps, graphs_ready=stats.graphs_ready,
               dynamo_frames=sum(counters["frames"].values()),
               inductor_compiles=counters["inductor"].get("fxgraph_cache_miss", 0)
               + counters["inductor"].get("fxgraph_cache_hit", 0))
    if arm == "warm":
        row["ready_s"] = built_s
    engine.close()
    return row


def burst(engine, params, clients: int) -> list[float]:
    """``clients`` requests at once, stepped to the end; the seconds of each step that decoded
    without a prefill chunk beside it (the inter-token latency every stream sees)."""
    prompts = [f"Request {i}: list some facts about the number {i}." for i in range(clients)]
    for prompt in prompts:
        engine.add_request(prompt, params)
    times = []
    while engine.has_unfinished():
        before = engine.stats().prefill_steps
        began = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - began
        if engine.stats().prefill_steps == before:
            times.append(elapsed)
    return times


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spawn(arm: str, args: argparse.Namespace, cache: Path) -> dict:
    """The arm in a process of its own, the compile cache at ``cache`` (inductor's inside it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "NANOSERVE_COMPILE")}
    env["NANOSERVE_CACHE_DIR"] = str(cache)
    command = [sys.executable, "-m", "compile.startup", "--arm", arm, "--model", args.model,
               "--max-batch-size", str(args.max_batch_size), "--clients", str(args.clients),
               "--tokens", str(args.tokens), "--timeout", str(args.timeout)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if done.returncode:
        raise RuntimeError(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows_of(results: list[dict]) -> list[dict]:
    host = host_description()
    rows = []
    for result in results:
        buckets = result.pop("buckets", {})
        rows.append({**result, "bucket": "all", **host})
        for bucket, seconds in buckets.items():
            rows.append(dict(arm=result["arm"], bucket=bucket, build_s=seconds, **host))
    return rows


def plot(rows: Sequence[dict], path: Path) -> None:
    plt = pyplot()
    arms = [r for r in rows if r["bucket"] == "all"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["arm"] for r in arms]
    left.bar(names, [r.get("ready_s") or 0 for r in arms], label="all graphs ready")
    left.bar(names, [r["first_token_s"] for r in arms], label="first token", alpha=0.7)
    left.set_ylabel("seconds from process start (ready) / from the request (first token)")
    left.set_yscale("log")
    left.legend()
    x = range(len(arms))
    right.bar([i - 0.2 for i in x], [r["step_median_ms"] for r in arms], width=0.4, label="median step")
    right.bar([i + 0.2 for i in x], [r["step_max_ms"] for r in arms], width=0.4, label="slowest step")
    right.set_xticks(list(x), names)
    right.set_ylabel("decode step of the burst (ms)")
    right.legend()
    fig.suptitle(f"start-up: {arms[0].get('cpu', '')}, {arms[0].get('kernels', '')}")
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16, help="requests decoding together in the burst")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each burst request decodes")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the cold arm waits for its graphs")
    parser.add_argument("--arm", choices=("eager", "cold", "warm"), help=argparse.SUPPRESS)
    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.arm:  # a child: one arm, its record as the last line
        print(json.dumps(run_arm(args.arm, args.model, args.max_batch_size, args.clients, args.tokens,
                                 args.timeout)))
        return 0
    with tempfile.TemporaryDirectory(prefix="nanoserve-startup-") as cache:
        results = [spawn(arm, args, Path(cache)) for arm in ("eager", "cold", "warm")]
    rows = rows_of(results)
    print(format_table(rows, COLUMNS))
    write_results(rows, args.out, result_stem("startup", args.model, args.tag), None if args.no_plot else plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
