"""Prefix caching in the engine: a request adopts the cached K/V of its longest shared prefix
and computes only the rest. Adoption must not change a greedy token or a logprob (the dense
oracle decides, fp32, logprobs within 1e-4), with chunking on or off, after eviction, across
preemption and aborts; every leaving request gives back its row and its references."""

from __future__ import annotations

import random

import pytest
import torch
from engine_oracle_helpers import BLOCK_BYTES, dense_greedy_with_logprobs, generate, greedy, run  # noqa: F401
from engine_oracle_helpers import engine_for as _engine_for

from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config(), seed=0)


def engine_for(model, **kwargs):
    """The shared engine with this suite's default token budget (12)."""
    return _engine_for(model, **{"max_num_batched_tokens": 12, **kwargs})



def with_system_prompt(count: int, seed: int, system_len: int = 22) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    return [system + [rng.randrange(256) for _ in range(rng.randint(1, 10))] for _ in range(count)]


@pytest.mark.parametrize("chunked", [True, False])
def test_shared_prefixes_give_the_dense_oracles_tokens_and_logprobs(tiny, chunked):
    # The first wave fills the cache; the second adopts (22 shared tokens = 5 full blocks each).
    first, second = with_system_prompt(4, seed=1), with_system_prompt(6, seed=1)[4:] + with_system_prompt(2, seed=1)[:2]
    cached = engine_for(tiny, enable_chunked_prefill=chunked)
    plain = engine_for(tiny, enable_chunked_prefill=chunked, enable_prefix_caching=False)
    params = greedy(7, logprobs=0)
    for wave in (first, second):
        got, ref = generate(cached, wave, params), generate(plain, wave, params)
        for prompt, out, other in zip(wave, got, ref):
            tokens, logprobs = dense_greedy_with_logprobs(tiny, prompt, 7)
            assert out.token_ids == other.token_ids == tokens
            assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=1e-4)
    stats, plain_stats = cached.stats(), plain.stats()
    assert stats.prefix_cache_hits >= 4 * 20  # the second wave adopted at least 5 blocks each
    assert stats.prefill_tokens <= plain_stats.prefill_tokens - stats.prefix_cache_hits
    assert plain_stats.prefix_cache_hits == 0 and stats.gathers == 0
    cached.check_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_a_burst_sharing_an_uncached_prefix_computes_it_once(tiny, chunked):
    # Four prompts arrive together on an empty cache, sharing 22 tokens (5 full blocks), with
    # budget for all of them in one step: the first computes the shared blocks, the others adopt
    # them in the same step (its forward writes them before reading), and the tokens and
    # logprobs stay the dense oracle's.
    burst = with_system_prompt(4, seed=3)
    engine = engine_for(tiny, max_num_batched_tokens=256, enable_chunked_prefill=chunked)
    outs = generate(engine, burst, greedy(5, logprobs=0))
    for prompt, out in zip(burst, outs):
        tokens, logprobs = dense_greedy_with_logprobs(tiny, prompt, 5)
        assert out.token_ids == tokens
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=1e-4)
    stats = engine.stats()
    assert stats.prefix_cache_hits == 3 * 20
    assert stats.prefill_tokens == sum(len(p) for p in burst) - 3 * 20
    assert stats.prefill_steps == 1
    engine.check_drained()


def test_a_burst_with_nothing_in_common_is_admitted_in_one_step(tiny):
    burst = [[(11 * i + 17 * j + 1) % 256 for i in range(15)] for j in range(4)]
    engine = engine_for(tiny, max_num_batched_tokens=256)
    generate(engine, burst, greedy(1))
    assert engine.stats().prefill_steps == 1 and engine.stats().prefix_cache_hits == 0
    engine.check_drained()


def test_a_second_turn_adopts_the_whole_first_turn(tiny):
    engine = engine_for(tiny)
    turn1 = [(5 * i + 3) % 256 for i in range(30)]
    out1 = generate(engine, [turn1], greedy(9))[0]
    turn2 = turn1 + out1.token_ids + [7, 8, 9]
    hits_before = engine.stats().prefix_cache_hits
    out2 = generate(engine, [turn2], greedy(5))[0]
    # Prompt and reply of turn 1 (39 tokens, the last sampled one without K/V) = 9 full blocks.
    assert engine.stats().prefix_cache_hits - hits_before == 9 * 4
    assert out2.token_ids == dense_greedy_with_logprobs(tiny, turn2, 5)[0]
    engine.check_drained()


def test_a_request_whose_prefix_was_evicted_gets_the_same_tokens(tiny):
    # 12 usable blocks: the fillers need all of them, so the first prompt's cached blocks go.
    engine = engine_for(tiny, kv_cache_bytes=13 * BLOCK_BYTES, max_model_len=44)
    prompt = [(7 * i + 1) % 256 for i in range(24)]
    want = dense_greedy_with_logprobs(tiny, prompt, 6)[0]
    assert generate(engine, [prompt], greedy(6))[0].token_ids == want
    assert engine.stats().prefix_cache_blocks >= 6
    fillers = [[(13 * i + j) % 256 for i in range(40)] for j in range(2)]
    generate(engine, fillers, greedy(3))
    assert engine.stats().prefix_cache_evictions > 0
    hits_before = engine.stats().prefix_cache_hits
    assert generate(engine, [prompt + [5]], greedy(6))[0].token_ids == dense_greedy_with_logprobs(tiny, prompt + [5], 6)[0]
    assert engine.stats().prefix_cache_hits - hits_before < 24  # not all of it was still there
    engine.check_drained()


def test_preemption_and_aborts_with_shared_prefixes_give_everything_back(tiny):
    rng = random.Random(11)
    engine = engine_for(tiny, kv_cache_bytes=20 * BLOCK_BYTES, max_model_len=64, max_num_batched_tokens=9)
    prompts = with_system_prompt(24, seed=2, system_len=13)
    expected, live = {}, []
    for _ in range(3000):
        if prompts and rng.random() < 0.6:
            prompt = prompts.pop()
            request_id = engine.add_request(prompt, greedy(rng.randint(1, 30)))
            expected[request_id] = prompt
            live.append(request_id)
        if live and rng.random() < 0.05:
            aborted = live.pop(rng.randrange(len(live)))
            engine.abort(aborted)
            expected.pop(aborted)
        for out in engine.step():
            if out.finished and out.request_id in expected:
                live.remove(out.request_id)
                prompt = expected.pop(out.request_id)
                assert out.token_ids == dense_greedy_with_logprobs(tiny, prompt, len(out.token_ids))[0]
        if not prompts and not engine.has_unfinished():
            break
    else:
        raise AssertionError(f"engine still busy after 3000 steps: {engine.stats()}")
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.aborted > 0 and stats.prefix_cache_hits > 0
    assert stats.gathers == 0
    engine.check_drained()
    assert engine.scheduler.blocks.pool.num_free == engine.scheduler.blocks.pool.num_blocks - 1  # all but the scratch block


def test_prompt_logprobs_requests_score_every_token_beside_a_cached_prefix(tiny):
    engine = engine_for(tiny)
    prompt = list(range(3, 33))
    generate(engine, [prompt], greedy(2))  # the prefix is cached now
    out = generate(engine, [prompt], greedy(2, prompt_logprobs=0))[0]
    reference = torch.log_softmax(dense_forward(tiny, torch.tensor([prompt]))[0].float(), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt)
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
        [float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-4)
    engine.check_drained()


def test_a_request_sharing_a_running_rows_prefix_is_admitted_for_the_blocks_it_adds(tiny):
    # 16 blocks of 4. A holds its 40-token prompt (10 blocks, all cached) and decodes; B shares
    # those 40 tokens and adds 4: it needs 2 blocks of its own, not 12, so it runs beside A.
    engine = engine_for(tiny, kv_cache_bytes=16 * BLOCK_BYTES, max_model_len=48, max_num_batched_tokens=64)
    assert engine.scheduler.blocks.pool.num_blocks == 16
    prefix = [random.Random(5).randrange(256) for _ in range(40)]
    first = engine.add_request(prefix, greedy(8))
    engine.step()  # A's whole prompt
    assert engine.scheduler.blocks.blocks_to_admit(prefix + [1, 2, 3, 4]) == 12 - 10
    assert engine.scheduler.blocks.blocks_to_admit(prefix + [1, 2, 3, 4], adopt=False) == 12
    second = engine.add_request(prefix + [1, 2, 3, 4], greedy(4))
    engine.step()  # A decodes, B is admitted and prefills its 4 tokens
    assert [r.request_id for r in engine.scheduler.running] == [first, second]
    assert engine.stats().prefix_cache_hits == 40
    done = run(engine)
    assert done[second].token_ids == dense_greedy_with_logprobs(tiny, prefix + [1, 2, 3, 4], 4)[0]
    assert done[first].token_ids == dense_greedy_with_logprobs(tiny, prefix, 8)[0]
    engine.check_drained()


def test_each_full_block_of_a_request_is_hashed_once(tiny, monkeypatch):
    # Chunks of 12 tokens, admission checks while the pool is short, and preemption: the
    # request's chain grows with its tokens instead of being rehashed at each of them.
    import hashlib
    import threading

    engine = engine_for(tiny, kv_cache_bytes=16 * BLOCK_BYTES, max_model_len=48)
    real, hashed, here = hashlib.sha256, [], threading.current_thread()

    def counting(data):  # this engine's hashes: another test's graph loader may hash an entry meanwhile
        if threading.current_thread() is here:
            hashed.append(data)
        return real(data)

    monkeypatch.setattr(hashlib, "sha256", counting)
    outputs = generate(engine, with_system_prompt(6, seed=4, system_len=26), greedy(10))
    monkeypatch.undo()
    assert engine.stats().preemptions > 0 and engine.stats().prefill_steps > 6
    full_blocks = sum((len(out.prompt_token_ids) + len(out.token_ids)) // 4 for out in outputs)
    assert len(hashed) == full_blocks
