"""The worker: a model, its K/V cache and its decode step, applying step plans on the device.

``execute(plan, sampling)`` is the whole interface: the plan is all the worker is told about the
batch (it never reads the scheduler or its block manager), ``sampling`` what choosing each
sampled row's tokens needs, and ``StepOutput`` all it answers: tokens, never logits. An eager
step with both decode rows and prefill chunks runs them as one forward (the decode rows' tokens
first, then the chunks'), so every layer's weights are read once a step; each part keeps its own
attention. A compiled decode step runs its fixed-shape graph and the chunks in an eager forward
beside it. A verify step whose proposals a draft model makes has them drafted here first, by
the draft this worker holds (speculative/draft.py: its K/V in this worker's pool). A
tensor-parallel rank is one worker applying the same plans; rank 0's samples (and drafts).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoserve.cache.blocks import BlockTable
from nanoserve.worker.attention import (
    ChunkContext,
    DecodeThenPrefill,
    PackedPrefillAttention,
    WindowAttention,
)
from nanoserve.worker.decode_step import DecodeStats, DecodeStep
from nanoserve.worker.gates import (
    check_decode_follows,
    check_mapping_is_window,
    check_slots_agree,
    check_window_intact,
)
from nanoserve.worker.kv_cache import DecodePlan, KVCache
from nanoserve.worker.plan import PrefillChunk, RingSave, RowChange, RowFree, RowMove, RowTrim, StepPlan
from nanoserve.worker.sampler import Sampler
from nanoserve.worker.sampling import SampledRow, StepSampling, sample_step
from nanoserve.worker.scoring import TokenLogprobs, score_prompt

if TYPE_CHECKING:
    from nanoserve.speculative.draft import Draft, DraftCost


@dataclass
class ForwardOutput:
    """A forward's results: logits [len(plan.sampled), vocab], in the plan's ``sampled`` order
    (a verifying row's 1 + k in a run); each scoring chunk's prompt logprobs (by chunk index: one
    per ``score_targets``), or why its scoring failed; the decode rows' addressing, for the gates
    that check it against the block tables; each pooling chunk's part, by chunk index."""

    logits: torch.Tensor
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_errors: dict[int, str] = field(default_factory=dict)
    decode: DecodePlan | None = None
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # by chunk index: PrefillChunk.pool's part


@dataclass
class StepOutput:
    """A step's answer: one ``SampledRow`` per ``plan.sampled`` row (none on a rank that does not
    sample), the forward's prompt logprobs, addressing and pooled parts (``ForwardOutput``), and
    the step's own price: its forward's seconds (the device synchronised), and the graphs built
    and decode steps run eagerly for want of one while it ran."""

    rows: list[SampledRow]
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_errors: dict[int, str] = field(default_factory=dict)
    decode: DecodePlan | None = None
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    graphs_built: int = 0
    eager_steps: int = 0
    draft: DraftCost | None = None  # what the draft model's proposals took, when it made them


@dataclass
class WorkerStats:
    """What ``EngineStats`` reports of the worker: its decode step's counters and graphs, the
    slot table's window and gather reads, its K/V bytes, and its draft model's own (None
    without one)."""

    decode: DecodeStats
    graphs_built: int
    graphs_ready: int
    graphs_building: int
    graphs_pending: int
    windows: int
    gathers: int
    kv_bytes: int = 0
    draft: WorkerStats | None = None


class Worker:
    """Built from a model, its ``KVCache`` and its ``DecodeStep`` (``build_worker``). With
    ``checks`` the device-side gates run on every plan (nanoserve.worker.gates)."""

    def __init__(self, model, cache: KVCache, decode_step: DecodeStep, checks: bool = False) -> None:
        self.model, self.cache, self.decode_step = model, cache, decode_step
        self.device = cache.device
        self.checks = checks
        self.sampler = Sampler()
        self.draft: Draft | None = None  # a draft model proposing on this worker (speculative/draft.py)

    def close(self) -> None:
        """Stop the decode step's background graph builder (a tensor-parallel worker also stops
        its ranks), and the draft's."""
        if self.draft is not None:
            self.draft.close()
        self.decode_step.close()

    @torch.inference_mode()
    def propose(self, plan: StepPlan, sampling: StepSampling | None
                ) -> tuple[StepPlan, StepSampling | None, DraftCost | None]:
        """Where the plan's proposals are this worker's draft's to make: the plan's row changes
        applied, the draft run, and the plan to run now (its proposals filled, its row changes
        done) with the sampling that verifies them (each drafting row's law q); else as given."""
        decode = plan.decode
        if self.draft is None or decode is None or decode.draft is None or decode.proposals:
            return plan, sampling, None
        if sampling is None:
            raise RuntimeError("a draft proposes on the rank that samples: this worker was given no sampling")
        self._apply(plan.row_changes)
        n = decode.num_rows
        proposals, laws, cost = self.draft.propose(decode, sampling.rows[:n])
        rows = [dataclasses.replace(r, draft_probs=q) for r, q in zip(sampling.rows[:n], laws)] + sampling.rows[n:]
        filled = dataclasses.replace(plan, row_changes=(), decode=dataclasses.replace(decode, proposals=proposals))
        return filled, StepSampling(rows, sampling.masks), cost

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sampling: StepSampling | None = None) -> StepOutput:
        """Run the plan's forward (its proposals drafted first, where the draft makes them),
        then choose every sampled row's tokens (worker/sampling.py) under the step's masks,
        waited for only now: they are filled beside the forward. Without ``sampling`` (a
        tensor-parallel rank past 0) the forward alone runs."""
        plan, sampling, drafted = self.propose(plan, sampling)
        step = self.decode_step
        built, eager = step.graphs_built, step.stats.eager_steps
        start = time.perf_counter()
        forward = self.forward(plan)
        if self.device.type == "cuda":  # an asynchronous device: the step is priced by its work, not its dispatch
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        rows = []
        if sampling is not None:
            masks = sampling.masks.wait() if sampling.masks is not None else None
            rows = sample_step(self.sampler, plan, forward.logits, sampling, masks)
        return StepOutput(rows, forward.prompt_logprobs, forward.prompt_errors, forward.decode, forward.pooled,
                          seconds, step.graphs_built - built, step.stats.eager_steps - eager, drafted)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> ForwardOutput:
        """Apply the plan in order (row changes, the decode rows' cells and buffers, the chunks'
        cells) and run its forward(s); the logits stay on the device (a draft model chooses
        from them itself)."""
        self._apply(plan.row_changes)
        decode = None
        if plan.decode is not None:
            if self.checks:
                check_decode_follows(plan.decode, self.cache.slot_table)
            decode = self.cache.plan_decode(plan.decode)
            self.decode_step.load(decode, plan.decode.rows)
        logits, scored, errors, pooled = [], {}, {}, {}
        graph = decode is not None and self.decode_step.runs_graph(plan.decode.rows, decode.width, decode.queries)
        together = decode is not None and not graph and plan.prefill  # one eager forward
        if decode is not None and not together:
            if graph:
                # The capture gate: a graph reads the table's own buffer, so the rows must be a
                # window of it; anything else is refused, not run.
                check_mapping_is_window(decode, self.cache.slot_table)
            logits.append(self.decode_step.run(decode, plan.decode.rows))
        if plan.prefill:
            logits.append(self._prefill(plan.prefill, decode if together else None, scored, errors, pooled))
        if self.checks and decode is not None:
            check_window_intact(decode)
        return ForwardOutput(torch.cat(logits) if len(logits) > 1 else logits[0], scored, errors, decode, pooled)

    def _apply(self, changes: tuple[RowChange, ...]) -> None:
        """The plan's row changes, in order."""
        for change in changes:
            if isinstance(change, RowMove):
                self.cache.move(change.src, change.dst, change.length)
            elif isinstance(change, RowFree):
                self.cache.free(change.row)
            elif isinstance(change, RowTrim):
                self.cache.trim(change.row, change.length)
            elif isinstance(change, RingSave):
                self.cache.save_rings(change.row, change.slot)
            else:
                self.cache.restore_rings(change.slot, change.row)

    def stats(self) -> WorkerStats:
        """The decode step's counters and graphs (graphs a background builder finished swapped in
        first), the slot table's reads, the K/V bytes, and the draft's own."""
        step, table = self.decode_step, self.cache.slot_table
        step.poll()
        ready, building, pending = step.graph_counts()
        return WorkerStats(step.stats, step.graphs_built, ready, building, pending, table.windows, table.gathers,
                           self.cache.kv_bytes, self.draft.worker.stats() if self.draft is not None else None)

    def check_slots(self, tables: Sequence[BlockTable], rows: Sequence[int]) -> None:
        """The debug gate after a step: the slot table equals the host's block ``tables`` on ``rows``."""
        check_slots_agree(self.cache.slot_table, tables, rows)

    def _prefill(self, chunks: tuple[PrefillChunk, ...], decode: DecodePlan | None,
                 scored: dict[int, list[TokenLogprobs]], errors: dict[int, str],
                 pooled: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Write the chunks' K/V and score the chunks that ask for it (into ``scored``, or why not
        into ``errors``, by chunk index); return logits at the last token of each chunk that ends
        its request's prefill (in chunk order). With ``decode`` (eager) the same forward also
        decodes its rows, whose logits come first."""
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)
        positions = torch.cat([torch.arange(c.start, c.end, device=self.device) for c in chunks])
        write_slots, contexts = [], []
        for c in chunks:
            slots = torch.tensor(c.slots, dtype=torch.long, device=self.device)
            self.cache.adopt(c.row, slots)
            write_slots.append(slots[c.start:])
            contexts.append(ChunkContext(c.start, c.length, slots if c.start else None, c.row))
        attention = PackedPrefillAttention(self.cache, torch.cat(write_slots), contexts)
        rows = 0
        decode_logits = None
        if decode is not None:
            fed, at, slots, lens = decode.query_inputs or (decode.token_ids, decode.positions, decode.write_slots,
                                                           decode.context_lens)
            rows = fed.shape[0]
            window = WindowAttention(self.cache.layers, slots, decode.slot_mapping, lens,
                                     self.decode_step.attention_kernel, self.cache.ring_addressing(decode, at, lens))
            attention = DecodeThenPrefill(rows, window, attention)
            token_ids = torch.cat([fed, token_ids])
            positions = torch.cat([at, positions])
            decode_logits = decode.real_queries if decode.real_queries is not None else torch.arange(rows)
        hidden = self.model(token_ids, positions, attention)
        ends = [rows + end for end in itertools.accumulate(c.length for c in chunks)]
        for i, c in enumerate(chunks):
            if c.score_top is not None:
                # The request's own work: a failure fails that request alone, so it is reported, not raised.
                try:
                    scored[i] = score_prompt(self.model, hidden[ends[i] - c.length:ends[i]], c.score_targets,
                                             c.score_top)
                except Exception as exc:
                    errors[i] = f"prompt scoring failed: {type(exc).__name__}: {exc}"
            if c.pool is not None and pooled is not None:
                part = _pool_part(c, hidden[ends[i] - c.length:ends[i]])
                if part is not None:
                    pooled[i] = part
        last = torch.tensor([end - 1 for end, c in zip(ends, chunks) if c.is_last], dtype=torch.long)
        if decode_logits is not None:
            last = torch.cat([decode_logits.cpu(), last])
        last = last.to(self.device)
        return self.model.compute_logits(hidden.index_select(0, last))


def _pool_part(chunk: PrefillChunk, hidden: torch.Tensor) -> torch.Tensor | None:
    """The chunk's part of its request's pooled hidden state (float32, on the host), or None."""
    if chunk.pool == "mean":
        return hidden.float().sum(0).cpu()
    if chunk.pool == "cls":
        return hidden[0].float().cpu() if chunk.start == 0 else None
    return hidden[-1].float().cpu() if chunk.is_last else None
