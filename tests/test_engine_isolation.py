"""One request's own failure (sampling, prompt scoring, detokenizing) fails it alone; an engine
fault (the model, the cache) propagates out of step(). Prompt logprobs and prefill-only
requests (max_tokens=0) against the dense reference."""

from __future__ import annotations

import pytest
import torch
from conftest import while_unfinished

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config(), seed=0)


def engine_for(model, **kwargs):
    options = dict(max_batch_size=8, kv_cache_bytes=1 << 20, block_size=4, max_model_len=64)
    return build_engine(model, **{**options, **kwargs})


@pytest.fixture(scope="module")
def alone(tiny):
    """Each prompt's greedy tokens when it runs by itself."""
    return [engine_for(tiny).generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]


class _FailingForSeed(Sampler):
    """A sampler that raises whenever a row's seed is the planted one: a per-request fault."""

    def __call__(self, logits, params, generators, histories=None):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("planted sampling fault")
        return super().__call__(logits, params, generators, histories)


def test_a_request_whose_sampling_raises_fails_alone(tiny, alone):
    engine = engine_for(tiny)
    engine.worker.sampler = _FailingForSeed()
    bad = SamplingParams(temperature=1.0, seed=666, max_tokens=6)
    outputs = engine.generate(PROMPTS + [[11, 12]], [GREEDY] * 4 + [bad], use_tqdm=False)
    assert [o.token_ids for o in outputs[:4]] == alone
    assert outputs[4].finish_reason == "error" and "planted sampling fault" in outputs[4].error
    engine.check_drained()


def test_seeded_neighbours_of_a_failing_row_keep_their_tokens(tiny):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    expected = engine_for(tiny).generate([[3, 4]], seeded, use_tqdm=False)[0].token_ids
    engine = engine_for(tiny)
    engine.worker.sampler = _FailingForSeed()
    bad = SamplingParams(temperature=1.0, seed=666, max_tokens=6)
    outputs = engine.generate([[3, 4], [5, 6]], [seeded, bad], use_tqdm=False)
    assert outputs[0].token_ids == expected and outputs[1].finish_reason == "error"


class _ExplodingDetokenizer:
    def add(self, token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted detokenizer fault")

    def flush(self):
        return ""


def test_a_request_whose_detokenizer_raises_fails_alone(tiny, alone):
    engine = engine_for(tiny)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.requests[ids[1]].detokenizer = _ExplodingDetokenizer()
    finished = {}
    for _ in while_unfinished(engine):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[ids[1]].finish_reason == "error" and "detokenizer" in finished[ids[1]].error
    assert [finished[i].token_ids for i in (ids[0], ids[2], ids[3])] == [alone[0], alone[2], alone[3]]
    engine.check_drained()


def test_an_engine_fault_propagates_out_of_step(tiny):
    engine = engine_for(tiny)
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()  # prefill

    def broken_advance(rows):
        raise AssertionError("planted: slot table out of step with the pool")

    engine.scheduler.blocks.advance = broken_advance
    with pytest.raises(AssertionError, match="planted"):
        engine.step()


def test_a_lone_surrogate_in_a_text_prompt_is_a_request_error(smollm2):
    from nanoserve.engine import RequestError

    model, tokenizer = smollm2
    engine = build_engine(model, tokenizer=tokenizer, max_batch_size=2, max_model_len=64)
    with pytest.raises(RequestError, match="prompt: not valid Unicode"):
        engine.add_request("abc\ud800def", GREEDY)
    engine.check_drained()


def dense_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    logits = dense_forward(model, torch.tensor([prompt]))[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_equal_the_dense_reference(tiny, max_tokens):
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=3, ignore_eos=True)
    engine = engine_for(tiny)
    # Beside other requests, so the scored prompt is one slice of a packed prefill.
    outputs = engine.generate([[9, 9], prompt, [7]], [GREEDY, params, GREEDY], use_tqdm=False)
    out = outputs[1]
    reference = dense_prompt_logprobs(tiny, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert outputs[0].prompt_logprobs is None
    engine.check_drained()


def test_prompt_logprobs_are_scored_once_across_preemption(tiny):
    # 24 blocks of 4 slots: 12 prompts cannot all hold their contexts at once.
    engine = engine_for(tiny, kv_cache_bytes=24 * 4 * 2 * 2 * 2 * 16 * 4)
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)
    batch = [[(7 * i + j) % 256 for j in range(4 + i)] for i in range(12)]
    outputs = engine.generate(batch, params, use_tqdm=False)
    assert engine.stats().preemptions > 0
    for prompt, out in zip(batch, outputs):
        reference = dense_prompt_logprobs(tiny, prompt)
        scored = [entry.logprob for entry in out.prompt_logprobs[1:]]
        expected = [float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert scored == pytest.approx(expected, abs=1e-4)
    engine.check_drained()
