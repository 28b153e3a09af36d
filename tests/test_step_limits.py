"""The step limits of the test suite itself: an engine that can no longer schedule anything
fails the test with the stuck requests named, instead of hanging it."""

from __future__ import annotations

import pytest
from conftest import while_unfinished

from nanoserve import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config


def leaking_engine():
    """An engine whose rows keep their blocks when freed: admission starves once they are gone."""
    engine = build_engine(random_model(tiny_config(num_layers=1), seed=0), max_batch_size=2, block_size=4,
                          max_model_len=16, kv_cache_bytes=12 * 4 * 2 * 16 * 2 * 4, enable_prefix_caching=False)
    engine.scheduler.blocks.reset_row = lambda row: engine.scheduler.blocks.tables[row].clear()
    return engine


def test_generate_on_a_starved_engine_fails_naming_the_stuck_requests():
    engine = leaking_engine()
    with pytest.raises(AssertionError, match=r"engine stuck: .*scheduled nothing.*waiting: req-\d+ \(5 tokens"):
        engine.generate([[1, 2, 3, 4, 5]] * 8, SamplingParams(max_tokens=1), use_tqdm=False)


def test_a_test_loop_on_a_starved_engine_fails_after_its_step_limit():
    engine = leaking_engine()
    for _ in range(8):
        engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    with pytest.raises(AssertionError, match=r"engine stuck: still unfinished after 50 steps.*blocks free"):
        for _ in while_unfinished(engine, max_steps=50):
            engine.step()
