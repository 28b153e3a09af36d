"""PairedCache against a shadow model the test keeps itself, under random geometry.

The shadow knows, without asking the cache, which block ids each row holds (a step-by-step
allocator keeps the free ids on a stack: untouched ids lowest first, a freed id on top; a row
gives its blocks back last block first), each row's length, and
the K/V values written for every token. Every operation's result, every failed operation's
"nothing changed", and every read (the slot table, a plan's slot_mapping, the K/V behind it
and the attention output over it) is compared with the shadow by plain asserts; no `check_*`
gate is involved, so a gate that stops checking cannot hide a fault here.

A block that leaves a row is poisoned (its K/V overwritten with a value no token has), so a
new tenant that reads a slot of the old one sees poison, not a plausible number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from attention_support import paged_attention, paged_attention_reference
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from paired_cache import PairedCache
from slot_table_support import lengths, read

from nanoserve.cache import BlockTable, PoolExhaustedError
from nanoserve.worker.slot_table import rebuild_mapping

NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 2, 2, 4
POISON = 1.0e4  # finite, so a masked column times probability 0 stays 0; no token's K/V is near it


def token_kv(values: list[int], layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V [n, kv_heads, head_dim] the test writes for tokens with these value ids:
    a deterministic function of (id, layer), distinct per id, in [-1, 1]."""
    ids = torch.tensor(values, dtype=torch.float64).view(-1, 1, 1)
    grid = torch.arange(NUM_KV_HEADS * HEAD_DIM, dtype=torch.float64).view(1, NUM_KV_HEADS, HEAD_DIM)
    k = torch.sin(ids * 0.7311 + grid * 1.13 + layer * 0.3)
    v = torch.cos(ids * 0.5173 + grid * 0.917 - layer * 0.2)
    return k.float().to(device), v.float().to(device)


def expected_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Each row's attention [n, H, D] over its own keys/values [t, KV, D] (zeros for t = 0), in float64."""
    n, width = len(keys), max(len(k) for k in keys)
    group = NUM_HEADS // NUM_KV_HEADS

    def padded(parts: list[torch.Tensor]) -> torch.Tensor:  # [n, width, H, D]
        out = torch.zeros(n, width, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float64)
        for i, part in enumerate(parts):
            out[i, : len(part)] = part.double()
        return out.repeat_interleave(group, dim=2)

    scores = torch.einsum("nhd,nthd->nht", q.double(), padded(keys)) * HEAD_DIM**-0.5
    hidden = torch.arange(width).view(1, 1, width) >= torch.tensor([len(k) for k in keys]).view(n, 1, 1)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("nht,nthd->nhd", probs, padded(values))


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: extra threads only contend with each other on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Row:
    blocks: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)  # one value id per token, in token order
    slots: list[int] = field(default_factory=list)  # each token's slot, from the blocks above


class Shadow:
    """What the cache must hold, predicted from the operations alone."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: the top is the end
        self.rows: dict[int, Row] = {}  # claimed rows (a reset row stays claimed, empty)
        self.outside: list[int] = []  # blocks the test itself took from the pool
        self.next_value = 1

    def take(self, n: int) -> list[int]:
        """A step-by-step allocator: the top of the free stack, one at a time."""
        assert n <= len(self.free_blocks)
        return [self.free_blocks.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        """Blocks freed in this order: the last of them is the next taken."""
        assert not set(self.free_blocks) & set(blocks)
        self.free_blocks += blocks

    def new_values(self, n: int) -> list[int]:
        values = list(range(self.next_value, self.next_value + n))
        self.next_value += n
        return values

    def push(self, row: int, values: list[int]) -> list[int]:
        """Count tokens with these values as the row's next ones; returns their slots."""
        held, bs = self.rows[row], self.block_size
        start = len(held.values)
        slots = [held.blocks[t // bs] * bs + t % bs for t in range(start, start + len(values))]
        held.values += values
        held.slots += slots
        return slots

    def slots(self, row: int) -> list[int]:
        return self.rows[row].slots if row in self.rows else []

    def length(self, row: int) -> int:
        return len(self.rows[row].values) if row in self.rows else 0

    def capacity(self, row: int) -> int:
        return len(self.rows[row].blocks) * self.block_size


class CacheUnderShadow:
    """A cache and its shadow, driven together: each operation asserts its outcome against
    the shadow. Used by the state machine and by the long steady runs."""

    def __init__(self, *, block_size: int, max_batch_size: int, max_model_len: int, num_blocks: int,
                 num_layers: int, device: str) -> None:
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.max_batch_size = max_batch_size
        self.cache = PairedCache(num_layers, NUM_KV_HEADS, HEAD_DIM, num_blocks, block_size,
                                         max_batch_size, max_model_len, device=device)
        self.shadow = Shadow(num_blocks, block_size)
        assert self.shadow.take(1) == [0] and self.cache.scratch_slot == 0  # the reserved block: id 0
        self.max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
        assert self.cache.max_model_len == self.max_model_len
        # Copies somebody is still holding, with what they held when taken.
        self.held: list[tuple[str, torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] = []
        self.queries = torch.Generator().manual_seed(0)

    # -- helpers ----------------------------------------------------------------------------

    def snapshot(self) -> list:
        """Everything an operation could change, for 'a failed operation changes nothing'."""
        cache = self.cache
        return [
            cache.pool.num_free,
            [b for b in range(cache.pool.num_blocks) if cache.pool.ref_count(b) > 0],
            cache.live_rows,
            [(t.blocks, t.num_tokens) for t in cache.tables],
            cache.slot_table.lengths_array.copy(),
            cache.slot_table.slots.clone(),
        ]

    def unchanged_since(self, before: list) -> bool:
        now = self.snapshot()
        return before[:4] == now[:4] and np.array_equal(before[4], now[4]) and torch.equal(before[5], now[5])

    def refused(self, error: type[Exception], operation, *args) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            operation(*args)
        assert self.unchanged_since(before), f"{operation.__name__}{args} raised {error.__name__} and changed the cache"

    def hold(self, name: str, value: torch.Tensor | np.ndarray) -> None:
        """Keep a value that was promised as a copy; it must never move afterwards."""
        taken = value.clone() if isinstance(value, torch.Tensor) else value.copy()
        self.held = [*self.held[-7:], (name, value, taken)]

    def scribble_on(self, name: str, value: torch.Tensor | np.ndarray) -> None:
        """Overwrite a value promised as a copy: the cache's own state must not change."""
        before = self.snapshot()
        value[...] = -12345
        assert self.unchanged_since(before), f"{name} is a view of the cache's state, not a copy"

    def write_tokens(self, slots: torch.Tensor, values: list[int]) -> None:
        for layer in range(self.num_layers):
            k, v = token_kv(values, layer, self.device)
            self.cache.write_kv(layer, slots, k, v)

    def poison(self, blocks: list[int]) -> None:
        bs = self.shadow.block_size
        slots = torch.tensor([b * bs + i for b in blocks for i in range(bs)], dtype=torch.int64,
                             device=self.device)
        if len(slots):
            for layer in range(self.num_layers):
                self.cache.layers.k_cells[layer][slots] = POISON
                self.cache.layers.v_cells[layer][slots] = -POISON

    def claim(self, row: int) -> None:
        self.shadow.rows.setdefault(row, Row())

    def release_blocks(self, row: int) -> None:
        blocks = self.shadow.rows[row].blocks
        self.poison(blocks)
        self.shadow.give_back(blocks[::-1])
        self.shadow.rows[row] = Row()

    def free_rows(self) -> list[int]:
        return [r for r in range(self.max_batch_size) if r not in self.shadow.rows]

    # -- operations -------------------------------------------------------------------------

    def allocate_prompt(self, row: int, n: int) -> None:
        shadow = self.shadow
        start = shadow.length(row)
        if n < 1 or start + n > self.max_model_len:
            self.refused(ValueError, self.cache.allocate_prompt, row, n)
            return
        capacity = shadow.capacity(row) if row in shadow.rows else 0
        need = max(0, -(-(start + n - capacity) // shadow.block_size))
        if need > len(shadow.free_blocks):  # must not claim the row, nor keep any block
            self.refused(PoolExhaustedError, self.cache.allocate_prompt, row, n)
            return
        slots = self.cache.allocate_prompt(row, n)
        self.claim(row)
        shadow.rows[row].blocks += shadow.take(need)
        values = shadow.new_values(n)
        assert slots.tolist() == shadow.push(row, values)
        self.write_tokens(slots, values)
        self.scribble_on("allocate_prompt's slots", slots)

    def adopt(self, row: int, n: int) -> None:
        """Hand the row a freshly built table of n tokens (blocks taken from the cache's pool)."""
        shadow = self.shadow
        need = -(-n // shadow.block_size)
        if need > len(shadow.free_blocks) or n > self.max_model_len:
            return
        table = BlockTable(shadow.block_size)
        table.add_blocks(self.cache.pool.allocate(table.blocks_needed(n)))
        table.advance(n)
        blocks = shadow.take(need)
        assert list(table.blocks) == blocks
        self.cache.adopt_row(row, table)
        assert table.is_empty
        self.claim(row)
        shadow.rows[row] = Row(blocks)
        values = shadow.new_values(n)
        self.write_tokens(torch.tensor(shadow.push(row, values), dtype=torch.int64, device=self.device), values)

    def adopt_refused(self, row: int, other: int) -> None:
        """Adopting a table that lists a block another row holds, or into a row that is not
        empty, raises and changes nothing."""
        table = BlockTable(self.shadow.block_size)
        table.add_blocks(self.shadow.rows[other].blocks[:1])
        table.advance(min(1, table.capacity))
        self.refused(ValueError, self.cache.adopt_row, row, table)
        assert table.blocks == tuple(self.shadow.rows[other].blocks[:1])  # the refused table kept its own

    def decode(self, rows: list[int], thorough: bool = True) -> bool:
        """One decode step over `rows`; returns whether it ran (False: refused, nothing changed).
        `thorough` adds the attention read and the copy checks (the costly part)."""
        shadow, cache = self.shadow, self.cache
        lengths = [shadow.length(r) for r in rows]
        if any(r not in shadow.rows for r in rows) or max(lengths) >= self.max_model_len:
            self.refused(ValueError, cache.plan_decode, rows)
            return False
        full = [r for r in rows if shadow.length(r) == shadow.capacity(r)]
        assert cache.can_append(rows) == (len(full) <= len(shadow.free_blocks))
        if len(full) > len(shadow.free_blocks):
            self.refused(PoolExhaustedError, cache.plan_decode, rows)
            return False
        plan = cache.plan_decode(rows)
        for r in full:  # in the order the rows were given, one block each
            shadow.rows[r].blocks += shadow.take(1)
        values = shadow.new_values(len(rows))
        write_slots = [shadow.push(r, [value])[0] for r, value in zip(rows, values)]
        width = max(lengths) + 1
        assert plan.rows == tuple(rows)
        assert plan.is_window == (rows == list(range(len(rows))))
        assert plan.positions.tolist() == lengths
        assert plan.context_lens.tolist() == [n + 1 for n in lengths]
        assert plan.write_slots.tolist() == write_slots
        assert tuple(plan.slot_mapping.shape) == (len(rows), width)
        for i, r in enumerate(rows):
            assert plan.slot_mapping[i, : lengths[i] + 1].tolist() == shadow.slots(r), f"row {r}"
        self.write_tokens(plan.write_slots, values)
        if thorough:
            self.check_attention(rows, plan.slot_mapping, plan.context_lens)
            self.scribble_on("plan.context_lens", plan.context_lens)
            self.scribble_on("plan.positions", plan.positions)
        for name in ("context_lens", "positions", "write_slots"):
            self.hold(f"plan.{name}", getattr(plan, name))
        if not plan.is_window:
            self.hold("plan.slot_mapping (a gather)", plan.slot_mapping)
        return True

    def reset(self, row: int) -> None:
        self.cache.reset_row(row)
        self.release_blocks(row)

    def free(self, row: int) -> None:
        self.cache.free(row)
        self.release_blocks(row)
        del self.shadow.rows[row]

    def move(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.shadow.rows[dst] = self.shadow.rows.pop(src)

    def outsider(self, take: int) -> None:
        """Something other than a row takes blocks from the pool, or gives its blocks back."""
        if take:
            if take <= len(self.shadow.free_blocks):
                got = self.cache.pool.allocate(take)
                assert got == self.shadow.take(take)
                self.shadow.outside += got
            else:
                with pytest.raises(PoolExhaustedError):
                    self.cache.pool.allocate(take)
        elif self.shadow.outside:
            self.cache.pool.free(self.shadow.outside)
            self.shadow.give_back(self.shadow.outside)
            self.shadow.outside = []

    def read(self, rows: list[int], width: int) -> None:
        table = self.cache.slot_table
        rect, lens = read(table, rows, width)
        assert tuple(rect.shape) == (len(rows), width)
        assert lens.tolist() == [self.shadow.length(r) for r in rows]
        for i, r in enumerate(rows):
            n = min(width, self.shadow.length(r))
            assert rect[i, :n].tolist() == self.shadow.slots(r)[:n]
        assert lengths(table, rows).tolist() == lens.tolist()
        is_window = rect.untyped_storage().data_ptr() == table.slots.untyped_storage().data_ptr()
        assert is_window == (rows == list(range(len(rows))))
        if width and width >= max(lens.tolist()):
            self.check_attention(rows, rect, lens)
        self.scribble_on("read's lengths", lens)
        self.scribble_on("SlotTable.lengths", lengths(table, rows))
        self.hold("read's lengths", lens)
        if not is_window:
            self.scribble_on("a gathered rect", rect)
            self.hold("a gathered rect", rect)

    # -- what must hold after every operation ---------------------------------------------------

    def check_state(self, against_rebuild: bool = True) -> None:
        cache, shadow = self.cache, self.shadow
        assert cache.live_rows == sorted(shadow.rows)
        assert cache.pool.num_free == len(shadow.free_blocks)
        assert [b for b in range(cache.pool.num_blocks) if not cache.pool.ref_count(b) > 0] == sorted(shadow.free_blocks)
        for r in range(self.max_batch_size):
            assert (r in cache.live_rows) == (r in shadow.rows)
            blocks = shadow.rows[r].blocks if r in shadow.rows else []
            assert list(cache.tables[r].blocks) == blocks, f"row {r}"
            assert cache.num_tokens(r) == cache.slot_table.lengths_array[r] == shadow.length(r), f"row {r}"
            assert cache.tables[r].capacity == len(blocks) * shadow.block_size
        assert cache.slot_table.lengths_array.tolist() == [shadow.length(r) for r in range(self.max_batch_size)]
        live = [r for r in sorted(shadow.rows) if shadow.length(r)]
        for r in live:
            n = shadow.length(r)
            assert cache.slot_table.slots[r, :n].tolist() == shadow.slots(r), f"row {r}"
        if live and against_rebuild:
            expected = [shadow.slots(r) + [0] * (self.max_model_len - shadow.length(r)) for r in live]
            assert rebuild_mapping(cache.tables, live, self.max_model_len).tolist() == expected
        for name, value, taken in self.held:
            same = torch.equal(value, taken) if isinstance(value, torch.Tensor) else np.array_equal(value, taken)
            assert same, f"{name} changed after it was handed out: a view where a copy was promised"

    def check_data(self) -> None:
        """The K/V behind every live row's slots is the row's own, in every layer."""
        for r in sorted(self.shadow.rows):
            if not self.shadow.length(r):
                continue
            slots = torch.tensor(self.shadow.slots(r), device=self.device)
            for layer in range(self.num_layers):
                k, v = token_kv(self.shadow.rows[r].values, layer, self.device)
                assert torch.equal(self.cache.layers.k_cells[layer][slots], k), f"row {r} layer {layer}: K"
                assert torch.equal(self.cache.layers.v_cells[layer][slots], v), f"row {r} layer {layer}: V"

    def check_attention(self, rows: list[int], slot_mapping: torch.Tensor, context_lens: torch.Tensor) -> None:
        """Attention through the cache's addressing equals attention over the shadow's K/V."""
        q = torch.randn(len(rows), NUM_HEADS, HEAD_DIM, generator=self.queries).to(self.device)
        for layer in range(self.num_layers):
            k_cache, v_cache = self.cache.layers.k_cells[layer], self.cache.layers.v_cells[layer]
            reference = paged_attention_reference(q, k_cache, v_cache, slot_mapping, context_lens)
            fused = paged_attention(q, k_cache, v_cache, slot_mapping, context_lens)
            kv = [token_kv(self.shadow.rows[r].values if self.shadow.length(r) else [], layer, "cpu") for r in rows]
            want = expected_attention(q.cpu(), [k for k, _ in kv], [v for _, v in kv]).float().to(self.device)
            torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-5, msg=f"rows {rows} (reference)")
            torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4, msg=f"rows {rows} (fused)")


class ShadowMachine(RuleBasedStateMachine):
    """Random geometry per run; random admit / prefill / adopt / decode / reset / free / move /
    read sequences; failed operations that must change nothing."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    @initialize(block_size=st.integers(1, 6), max_batch_size=st.integers(1, 6),
                max_model_len=st.integers(1, 48), num_blocks=st.integers(2, 24), num_layers=st.integers(1, 2))
    def build(self, block_size, max_batch_size, max_model_len, num_blocks, num_layers):
        self.run = CacheUnderShadow(block_size=block_size, max_batch_size=max_batch_size,
                                    max_model_len=max_model_len, num_blocks=num_blocks,
                                    num_layers=num_layers, device=self.device)

    def rows_drawn(self, data, candidates: list[int], label: str) -> list[int]:
        rows = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=len(candidates),
                                  unique=True), label=label)
        if data.draw(st.booleans(), label="sorted"):
            rows.sort()
        return rows

    @property
    def live(self) -> list[int]:
        return sorted(self.run.shadow.rows)

    @rule(data=st.data(), n=st.integers(0, 50))
    def prefill(self, data, n):
        """A prompt into a free row, or more prompt into a live one (runs out of blocks or
        past max_model_len at times: then nothing may change)."""
        row = data.draw(st.integers(0, self.run.max_batch_size - 1), label="row")
        self.run.allocate_prompt(row, n)

    @rule(data=st.data(), n=st.integers(0, 30))
    def adopt(self, data, n):
        empty = [r for r in range(self.run.max_batch_size) if not self.run.shadow.length(r)]
        if empty:
            self.run.adopt(data.draw(st.sampled_from(empty), label="row"), n)

    @precondition(lambda self: any(r.blocks for r in self.run.shadow.rows.values()))
    @rule(data=st.data())
    def adopt_refused(self, data):
        holders = [r for r in self.live if self.run.shadow.rows[r].blocks]
        other = data.draw(st.sampled_from(holders), label="holder")
        row = data.draw(st.integers(0, self.run.max_batch_size - 1), label="row")
        self.run.adopt_refused(row, other)

    @precondition(lambda self: self.run.shadow.rows)
    @rule(data=st.data(), steps=st.integers(1, 12))
    def decode(self, data, steps):
        rows = self.rows_drawn(data, self.live, "rows")
        for _ in range(steps):
            if not self.run.decode(rows):
                return

    @precondition(lambda self: self.run.shadow.rows)
    @rule(data=st.data(), steps=st.integers(1, 12))
    def decode_prefix(self, data, steps):
        """The engine's steady case: the live rows are a prefix and decode together."""
        prefix = 0
        while prefix in self.run.shadow.rows:
            prefix += 1
        if prefix:
            for _ in range(steps):
                if not self.run.decode(list(range(prefix))):
                    return

    @rule(data=st.data())
    def decode_refused_on_a_free_row(self, data):
        free = self.run.free_rows()
        if free:
            rows = [*self.live, data.draw(st.sampled_from(free), label="free row")]
            self.run.refused(ValueError, self.run.cache.plan_decode, rows)

    @precondition(lambda self: self.run.shadow.rows)
    @rule(data=st.data(), free=st.booleans())
    def release(self, data, free):
        row = data.draw(st.sampled_from(self.live), label="row")
        (self.run.free if free else self.run.reset)(row)

    @precondition(lambda self: self.run.shadow.rows and self.run.free_rows())
    @rule(data=st.data())
    def move(self, data):
        src = data.draw(st.sampled_from(self.live), label="src")
        dst = data.draw(st.sampled_from(self.run.free_rows()), label="dst")
        self.run.move(src, dst)

    @precondition(lambda self: self.run.shadow.rows and self.run.free_rows())
    @rule(data=st.data())
    def move_refused(self, data):
        """Onto a row that holds tokens, onto itself, or from a free row: refused, no change."""
        src = data.draw(st.sampled_from(self.live), label="src")
        busy = [r for r in self.live if self.run.shadow.length(r) and r != src]
        dst = data.draw(st.sampled_from([src, *busy]), label="dst")
        self.run.refused(ValueError, self.run.cache.move_row, src, dst)
        self.run.refused(ValueError, self.run.cache.move_row, self.run.free_rows()[0], src)

    @rule(take=st.integers(0, 3))
    def outsider(self, take):
        self.run.outsider(take)

    @rule(data=st.data())
    def read(self, data):
        rows = self.rows_drawn(data, list(range(self.run.max_batch_size)), "rows")
        width = data.draw(st.integers(0, self.run.max_model_len), label="width")
        self.run.read(rows, width)

    @invariant()
    def matches_the_shadow(self):
        if hasattr(self, "run"):
            self.run.check_state()
            self.run.check_data()


def test_cache_matches_its_shadow_under_random_geometry(device):
    run_state_machine_as_test(lambda: ShadowMachine(device))


@pytest.mark.parametrize("block_size,rows,steps", [(1, 3, 300), (4, 8, 400), (16, 5, 700)])
def test_a_steady_batch_decodes_hundreds_of_steps_across_block_boundaries(device, block_size, rows, steps):
    """Rows of different prompt lengths decode together for hundreds of steps; then the pool
    runs dry, the step is refused with nothing changed, a row finishes, the batch compacts
    and goes on. Each step is checked against the shadow; the K/V and attention every 25."""
    max_model_len = steps + 40
    blocks_for_all = rows * -(-max_model_len // block_size)
    run = CacheUnderShadow(block_size=block_size, max_batch_size=rows, max_model_len=max_model_len,
                           num_blocks=blocks_for_all * 3 // 4, num_layers=1, device=device)
    for row in range(rows):
        run.allocate_prompt(row, 1 + 7 * row % 37)
    batch = list(range(rows))
    done = 0
    while done < steps:
        if not run.decode(batch, thorough=done % 25 == 0):
            assert not run.cache.can_append(batch) and len(batch) > 1  # refused only for want of blocks
            run.free(batch[0])
            run.move(batch[-1], batch[0])
            batch.pop()
            continue
        done += 1
        run.check_state(against_rebuild=done % 25 == 0)
        if done % 25 == 0:
            run.check_data()
    assert len(batch) < rows  # the pool ran dry at least once
    run.check_data()
