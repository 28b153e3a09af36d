"""Several systems decoding the same prompts, one step each in turn, so that the i-th steps of
all of them are neighbours in time and see one machine state (on a shared VM whose speed
drifts within a minute, back-to-back runs do not).

An arm is anything with ``step()`` (one timed step; the first is the prefill), ``done``,
``decode_steps`` (seconds, prefill left out) and ``tokens``. With transformers in the run,
its ``generate()`` drives: a logits processor steps every other arm each time it produces a
position, and transformers' own step is the time between two such calls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from compile.common import SAMPLING_LAWS
from nanoserve.engine import SamplingParams
from nanoserve.model.formats.loader import resolve_model_path

TRANSFORMERS = "transformers"


class Arm(Protocol):
    done: bool
    decode_steps: list[float]
    tokens: list[list[int]]

    def step(self) -> None: ...


@dataclass
class StepTiming:
    """Wall time of whole pure-decode steps and of the worker's forward inside them (the
    worker's own measure, ``StepOutput.seconds``: on a GPU the device is synchronised first)."""

    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    steps: int = 0

    @property
    def outside_forward_share(self) -> float:
        return 1.0 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0


class EngineSteps:
    """Drives the engine one step at a time and times each; collects the finished tokens."""

    def __init__(self, engine, prompts: list[list[int]], new_tokens: int, law: dict | None = None) -> None:
        # law: SamplingParams fields (common.SAMPLING_LAWS); None: greedy
        params = SamplingParams(**(law or SAMPLING_LAWS["greedy"]), max_tokens=new_tokens, ignore_eos=True)
        self.engine = engine
        self.ids = [engine.add_request(p, params) for p in prompts]
        self.timing = StepTiming()
        self._forward: float | None = None  # the worker's forward seconds in the step being timed, if pure decode
        execute = engine.worker.execute

        def timed(plan, sampling=None):
            out = execute(plan, sampling)
            if plan.decode is not None and not plan.prefill:
                self._forward = out.seconds
            return out

        engine.worker.execute = timed  # this run's engine: each step's forward as the worker measured it
        self.durations: list[float] = []
        self.outputs: dict[str, list[int]] = {}

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> None:
        if self.done:
            return
        started, self._forward = time.perf_counter(), None
        for out in self.engine.step():
            if out.finished:
                self.outputs[out.request_id] = out.token_ids
        self.durations.append(time.perf_counter() - started)
        if self._forward is not None:
            self.timing.steps += 1
            self.timing.forward_seconds += self._forward
            self.timing.step_seconds += self.durations[-1]

    @property
    def decode_steps(self) -> list[float]:
        return self.durations[1:]  # the first step is the batch's prefill

    @property
    def tokens(self) -> list[list[int]]:
        return [self.outputs[i] for i in self.ids]

    @property
    def outside_forward(self) -> float:
        return self.timing.outside_forward_share


class Rotation:
    """Steps every arm once per call; the order rotates by one each call, so no arm always
    runs first or right after transformers."""

    def __init__(self, arms: Mapping[str, Arm]) -> None:
        self.arms = list(arms.values())
        self.calls = 0

    def step_all(self) -> None:
        turn = self.calls % len(self.arms)
        self.calls += 1
        for arm in self.arms[turn:] + self.arms[:turn]:
            arm.step()

    @property
    def done(self) -> bool:
        return all(arm.done for arm in self.arms)


class _Lockstep:
    """A transformers logits processor that steps every other arm each time generate()
    produces a position. transformers' step is the time from one call's exit to the next
    call's entry: its forward, cache update and generate() bookkeeping, without the others."""

    def __init__(self, rotation: Rotation) -> None:
        self.rotation = rotation
        self.durations: list[float] = []
        self._left: float | None = None

    def __call__(self, input_ids, scores):
        entered = time.perf_counter()
        if self._left is not None:
            self.durations.append(entered - self._left)
        self.rotation.step_all()
        self._left = time.perf_counter()
        return scores


@dataclass(frozen=True)
class PassResult:
    """One interleaved pass: per arm (transformers included when it ran), its decode step
    seconds in order and its tokens."""

    decode_steps: dict[str, list[float]]
    tokens: dict[str, list[list[int]]]


def interleaved_run(arms: Mapping[str, Arm], prompts: list[list[int]], new_tokens: int,
                    reference=None) -> PassResult:
    """Every arm (already holding ``prompts``) steps to the end, in rotation; with a transformers
    ``reference``, its generate() over the same prompts drives the rotation."""
    rotation = Rotation(arms)
    steps = {}
    tokens = {}
    if reference is not None:
        steps[TRANSFORMERS], tokens[TRANSFORMERS] = _generate(reference, rotation, prompts, new_tokens)
    while not rotation.done:  # the arms have as many steps as generate() has positions
        rotation.step_all()
    for name, arm in arms.items():
        steps[name], tokens[name] = arm.decode_steps, arm.tokens
    return PassResult(steps, tokens)


def _generate(reference, rotation: Rotation, prompts: list[list[int]], new_tokens: int):
    from transformers import LogitsProcessorList

    lockstep = _Lockstep(rotation)
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([lockstep]))
    return lockstep.durations, out[:, input_ids.shape[1]:].tolist()


def load_reference(model: str):
    """transformers' fp32 model of the same weights (a GGUF is dequantised on load)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    if path.is_dir():
        reference = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    else:
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    reference.generation_config.eos_token_id = None  # run exactly new_tokens past any EOS
    return reference.eval()
