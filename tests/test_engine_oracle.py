"""The engine against the dense oracle, token by token and logprob by logprob.

Every request's prompt plus generated tokens is re-run through `dense_forward` (no cache, no
batching) and read teacher-forced: at each generated position, the engine's greedy token must
be the oracle's argmax, and the logprob the engine reports for the token it chose (greedy or
sampled) and its top alternatives must be the oracle's, within 1e-4 in fp32 (the paged and
the dense forward sum in different orders; a wrong K/V row moves a logprob by far more).
Pools are small enough that requests are preempted and rows compacted mid-run.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import SamplingParams, build_engine
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config

TOLERANCE = 1e-4  # fp32 throughout
TOP = 3  # alternatives compared per position


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config(), seed=0)


def bytes_for_blocks(model, num_blocks: int, block_size: int) -> int:
    config = model.config
    return num_blocks * 2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size * 4


@torch.no_grad()
def assert_matches_the_dense_oracle(model, prompt: list[int], out, greedy: bool) -> None:
    generated = out.token_ids
    logits = dense_forward(model, torch.tensor([prompt + generated]))[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # the position that chose each token
    assert len(out.logprobs) == len(generated)
    for position, (token, entry, row) in enumerate(zip(generated, out.logprobs, reference)):
        where = f"{out.request_id} (prompt of {len(prompt)}), generated token {position}"
        if greedy:
            assert token == int(row.argmax()), f"{where}: greedy token differs from the oracle's argmax"
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=TOLERANCE), where
        top_values, top_ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == top_ids.tolist(), where
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=TOLERANCE), where


@pytest.mark.parametrize("block_size,num_blocks", [(1, 90), (4, 22), (16, 7)])
def test_tokens_and_logprobs_equal_the_dense_oracle_through_preemption_and_compaction(tiny, block_size,
                                                                                      num_blocks):
    rng = random.Random(block_size)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 3, 4, 5, 9, 16, 17, 33, 2, 40, 7, 24)]
    params = [SamplingParams(temperature=0.0, max_tokens=1 + 5 * i % 23, ignore_eos=True, logprobs=TOP)
              for i in range(len(prompts))]
    # Two sampled requests: their tokens are not the argmax, but their logprobs are still the oracle's.
    params[3] = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True, logprobs=TOP)
    params[8] = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=15, ignore_eos=True, logprobs=TOP)
    # Whole-prompt admission: this pool is sized so whole prompts force preemption and compaction;
    # chunked and prefix-shared runs meet the oracle in their own suites.
    engine = build_engine(tiny, max_batch_size=6, block_size=block_size, max_model_len=80, enable_chunked_prefill=False,
                          kv_cache_bytes=bytes_for_blocks(tiny, num_blocks, block_size))
    outputs = engine.generate(prompts, params, use_tqdm=False)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.compactions > 0, stats
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
        assert_matches_the_dense_oracle(tiny, prompt, out, greedy=p.temperature == 0.0)
    engine.check_drained()


def test_a_steady_batch_decodes_hundreds_of_tokens_as_the_dense_oracle_does(tiny):
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11, list(range(100, 101))]
    params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True, logprobs=TOP)
    engine = build_engine(tiny, max_batch_size=4, block_size=4, max_model_len=280,
                          kv_cache_bytes=bytes_for_blocks(tiny, 4 * 70 + 1, 4))
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats().preemptions == 0 and engine.stats().decode_steps >= 239
    for prompt, out in zip(prompts, outputs):
        assert len(out.token_ids) == 240
        assert_matches_the_dense_oracle(tiny, prompt, out, greedy=True)
    engine.check_drained()
