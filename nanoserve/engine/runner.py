"""Applies a step plan on the device: packed prefill chunks (eager) and the fixed-shape decode step.

The runner holds the cache's device tensors (the slot table's buffer, the K/V) as its
persistent buffers and calls none of the cache's or the scheduler's operations: the plan is
all it is told. An eager step with both decode rows and prefill chunks runs them as one
forward (the decode rows' tokens first, then the chunks'), so every layer's weights are read
once a step; each part keeps its own attention. A compiled decode step runs its fixed-shape
graph and the chunks in an eager forward beside it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from nanoserve.cache.gates import check_mapping_is_window
from nanoserve.cache.paged_cache import DecodePlan
from nanoserve.engine.attention import ChunkContext, PackedPrefillAttention
from nanoserve.engine.decode import DecodeStep, WindowAttention
from nanoserve.engine.plan import PrefillChunk, StepPlan


@dataclass
class StepOutput:
    """Logits [len(plan.sampled), vocab], in the plan's ``sampled`` order, and the final hidden
    states of each chunk that keeps them (by chunk index)."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor]


class ModelRunner:
    def __init__(self, model, cache, decode_step: DecodeStep, device: torch.device | str) -> None:
        self.model = model
        self.kv = cache  # its K/V tensors and write_kv, for the prefill attention
        self.slot_table = cache.slot_table
        self.decode_step = decode_step
        self.device = torch.device(device)

    def close(self) -> None:
        """Nothing to release in one process (a tensor-parallel runner stops its ranks)."""

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Apply the plan in order (row moves, the decode rows' cells and buffers, the chunks'
        cells) and run its forward(s)."""
        for move in plan.moves:
            self.slot_table.copy_row(move.src, move.dst, move.length)
        logits, hidden = [], {}
        window = self.decode_step.load(plan.decode) if plan.decode is not None else None
        if window is not None and (self.decode_step.compiled or not plan.prefill):
            if self.decode_step.compiled:
                # The capture gate: a graph reads the table's own buffer, so the rows must be a
                # window of it; anything else is refused, not run.
                check_mapping_is_window(window, self.slot_table)
            logits.append(self.decode_step.run(window, plan.decode.rows))
            window = None
        if plan.prefill:
            chunk_logits, hidden = self._prefill(plan.prefill, window)
            logits.append(chunk_logits)
        return StepOutput(torch.cat(logits) if len(logits) > 1 else logits[0], hidden)

    def _prefill(self, chunks: tuple[PrefillChunk, ...], decode: DecodePlan | None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Write the chunks' K/V; return logits at the last token of each chunk that ends its
        request's prefill (in chunk order), and the final hidden states of the chunks that keep
        them. With ``decode`` (eager) the same forward also decodes its rows, whose logits come
        first."""
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)
        positions = torch.cat([torch.arange(c.start, c.end, device=self.device) for c in chunks])
        write_slots, contexts = [], []
        for c in chunks:
            slots = torch.tensor(c.slots, dtype=torch.long, device=self.device)
            self.slot_table.write_row(c.row, slots)
            write_slots.append(slots[c.start:])
            contexts.append(ChunkContext(c.start, c.length, slots if c.start else None))
        attention = PackedPrefillAttention(self.kv, torch.cat(write_slots), contexts)
        rows = 0
        if decode is not None:
            rows = len(decode.rows)
            window = WindowAttention(self.kv.k_caches, self.kv.v_caches, decode.write_slots, decode.slot_mapping,
                                     decode.context_lens, self.decode_step.attention_kernel)
            attention = DecodeThenPrefill(rows, window, attention)
            token_ids = torch.cat([self.decode_step.input_ids[:rows], token_ids])
            positions = torch.cat([decode.positions, positions])
        hidden = self.model(token_ids, positions, attention)
        lengths = [c.length for c in chunks]
        ends = [rows + end for end in itertools.accumulate(lengths)]
        kept = {i: hidden[ends[i] - c.length:ends[i]] for i, c in enumerate(chunks) if c.keep_hidden}
        last = torch.tensor([*range(rows), *(end - 1 for end, c in zip(ends, chunks) if c.is_last)],
                            dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, last)), kept


class DecodeThenPrefill:
    """One forward's attention when its first ``rows`` tokens are decode rows (one token each,
    attending through their slot-table window) and the rest prefill chunks. Each part writes its
    own K/V before reading; the parts hold different rows and share only full, read-only blocks."""

    def __init__(self, rows: int, decode: WindowAttention, prefill: PackedPrefillAttention) -> None:
        self.rows, self.decode, self.prefill = rows, decode, prefill

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None) -> torch.Tensor:
        n = self.rows
        return torch.cat([self.decode(layer, q[:n], k[:n], v[:n], window=window),
                          self.prefill(layer, q[n:], k[n:], v[n:], window=window)])
