"""The engine end to end on a tiny random model: continuous batching must not change a
single greedy token, preemption must be invisible, and bad requests fail alone."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import while_unfinished

from nanoserve.engine import Engine, SamplingParams, build_engine
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config(), seed=0)


def tiny_engine(model, **kwargs) -> Engine:
    options = dict(max_batch_size=8, kv_cache_bytes=1 << 20, block_size=4, max_model_len=128)
    options.update(kwargs)
    return build_engine(model, **options)


def dense_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = dense_forward(model, torch.tensor([ids]))[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def test_batched_greedy_equals_each_prompt_alone_through_the_dense_reference(tiny):
    batch = prompts(16)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i % 5, ignore_eos=True) for i in range(16)]
    outputs = tiny_engine(tiny).generate(batch, params, use_tqdm=False)
    for prompt, p, out in zip(batch, params, outputs):
        assert out.token_ids == dense_greedy(tiny, prompt, p.max_tokens)
        assert out.finish_reason == "length"


def test_staggered_arrivals_give_the_same_greedy_tokens(tiny):
    engine = tiny_engine(tiny)
    batch = prompts(16, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    pending, done = list(enumerate(batch)), {}
    ids = {}
    for _ in while_unfinished(engine, until=lambda: pending or engine.has_unfinished()):
        for _ in range(min(3, len(pending))):  # a few new arrivals every step
            index, prompt = pending.pop(0)
            ids[engine.add_request(prompt, params)] = index
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    for index, prompt in enumerate(batch):
        assert done[index] == dense_greedy(tiny, prompt, 10)
    engine.check_drained()


def test_preemption_by_recompute_is_invisible_in_greedy_tokens(tiny):
    # 24 blocks of 4 slots: 16 prompts cannot all hold their contexts at once.
    engine = tiny_engine(tiny, kv_cache_bytes=24 * 4 * 2 * 2 * 2 * 16 * 4, max_model_len=64)
    batch = prompts(16, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = engine.generate(batch, params, use_tqdm=False)
    assert engine.stats().preemptions > 0
    for prompt, out in zip(batch, outputs):
        assert out.token_ids == dense_greedy(tiny, prompt, 12)
    engine.check_drained()


def test_decode_reads_are_windows_when_rows_finish_out_of_order(tiny):
    engine = tiny_engine(tiny)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 6, 2, 8)]
    engine.generate(prompts(6, seed=3), params, use_tqdm=False)
    stats = engine.stats()
    assert stats.compactions > 0 and stats.gathers == 0 and stats.windows > 0


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny_engine(tiny).generate([[5, 6, 7]], seeded, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    batch = tiny_engine(tiny).generate(prompts(5, seed=4) + [[5, 6, 7]], others + [seeded],
                                       use_tqdm=False)
    assert batch[-1].token_ids == alone


def test_temperature_zero_is_argmax_of_the_engine_logits(tiny):
    out = tiny_engine(tiny).generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4,
                                                                 ignore_eos=True, logprobs=1),
                                     use_tqdm=False)[0]
    for lp in out.logprobs:
        assert lp.top[0][0] == lp.token_id


def test_stop_token_ids_and_max_model_len_finish_requests(tiny):
    engine = tiny_engine(tiny, max_model_len=32)
    prompt = [1, 2, 3]
    first = dense_greedy(tiny, prompt, 3)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[first[2]]),
                          use_tqdm=False)[0]
    assert out.token_ids == first and out.finish_reason == "stop"
    long = engine.generate([list(range(30))], SamplingParams(temperature=0.0, max_tokens=100),
                           use_tqdm=False)[0]
    assert len(long.token_ids) == 2 and long.finish_reason == "length"


def test_bad_requests_fail_alone_while_the_others_finish(tiny):
    engine = tiny_engine(tiny, max_model_len=64)
    batch = [[1, 2, 3], list(range(64)), [], [5, 300, 7], [4, 5]]
    outputs = engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)
    reasons = [o.finish_reason for o in outputs]
    assert reasons == ["length", "error", "error", "error", "length"]
    assert "max_model_len" in outputs[1].error
    assert "empty" in outputs[2].error
    assert "vocabulary" in outputs[3].error and "300" in outputs[3].error
    engine.check_drained()


def test_a_pool_too_small_for_one_request_is_refused_with_the_arithmetic(tiny):
    with pytest.raises(ValueError, match=r"kv_cache_bytes=.*max_model_len=512"):
        build_engine(tiny, kv_cache_bytes=4096, block_size=4, max_model_len=512)


def test_drained_after_many_random_requests_with_random_aborts(tiny):
    rng = random.Random(7)
    engine = tiny_engine(tiny, kv_cache_bytes=40 * 4 * 2 * 2 * 2 * 16 * 4, max_model_len=64)
    live: list[str] = []
    submitted = 0

    def more() -> bool:
        return submitted < 500 or engine.has_unfinished()

    for _ in while_unfinished(engine, until=more):
        for _ in range(rng.randint(0, 6)):
            if submitted >= 500:
                break
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 12),
                                    seed=rng.choice([None, rng.randrange(100)]))
            live.append(engine.add_request(prompt, params))
            submitted += 1
        if live and rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    engine.check_drained()
    stats = engine.stats()
    assert stats.aborted > 0 and stats.finished + stats.aborted == 500


def test_stream_yields_the_same_text_as_generate():
    pytest.importorskip("tokenizers")
    # Text streaming is exercised with the real tokenizer in test_engine_model.py; here the
    # token-id path: stream of a tokenizer-less engine refuses text prompts clearly.
    engine = tiny_engine(random_model(tiny_config(), seed=1))
    with pytest.raises(ValueError, match="tokenizer"):
        list(engine.stream("hello"))


def test_the_package_exports_the_engine_api():
    import nanoserve
    from nanoserve.engine import Engine, SamplingParams, build_engine

    assert (nanoserve.Engine, nanoserve.SamplingParams, nanoserve.build_engine) == (Engine, SamplingParams, build_engine)
