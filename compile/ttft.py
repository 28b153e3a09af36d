"""ttft: time to first token of one long prompt, nanoserve against llama.cpp on the same GGUF
(``python compilebench.py ttft``): prompts of 512 and 2,000 tokens of real text, prefix caching
off, one request at a time, the two systems alternating; medians over ``--repeats`` after one
warm-up each. Writes ``compile/results/ttft[-TAG].csv``; the table names the CPU and the kernel
tier (``NANOSERVE_CPU_KERNELS`` forces one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from compile import llama_peer
from compile.report import RESULTS, format_table, host_description, write_csv
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.loader import resolve_model_path

TEXT = Path(__file__).parent / "texts" / "fidelity.txt"


def prompt_of(tokenizer, length: int) -> list[int]:
    """The first ``length`` tokens of the fidelity text (repeated if it is shorter)."""
    ids = tokenizer.encode(TEXT.read_text())
    return (ids * (length // len(ids) + 1))[:length]


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
    for start in range(0, len(prompt), peer.max_batch_tokens):
        chunk = np.array(prompt[start:start + peer.max_batch_tokens])
        wants = np.zeros(len(chunk), dtype=np.int8)
        last = start + len(chunk) == len(prompt)
        wants[-1] = last
        logits = peer.decode(chunk, np.arange(start, start + len(chunk)), np.zeros(len(chunk), dtype=np.int32), wants)
        if last:
            int(logits[0].argmax())
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="512,2000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--tag", default="", help="suffix for the output file (e.g. the forced kernel tier)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    lengths = [int(n) for n in args.lengths.split(",")]
    host = host_description()
    print(f"CPU: {host['cpu']}; nanoserve kernels: {host['kernels']}, compute dtype {host['dtype']}")
    engine = build_engine(args.model, max_batch_size=1, max_model_len=max(lengths) + 16, enable_prefix_caching=False)
    peer = None
    if not args.no_llama_cpp:
        if llama_peer.available():
            peer = llama_peer.LlamaCpp(resolve_model_path(args.model), 1, max(lengths) + 16, torch.get_num_threads())
        else:
            print(llama_peer.ABSENT)
    rows = []
    for length in lengths:
        prompt = prompt_of(engine.tokenizer, length)
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
            row.update(llama_s=statistics.median(theirs), vs_llama=statistics.median(theirs) / row["nanoserve_s"])
        rows.append(row)
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    if peer is not None:
        peer.close()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    print("\n" + format_table(rows, columns))
    path = args.out / f"ttft{'-' + args.tag if args.tag else ''}.csv"
    write_csv(rows, path)
    print(f"wrote {path} (vs_llama > 1: nanoserve's first token comes sooner)")
    return 0
