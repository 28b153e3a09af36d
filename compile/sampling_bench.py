"""sampling: what choosing a token costs on the CPU, the ``sample_rows`` op (one uniform draw a
row) against the exponential race (a random number per vocabulary entry, a sort for top-k/top-p;
the GPU's path), each under the laws users run (``python compilebench.py sampling``).

Two parts. (1) The sampler alone on random logits of each ``--vocabs`` size at each batch, the
median of ``--repeats`` calls per arm, the arms alternating: a draw, and the law as probabilities
(``Sampler.distribution``, which speculative decoding's acceptance reads: the ``law_probabilities``
op against torch's sort). (2) Decode tokens/s of the model with
each sampler: two engines loaded alike, one with the race, stepping in turn (compile/interleave.py)
over the same prompts, each row decoding ``--new-tokens`` tokens (EOS ignored). Writes
``compile/results/runs/sampling[-TAG].csv`` (and ``sampling-e2e[-TAG].csv``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from compile.common import (
    add_output_options,
    format_table,
    host_description,
    int_list,
    make_prompts,
    result_stem,
    write_results,
)
from compile.interleave import Rotation
from compile.structured_bench import BatchSteps
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.loader import DEFAULT_MODEL
from nanoserve.worker.sampler import Sampler

# The laws compared: name -> params (max_tokens set per run).
LAWS = {
    "greedy": dict(temperature=0.0),
    "llama.cpp defaults (T 0.8, top-k 40, top-p 0.95, min-p 0.05)": dict(temperature=0.8, top_k=40, top_p=0.95,
                                                                      min_p=0.05),
    "OpenAI defaults (T 1)": dict(temperature=1.0),
    "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "T 1.5, top-p 0.95 (flatter: most of the vocabulary in the nucleus)": dict(temperature=1.5, top_p=0.95),
    "Ollama's (T 0.8, top-k 40, top-p 0.9, repetition penalty 1.1)": dict(temperature=0.8, top_k=40, top_p=0.9,
                                                                        repetition_penalty=1.1),
}
HISTORY = (500, 200)  # a row's prompt and output tokens so far, which the penalties read
ARMS = {"op": Sampler(), "race": Sampler(cpu_op=False)}


def sampler_alone(vocab: int, batch: int, law: dict, repeats: int) -> dict:
    """Median ms a call per arm on random logits (a language model's spread: randn x 4): a draw,
    and the law as probabilities (``Sampler.distribution``, what speculative decoding reads: the
    op's, or torch's sort)."""
    logits = (torch.randn(batch, vocab) * 4).bfloat16()
    params = [SamplingParams(**law)] * batch
    draw = torch.Generator().manual_seed(vocab)
    histories = [tuple(torch.randint(vocab, (length,), generator=draw).tolist() for length in HISTORY)
                 for _ in range(batch)]
    times: dict[str, list[float]] = {f"{name}_{part}": [] for name in ARMS for part in ("draw", "law")}
    for _ in range(repeats):
        for name, sampler in ARMS.items():
            started = time.perf_counter()
            sampler(logits, params, [None] * batch, histories)
            times[f"{name}_draw"].append(time.perf_counter() - started)
            started = time.perf_counter()
            sampler.distribution(logits, params, histories)
            times[f"{name}_law"].append(time.perf_counter() - started)
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    return dict(vocab=vocab, batch=batch, op_ms=ms["op_draw"], race_ms=ms["race_draw"],
                race_over_op=ms["race_draw"] / ms["op_draw"], law_op_ms=ms["op_law"], law_sort_ms=ms["race_law"],
                sort_over_op=ms["race_law"] / ms["op_law"])


def decode_with_each(engines: dict[str, object], batch: int, law: dict, new_tokens: int, prompt_len: int) -> dict:
    """Both engines over the same prompts and law, interleaved step by step; one result row."""
    prompts = make_prompts(batch, prompt_len, engines["op"].vocab_size)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **law)
    arms = {name: BatchSteps(engine, prompts, params) for name, engine in engines.items()}
    rotation = Rotation(arms)
    while not rotation.done:
        rotation.step_all()
    tok_s = {name: batch / statistics.median(arm.decode_steps) for name, arm in arms.items()}
    return dict(batch=batch, op_tok_s=tok_s["op"], race_tok_s=tok_s["race"], op_over_race=tok_s["op"] / tok_s["race"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py sampling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--vocabs", type=int_list, default=(49152, 128256, 151936),
                        help="vocabulary sizes of the sampler-alone part (SmolLM2, Llama 3, Qwen)")
    parser.add_argument("--batches", type=int_list, default=(1, 8), help="batch sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--no-e2e", action="store_true", help="the sampler alone, no engine")
    parser.add_argument("--eager", action="store_true", help="do not compile the decode step")
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    host = host_description()
    rows = [dict(**host, law=name, **sampler_alone(vocab, batch, law, args.repeats))
            for name, law in LAWS.items() for vocab in args.vocabs for batch in args.batches]
    print(format_table(rows, list(rows[0])))
    write_results(rows, args.out, result_stem("sampling", args.model, args.tag))
    if args.no_e2e:
        return 0
    options = dict(max_batch_size=max(args.batches), max_model_len=args.prompt_len + args.new_tokens + 16,
                   compile=not args.eager, warmup="eager", enable_prefix_caching=False)
    engines = {name: build_engine(args.model, **options) for name in ARMS}
    engines["race"].worker.sampler = ARMS["race"]
    e2e = [dict(**host, law=name, compiled=not args.eager,
                **decode_with_each(engines, batch, law, args.new_tokens, args.prompt_len))
           for name, law in LAWS.items() for batch in args.batches]
    print(format_table(e2e, list(e2e[0])))
    write_results(e2e, args.out, result_stem("sampling-e2e", args.model, args.tag))
    return 0
