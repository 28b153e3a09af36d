"""structured: decode tokens/s of a batch of constrained requests (a JSON schema, masks filled
beside the forward and applied to the logits) against the same batch unconstrained
(``python compilebench.py structured``). Two engines of one model, compiled ``auto`` by default,
step in turn (compile/interleave.py), so neighbouring steps see one machine state; each row
decodes ``--new-tokens`` tokens (the schema cannot close sooner, the plain batch ignores EOS).
Writes ``compile/results/runs/structured[-TAG].csv``: tokens/s of each, their ratio, and the mean
time filling a step's masks.
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
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.formats.loader import DEFAULT_MODEL
from nanoserve.structured import StructuredOutputs

# A reply that stays open for as long as it is let run: a long list of small records.
SCHEMA = {"type": "array", "minItems": 10_000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}}


class BatchSteps:
    """One engine decoding one batch, a timed step per call (the first, the prefill, left out)."""

    def __init__(self, engine, prompts: list[list[int]], params: SamplingParams) -> None:
        self.engine = engine
        for prompt in prompts:
            engine.add_request(prompt, params)
        self.durations: list[float] = []

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> None:
        if not self.done:
            started = time.perf_counter()
            self.engine.step()
            self.durations.append(time.perf_counter() - started)

    @property
    def decode_steps(self) -> list[float]:
        return self.durations[1:]


def measure(engines: dict[str, object], batch: int, new_tokens: int, prompt_len: int) -> dict:
    """Both arms over the same prompts, interleaved; one result row."""
    vocab = engines["plain"].vocab_size
    prompts = make_prompts(batch, prompt_len, vocab)
    params = {"plain": SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
              "constrained": SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                            structured=StructuredOutputs(json=SCHEMA))}
    before = engines["constrained"].stats()
    arms = {name: BatchSteps(engines[name], prompts, params[name]) for name in engines}
    rotation = Rotation(arms)
    while not rotation.done:
        rotation.step_all()
    after = engines["constrained"].stats()
    tok_s = {name: batch / statistics.median(arm.decode_steps) for name, arm in arms.items()}
    steps = after.mask_steps - before.mask_steps
    return dict(batch=batch, new_tokens=new_tokens, plain_tok_s=tok_s["plain"],
                constrained_tok_s=tok_s["constrained"], ratio=tok_s["constrained"] / tok_s["plain"],
                mask_ms_per_step=1e3 * (after.mask_seconds - before.mask_seconds) / max(steps, 1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilebench.py structured", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", type=int_list, default=(8,), help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--eager", action="store_true", help="do not compile the decode step")
    add_output_options(parser, plot=False)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    host = host_description()
    options = dict(max_batch_size=max(args.batches), max_model_len=args.prompt_len + args.new_tokens + 16,
                   compile=not args.eager, warmup="eager", weights=args.weights)
    # Two engines loaded alike (the model's weights twice: the suite is for models that fit so).
    engines = {"plain": build_engine(args.model, **options), "constrained": build_engine(args.model, **options)}
    rows = [dict(**host, weights=args.weights, compiled=not args.eager,
                 **measure(engines, batch, args.new_tokens, args.prompt_len)) for batch in args.batches]
    print(format_table(rows, list(rows[0])))
    write_results(rows, args.out, result_stem("structured", args.model, args.tag))
    return 0
