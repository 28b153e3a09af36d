"""Speculation through nanoserve's CPU kernels (packed int4 weights, and bf16 ones whose decode
attention the kernel tier reads): a verify row's queries share one read of its cells, and the
greedy tokens are the plain engine's."""

from __future__ import annotations

import pytest

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [9, 10, 11, 9, 10, 11, 9, 10], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("weights", ["int4", "bf16"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_tokens_through_the_kernel_tier_are_the_plain_engines(weights, method):
    options = dict(max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4, max_model_len=128, weights=weights)
    want = build_engine(random_model(tiny_config()), **options).generate(PROMPTS, GREEDY, use_tqdm=False)
    speculative = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        speculative["prompt_lookup_min"] = 1
    engine = build_engine(random_model(tiny_config()), speculative=speculative, **options)
    assert engine.worker.decode_step.attention_kernel is not None  # the kernel reads the cells
    got = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_accepted_tokens > 0
    engine.check_drained()
