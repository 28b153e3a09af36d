"""The slot table against rebuild_mapping, under random sequences of what a scheduler does.

A hypothesis RuleBasedStateMachine adopts, prefills, decodes, resets, re-tenants, frees,
compacts and reads rows of one PairedCache. After every rule: the table
equals rebuild_mapping for every live row; held plans keep their copies; a held window's
longest row is untouched by later appends; and the pool's accounting adds up.
Run on every device of the `device` fixture; NANOSERVE_HYPOTHESIS=long explores further.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from paired_cache import PairedCache
from slot_table_support import lengths, read

from nanoserve.cache import BlockTable, PoolExhaustedError
from nanoserve.worker.gates import check_plan_addressing, check_slots_agree
from nanoserve.worker.kv_cache import DecodePlan

BLOCK_SIZE = 4
MAX_ROWS = 5
MAX_MODEL_LEN = 40
NUM_BLOCKS = 40


@dataclass
class Held:
    """A plan somebody is still holding, with copies taken when it was made."""

    plan: DecodePlan
    tenants: list[int]  # tenant of each plan row when the plan was made
    context_lens: torch.Tensor
    write_slots: torch.Tensor
    positions: torch.Tensor
    longest: int  # plan index of the longest row
    longest_window: torch.Tensor  # that row of the window, as it was


class SlotTableMachine(RuleBasedStateMachine):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.cache = PairedCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=NUM_BLOCKS,
                                         block_size=BLOCK_SIZE, max_batch_size=MAX_ROWS,
                                         max_model_len=MAX_MODEL_LEN, device=device)
        self.tenant = [0] * MAX_ROWS
        self.next_tenant = 1
        self.held: list[Held] = []
        self.outside: list[int] = []  # blocks somebody other than a row took from the pool

    # -- helpers ---------------------------------------------------------------------------

    def free_rows(self) -> list[int]:
        return [r for r in range(MAX_ROWS) if r not in self.cache.live_rows]

    def new_tenant(self, row: int) -> None:
        self.tenant[row] = self.next_tenant
        self.next_tenant += 1

    def adopt(self, row: int, length: int) -> None:
        table = BlockTable(BLOCK_SIZE)
        table.add_blocks(self.cache.pool.allocate(table.blocks_needed(length)))
        table.advance(length)
        self.cache.adopt_row(row, table)
        assert table.is_empty
        self.new_tenant(row)

    def hold(self, plan: DecodePlan) -> None:
        lens = plan.context_lens.tolist()
        longest = max(range(len(lens)), key=lens.__getitem__)
        self.held.append(Held(plan, [self.tenant[r] for r in plan.rows], plan.context_lens.clone(),
                              plan.write_slots.clone(), plan.positions.clone(), longest,
                              plan.slot_mapping[longest].clone()))
        self.held = self.held[-4:]

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: self.free_rows())
    @rule(data=st.data(), length=st.integers(1, 12), adopted=st.booleans())
    def admit(self, data, length, adopted):
        row = data.draw(st.sampled_from(self.free_rows()), label="row")
        if self.cache.blocks_needed(length) > self.cache.pool.num_free:
            return
        if adopted:
            self.adopt(row, length)
        else:
            slots = self.cache.allocate_prompt(row, length)
            assert slots.tolist() == [self.cache.tables[row].slot(t) for t in range(length)]
            self.new_tenant(row)

    @precondition(lambda self: self.cache.live_rows)
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode(self, data, steps):
        live = self.cache.live_rows
        rows = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True), label="rows")
        if data.draw(st.booleans(), label="sorted"):
            rows.sort()
        for _ in range(steps):
            if max(self.cache.num_tokens(r) for r in rows) >= MAX_MODEL_LEN:
                return
            before = [self.cache.num_tokens(r) for r in rows]
            if not self.cache.can_append(rows):  # refused, and nothing changes
                with pytest.raises(PoolExhaustedError):
                    self.cache.plan_decode(rows)
                assert [self.cache.num_tokens(r) for r in rows] == before
                return
            plan = self.cache.plan_decode(rows)
            assert plan.context_lens.tolist() == [n + 1 for n in before]
            assert plan.context_lens.tolist() == lengths(self.cache.slot_table, rows).tolist()  # the table's own
            assert plan.is_window == (rows == list(range(len(rows))))
            check_plan_addressing(plan, self.cache.tables)
            self.hold(plan)

    @precondition(lambda self: self.cache.live_rows)
    @rule(data=st.data())
    def reset(self, data):
        row = data.draw(st.sampled_from(self.cache.live_rows), label="row")
        self.cache.reset_row(row)
        self.new_tenant(row)

    @precondition(lambda self: any(self.cache.num_tokens(r) > 1 for r in self.cache.live_rows))
    @rule(data=st.data())
    def retenant(self, data):
        """Reset a row and hand it to a shorter request: its old slots sit past the new length."""
        row = data.draw(st.sampled_from([r for r in self.cache.live_rows if self.cache.num_tokens(r) > 1]), label="row")
        shorter = data.draw(st.integers(1, self.cache.num_tokens(row) - 1), label="length")
        self.cache.reset_row(row)
        self.adopt(row, shorter)

    @precondition(lambda self: self.cache.live_rows)
    @rule(data=st.data())
    def free(self, data):
        row = data.draw(st.sampled_from(self.cache.live_rows), label="row")
        self.cache.free(row)
        self.new_tenant(row)
        assert row not in self.cache.live_rows and self.cache.slot_table.lengths_array[row] == 0

    @precondition(lambda self: self.cache.live_rows and self.free_rows())
    @rule(data=st.data())
    def compact(self, data):
        src = data.draw(st.sampled_from(self.cache.live_rows), label="src")
        dst = data.draw(st.sampled_from(self.free_rows()), label="dst")
        n = self.cache.num_tokens(src)
        self.cache.move_row(src, dst)
        assert self.cache.num_tokens(dst) == n and src not in self.cache.live_rows
        self.new_tenant(src)
        self.new_tenant(dst)

    @rule(data=st.data(), n=st.integers(0, 3))
    def outsider_uses_the_pool(self, data, n):
        """Something other than a row takes blocks from the pool or gives them back, between
        decode steps: the next step's blocks come from what is free then."""
        if self.outside and data.draw(st.booleans(), label="give back"):
            self.cache.pool.free(self.outside)
            self.outside = []
        elif n <= self.cache.pool.num_free:
            self.outside += self.cache.pool.allocate(n)

    @rule()
    def lengths_agree(self):
        live = self.cache.live_rows
        if live:  # every change went through the cache, so no row's length disagrees with its block table
            assert lengths(self.cache.slot_table, live).tolist() == [self.cache.num_tokens(r) for r in live]

    @rule(data=st.data(), width=st.integers(0, MAX_MODEL_LEN))
    def read(self, data, width):
        table = self.cache.slot_table
        rows = data.draw(st.lists(st.integers(0, MAX_ROWS - 1), min_size=1, max_size=MAX_ROWS, unique=True),
                         label="rows")
        rect, lens = read(table, rows, width)
        assert rect.shape == (len(rows), width)
        assert lens.tolist() == [table.lengths_array[r] for r in rows]
        if rows == list(range(len(rows))):
            # a view: the buffer's storage at the buffer's address, with the buffer's row stride
            assert rect.untyped_storage().data_ptr() == table.slots.untyped_storage().data_ptr()
            assert rect.storage_offset() == 0 and rect.stride(0) == table.slots.stride(0)
            if width:
                assert rect.data_ptr() == table.slots.data_ptr()
        else:
            assert rect.is_contiguous() and rect.untyped_storage().data_ptr() != table.slots.untyped_storage().data_ptr()
            assert rect.untyped_storage().nbytes() == len(rows) * width * 8  # exactly the rectangle
            assert torch.equal(rect, table.slots[rows, :width])

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def table_equals_rebuild(self):
        check_slots_agree(self.cache.slot_table, self.cache.tables, self.cache.live_rows)

    @invariant()
    def held_plans_keep_their_copies(self):
        for held in self.held:
            assert torch.equal(held.plan.context_lens, held.context_lens)
            assert torch.equal(held.plan.write_slots, held.write_slots)
            assert torch.equal(held.plan.positions, held.positions)

    @invariant()
    def held_window_of_the_longest_row_is_unchanged_by_appends(self):
        for held in self.held:
            if not held.plan.is_window:
                continue
            row = held.plan.rows[held.longest]
            if self.tenant[row] == held.tenants[held.longest]:  # resets and moves are not appends
                assert torch.equal(held.plan.slot_mapping[held.longest], held.longest_window)

    @invariant()
    def pool_accounting_holds(self):
        cache, pool = self.cache, self.cache.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        held = [b for r in range(MAX_ROWS) for b in cache.tables[r].blocks]
        assert len(held) == len(set(held)), "a block is in two tables"
        assert cache.scratch_slot // BLOCK_SIZE not in held
        assert not set(held) & set(self.outside), "a row holds a block somebody else took"
        assert pool.num_used == len(held) + 1 + len(self.outside)  # + the scratch block: nothing leaked
        for r in range(MAX_ROWS):
            if r not in cache.live_rows:
                assert cache.tables[r].is_empty
            # exact: a row holds a block from the step its first token needs it, never before
            assert cache.tables[r].num_blocks == -(-cache.num_tokens(r) // BLOCK_SIZE)


def test_slot_table_against_rebuild_mapping(device):
    run_state_machine_as_test(lambda: SlotTableMachine(device))

