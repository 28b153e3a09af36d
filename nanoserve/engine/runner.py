"""Executes a scheduled step: packed prefill chunks (eager) and the fixed-shape decode step.

An eager step with both decode rows and prefill chunks runs them as one forward (the decode
rows' tokens first, then the chunks'), so every layer's weights are read once a step; each
part keeps its own attention. A compiled decode step runs its fixed-shape graph and the chunks
in an eager forward beside it."""

from __future__ import annotations

import itertools
import time

import torch

from nanoserve.cache.gates import check_mapping_is_window
from nanoserve.engine.attention import ChunkContext, PackedPrefillAttention
from nanoserve.engine.decode import DecodeStep, WindowAttention
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import PrefillChunk


class ModelRunner:
    """Runs prefill eagerly and decode through ``DecodeStep``. Each row's last sampled token
    is written back on the device into the decode step's input buffer, so a decode step reads
    its input ids without building them on the host."""

    def __init__(self, model, cache, decode_step: DecodeStep, device: torch.device | str) -> None:
        self.model = model
        self.cache = cache
        self.decode_step = decode_step
        self.device = torch.device(device)
        self.last_forward_seconds = 0.0  # the decode forward alone, for the host-overhead figure

    @property
    def folds_decode(self) -> bool:
        """Whether decode rows run inside the prefill forward (``prefill(chunks, decode=n)``)."""
        return not self.decode_step.compiled

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk], keep_hidden: frozenset[int] = frozenset(), decode: int = 0
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Write the chunks' K/V and return logits at the last token of each chunk that ends
        its request's prefill (in chunk order), and for the chunk indices in ``keep_hidden`` the
        final hidden states of that chunk's tokens. With ``decode=n`` (eager only) the same
        forward also decodes rows 0..n-1, whose logits come first: [n + last chunks, vocab]."""
        lengths = [c.length for c in chunks]
        token_ids = torch.tensor([t for c in chunks for t in c.request.all_token_ids[c.start:c.end]],
                                 device=self.device)
        positions = torch.cat([torch.arange(c.start, c.end, device=self.device) for c in chunks])
        write_slots = torch.cat([c.write_slots for c in chunks]).to(self.device)
        slots = self.cache.slot_table.slots
        contexts = [ChunkContext(c.start, c.length, slots[c.request.row, :c.end] if c.start else None)
                    for c in chunks]
        attention = PackedPrefillAttention(self.cache, write_slots, contexts)
        if decode:
            if not self.folds_decode:
                raise RuntimeError("a compiled decode step runs in its own graph, not inside a prefill forward")
            plan = self.cache.plan_decode(decode)
            window = WindowAttention(self.cache.k_caches, self.cache.v_caches, plan.write_slots,
                                     plan.slot_mapping, plan.context_lens, self.decode_step.attention_kernel)
            attention = DecodeThenPrefill(decode, window, attention)
            token_ids = torch.cat([self.decode_step.input_ids[:decode], token_ids])
            positions = torch.cat([plan.positions, positions])
        hidden = self.model(token_ids, positions, attention)
        ends = [decode + end for end in itertools.accumulate(lengths)]
        kept = {i: hidden[ends[i] - lengths[i]:ends[i]] for i in keep_hidden}
        last = torch.tensor([*range(decode), *(end - 1 for end, c in zip(ends, chunks) if c.is_last)],
                            dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, last)), kept

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> torch.Tensor:
        """Logits [len(requests), vocab]: one new token for each of rows 0..n-1."""
        num_rows = len(requests)
        plan = self.cache.plan_decode(num_rows)
        if self.decode_step.compiled:
            # The capture gate: a graph reads the table's own buffer, so the rows must be a
            # prefix; a gather here is the scheduler's fault and is refused, not run.
            check_mapping_is_window(plan, self.cache.slot_table)
        started = time.perf_counter()
        logits = self.decode_step.run(num_rows, plan.width, plan.total_context, plan.write_slots,
                                      plan.positions, plan.context_lens)
        self.last_forward_seconds = time.perf_counter() - started
        return logits

    def record_tokens(self, first_row: int, token_ids: torch.Tensor) -> None:
        """Rows first_row.. (a contiguous run, as the scheduler hands them out) sampled these."""
        self.decode_step.input_ids[first_row:first_row + token_ids.numel()].copy_(token_ids)

    def move_row(self, src: int, dst: int) -> None:
        self.decode_step.move_row(src, dst)


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
