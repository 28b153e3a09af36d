"""Prefix caching under random traffic, against a shadow model of what every row should read.

A hypothesis RuleBasedStateMachine plays a scheduler over one small PairedCache:
requests whose token ids share prefixes (drawn from a few stems) arrive, are admitted
(admit_prefix, allocate_prompt, K/V written, cache_full_blocks), decode, finish, abort and
are preempted (freed, then admitted again with everything they hold), with rows kept a
prefix by compaction. The pool is small, so cached blocks are evicted all the time.

The K/V value of token t is a function of the tokens up to t, so a row that adopts a block
must read back exactly what its own prefill would have written. After every rule: each row's
slot table equals rebuild_mapping, each block's reference count equals the rows holding it,
the pool's accounting holds, registered blocks carry their prefix's hash, and every row
reads its own values. Runs on every device of the `device` fixture.
"""

from __future__ import annotations

import zlib
from collections import Counter

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from paired_cache import PairedCache

from nanoserve.cache.prefix_cache import chain_hashes, root_hash
from nanoserve.worker.slot_table import rebuild_mapping

BS = 4
MAX_ROWS = 4
MAX_LEN = 24
NUM_BLOCKS = 10  # 9 besides the scratch block: one or two requests' worth, so eviction is constant
SALT = "shadow-model"
STEMS = ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [11, 12, 13, 14, 30, 31, 32, 33, 34, 35, 36, 37],
         [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51])


def kv_value(prefix: list[int]) -> float:
    """The K/V a token gets: a function of it and everything before it (exact in float32)."""
    return float(zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes()) % (1 << 20))


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.cache = PairedCache(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=NUM_BLOCKS,
                                         block_size=BS, max_batch_size=MAX_ROWS, max_model_len=MAX_LEN,
                                         device=device, enable_prefix_caching=True, prefix_salt=SALT)
        self.running: list[list[int]] = []  # running[row]: the tokens whose K/V the row holds
        self.waiting: list[list[int]] = []

    # -- what an engine does -----------------------------------------------------------------

    def write(self, row: int, slots: torch.Tensor, first: int) -> None:
        """Write the K/V of the row's tokens from `first` on at `slots`, into private blocks only."""
        tokens = self.running[row]
        for slot in slots.tolist():
            block = slot // BS
            assert self.cache.pool.ref_count(block) == 1, f"row {row} writes into shared block {block}"
            assert self.cache.pool.hash_of(block) is None, f"row {row} writes into cached block {block}"
        values = torch.tensor([kv_value(tokens[: t + 1]) for t in range(first, len(tokens))],
                              device=self.cache.device).view(-1, 1, 1)
        self.cache.write_kv(0, slots, values, -values)

    def release(self, row: int) -> list[int]:
        """Free a row and compact: the last row moves into the hole."""
        tokens = self.running[row]
        self.cache.free(row)
        last = len(self.running) - 1
        if row != last:
            self.cache.move_row(last, row)
            self.running[row] = self.running[last]
        self.running.pop()
        return tokens

    # -- rules -------------------------------------------------------------------------------

    @initialize(tails=st.lists(st.lists(st.integers(1, 3), max_size=6), min_size=3, max_size=3))
    def first_arrivals(self, tails):
        self.waiting = [stem + tail for stem, tail in zip(STEMS, tails)]

    @precondition(lambda self: len(self.waiting) < 6)
    @rule(stem=st.sampled_from(STEMS), cut=st.sampled_from([0, 3, 4, 8, 9, 12, 12]),
          tail=st.lists(st.integers(1, 3), max_size=6))
    def arrive(self, stem, cut, tail):
        tokens = stem[:cut] + tail
        if tokens:
            self.waiting.append(tokens)

    @precondition(lambda self: self.waiting and len(self.running) < MAX_ROWS)
    @rule(data=st.data())
    def admit(self, data):
        """Admit waiting requests, first come first served, while rows and blocks allow."""
        while self.waiting and len(self.running) < MAX_ROWS and self.admit_one(self.waiting[0]):
            self.waiting.pop(0)
        if self.waiting and len(self.running) < MAX_ROWS:  # and one out of turn
            index = data.draw(st.integers(0, len(self.waiting) - 1), label="waiting index")
            if self.admit_one(self.waiting[index]):
                self.waiting.pop(index)

    def admit_one(self, tokens: list[int]) -> bool:
        row = len(self.running)
        before = (self.cache.pool.num_free, self.cache.prefix_cache_stats()["prefix_cache_blocks"])
        matched = self.cache.match_prefix(tokens)
        adopted = self.cache.admit_prefix(row, tokens)
        assert adopted == matched and adopted % BS == 0 and adopted <= len(tokens) - 1
        if self.cache.blocks_needed(len(tokens) - adopted + 1, row) > self.cache.pool.num_free:  # + its first decode token
            self.cache.free(row)  # undo: the adopted blocks go back to the LRU
            assert (self.cache.pool.num_free, self.cache.prefix_cache_stats()["prefix_cache_blocks"]) == before
            return False
        slots = self.cache.allocate_prompt(row, len(tokens) - adopted)
        self.running.append(tokens)
        self.write(row, slots, adopted)
        self.cache.cache_full_blocks(row, tokens)
        return True

    @precondition(lambda self: self.running)
    @rule(data=st.data(), steps=st.integers(1, 5), register=st.booleans())
    def decode(self, data, steps, register):
        for _ in range(steps):
            for row in reversed(range(len(self.running))):
                if len(self.running[row]) >= MAX_LEN:
                    self.release(row)  # finished: at max_model_len
            # preempt the last row (recompute later) until every row can grow by one
            while len(self.running) > 1 and not self.cache.can_append(range(len(self.running))):
                self.waiting.insert(0, self.release(len(self.running) - 1))
            if not self.running or not self.cache.can_append(range(len(self.running))):
                return
            plan = self.cache.plan_decode(len(self.running))
            assert plan.is_window
            assert plan.slot_mapping.untyped_storage().data_ptr() == self.cache.slot_table.slots.untyped_storage().data_ptr()
            new = data.draw(st.lists(st.integers(1, 4), min_size=len(self.running), max_size=len(self.running)),
                            label="sampled")
            for row, token in enumerate(new):
                self.running[row].append(token)
                self.write(row, plan.write_slots[row : row + 1], len(self.running[row]) - 1)
            if register:  # an engine may register blocks as decode fills them
                for row, tokens in enumerate(self.running):
                    self.cache.cache_full_blocks(row, tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.release(data.draw(st.integers(0, len(self.running) - 1), label="row"))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.waiting.insert(0, self.release(data.draw(st.integers(0, len(self.running) - 1), label="row")))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1), label="waiting index"))

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def rows_are_a_prefix_and_match_rebuild_mapping(self):
        cache = self.cache
        assert cache.live_rows == list(range(len(self.running)))
        for row, tokens in enumerate(self.running):
            assert cache.num_tokens(row) == len(tokens) == cache.slot_table.lengths_array[row]
            expected = rebuild_mapping(cache.tables, [row], device=cache.device)[0]
            assert torch.equal(cache.slot_table.slots[row, : len(tokens)], expected), f"row {row}: {cache.slot_table.slots[row, : len(tokens)].tolist()}"

    @invariant()
    def reference_counts_equal_holders_and_the_pool_adds_up(self):
        cache, pool = self.cache, self.cache.pool
        holders = Counter(b for row in range(len(self.running)) for b in cache.tables[row].blocks)
        holders[cache.scratch_slot // BS] += 1
        cached = 0
        for block in range(NUM_BLOCKS):
            assert pool.ref_count(block) == holders[block], f"block {block}: count {pool.ref_count(block)}, " \
                                                            f"held by {holders[block]}"
            if holders[block] == 0 and pool.hash_of(block) is not None:
                assert pool.is_cached(block)
                cached += 1
            else:
                assert not pool.is_cached(block), f"block {block} is evictable while held"
        assert pool.num_cached == cached
        num_empty = sum(not pool.ref_count(b) and not pool.is_cached(b) for b in range(pool.num_blocks))
        assert num_empty + pool.num_cached + pool.num_used == NUM_BLOCKS
        assert pool.num_used == len(holders)
        assert cache.prefix_cache_stats()["prefix_cache_blocks"] == pool.num_registered

    @invariant()
    def registered_blocks_carry_their_prefix_hash(self):
        root = root_hash(SALT)
        for row, tokens in enumerate(self.running):
            hashes = chain_hashes(tokens, BS, root)
            for i, block in enumerate(self.cache.tables[row].blocks):
                known = self.cache.pool.hash_of(block)
                assert known is None or (i < len(hashes) and known == hashes[i]), f"row {row} block {i}"

    @invariant()
    def every_row_reads_its_own_values(self):
        for row, tokens in enumerate(self.running):
            slots = self.cache.slot_table.slots[row, : len(tokens)]
            read = self.cache.layers.k_cells[0][slots].view(-1).tolist()
            want = [kv_value(tokens[: t + 1]) for t in range(len(tokens))]
            assert read == want, f"row {row} reads {read}, wrote {want}"


def test_prefix_caching_against_a_shadow_model(device):
    run_state_machine_as_test(lambda: PrefixCacheMachine(device))
