"""The draft model: a second, smaller model (or the target's own file in a cheaper weight
format) that makes a verify step's proposals on the worker, just before the target verifies them.

Its layers are more per-layer K/V tensors over the target's pool: the same slots and the same
slot table, addressed by the scheduler's block tables (a position's draft K/V sits at the slot
of its target K/V). So it keeps no pool, rows or block tables of its own: the scheduler plans
its work in the step (``DraftRows``: how many tokens each decode row drafts, and what its draft
K/V lacks) and reserves the slots its proposals take, which the verify then writes again.

A step's draft first catches up on each drafting row's tokens its K/V lacks (a prompt in eager
prefill chunks; the one token a fully accepted verify leaves, in the first compiled step, shaped
like a verify, beside the row's own token), then decodes k - 1 more. The decode rows are its rows, so its
compiled graphs read windows of the shared table; a row not drafting (or past its own k) feeds
its last planned slot again, whose draft K/V no row counts as computed. The draft leaves each
row's length in the table where the target's plan expects it.

A greedy row's draft proposes its argmax; a sampling row's draft samples its own processed
distribution with the row's generator, which acceptance divides by as q.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanoserve.speculative.config import SpeculativeConfig
from nanoserve.worker.attention import decode_attention_kernel
from nanoserve.worker.bucketing import Buckets, step_shape
from nanoserve.worker.build import WorkerConfig, build_worker
from nanoserve.worker.plan import DecodeBatch, PrefillChunk, StepPlan
from nanoserve.worker.sampler import Sampler, inverse_cdf_draw
from nanoserve.worker.worker import Worker

if TYPE_CHECKING:
    from nanoserve.model.quant.weight_plan import WeightPlan
    from nanoserve.worker.sampling import RowSampling

PREFILL_CHUNK = 512  # tokens of a catch-up prefill per row and forward: a prompt's K/V, chunk by chunk


@dataclass
class DraftCost:
    """What a step's drafting took: all of it (``seconds``), and its compiled-shape steps alone
    (``step_seconds`` over ``steps``: what one more drafted token costs; a catch-up prefill is
    paid once)."""

    seconds: float = 0.0
    step_seconds: float = 0.0
    steps: int = 0


@dataclass
class _Feed:
    """One draft forward's input for one row: tokens at consecutive positions from ``position``,
    written to ``slots``."""

    tokens: list[int]
    position: int
    slots: list[int]


class Draft:
    """The draft model's worker (its model, its K/V layers over the target's slots and table,
    its decode graphs) and how it proposes."""

    def __init__(self, worker: Worker, buckets: Buckets | None) -> None:
        self.worker, self.buckets = worker, buckets
        self.sampler = Sampler()

    def close(self) -> None:
        self.worker.close()

    @torch.inference_mode()
    def propose(self, batch: DecodeBatch, rows: list[RowSampling]
                ) -> tuple[tuple[tuple[int, ...], ...], list[torch.Tensor | None], DraftCost]:
        """The proposals of ``batch``'s drafting rows (``batch.draft.counts[i]`` tokens each),
        the law each sampling row drew them from ([k, vocab], None for a greedy row), and the
        cost. ``rows``: the decode rows' sampling, in row order."""
        work, n = batch.draft, batch.num_rows
        cost = DraftCost()
        started = time.perf_counter()
        tails = self._catch_up(batch)
        # The first forward: each drafting row's last catch-up token(s) and its own token.
        feeds = []
        for i in range(n):
            if work.counts[i]:
                tail = tails[i]
                feeds.append(_Feed([*work.tokens[i][len(work.tokens[i]) - tail:], batch.token_ids[i]],
                                   batch.positions[i] - tail,
                                   [*work.slots[i][len(work.slots[i]) - tail:], batch.write_slots[i]]))
            else:
                feeds.append(self._idle(batch, i))
        logits = self._step(batch, feeds, cost)
        drafted: list[list[int]] = [[] for _ in range(n)]
        dists: list[list[torch.Tensor]] = [[] for _ in range(n)]
        steps = max(work.counts)
        for step in range(steps):
            tokens, q = self._choose(logits, rows, drafted, [step < k for k in work.counts])
            for i, token in enumerate(tokens):
                if step < work.counts[i]:
                    drafted[i].append(token)
                    if q is not None and q[i] is not None:
                        dists[i].append(q[i])
            if step == steps - 1:
                break
            feeds = [_Feed([drafted[i][step]], batch.positions[i] + 1 + step, [batch.proposal_slots[i][step]])
                     if step + 1 < work.counts[i] else self._idle(batch, i) for i in range(n)]
            logits = self._step(batch, feeds, cost)
        table = self.worker.cache.slot_table
        for row, position in zip(batch.row_ids, batch.positions):
            table.trim(row, position)  # what the target's plan expects the row to hold
        cost.seconds = time.perf_counter() - started
        return (tuple(tuple(d) for d in drafted),
                [torch.stack(d) if d else None for d in dists], cost)

    def _idle(self, batch: DecodeBatch, i: int) -> _Feed:
        """A row with nothing to draft in this forward feeds its last planned slot again: the
        verify writes the target's K/V there after, and no row counts its draft K/V as held."""
        k = batch.draft.counts[i]
        return _Feed([batch.token_ids[i]], batch.positions[i] + k, [batch.row_slots(i)[k]])

    def _catch_up(self, batch: DecodeBatch) -> list[int]:
        """Eager prefill chunks over each drafting row's catch-up tokens where it has more than
        one (a prompt, or a row that did not draft for a while); returns how many each row has
        left for the first step (0, or the one a verify step's last proposal leaves)."""
        work = batch.draft
        table = self.worker.cache.slot_table
        done = [0] * batch.num_rows  # catch-up tokens fed so far, per row
        while True:
            chunks = []
            for i, row in enumerate(batch.row_ids):
                tokens = work.tokens[i]
                end = min(len(tokens), done[i] + PREFILL_CHUNK)
                if not work.counts[i] or len(tokens) < 2 or end <= done[i]:
                    continue
                start = batch.positions[i] - len(tokens) + done[i]
                context = table.slots[row, :start].tolist()  # the target's cells: [0, start) are its own
                chunks.append(PrefillChunk(batch.request_ids[i], row, start, tuple(tokens[done[i]:end]),
                                           (*context, *work.slots[i][done[i]:end]), is_last=False))
                done[i] = end
            if not chunks:
                return [len(t) - d if k else 0 for t, d, k in zip(work.tokens, done, work.counts)]
            self.worker.forward(StepPlan((), None, tuple(chunks)))

    def _step(self, batch: DecodeBatch, feeds: list[_Feed], cost: DraftCost) -> torch.Tensor:
        """One draft forward over the decode rows; the logits at each row's last fed token."""
        n = len(feeds)
        table = self.worker.cache.slot_table
        for row, feed in zip(batch.row_ids, feeds):
            table.trim(row, feed.position)  # a row feeds at its length (an idle row again at its last slot)
        most = max(len(f.tokens) for f in feeds)
        rows, width, queries = step_shape(self.buckets, n, max(f.position + len(f.tokens) for f in feeds), most)
        verify = queries > 1
        step = DecodeBatch(batch.request_ids, batch.row_ids, tuple(f.tokens[0] for f in feeds),
                           tuple(f.position for f in feeds), tuple(f.slots[0] for f in feeds), rows, width,
                           tuple(tuple(f.tokens[1:]) for f in feeds) if verify else (),
                           tuple(tuple(f.slots[1:]) for f in feeds) if verify else (), queries)
        started = time.perf_counter()
        logits = self.worker.forward(StepPlan((), step, ())).logits
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize(self.worker.device)
        cost.step_seconds += time.perf_counter() - started
        cost.steps += 1
        if queries == 1:
            return logits
        last = torch.tensor([len(f.tokens) for f in feeds]).cumsum(0).sub(1)
        return logits.index_select(0, last.to(logits.device))

    def _choose(self, logits: torch.Tensor, rows: list[RowSampling], drafted: list[list[int]], wanted: list[bool]
                ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """The draft's next token per row: the argmax for a greedy row, else a draw from its own
        distribution (returned as q: what acceptance divides by). A row not drafting now takes
        the argmax: it draws nothing, so a seeded row's generator advances by its own proposals
        alone, whatever shares the batch."""
        logits = logits.float()
        if all(r.params.greedy for r in rows):
            return logits.argmax(dim=-1).tolist(), None
        histories = [(r.history[0], r.history[1] + d) for r, d in zip(rows, drafted)] \
            if any(r.params.uses_penalties for r in rows) else None
        _, probs = self.sampler.distribution(logits, [r.params for r in rows], histories)
        tokens, q = [], []
        for i, row in enumerate(rows):
            if row.params.greedy or not wanted[i]:
                tokens.append(int(logits[i].argmax()))
                q.append(None)
                continue
            tokens.append(int(inverse_cdf_draw(probs[i:i + 1], [row.generator])[0]))
            q.append(probs[i].cpu())
        return tokens, q


def draft_buckets(config: SpeculativeConfig, target_spec: WorkerConfig, head_dim: int, tier: str | None,
                  dtype: torch.dtype) -> Buckets | None:
    """The draft's decode grid: the target's row buckets below ``disable_by_batch_size`` (the
    steps that speculate), its widths (one, where the kernel reads each row's own cells), and
    1- and 2-token steps."""
    if target_spec.buckets is None:
        return None
    rows = config.most_rows(target_spec.max_batch_size)
    row_buckets = tuple(r for r in target_spec.buckets.rows if r < rows) + (rows,)
    widths = target_spec.buckets.widths
    if decode_attention_kernel(target_spec.device, dtype, head_dim, tier, target_spec.kv_cache_types) is not None:
        widths = (target_spec.max_model_len,)  # the kernel reads each row's own cells: one width
    return Buckets(tuple(sorted(set(row_buckets))), widths, (1, 2), rows)


def build_draft(config: SpeculativeConfig, source, plan: WeightPlan | None, dtype: torch.dtype, head_dim: int,
                target_spec: WorkerConfig, target_vocab: int, target: Worker) -> Draft:
    """The draft for the speculative ``config``: ``source`` (a path, or a LlamaModel used as it
    is where ``plan`` is None; its heads ``head_dim`` wide) held in ``plan`` / ``dtype``, its K/V
    layers over the pool and slot table of ``target``, built with ``target_spec`` (so with the
    target's row count: its graphs read windows of that table; under tensor parallelism, rank
    0's worker)."""
    tier = plan.tier if plan is not None else None
    buckets = draft_buckets(config, target_spec, head_dim, tier, dtype)
    spec = dataclasses.replace(target_spec, weights=plan, dtype=dtype, buckets=buckets, attention_tier=tier,
                               max_queries=2, window_ring=None, ring_snapshots=0)
    worker = build_worker(source, spec, slot_table=target.cache.slot_table)
    vocab = worker.model.config.vocab_size
    if vocab != target_vocab:
        worker.close()
        raise ValueError(f"speculative draft model has a vocabulary of {vocab} tokens, the target {target_vocab}: "
                         "a draft must share the target's tokenizer")
    return Draft(worker, buckets)
