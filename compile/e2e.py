"""e2e: offline decode throughput of the engine against Hugging Face transformers
(`python compilebench.py e2e`).

Both run the default model's dequantised weights in the same process: batches of
``--prompt-len``-token prompts, ``--new-tokens`` greedy tokens each, EOS ignored. Each
system's decode step time is the median over its steps, prefill left out of both. The two
run in lockstep: a logits processor inside ``generate()`` runs (and times) one engine step
each time transformers produces a position, transformers' step being the time between two
such calls. The ratio is the median over those neighbouring pairs: on a shared VM whose
speed drifts 10-15% over a minute, a neighbour sees the same machine; two back-to-back runs
do not. The matrix-product floor and the engine's share of step time spent outside the
forward (scheduling, planning, sampling) come from the same run.
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

COLUMNS = ["batch", "engine_tok_s", "hf_tok_s", "engine_vs_hf", "ratio_p10", "ratio_p90", "engine_step_ms",
           "hf_step_ms", "floor_ms", "engine_x_floor", "hf_x_floor", "outside_forward", "same_tokens"]


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed + batch)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


class _EngineSteps:
    """Drives the engine one step at a time and times each; collects the finished tokens."""

    def __init__(self, engine, prompts: list[list[int]], new_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        self.engine = engine
        self.ids = [engine.add_request(p, params) for p in prompts]
        engine.decode_timing = StepTiming()  # this run's figure alone
        self.durations: list[float] = []
        self.outputs: dict[str, list[int]] = {}

    def step(self) -> None:
        if not self.engine.has_unfinished():
            return
        started = time.perf_counter()
        for out in self.engine.step():
            if out.finished:
                self.outputs[out.request_id] = out.token_ids
        self.durations.append(time.perf_counter() - started)

    @property
    def decode_steps(self) -> list[float]:
        return self.durations[1:]  # the first step is the batch's prefill

    @property
    def tokens(self) -> list[list[int]]:
        return [self.outputs[i] for i in self.ids]


def engine_run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], float, list[list[int]]]:
    """The engine alone: its decode step times, share outside the forward, and the tokens."""
    steps = _EngineSteps(engine, prompts, new_tokens)
    while engine.has_unfinished():
        steps.step()
    return steps.decode_steps, engine.decode_timing.outside_forward_share, steps.tokens


class _Lockstep:
    """A transformers logits processor that runs one engine step each time generate()
    produces a position, so the two systems alternate step by step on the same machine.
    transformers' step is the time from one call's exit to the next call's entry: its
    forward, cache update and generate() bookkeeping, without the engine's step."""

    def __init__(self, engine_steps: _EngineSteps) -> None:
        self.engine_steps = engine_steps
        self.hf_durations: list[float] = []
        self._left: float | None = None

    def __call__(self, input_ids, scores):
        entered = time.perf_counter()
        if self._left is not None:
            self.hf_durations.append(entered - self._left)
        self.engine_steps.step()
        self._left = time.perf_counter()
        return scores


def paired_run(engine, model, prompts: list[list[int]], new_tokens: int):
    """Both systems decoding the same prompts in lockstep. Returns (engine step times,
    transformers step times, outside-forward share, engine tokens, transformers tokens);
    the i-th times of both are neighbours in time, so their ratio sees one machine state."""
    from transformers import LogitsProcessorList

    engine_steps = _EngineSteps(engine, prompts, new_tokens)
    lockstep = _Lockstep(engine_steps)
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([lockstep]))
    while engine.has_unfinished():  # the engine has as many steps as generate() has positions
        engine_steps.step()
    hf_tokens = out[:, input_ids.shape[1]:].tolist()
    return (engine_steps.decode_steps, lockstep.hf_durations, engine.decode_timing.outside_forward_share,
            engine_steps.tokens, hf_tokens)


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
        paired_run(engine, reference, warm[:2], 4)
    results = []
    for batch in args.batches:
        prompts = make_prompts(batch, args.prompt_len, vocab)
        if reference is None:
            engine_steps, outside, _ = engine_run(engine, prompts, args.new_tokens)
        else:
            engine_steps, hf_steps, outside, engine_tokens, hf_tokens = paired_run(
                engine, reference, prompts, args.new_tokens)
        floor = matmul_floor_seconds(engine.model, batch)
        engine_step = statistics.median(engine_steps)
        row = dict(batch=batch, engine_tok_s=batch / engine_step, engine_step_ms=engine_step * 1e3,
                   floor_ms=floor * 1e3, engine_x_floor=engine_step / floor, outside_forward=outside)
        if reference is not None:
            # Pair each transformers step with the engine step run right after it.
            ratios = sorted(h / e for h, e in zip(hf_steps, engine_steps))
            hf_step = statistics.median(hf_steps)
            same = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
            row.update(hf_tok_s=batch / hf_step, hf_step_ms=hf_step * 1e3, engine_vs_hf=statistics.median(ratios),
                       ratio_p10=ratios[len(ratios) // 10], ratio_p90=ratios[len(ratios) * 9 // 10],
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
    name = "e2e-compile" if args.compile else "e2e"  # the eager record is not overwritten
    write_csv(results, args.out / f"{name}.csv")
    if not args.no_plot:
        write_plot(results, args.out / f"{name}.png")
    print(f"wrote {args.out / name}.csv" + ("" if args.no_plot else f" and {name}.png"))
    return 0
