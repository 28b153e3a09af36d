"""e2e: offline decode throughput of the engine against Hugging Face transformers
(`python compilebench.py e2e`).

Both run the default model's dequantised weights in the same process: batches of
``--prompt-len``-token prompts, ``--new-tokens`` greedy tokens each, EOS ignored. Each
system's decode step time is the median over its steps (the engine's from timing ``step()``,
transformers' from a logits processor that stamps every generated position), so prefill is
left out of both. The matrix-product floor and the engine's share of step time spent
outside the forward (scheduling, planning, sampling) come from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from compile.floor import matmul_floor_seconds
from compile.report import RESULTS, format_table, write_csv
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.engine.engine import StepTiming
from nanoserve.model.loader import resolve_model_path

COLUMNS = ["batch", "engine_tok_s", "hf_tok_s", "engine_vs_hf", "engine_step_ms", "hf_step_ms", "floor_ms",
           "engine_x_floor", "hf_x_floor", "outside_forward", "same_tokens"]


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed + batch)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


def engine_run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """Median decode step seconds, share outside the forward, and the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.decode_timing = StepTiming()  # this run's figure alone
    durations, outputs = [], {}
    while engine.has_unfinished():
        started = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        durations.append(time.perf_counter() - started)
    decode = durations[1:]  # the first step is the batch's prefill
    return statistics.median(decode), engine.decode_timing.outside_forward_share, [outputs[i] for i in ids]


class _StepClock:
    """A transformers logits processor that only records when each position is produced."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def hf_run(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import LogitsProcessorList

    clock = _StepClock()
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]))
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return statistics.median(steps), out[:, input_ids.shape[1]:].tolist()


def load_reference(model: str):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    if path.is_dir():
        reference = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    else:
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    reference.generation_config.eos_token_id = None  # run exactly new_tokens past any EOS
    return reference.eval()


def run(args: argparse.Namespace) -> list[dict]:
    length = args.prompt_len + args.new_tokens + 1
    engine = build_engine(args.model, max_batch_size=max(args.batches), max_model_len=length,
                          kv_cache_bytes=args.kv_cache_bytes, compile=args.compile)
    reference = None if args.no_reference else load_reference(args.model)
    vocab = engine.vocab_size
    warm = make_prompts(max(args.batches), 8, vocab, seed=99)
    engine_run(engine, warm, 4)  # first-call costs out of the measurement
    if reference is not None:
        hf_run(reference, warm[:2], 4)
    results = []
    for batch in args.batches:
        prompts = make_prompts(batch, args.prompt_len, vocab)
        engine_step, outside, engine_tokens = engine_run(engine, prompts, args.new_tokens)
        floor = matmul_floor_seconds(engine.model, batch)
        row = dict(batch=batch, engine_tok_s=batch / engine_step, engine_step_ms=engine_step * 1e3,
                   floor_ms=floor * 1e3, engine_x_floor=engine_step / floor, outside_forward=outside)
        if reference is not None:
            hf_step, hf_tokens = hf_run(reference, prompts, args.new_tokens)
            same = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
            row.update(hf_tok_s=batch / hf_step, hf_step_ms=hf_step * 1e3, engine_vs_hf=hf_step / engine_step,
                       hf_x_floor=hf_step / floor, same_tokens=f"{same}/{batch}")
        results.append(row)
        print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)
    return results


def write_plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["engine_tok_s"] for r in results], marker="o", label="nanoserve")
    if "hf_tok_s" in results[0]:
        ax.plot(batches, [r["hf_tok_s"] for r in results], marker="o", label="transformers generate")
    ax.plot(batches, [b / (r["floor_ms"] / 1e3) for b, r in zip(batches, results)], linestyle="--",
            color="grey", label="matmul floor")
    ax.set(xscale="log", xlabel="batch", ylabel="decode tokens/s (median step)", title="e2e decode, fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="the engine with compile=True")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    results = run(args)
    print("\n" + format_table(results, COLUMNS))
    write_csv(results, args.out / "e2e.csv")
    if not args.no_plot:
        write_plot(results, args.out / "e2e.png")
    print(f"wrote {args.out / 'e2e.csv'}" + ("" if args.no_plot else " and e2e.png"))
    return 0
