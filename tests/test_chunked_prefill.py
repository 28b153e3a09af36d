"""Chunked prefill: a step decodes its rows and fills the rest of its token budget with prefill
chunks. Chunking must not change a greedy token or a logprob (the dense oracle decides, fp32,
logprobs within 1e-4), running rows keep decoding while a long prompt is prefilled, and
preemption, abort and compaction mid-prefill give everything back."""

from __future__ import annotations

import random

import pytest
import torch
from engine_oracle_helpers import BLOCK_BYTES, dense_greedy_with_logprobs, generate, greedy, run  # noqa: F401
from engine_oracle_helpers import engine_for as _engine_for

from nanoserve.engine.request import RequestStatus
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config(), seed=0)


def engine_for(model, **kwargs):
    """The shared engine with this suite's default token budget (7)."""
    return _engine_for(model, **{"max_num_batched_tokens": 7, **kwargs})



def shared_prefix_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(21)]
    return [system + [rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def test_chunked_greedy_tokens_and_logprobs_equal_the_dense_oracle(tiny):
    batch = shared_prefix_prompts(6) + [list(range(40, 90))]
    params = greedy(9, logprobs=0)
    chunked = engine_for(tiny)
    whole = engine_for(tiny, enable_chunked_prefill=False)
    got, unchunked = generate(chunked, batch, params), generate(whole, batch, params)
    assert chunked.stats().prefill_steps > len(batch)  # prompts really were split
    for prompt, out, ref in zip(batch, got, unchunked):
        tokens, logprobs = dense_greedy_with_logprobs(tiny, prompt, 9)
        assert out.token_ids == ref.token_ids == tokens
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=1e-4)
    chunked.check_drained()
    whole.check_drained()


def test_prompt_logprobs_across_chunks_equal_the_dense_oracle(tiny):
    prompt = list(range(5, 45))
    engine = engine_for(tiny)
    out = generate(engine, [[9, 9], prompt, [7]], greedy(2, prompt_logprobs=3))[1]
    reference = torch.log_softmax(dense_forward(tiny, torch.tensor([prompt]))[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    engine.check_drained()


def test_a_long_prompt_is_chunked_while_running_rows_keep_decoding(tiny):
    engine = engine_for(tiny, max_num_batched_tokens=8)
    streams = [engine.add_request(p, greedy(40)) for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
    for _ in range(3):  # prefill the three streams; they are decoding after this
        engine.step()
    assert all(engine.requests[i].status is RequestStatus.RUNNING for i in streams)
    long_prompt = [(11 * i) % 256 for i in range(60)]
    long_id = engine.add_request(long_prompt, greedy(5))
    long_request = engine.requests[long_id]
    prefill_steps = 0
    for _ in range(100):
        outputs = {out.request_id: out for out in engine.step()}
        if long_request.status is not RequestStatus.PREFILLING:
            break
        prefill_steps += 1
        # Every stream got its token in the very step that prefilled a chunk of the long prompt.
        assert all(len(outputs[i].new_token_ids) == 1 for i in streams), outputs.keys()
        assert long_id not in outputs  # nothing to say until its last chunk
    else:
        raise AssertionError("the long prompt never finished its prefill in 100 steps")
    assert prefill_steps >= 60 // 5 - 1  # 3 decode tokens + 5 prefill tokens a step
    done = run(engine)
    assert done[long_id].token_ids == dense_greedy_with_logprobs(tiny, long_prompt, 5)[0]
    engine.check_drained()


def test_an_eager_step_decodes_and_prefills_in_one_forward_with_the_oracles_logprobs(tiny):
    engine = engine_for(tiny, max_num_batched_tokens=8)
    forwards = []
    hook = engine.model.register_forward_hook(lambda module, args, out: forwards.append(out.shape[0]))
    try:
        streams = {engine.add_request(p, greedy(12, logprobs=0)): p for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9])}
        for _ in range(3):
            engine.step()
        long_prompt = [(13 * i + 5) % 256 for i in range(40)]
        long_id = engine.add_request(long_prompt, greedy(4, logprobs=0))
        forwards.clear()
        engine.step()
        assert forwards == [8]  # 3 decode tokens and a 5-token chunk: one forward
        done = run(engine)
    finally:
        hook.remove()
    for request_id, prompt in [*streams.items(), (long_id, long_prompt)]:
        tokens, logprobs = dense_greedy_with_logprobs(tiny, prompt, len(done[request_id].token_ids))
        assert done[request_id].token_ids == tokens
        assert [lp.logprob for lp in done[request_id].logprobs] == pytest.approx(logprobs, abs=1e-4)
    assert engine.stats().gathers == 0
    engine.check_drained()


def test_preemption_mid_prefill_is_invisible_and_gives_everything_back(tiny):
    # 26 usable blocks of 4 slots: the long prompt is admitted (16 blocks), then the decoding
    # streams grow into the blocks its later chunks need and the newest, the long prompt, gives way.
    engine = engine_for(tiny, kv_cache_bytes=27 * BLOCK_BYTES, max_model_len=64, max_num_batched_tokens=8)
    victims = []
    preempt = engine.scheduler._preempt

    def recording(victim):
        victims.append(victim.status)
        preempt(victim)

    engine.scheduler._preempt = recording
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [(11 * i) % 256 for i in range(60)]]
    ids = [engine.add_request(p, greedy(20)) for p in prompts[:3]]
    for _ in range(3):
        engine.step()
    ids.append(engine.add_request(prompts[3], greedy(3)))
    done = run(engine)
    assert RequestStatus.PREFILLING in victims, victims
    for request_id, prompt in zip(ids, prompts):
        assert done[request_id].token_ids == dense_greedy_with_logprobs(tiny, prompt, len(done[request_id].token_ids))[0]
    assert [len(done[i].token_ids) for i in ids] == [20, 20, 20, 3]
    engine.check_drained()


def test_abort_mid_prefill_gives_back_blocks_and_row(tiny):
    engine = engine_for(tiny)
    keep = engine.add_request([1, 2, 3], greedy(12))
    engine.step()
    gone = engine.add_request(list(range(50)), greedy(4))
    waiting = engine.add_request(list(range(20)), greedy(4))
    engine.step()
    assert engine.requests[gone].status is RequestStatus.PREFILLING
    engine.abort(gone)
    engine.abort(waiting)
    done = run(engine)
    assert done[keep].token_ids == dense_greedy_with_logprobs(tiny, [1, 2, 3], 12)[0]
    assert engine.stats().aborted == 2
    engine.check_drained()


def test_a_request_failing_mid_prefill_fails_alone(tiny, monkeypatch):
    import nanoserve.worker.worker as worker_module

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    engine = engine_for(tiny)
    ids = [engine.add_request(list(range(30)), greedy(3, prompt_logprobs=1)), engine.add_request([4, 5, 6], greedy(3))]
    monkeypatch.setattr(worker_module, "score_prompt", broken)
    outputs = {out.request_id: out for out in engine.step()}  # the first chunk of 30 tokens
    monkeypatch.undo()
    assert outputs[ids[0]].finish_reason == "error" and "planted" in outputs[ids[0]].error
    done = run(engine)
    assert done[ids[1]].token_ids == dense_greedy_with_logprobs(tiny, [4, 5, 6], 3)[0]
    engine.check_drained()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_chunked_prefill_interleaved_with_compiled_decode_never_recompiles(tiny, fresh_dynamo):
    engine = engine_for(tiny, compile=True, compile_backend="eager", row_buckets=(1, 2, 4),
                        width_buckets=(32, 64, 128), warmup="eager", max_num_batched_tokens=9)
    rng = random.Random(5)
    pending = [[rng.randrange(256) for _ in range(rng.randint(3, 70))] for _ in range(10)]
    for _ in range(2000):
        if not pending and not engine.has_unfinished():
            break
        if pending and rng.random() < 0.3:
            engine.add_request(pending.pop(), greedy(rng.randint(1, 20)))
        engine.step()
    else:
        raise AssertionError(f"engine still busy after 2000 steps: {engine.stats()}")
    stats = engine.stats()
    assert stats.prefill_steps > 10 and stats.decode_steps > 0
    assert stats.recompiles_after_warmup == 0 and stats.gathers == 0
    assert stats.graphs_built <= len(engine.worker.decode_step.buckets.grid)
    engine.check_drained()


def test_a_prefilling_row_before_a_decoding_row_is_an_engine_fault(tiny):
    engine = engine_for(tiny)
    first = engine.add_request([1, 2, 3], greedy(8))
    engine.step()
    second = engine.add_request(list(range(40)), greedy(2))
    engine.step()
    running = engine.scheduler.running
    assert [r.request_id for r in running] == [first, second] and running[1].status is RequestStatus.PREFILLING
    running[0].status, running[1].status = RequestStatus.PREFILLING, RequestStatus.RUNNING  # planted
    with pytest.raises(RuntimeError, match=r"rows out of order at \[0, 1\]"):
        engine.scheduler._check_regions()


def test_a_budget_that_leaves_no_prefill_token_is_refused(tiny):
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 leaves no prefill token"):
        engine_for(tiny, max_num_batched_tokens=4)
    engine_for(tiny, max_num_batched_tokens=4, enable_chunked_prefill=False)  # whole prompts: any budget


def test_the_default_budget_leaves_half_a_decode_batch_or_48_tokens_for_chunks_on_the_cpu_and_512_on_a_gpu(tiny):
    from nanoserve.engine.build import default_token_budget

    assert default_token_budget(True, 32, 4096, "cpu") == 80
    assert default_token_budget(True, 33, 4096, "cpu") == 81  # a 48-token chunk beside 33 decode rows
    assert default_token_budget(True, 4, 4096, "cpu") == 52  # a small batch still prefills 48 tokens a step
    assert default_token_budget(True, 200, 4096, "cpu") == 300
    assert default_token_budget(True, 32, 4096, "cuda") == 512
    assert default_token_budget(True, 600, 4096, "cuda") == 601
    assert default_token_budget(False, 32, 4096, "cpu") == 4096
    assert engine_for(tiny, max_num_batched_tokens=None, max_batch_size=40).resolved.max_num_batched_tokens == 88


def test_a_step_with_no_stream_decoding_takes_the_prefill_only_budget_and_one_beside_streams_the_small_one(tiny):
    engine = _engine_for(tiny, None)  # the CPU defaults for 4 rows: 52 tokens a step, 512 with none decoding
    stats = engine.scheduler.stats
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.prefill_only_budget) == (52, 512)
    engine.add_request(list(range(3, 103)), greedy(20))
    engine.step()  # nobody decodes: the whole 100-token prompt in one step
    assert (stats.prefill_steps, stats.prefill_tokens) == (1, 100)
    engine.add_request(list(range(103, 203)), greedy(2))
    engine.step()  # one stream decodes: a chunk of what is left of 52
    assert (stats.prefill_steps, stats.prefill_tokens, stats.decode_tokens) == (2, 151, 1)
    run(engine)

    capped = _engine_for(tiny, 20)  # a budget the caller sets binds every step
    assert capped.scheduler.prefill_only_budget == 20
    capped.add_request(list(range(3, 103)), greedy(1))
    run(capped)
    assert (capped.scheduler.stats.prefill_steps, capped.scheduler.stats.prefill_tokens) == (5, 100)
