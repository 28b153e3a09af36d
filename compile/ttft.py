"""ttft: time to first token of one long prompt, nanoserve against llama.cpp on the same GGUF
(``python compilebench.py ttft``): prompts of 512 and 2,000 tokens of real text, prefix caching
off, one request at a time, the two systems alternating; medians over ``--repeats`` after one
warm-up each. Writes ``compile/results/runs/ttft[-TAG].csv``; the table names the CPU and the kernel
tier (``NANOSERVE_CPU_KERNELS`` forces one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from compile import llama_peer
from compile.common import (
    add_output_options,
    format_table,
    host_description,
    int_list,
    result_stem,
    text_prompt,
    write_results,
)
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.loader import DEFAULT_MODEL


def nanoserve_ttft(engine, prompt: list[int]) -> float:
    started = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    elapsed = time.perf_counter() - started
    if out.error:
        raise RuntimeError(out.error)
    return elapsed


def llama_ttft(peer: llama_peer.LlamaCpp, prompt: list[int]) -> float:
    """Prefill in chunks of the context's batch, then the first token's argmax."""
    peer.clear()
    started = time.perf_counter()
    int(llama_peer.prefill_logits(peer, prompt, every_position=False)[-1].argmax())
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--lengths", type=int_list, default=(512, 2000), help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-llama-cpp", action="store_true")
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    lengths = args.lengths
    host = host_description()
    print(f"CPU: {host['cpu']}; nanoserve kernels: {host['kernels']}, compute dtype {host['dtype']}")
    engine = build_engine(args.model, max_batch_size=1, max_model_len=max(lengths) + 16, enable_prefix_caching=False,
                          compile=False)
    peer, llama_mode = None, None
    if not args.no_llama_cpp and not llama_peer.available():
        print(llama_peer.ABSENT)
    elif not args.no_llama_cpp and (path := llama_peer.gguf_of(args.model)) is not None:
        peer, llama_mode = llama_peer.load_as_run(path, 1, max(lengths) + 16, torch.get_num_threads())
    rows = []
    for length in lengths:
        prompt = text_prompt(engine.tokenizer, length)
        ours, theirs = [], []
        for repeat in range(args.repeats + 1):  # the first of each is a warm-up
            t = nanoserve_ttft(engine, prompt)
            if repeat:
                ours.append(t)
            if peer is not None:
                t = llama_ttft(peer, prompt)
                if repeat:
                    theirs.append(t)
        row = dict(**host, weights=engine.stats().weights, prompt_tokens=length,
                   nanoserve_s=statistics.median(ours))
        if theirs:
            row.update(llama_s=statistics.median(theirs), vs_llama=statistics.median(theirs) / row["nanoserve_s"],
                       llama_cpp=llama_mode.label)
        rows.append(row)
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    if peer is not None:
        peer.close()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    print("\n" + format_table(rows, columns))
    write_results(rows, args.out, result_stem("ttft", args.model, args.tag))
    print("vs_llama > 1: nanoserve's first token comes sooner")
    return 0
