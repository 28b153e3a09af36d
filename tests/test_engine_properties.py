"""Compaction keeps windows: requests arrive (sharing prefixes), are prefilled in chunks, finish,
are preempted and aborted in random order, and every decode read stays a window of the slot
table, the table equals rebuild_mapping once each step's plan is applied, and every block's
reference count is the number of rows holding it."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from conftest import DEVICES, while_unfinished
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.engine.request import RequestStatus
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.worker.gates import check_slots_agree

MODEL = random_model(tiny_config(num_layers=1, vocab_size=64), seed=0)


class CompactionMachine(RuleBasedStateMachine):
    def __init__(self, device: str, chunked: bool) -> None:
        super().__init__()
        # A pool small enough that preemption (and eviction of cached prefixes) happens too;
        # a budget of 7 splits prompts over several steps next to up to 4 decoding rows.
        self.engine = build_engine(MODEL, max_batch_size=4, block_size=4, max_model_len=32,
                                   kv_cache_bytes=20 * 4 * 2 * 16 * 2 * 4, device=device,
                                   enable_chunked_prefill=chunked, max_num_batched_tokens=7 if chunked else None)
        self.live: list[str] = []
        execute = self.engine.worker.execute

        def execute_then_check(plan, sampling=None):
            # Between steps the table may wait on moves the next plan carries; once a plan is
            # applied, every running row's cells are its block table's.
            out = execute(plan, sampling)
            running = len(self.engine.scheduler.running)
            check_slots_agree(self.engine.worker.cache.slot_table, self.engine.scheduler.blocks.tables, range(running))
            return out

        self.engine.worker.execute = execute_then_check

    @rule(stem=st.integers(0, 2), shared=st.integers(0, 12), own=st.lists(st.integers(0, 63), max_size=8),
          max_tokens=st.integers(1, 10))
    def arrive(self, stem, shared, own, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompt = [stem] * shared + own or [stem]
        self.live.append(self.engine.add_request(prompt, params))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            for out in self.engine.step():
                if out.finished and out.request_id in self.live:  # aborts report too
                    self.live.remove(out.request_id)

    @rule(data=st.data())
    def abort(self, data):
        if self.live:
            self.engine.abort(self.live.pop(data.draw(st.integers(0, len(self.live) - 1))))

    @invariant()
    def every_read_is_a_window(self):
        assert self.engine.worker.cache.slot_table.gathers == 0

    @invariant()
    def running_rows_are_a_prefix(self):
        running = self.engine.scheduler.running
        assert [r.row for r in running] == list(range(len(running)))
        decoding = [r.status is RequestStatus.RUNNING for r in running]
        assert decoding == sorted(decoding, reverse=True)  # decoding rows first, then prefilling
        assert sorted(self.engine.scheduler.blocks.live_rows) == list(range(len(running)))

    @invariant()
    def pool_accounting_holds(self):
        cache, pool = self.engine.scheduler.blocks, self.engine.scheduler.blocks.pool
        holders = Counter(block for t in cache.tables for block in t.blocks)
        assert len(holders) + 1 == pool.num_used  # + the scratch block
        assert all(pool.ref_count(block) == n for block, n in holders.items())
        num_empty = sum(not pool.ref_count(b) and not pool.is_cached(b) for b in range(pool.num_blocks))
        assert num_empty + pool.num_cached + pool.num_used == pool.num_blocks

    def teardown(self):
        for _ in while_unfinished(self.engine):
            self.engine.step()
        self.engine.check_drained()


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_compaction_keeps_every_decode_read_a_window(device, chunked):
    run_state_machine_as_test(lambda: CompactionMachine(device, chunked))
