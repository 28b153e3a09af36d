"""The step plan: the scheduler decides and allocates everything a step does and hands the worker
plain data. A plan survives pickling and deep copies, and replayed into a second engine's worker
(the same weights, its own cache) it gives the same logits and prompt logprobs: what a second
process will receive."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
from collections import Counter

import torch
from engine_oracle_helpers import BLOCK_BYTES, engine_for, greedy, run

from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.worker.gates import check_slots_agree
from nanoserve.worker.plan import DecodeBatch, PrefillChunk, RowFree, RowMove, StepPlan

MODEL = random_model(tiny_config(), seed=3)


def assert_data_only(value, where: str = "plan") -> None:
    """Ints, strings, bools, None, tuples of them and frozen dataclasses of them: no tensor, no
    list that could be shared, no reference to a cache or a request."""
    if dataclasses.is_dataclass(value):
        assert type(value).__dataclass_params__.frozen, f"{where}: {type(value).__name__} is not frozen"
        for field in dataclasses.fields(value):
            assert_data_only(getattr(value, field.name), f"{where}.{field.name}")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            assert_data_only(item, f"{where}[{i}]")
    else:
        assert value is None or type(value) in (int, str, bool), f"{where} holds a {type(value).__name__}"


def replaying_into(engine, replica) -> list[StepPlan]:
    """Make every plan `engine` executes go, pickled and deep-copied, through `replica`'s worker's
    forward too, and its output compared; returns the list the plans are recorded in."""
    plans: list[StepPlan] = []
    forward = engine.worker.forward

    def forward_and_replay(plan: StepPlan):
        assert_data_only(plan)
        sent = pickle.loads(pickle.dumps(copy.deepcopy(plan)))
        assert sent == plan
        out = forward(plan)
        again = replica.worker.forward(sent)
        torch.testing.assert_close(again.logits, out.logits, rtol=0, atol=0)
        assert again.prompt_logprobs == out.prompt_logprobs and again.prompt_errors == out.prompt_errors
        plans.append(plan)
        return out

    engine.worker.forward = forward_and_replay
    return plans


def test_every_plan_is_data_only_and_replays_into_a_second_worker_with_the_same_output():
    # A pool of 14 blocks of 4 slots, shared prefixes, chunks of 7 tokens and aborts: the plans
    # carry preemptions' and finishes' row moves, adopted prefixes and chunk contexts.
    options = dict(kv_cache_bytes=14 * BLOCK_BYTES, max_num_batched_tokens=7, max_model_len=40)
    engine, replica = engine_for(MODEL, **options), engine_for(MODEL, **options)
    plans = replaying_into(engine, replica)
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(10)]
    ids = [engine.add_request(system + [rng.randrange(256) for _ in range(rng.randint(1, 14))],
                              greedy(12, prompt_logprobs=1 if i == 3 else None)) for i in range(8)]
    for _ in range(6):
        engine.step()
    engine.abort(ids[1])
    run(engine)
    engine.check_drained()
    assert any(p.row_changes for p in plans) and any(p.registered for p in plans)
    assert any(p.decode is not None and p.prefill for p in plans)  # decode rows beside chunks
    assert any(c.start and c.score_top is not None for p in plans for c in p.prefill)  # a scored, chunked prompt
    assert engine.stats().preemptions > 0 and engine.stats().prefix_cache_hits > 0
    # The replica's worker was told everything by the plans: its own scheduler never ran and its
    # pool lent nothing (the scratch block is the manager's own).
    blocks = replica.scheduler.blocks
    assert replica.scheduler.stats.steps == 0 and blocks.pool.num_used == 1 and not blocks.live_rows


def test_schedule_allocates_the_decode_slots_the_plan_names():
    engine = engine_for(MODEL, max_num_batched_tokens=7)
    engine.add_request([1, 2, 3, 4], greedy(6))
    engine.add_request([5, 6], greedy(6))
    for _ in range(2):
        engine.step()
    plan = engine.scheduler.schedule()
    batch, tables = plan.decode, engine.scheduler.blocks.tables
    assert batch.num_rows == 2 and not plan.prefill
    # The host tables already hold this step's token: the worker has nothing left to allocate.
    assert [tables[row].num_tokens for row in range(2)] == list(batch.context_lens)
    assert [tables[row].slot(p) for row, p in enumerate(batch.positions)] == list(batch.write_slots)
    assert batch.token_ids == tuple(r.last_token_id for r in engine.scheduler.running)
    engine.worker.execute(plan)
    check_slots_agree(engine.worker.cache.slot_table, tables, range(2))


def test_a_compiled_engine_runs_exactly_the_windows_its_plans_name():
    engine = engine_for(MODEL, max_num_batched_tokens=7, compile=True, compile_backend="eager",
                        row_buckets=(2, 4), width_buckets=(16, 32, 128))
    plans = []
    execute = engine.worker.execute
    engine.worker.execute = lambda plan, sampling=None: (plans.append(plan), execute(plan, sampling))[1]
    for prompt_len, tokens in ((3, 20), (12, 4), (5, 9)):
        engine.add_request(list(range(1, prompt_len + 1)), greedy(tokens))
    run(engine)
    windows = Counter((p.decode.rows, p.decode.width) for p in plans if p.decode is not None)
    assert windows == engine.stats().bucket_hits and len(windows) > 1
    assert engine.stats().recompiles_after_warmup == 0


def test_plan_records_are_plain_values():
    chunk = PrefillChunk("a", 1, 2, (7, 8), (4, 5, 6, 9), True)
    assert (chunk.length, chunk.end, chunk.write_slots) == (2, 4, (6, 9))
    batch = DecodeBatch(("b",), (0,), (3,), (4,), (21,), 2, 16)
    assert (batch.num_rows, batch.context_lens) == (1, (5,))
    plan = StepPlan((RowFree(0), RowMove(2, 0, 5)), batch, (chunk,))
    assert plan.sampled == ("b", "a")
    assert_data_only(plan)
