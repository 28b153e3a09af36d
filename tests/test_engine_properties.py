"""Compaction keeps windows: requests arrive, finish and are aborted in random order, and every
decode read stays a window of the slot table while the table still equals rebuild_mapping."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from conftest import DEVICES, while_unfinished
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from nanoserve.cache.gates import check_slots_agree
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.synthetic import random_model, tiny_config

MODEL = random_model(tiny_config(num_layers=1, vocab_size=64), seed=0)


class CompactionMachine(RuleBasedStateMachine):
    def __init__(self, device: str) -> None:
        super().__init__()
        # A pool small enough that preemption happens too.
        self.engine = build_engine(MODEL, max_batch_size=4, block_size=4, max_model_len=32,
                                   kv_cache_bytes=20 * 4 * 2 * 16 * 2 * 4, device=device)
        self.live: list[str] = []

    @rule(length=st.integers(1, 20), max_tokens=st.integers(1, 10))
    def arrive(self, length, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.live.append(self.engine.add_request([3] * length, params))

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
        assert self.engine.cache.slot_table.gathers == 0

    @invariant()
    def running_rows_are_a_prefix_and_agree_with_rebuild_mapping(self):
        running = self.engine.scheduler.running
        assert [r.row for r in running] == list(range(len(running)))
        assert sorted(self.engine.cache.live_rows) == list(range(len(running)))
        check_slots_agree(self.engine.cache.slot_table, self.engine.cache.tables, range(len(running)))

    @invariant()
    def pool_accounting_holds(self):
        cache = self.engine.cache
        held = sum(t.num_blocks for t in cache.tables)
        assert held + 1 == cache.pool.num_used  # + the scratch block

    def teardown(self):
        for _ in while_unfinished(self.engine):
            self.engine.step()
        self.engine.check_drained()


@pytest.mark.parametrize("device", DEVICES)
def test_compaction_keeps_every_decode_read_a_window(device):
    run_state_machine_as_test(lambda: CompactionMachine(device))
