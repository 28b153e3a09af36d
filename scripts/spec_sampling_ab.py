"""Sampled speculative decoding, the CPU ops' laws against torch's sort, in one process: two
engines alike (n-gram proposer), one whose sampler is ``Sampler(cpu_op=False)`` (the target's law
at each verified position by sorting the vocabulary), generating the same repetitive prompt in
turn, so a shared VM's phases fall on both. Acceptance is random, so a run's tokens a second moves
with how many proposals it accepted: compare medians over several runs. Prints each arm's median
tokens/s and the verify steps of each run.

    PYTHONPATH=. python scripts/spec_sampling_ab.py [--model FILE] [--k 4] [--runs 6] [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compile.common import SAMPLING_LAWS
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.loader import DEFAULT_MODEL
from nanoserve.worker.sampler import Sampler

TEXT = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. " * 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--runs", type=int, default=6, help="timed generations per arm, after one warm-up each")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    options = dict(max_batch_size=1, max_model_len=1024, enable_prefix_caching=False, warmup="eager",
                   speculative={"method": "ngram", "num_speculative_tokens": args.k})
    engines = {"ops": build_engine(args.model, **options), "sort": build_engine(args.model, **options)}
    engines["sort"].worker.sampler = Sampler(cpu_op=False)
    prompt = engines["ops"].tokenizer.encode(TEXT)[:300]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, **SAMPLING_LAWS["llama.cpp"])
    for engine in engines.values():
        engine.generate([prompt], params, use_tqdm=False)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    verifies: dict[str, list[int]] = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, engine in engines.items():
            before = engine.stats().spec_verify_steps
            started = time.perf_counter()
            engine.generate([prompt], params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - started)
            verifies[name].append(engine.stats().spec_verify_steps - before)
    vocab = engines["ops"].vocab_size
    print(f"n-gram k={args.k}, llama.cpp's law, vocabulary {vocab}, {args.new_tokens} tokens a run")
    for name in engines:
        print(f"{name:>5}: {args.new_tokens / statistics.median(seconds[name]):7.1f} tokens/s (median of {args.runs}),"
              f" verify steps a run {verifies[name]}")


if __name__ == "__main__":
    main()
