"""The device side of the paged KV cache: the K/V tensors and the slot table, changed only by
the operations a step plan drives (`adopt`, `move`, `free`, `plan_decode`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.worker.kv_cells import CellFormat, KVLayers, resolve_cell_format
from nanoserve.worker.plan import DecodeBatch
from nanoserve.worker.slot_table import SlotTable, is_prefix
from nanoserve.worker.window_ring import WindowRing, ring_writes


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's addressing; good for that step only.

    slot_mapping [n, width]: a window of the slot table when rows are a prefix, else a copy;
        width is the bucketed width. Live storage: later appends land past each row's length.
    context_lens [n]: lengths counting this step's token, a copy (the staleness gates rely on it);
        total_context is their sum, from the host.
    write_slots [n], positions [n], token_ids [n]: where this step's K/V goes, its position
        and the token fed (a verifying row: its last token's).
    queries: tokens each row feeds in the forward (1, or a verify step's bucketed 1 + k).
    query_inputs: with queries > 1, the forward's per-query (tokens, positions, write slots,
        lengths), each [n * queries], row-major; a padded query feeds token 0 at position 0,
        writes the scratch slot and has length 0. ``real_queries`` index the rest.
    """

    rows: tuple[int, ...]
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    total_context: int
    write_slots: torch.Tensor
    positions: torch.Tensor
    is_window: bool
    token_ids: torch.Tensor | None = None
    queries: int = 1
    query_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    real_queries: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.slot_mapping.shape[1]


class KVCache:
    """Every layer's K/V cells (``layers``, KVLayers: the one way in and out of them) for
    ``num_blocks * block_size`` slots, and the slot table of `max_batch_size` rows of
    `max_model_len` cells. K and V are each stored in ``dtype`` or as ``k_format`` /
    ``v_format`` say (kv_cells). `scratch_slot` is the host's reserved block's first slot:
    padded rows write there and no row reads it. With ``slot_table`` the cache addresses another
    cache's rows and slots (a draft model's layers over the target's pool). ``huge_pages``: the
    cells in memory advised for huge pages (KVLayers.allocate)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 max_batch_size: int, max_model_len: int, scratch_slot: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", k_format: CellFormat | None = None,
                 v_format: CellFormat | None = None, windows: list[int | None] | None = None,
                 ring: int | None = None, slot_table: SlotTable | None = None, ring_snapshots: int = 0,
                 huge_pages: bool = False) -> None:
        if min(num_layers, num_kv_heads, head_dim, num_blocks, block_size) < 1:
            raise ValueError(f"cache sizes must be positive: {num_layers} layers, {num_kv_heads} KV heads, "
                             f"head_dim {head_dim}, {num_blocks} blocks of {block_size}")
        self.device = torch.device(device)
        self.block_size, self.num_blocks, self.scratch_slot = block_size, num_blocks, scratch_slot
        self.head_dim = head_dim
        k_format = k_format or resolve_cell_format(None, dtype, head_dim)
        v_format = v_format or resolve_cell_format(None, dtype, head_dim)
        # With ``ring`` (window_ring.ring_size), the layers ``windows`` gives a sliding window
        # keep rings of that many cells a row instead of the pool's cells, and room for
        # ``ring_snapshots`` saved rows of rings (a cached prefix's: cache/ring_snapshots.py).
        self.ring = WindowRing(ring, max_batch_size, max_model_len, self.device, ring_snapshots) if ring else None
        self.ring_layers = [i for i, w in enumerate(windows or []) if w is not None] if ring else []
        slots = [self.ring.num_cells if i in self.ring_layers else num_blocks * block_size for i in range(num_layers)]
        self.layers = KVLayers.allocate(num_layers, slots, num_kv_heads, head_dim, k_format, v_format, self.device,
                                        huge_pages)
        # A draft model's layers share the target's table (speculative/draft.py): the same rows
        # and slots, so one pool holds both models' K/V.
        self.slot_table = slot_table if slot_table is not None else SlotTable(max_batch_size, max_model_len,
                                                                              self.device)
        if tuple(self.slot_table.slots.shape) != (max_batch_size, max_model_len):
            raise ValueError(f"a shared slot table is {tuple(self.slot_table.slots.shape)}; this cache needs "
                             f"{(max_batch_size, max_model_len)}")

    @property
    def ring_table(self) -> torch.Tensor | None:
        """The window layers' constant addressing (window_ring), or None without rings."""
        return self.ring.table if self.ring is not None else None

    @property
    def kv_bytes(self) -> int:
        return self.layers.num_bytes

    @property
    def ring_bytes(self) -> int:
        """The sliding-window layers' rings' share of ``kv_bytes``."""
        return sum(t.numel() * t.element_size() for layer in self.ring_layers for t in self.layers.of_layer(layer))

    @property
    def formats(self) -> tuple[CellFormat, CellFormat]:
        """K's and V's storage."""
        return self.layers.formats

    def adopt(self, row: int, slots: torch.Tensor) -> None:
        """The row holds tokens at `slots` (a prefill chunk's context and write slots)."""
        self.slot_table.adopt(row, slots)

    def move(self, src: int, dst: int, length: int) -> None:
        """The request on `src` (`length` tokens) now lives on `dst`; `src` holds nothing (its
        window layers' ring goes with it)."""
        self.slot_table.move(src, dst, length)
        if self.ring is not None:
            self._copy_rings(self.ring.row_cells(src), self.ring.row_cells(dst))

    def save_rings(self, row: int, slot: int) -> None:
        """Snapshot ``slot`` becomes a copy of the row's window rings."""
        self._copy_rings(self.ring.row_cells(row), self.ring.snapshot_cells(slot))

    def restore_rings(self, slot: int, row: int) -> None:
        """The row's window rings become a copy of snapshot ``slot`` (the prefix it adopted)."""
        self._copy_rings(self.ring.snapshot_cells(slot), self.ring.row_cells(row))

    def _copy_rings(self, src: slice, dst: slice) -> None:
        """Every window layer's ring cells ``dst`` become a copy of its cells ``src``."""
        for layer in self.ring_layers:
            self.layers.copy_cells(layer, src, dst)

    def free(self, row: int) -> None:
        """The row's request left: it holds nothing (its blocks are the host's to reuse)."""
        self.slot_table.reset(row)

    def trim(self, row: int, length: int) -> None:
        """The row keeps its first `length` cells (a verify step's rejected tokens fall off)."""
        self.slot_table.trim(row, length)

    def plan_decode(self, batch: DecodeBatch) -> DecodePlan:
        """Address a decode step: one indexed write puts each row's write slots at their
        positions in the slot table, the lengths move past the last of them, and the
        slot_mapping is read out of the table ([num_rows, batch.width]: a window when the rows
        are a prefix)."""
        if batch.proposals:
            return self._plan_verify(batch)
        ids, n = batch.row_ids, batch.num_rows
        host = torch.tensor((batch.token_ids, batch.positions, batch.write_slots), dtype=torch.long)
        token_ids, positions, write_slots = host.to(self.device).unbind()
        is_window = is_prefix(ids)
        rows = n if is_window else ids  # a prefix is passed by its size: a window of the buffer
        table = self.slot_table
        table.write_cells(rows, positions, write_slots)
        table.lengths_array[slice(n) if is_window else list(ids)] = host[1].numpy() + 1
        return DecodePlan(ids, table.rect(rows, batch.width), positions + 1, sum(batch.positions) + n,
                          write_slots, positions, is_window, token_ids)

    def _plan_verify(self, batch: DecodeBatch) -> DecodePlan:
        """A verify step: each row's fed token and proposals, one query each, padded to
        ``batch.queries`` a row; every cell they write joins the table first."""
        ids, n, q = batch.row_ids, batch.num_rows, batch.queries
        if any(1 + k > q for k in batch.num_proposed):
            raise ValueError(f"verify batch: a row of {1 + max(batch.num_proposed)} tokens does not fit {q} queries")
        tokens, positions, lens = [0] * (n * q), [0] * (n * q), [0] * (n * q)
        slots = [self.scratch_slot] * (n * q)
        cell_rows, real = [], []
        for i, row in enumerate(ids):
            fed = (batch.token_ids[i], *batch.proposals[i])
            for j, (token, slot) in enumerate(zip(fed, batch.row_slots(i))):
                at, position = i * q + j, batch.positions[i] + j
                tokens[at], positions[at], slots[at], lens[at] = token, position, slot, position + 1
                cell_rows.append(row)
                real.append(at)
        host = torch.tensor((tokens, positions, slots, lens), dtype=torch.long)
        real_queries = torch.tensor(real, dtype=torch.long)
        table = self.slot_table
        table.write_cells(cell_rows, host[1][real_queries], host[2][real_queries])
        is_window = is_prefix(ids)
        lengths = torch.tensor(batch.context_lens, dtype=torch.long)
        table.lengths_array[slice(n) if is_window else list(ids)] = lengths.numpy()
        device = host.to(self.device)
        last = device[:, [i * q + k for i, k in enumerate(batch.num_proposed)]]  # each row's last token
        return DecodePlan(ids, table.rect(n if is_window else ids, batch.width), lengths.to(self.device),
                          int(lengths.sum()), last[2], last[1], is_window, last[0], q, tuple(device.unbind()),
                          real_queries.to(self.device))

    def ring_addressing(self, plan: DecodePlan, positions: torch.Tensor,
                        lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The window layers' addressing of a decode step run outside its graph (decode_forward
        derives the same inside): each query's ring write cell, for queries at ``positions`` with
        ``lengths``, and the rows' ring cells [n, width] (window_ring); None without rings."""
        if self.ring is None:
            return None
        rows = torch.tensor(plan.rows, dtype=torch.long, device=self.device)
        table = self.ring.table
        writes = ring_writes(table, rows.repeat_interleave(plan.queries), positions, lengths)
        return writes, table.index_select(0, rows)[:, :plan.width]

    def write_kv(self, layer: int, write_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V [n, kv_heads, head_dim] at `write_slots` [n]."""
        self.layers.write(layer, write_slots, k, v)
