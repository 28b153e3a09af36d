"""Attention over the paged cache, every backend the model is handed: one interface,
``backend(layer, q, k, v, *, window=None) -> out``, where the backend writes this step's K/V
into the cache before it reads.

- ``WindowAttention``: decode rows, one query each over the row's window of the slot table,
  read by nanoserve's ``decode_attention`` kernel where ``decode_attention_kernel`` names a
  tier for it, else by torch's fused SDPA (``window_mask``, ``attend_window``); the tests hold
  the reference read both are tested against (tests/attention_support.py).
- ``PackedPrefillAttention``: prefill chunks packed into one token list, each causal over its
  sequence (``grouped_causal_attention``).
- ``DecodeThenPrefill``: one eager forward holding both.

Padding in ``slot_mapping`` only has to be a legal slot index: the gather reads it and the mask
(``column >= context_lens[row]``) throws it away.

A sliding-window layer (``window``) reads the same row of slots, restricted to its last
``window`` cells: column c of a row of length L is visible when L - window <= c < L.

A layer with attention sinks (gpt-oss: ``sinks`` [H], one logit per query head) has one more
logit in each softmax's denominator that takes probability mass and contributes no value.
SDPA has no such input: those layers run ``reference_attention.attend_with_sinks`` (the same
gathers and masks, the softmax in fp32 with the sink's column); the kernel tiers take the sinks
themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanoserve.model.network.reference_attention import attend_with_sinks
from nanoserve.model.quant import cpu_kernels
from nanoserve.worker.kv_cells import resolve_cell_format

if TYPE_CHECKING:
    from nanoserve.worker.kv_cache import KVCache
    from nanoserve.worker.kv_cells import KVLayers


def decode_attention_kernel(device: str | torch.device, dtype: torch.dtype, head_dim: int, tier: str | None,
                            kv_cache_types: tuple[str, str] = ("auto", "auto")) -> int | None:
    """The handle of the kernel tier (cpu_kernels) whose decode_attention reads, for queries in
    ``dtype`` with ``head_dim``, K/V cells stored as ``kv_cache_types`` (kv_cells) on ``device``
    in decode steps, or None for SDPA: on the CPU, with a tier of nanoserve's (the dense fp32
    format keeps torch's path as the reference), bf16 or fp32 queries, each side q8_0 or in
    the queries' dtype, and a head_dim the kernels' 16-lane loads cover."""
    if tier is None or torch.device(device).type != "cpu" or head_dim % 16:
        return None
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    formats = [resolve_cell_format(name, dtype, head_dim) for name in kv_cache_types]
    if any(not fmt.quantized and fmt.dtype != dtype for fmt in formats):
        return None
    return cpu_kernels.handle(tier)


def window_mask(context_lens: torch.Tensor, width: int, dtype: torch.dtype,
                window: int | None = None) -> torch.Tensor:
    """The additive mask [n, 1, 1, W] every layer of a decode step with this ``window`` shares:
    0 over each row's visible cells, -inf elsewhere. Built once per step, in q's dtype: a bool
    mask would be converted by SDPA in every layer. A row of length 0 (padding) may see column
    0, so the kernel never softmaxes an empty row."""
    n = context_lens.shape[0]
    hidden = hidden_columns(context_lens.clamp(min=1).view(n, 1), width, window)
    mask = torch.zeros(n, width, dtype=dtype, device=context_lens.device).masked_fill_(hidden, float("-inf"))
    return mask.view(n, 1, 1, width)


def hidden_columns(lengths: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[n, W] True where a row of length ``lengths[row]`` ([n, 1]) does not look: past its
    length, and before its last ``window`` cells."""
    columns = torch.arange(width, device=lengths.device)
    hidden = columns >= lengths
    return hidden if window is None else hidden | (columns < lengths - window)


def attend_window(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, H, D] over each row's gathered keys and values [n, KV, W, D] (``gather_rows``,
    ``KVLayers.gather``: SDPA reads them by their strides) through `window_mask`'s mask;
    [n, H, D] (``sinks`` [H]: each head's sink logit in the softmax).

    The query heads that share a K/V head are handed to SDPA as that head's query rows
    ([n, KV, group, D]): one small matrix product per K/V head instead of a GQA expansion
    per query head. A padded row's output is finite garbage.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    queries = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if sinks is not None:
        out = attend_with_sinks(queries, keys, values, mask, sinks.view(num_kv_heads, -1, 1), scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def attend_verify(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, queries: int,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A verify step's read through SDPA: q [rows * queries, H, D] (a row's queries in a run),
    each row's gathered keys and values [rows, KV, W, D], mask [rows, 1, queries * group, W]
    (each query's own length); [rows * queries, H, D]. Each row's cells are gathered once for
    all its queries, which SDPA reads as ``queries * group`` query rows of each K/V head."""
    n, num_heads, head_dim = q.shape
    rows, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    grouped = q.view(rows, queries, num_kv_heads, group, head_dim).transpose(1, 2).reshape(
        rows, num_kv_heads, queries * group, head_dim)
    if sinks is not None:  # row j * group + g of a K/V head is query j's head g
        sink = sinks.view(num_kv_heads, 1, group).expand(-1, queries, -1).reshape(num_kv_heads, -1, 1)
        out = attend_with_sinks(grouped, keys, values, mask, sink)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return out.view(rows, num_kv_heads, queries, group, head_dim).transpose(1, 2).reshape(n, num_heads, head_dim)


def gather_rows(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Each row's cached K (or V) through its slots: [n, W] slots -> [n, KV, W, D], one copy
    (the gather) and a transposed view of it."""
    n, width = slot_mapping.shape
    return cache.index_select(0, slot_mapping.reshape(-1)).view(n, width, *cache.shape[1:]).transpose(1, 2)


class WindowAttention:
    """Write each row's new K/V at its slot, then attend over the row's window of the slot
    table, masked by ``context_lens``. In a verify step a row sends several queries (``q``,
    ``context_lens`` and ``write_slots`` have ``queries`` entries a row, row-major), each with
    its own length, so query j sees the row's cells up to its own position and no later. A padded row (length 0) writes to the scratch slot and
    its output is never read. With ``kernel`` (a tier handle, ``decode_attention_kernel``) each
    row's cells are read in one pass of nanoserve's ``decode_attention`` (no gathered copy, no
    mask); else a gather and torch's SDPA, with the mask built once per step for every layer
    of one window (sliding-window layers read the same row of slots, masked to their window)."""

    def __init__(self, kv: KVLayers, write_slots: torch.Tensor, slot_mapping: torch.Tensor,
                 context_lens: torch.Tensor, kernel: int | None = None,
                 ring: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.kv = kv
        # Sliding-window layers' own addressing where they keep rings (window_ring): each
        # query's write cell and the rows' cells [rows, width], in place of the slot table's.
        self.ring = ring
        # A verify step: ``queries`` a row, all reading the row's one row of slots (the kernel
        # takes them so; SDPA gathers the row's cells once for all of them: attend_verify).
        self.queries = context_lens.shape[0] // max(slot_mapping.shape[0], 1)
        self.write_slots, self.slot_mapping, self.context_lens = write_slots, slot_mapping, context_lens
        self.kernel = kernel  # decided outside any graph
        self.masks: dict[int | None, torch.Tensor] = {}  # by window, built at the first layer of each

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        writes, mapping = self.ring if window is not None and self.ring is not None else (self.write_slots,
                                                                                         self.slot_mapping)
        self.kv.write(layer, writes, k, v)
        if self.kernel is not None:
            return self.kv.attend(layer, q, mapping, self.context_lens, self.kernel, window, sinks)
        if window not in self.masks:
            mask = window_mask(self.context_lens, self.slot_mapping.shape[1], q.dtype, window)
            if self.queries > 1:  # [rows * Q, 1, 1, W] -> [rows, 1, Q * group, W], query-major
                rows, group = self.slot_mapping.shape[0], q.shape[1] // k.shape[1]
                mask = mask.view(rows, self.queries, 1, -1).expand(-1, -1, group, -1).reshape(rows, 1, -1, mask.shape[-1])
            self.masks[window] = mask
        keys, values = self.kv.gather(layer, mapping, q.dtype)
        if self.queries > 1:
            return attend_verify(q, keys, values, self.masks[window], self.queries, sinks)
        return attend_window(q, keys, values, self.masks[window], sinks=sinks)


@dataclass(frozen=True)
class ChunkContext:
    """One chunk's place in its sequence: it holds tokens [start, start + length), and
    ``context_slots`` are the slots of tokens [0, start + length) (None when start is 0);
    ``row`` is its request's row (a window layer's ring: window_ring)."""

    start: int
    length: int
    context_slots: torch.Tensor | None = None
    row: int = 0


class PackedPrefillAttention:
    """Several chunks packed into one flat token list; each attends causally to its sequence.

    A chunk that starts a sequence has all its keys in this step's k and v, so it attends to
    them directly (no gather). A chunk after cached tokens (an earlier chunk, an adopted
    prefix) reads its keys back through the row's slots once its own K/V are written; query
    ``i`` (position ``start + i``) sees columns ``<= start + i``.

    A sliding-window layer's query ``i`` sees only columns ``start + i - window + 1 ..
    start + i``: a chunk after cached tokens reads back only the cells from its first query's
    window on, and a banded mask does the rest.

    Each chunk runs through ``grouped_causal_attention``: torch's fused CPU kernel, where
    ``enable_gqa`` or a 3-d input would send SDPA down its unfused math path (several times
    slower, and slower still as the context grows).
    """

    def __init__(self, cache: KVCache, write_slots: torch.Tensor, chunks: list[ChunkContext]) -> None:
        self.cache = cache
        self.ring = cache.ring  # where sliding-window layers keep their K/V (None: the slot table's cells)
        self.write_slots = write_slots
        self.chunks = chunks
        self.lengths = [c.length for c in chunks]
        # Per window: built at the first layer of each, shared by the layers with that window.
        self.masks: dict[int | None, list[torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        ringed = window is not None and self.ring is not None
        if not ringed:
            self.cache.write_kv(layer, self.write_slots, k, v)
        if window not in self.masks:
            group = q.shape[1] // k.shape[1]
            self.masks[window] = [
                grouped_causal_mask(c.start - first_key(c, window), c.length, group, q.dtype, q.device, window)
                for c in self.chunks]
        outputs = []
        k, v = self.cache.layers.as_stored(k, v)  # a chunk reads its own keys as later steps will
        for chunk, mask, q_i, k_i, v_i in zip(self.chunks, self.masks[window], q.split(self.lengths),
                                              k.split(self.lengths), v.split(self.lengths)):
            if ringed:
                k_i, v_i = self._through_ring(layer, chunk, window, q.dtype, k_i, v_i)
            elif chunk.context_slots is not None:
                slots = chunk.context_slots[first_key(chunk, window):]
                k_i, v_i = self.cache.layers.read(layer, slots, q.dtype)
            outputs.append(grouped_causal_attention(q_i, k_i, v_i, mask, sinks))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


    def _through_ring(self, layer: int, chunk: ChunkContext, window: int, dtype: torch.dtype, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A window layer's keys and values for one chunk: its context's (the positions its window
        reaches before the chunk) read from the row's ring first, then its own (``k``, ``v``),
        whose last ``ring`` positions are written there after."""
        cells = self.ring.table[chunk.row]
        end = chunk.start + chunk.length
        if chunk.context_slots is not None:
            context_k, context_v = self.cache.layers.read(layer, cells[first_key(chunk, window):chunk.start], dtype)
            keys, values = torch.cat([context_k, k]), torch.cat([context_v, v])
        else:
            keys, values = k, v
        kept = min(chunk.length, self.ring.ring)
        self.cache.layers.write(layer, cells[end - kept:end], k[-kept:], v[-kept:])
        return keys, values


def first_key(chunk: ChunkContext, window: int | None) -> int:
    """The first position any of the chunk's queries sees: 0, or its first query's window's
    start for a chunk after cached tokens (a chunk without them holds every key it sees)."""
    if window is None or chunk.context_slots is None:
        return 0
    return max(chunk.start - window + 1, 0)


def grouped_causal_mask(start: int, length: int, group: int, dtype: torch.dtype,
                        device: torch.device, window: int | None = None) -> torch.Tensor:
    """The additive mask [group * length, start + length] of ``grouped_causal_attention``:
    query row ``g * length + i`` (position ``start + i``) sees columns ``0..start + i`` (0), not
    the rest (-inf); with ``window``, only columns from ``start + i - window + 1``. In the
    activations' dtype: a bool mask would be converted in every layer."""
    columns = torch.arange(start + length, device=device).view(1, -1)
    positions = torch.arange(start, start + length, device=device).view(-1, 1)
    hidden = columns > positions
    if window is not None:
        hidden |= columns <= positions - window
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return mask.repeat(group, 1)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk's causal attention: q [T, H, D] over its sequence's keys k, v [C, KV, D]
    (H a multiple of KV; the last T keys are the chunk's own), with ``grouped_causal_mask``'s
    mask; returns [T, H, D].

    The ``group`` query heads that share a K/V head become ``group * T`` query rows of that
    head (``[1, KV, group * T, D]``), so K/V are read as they are, without a copy per query
    head, and SDPA gets the 4-d, mask-only input its fused CPU kernel takes."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    queries = q.view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, -1, head_dim)
    if sinks is not None:  # row g * length + i of a K/V head is its head g
        sink = sinks.view(num_kv_heads, group, 1).expand(-1, -1, length).reshape(1, num_kv_heads, -1, 1)
        out = attend_with_sinks(queries, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, sink)
    else:
        out = F.scaled_dot_product_attention(queries, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask)
    return out.view(num_kv_heads, group, length, head_dim).permute(2, 0, 1, 3).reshape(length, num_heads, head_dim)


class DecodeThenPrefill:
    """One forward's attention when its first ``rows`` tokens are decode rows (one token each,
    attending through their slot-table window) and the rest prefill chunks. Each part writes its
    own K/V before reading; the parts hold different rows and share only full, read-only blocks."""

    def __init__(self, rows: int, decode: WindowAttention, prefill: PackedPrefillAttention) -> None:
        self.rows, self.decode, self.prefill = rows, decode, prefill

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = self.rows
        return torch.cat([self.decode(layer, q[:n], k[:n], v[:n], window=window, sinks=sinks),
                          self.prefill(layer, q[n:], k[n:], v[n:], window=window, sinks=sinks)])
