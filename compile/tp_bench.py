"""tp: decode throughput under tensor parallelism (``python compilebench.py tp``): the same
batch of decoding rows at each tensor-parallel size, with the share of a step spent in
collectives on rank 0.

Each size builds its own engine (tensor_parallel_size=N: N-1 worker processes on this host,
gloo on the CPU, NCCL on CUDA), prefills ``--rows`` prompts, then times ``--steps`` decode
steps (tokens/s = rows x steps / seconds). A further ``--profile-steps`` run under
torch.profiler on rank 0 sums the forward's collectives (the all-reduces, the logits'
all-gather and their waits) per step; the plan's broadcast to the other ranks is timed apart.
Sizes default to those of 1, 2, 3 that divide the model's heads, K/V heads and MLP width (the
default model: 1 and 3). On a CPU the ranks share its cores: a correctness and overhead
figure, not a speed-up. Writes ``compile/results/runs/tp[-MODEL][-TAG].csv``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from compile.common import (
    add_output_options,
    format_table,
    host_description,
    int_list,
    result_stem,
    write_results,
)
from nanoserve.distributed.shard import check_tensor_parallel
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.engine.build import resolve_weights
from nanoserve.model.formats.loader import DEFAULT_MODEL, load_config

# The forward's collectives as torch.profiler names them (the functional ops and their waits).
COLLECTIVES = ("_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor",
               "_c10d_functional::wait_tensor")
COLUMNS = ["tp", "rows", "weights", "compiled", "step_ms", "tokens_per_s", "collectives_ms", "collectives_share",
           "plan_broadcast_ms"]


def tiny_model():
    """A random model whose 24 heads split 1, 2, 3, 4, 6 or 8 ways (a quick check of the suite,
    and the GPU check's model on any number of GPUs up to 8 that divides them)."""
    from nanoserve.model.network.synthetic import random_model, tiny_config
    return random_model(tiny_config(num_heads=24, num_kv_heads=24, hidden_size=384, intermediate_size=768), seed=0)


class TimedSend:
    """The driver's send with the seconds spent in it added up (the plan broadcast)."""

    def __init__(self, send) -> None:
        self.send, self.seconds = send, 0.0

    def __call__(self, message) -> None:
        started = time.perf_counter()
        self.send(message)
        self.seconds += time.perf_counter() - started


def decode_steps(engine, steps: int) -> None:
    for _ in range(steps):
        engine.step()


def measure(model, size: int, args) -> dict:
    options = dict(max_batch_size=args.rows, max_model_len=args.prompt_len + args.warmup_steps + args.steps
                   + args.profile_steps + 8, compile=args.compile, warmup="eager" if args.compile else "lazy",
                   device=args.device)
    if args.weights:
        options["weights"] = args.weights
    with build_engine(model, tensor_parallel_size=size, **options) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=10 ** 6, ignore_eos=True)
        vocab = engine.vocab_size
        for row in range(args.rows):
            engine.add_request([(row * 7919 + i * 31) % vocab for i in range(args.prompt_len)], params)
        while not all(r.output_token_ids for r in engine.requests.values()):  # every prompt prefilled
            engine.step()
        decode_steps(engine, args.warmup_steps)
        driver = getattr(engine.worker, "driver", None)
        timed = None
        if driver is not None:
            timed = driver.send = TimedSend(driver.send)
        started = time.perf_counter()
        decode_steps(engine, args.steps)
        elapsed = time.perf_counter() - started
        broadcast = timed.seconds / args.steps if timed else 0.0
        # Host time in the collective ops and their waits (on a GPU, where they are queued, the
        # waits carry most of it).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            decode_steps(engine, args.profile_steps)
        in_collectives = sum(e.cpu_time_total for e in profiler.key_averages() if e.key in COLLECTIVES) / 1e6
        step = elapsed / args.steps
        weights, compiled = engine.resolved.weights, engine.config.compile
    collectives = in_collectives / max(args.profile_steps, 1)
    return dict(tp=size, rows=args.rows, weights=weights, compiled=compiled, step_ms=step * 1e3,
                tokens_per_s=args.rows / step, collectives_ms=collectives * 1e3,
                collectives_share=collectives / step, plan_broadcast_ms=broadcast * 1e3)


def default_sizes(model, weights, device: str) -> tuple[int, ...]:
    config = model.config if not isinstance(model, str) else load_config(model)
    plan, _ = resolve_weights(weights, None, device, named_model=isinstance(model, str))
    sizes = []
    for size in (1, 2, 3):
        try:
            check_tensor_parallel(config, size, plan)
        except ValueError:
            continue
        sizes.append(size)
    return tuple(sizes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py tp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help='a model argument, or "tiny" (a random check model)')
    parser.add_argument("--sizes", "--tensor-parallel-size", type=int_list, default=None,
                        help="tensor-parallel sizes, comma-separated (default: those of 1, 2, 3 the model divides by)")
    parser.add_argument("--weights", default=None, help="weight format (default: the engine's)")
    parser.add_argument("--rows", type=int, default=8, help="decoding rows")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="compiled decode (each rank its own graphs)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (rank r on GPU r, NCCL)")
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model = tiny_model() if args.model == "tiny" else args.model
    host = host_description()
    print(f"CPU: {host['cpu']}; nanoserve kernels: {host['kernels']}, compute dtype {host['dtype']}")
    rows = []
    for size in args.sizes or default_sizes(model, args.weights, args.device):
        rows.append(dict(**host, **measure(model, size, args)))
        print(format_table(rows[-1:], COLUMNS), flush=True)
    print("\n" + format_table(rows, COLUMNS))
    write_results(rows, args.out, result_stem("tp", args.model if args.model != "tiny" else "tiny", args.tag))
    return 0
