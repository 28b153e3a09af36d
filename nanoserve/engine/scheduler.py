"""Continuous batching: who runs this step, on which row, and who gives way when blocks run out.

A step has a token budget (``max_num_batched_tokens``). Decode rows are served first (one
token each), then prefill chunks fill what is left: the rows still prefilling, in row order,
then new requests, FIFO. A prompt longer than what is left is prefilled over several steps
while the decode rows keep decoding. Without chunking a step is either whole prompts or one
decode step, as before chunking existed.

With prefix caching, the full blocks a chunk will complete are registered when it is scheduled,
so a request admitted after it in the same step adopts them: a burst sharing a system prompt
computes it once, in one step. (The step's forward writes every chunk's K/V of a layer before
any chunk reads its context there.)

Rows are kept a prefix of the slot table in two regions: decoding rows ``0..d-1`` (so every
decode read is a window), then prefilling rows ``d..n-1``. Chunks are handed out in row
order and only the last of them can stop short of its prompt's end, so the rows whose
prefill completes in a step are exactly ``d..d+c-1``: they join the decode region where
they stand. A row that leaves is filled by moving rows (compaction): the last decoding row
into a decode hole, the last row into what is left; the next plan lists the frees and moves.

The scheduler owns the block manager and is its only writer; the worker hears of every change
through the plan.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.cache.block_manager import BlockManager
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.worker.bucketing import Buckets, step_shape
from nanoserve.worker.plan import (
    DecodeBatch,
    DraftRows,
    PrefillChunk,
    RingRestore,
    RingSave,
    RowChange,
    RowFree,
    RowMove,
    RowTrim,
    StepPlan,
)

if TYPE_CHECKING:
    from nanoserve.worker.worker import StepOutput


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_steps: int = 0  # steps with at least one prefill chunk
    decode_steps: int = 0  # steps with decode rows
    prefill_tokens: int = 0  # tokens whose K/V a prefill computed (adopted prefixes excluded)
    decode_tokens: int = 0
    preemptions: int = 0
    compactions: int = 0
    decode_rows_total: int = 0
    max_decode_rows: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0


def check_token_budget(max_batch_size: int, max_num_batched_tokens: int, chunked: bool) -> None:
    """Raise ValueError for a step budget the scheduler cannot plan with."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if chunked and max_num_batched_tokens <= max_batch_size:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} leaves no prefill token once "
                         f"{max_batch_size} rows decode: with chunked prefill it must exceed max_batch_size")


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_batched_tokens: int, chunked: bool = True,
                 prefill_only_budget: int | None = None, buckets: Buckets | None = None) -> None:
        check_token_budget(max_batch_size, max_num_batched_tokens, chunked)
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        # A step with no decode row keeps no stream waiting, so its prefill may take this many
        # tokens (None: the same budget as any step).
        self.prefill_only_budget = max(max_num_batched_tokens, prefill_only_budget or 0)
        self.chunked = chunked
        self.buckets = buckets  # the decode windows a compiled graph was built for (None: exact)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i].row == i; decoding rows first
        self.stats = SchedulerStats()
        # trims, frees and compactions since the last plan, in order
        self._row_changes: list[RowChange] = []
        self._ring_saves: list[Request] = []  # prompts this step ends: their rings are saved after it
        self._registered: list[int] = []

    # -- queue -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if self.blocks.enable_prefix_caching and request.block_hashes is None:
            request.block_hashes = self.blocks.block_hashes()
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_decoding(self) -> int:
        return sum(r.status is RequestStatus.RUNNING for r in self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Make every decision and every allocation of the step, and return it as one plan.

        Decode first (preempting by recompute until every decoding row has its next slot, then
        appending that slot), then prefill chunks in what is left of the budget (chunked; a step
        without decode rows uses ``prefill_only_budget``); without chunking, whole prompts
        first, else one decode step. The worker needs nothing but the plan: it never asks the
        block manager or the scheduler again. None when nothing can run."""
        self._registered = []
        if self.chunked:
            decode = self._schedule_decode()
            budget = self.prefill_only_budget if decode is None else self.max_num_batched_tokens - decode.num_rows
            prefill = self._schedule_prefill(budget)
            while decode is None and not prefill and self.running:
                self._preempt_stuck_prefill()
                prefill = self._schedule_prefill(self.prefill_only_budget)
        else:
            prefill = self._schedule_prefill(self.max_num_batched_tokens)
            decode = None if prefill else self._schedule_decode()
        if decode is None and not prefill:
            return None
        plan = StepPlan(tuple(self._row_changes), decode, tuple(prefill), tuple(self._registered))
        self._row_changes.clear()
        # A prompt ending in this step has its rings saved before anything else changes next
        # step, at the last boundary the same prompt again can adopt (one token is computed).
        for request in self._ring_saves:
            self._save_rings(request.row, request, len(request.prompt_token_ids) - 1)
        self._ring_saves.clear()
        self._count(plan)
        self._check_regions()
        return plan

    def _schedule_decode(self) -> DecodeBatch | None:
        # Preempt by recompute, newest first, until every decoding row can grow by one.
        while len(self.running) > 1 and self.num_decoding and not self.blocks.can_append(range(self.num_decoding)):
            self._preempt(max(self.running, key=lambda r: r.metrics.arrival_time))
        n = self.num_decoding
        if not n:
            return None
        positions, write_slots = self.blocks.advance(range(n))
        requests = self.running[:n]
        proposals, proposal_slots, draft = self._place_proposals(requests, positions)
        most = max(map(len, proposal_slots), default=0)
        rows, width, queries = step_shape(self.buckets, n, max(positions) + 1 + most, 1 + most)
        return DecodeBatch(tuple(r.request_id for r in requests), tuple(range(n)),
                           tuple(r.last_token_id for r in requests), tuple(positions), tuple(write_slots), rows, width,
                           proposals, proposal_slots, queries, draft)

    def _place_proposals(self, requests: list[Request], positions: list[int]
                         ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...], DraftRows | None]:
        """Each decoding row's proposed tokens (``request.spec_tokens``, or ``spec_draft`` tokens
        its draft is to make on the worker; taken here) and the slots they are written to, cut to
        what the row may still emit (max_tokens), the step's token budget, the pool and
        max_model_len. Speculation never preempts: a row the pool cannot extend verifies
        nothing. ((), (), None) when no row verifies; the draft's work when a draft proposes."""
        if not any(r.spec_tokens or r.spec_draft for r in requests):
            return (), (), None
        proposals, slots = [], []
        budget = self.max_num_batched_tokens - len(requests)
        if self.buckets is not None and len(requests) > self.buckets.verify_rows:
            budget = 0  # past the verify grid: plain decode
        drafting = any(r.spec_draft for r in requests)
        for request in requests:
            wanted = request.spec_draft if drafting else len(request.spec_tokens)
            room = request.params.max_tokens - len(request.output_token_ids) - 1  # the verify emits k + 1 at most
            if self.buckets is not None:
                room = min(room, self.buckets.queries[-1] - 1)
            k = max(0, min(wanted, room, budget))
            placed = self.blocks.extend(request.row, k) if k else None
            budget -= len(placed or ())
            proposals.append(tuple(request.spec_tokens[:len(placed or ())]))
            slots.append(tuple(placed or ()))
            request.spec_tokens, request.spec_draft = [], 0
        if not any(slots):
            return (), (), None
        if not drafting:
            return tuple(proposals), tuple(slots), None
        return (), tuple(slots), self._draft_rows(requests, positions, [len(s) for s in slots])

    def _draft_rows(self, requests: list[Request], positions: list[int], counts: list[int]) -> DraftRows:
        """What each drafting row's draft catches up on first: its tokens from the first
        position whose draft K/V it lacks to the one it feeds now, and their slots."""
        tokens, slots = [], []
        for request, position, k in zip(requests, positions, counts):
            start = min(request.draft_computed, position) if k else position
            tokens.append(tuple(request.all_token_ids[start:position]))
            slots.append(tuple(self.blocks.slots_of(request.row, position, start)))
        return DraftRows(tuple(counts), tuple(tokens), tuple(slots))

    def update(self, plan: StepPlan, output: StepOutput) -> None:
        """After the worker ran ``plan``: in a verify step each decode row keeps the K/V of its
        fed token and of the proposals it accepted; the rest go, with the blocks they took."""
        decode = plan.decode
        if decode is None or decode.queries == 1:
            return
        counts = decode.draft.counts if decode.draft is not None else (0,) * decode.num_rows
        for row, position, sampled, k in zip(decode.row_ids, decode.positions, output.rows, counts):
            num_tokens = position + 1 + sampled.accepted
            if k:  # the draft fed the row's token and its first k - 1 proposals
                self.running[row].draft_computed = position + 1 + min(sampled.accepted, k - 1)
            if num_tokens < self.blocks.num_tokens(row):
                self.blocks.truncate(row, num_tokens)
                self._row_changes.append(RowTrim(row, num_tokens))

    def _schedule_prefill(self, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        for request in self.running[self.num_decoding:]:  # rows still prefilling, in row order
            remaining = request.num_tokens - self.blocks.num_tokens(request.row)
            length = min(remaining, budget, self._tokens_that_fit(request.row))
            if length >= 1:
                chunks.append(self._chunk(request, length))
                budget -= length
            if length < remaining:
                # The budget or the pool stopped this row short: no later row may complete
                # before it, or the rows whose prefill ends would not be the first prefilling ones.
                return chunks
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            request = self.waiting[0]
            # Without chunking one prompt larger than the budget still runs, alone.
            if not self.chunked and chunks and request.num_tokens > budget:
                break
            if not self._has_room_for(request):
                break
            self.waiting.popleft()
            self._admit(request)
            remaining = request.num_tokens - self.blocks.num_tokens(request.row)
            length = min(remaining, budget) if self.chunked else remaining
            chunks.append(self._chunk(request, length))
            budget -= length
        return chunks

    def _has_room_for(self, request: Request) -> bool:
        # Room for the whole sequence and its first decode token (less the prefix blocks it
        # would share with running rows), the rest of every prefilling row, and a block of
        # headroom for every running row: admitting into a pool the running rows are about to
        # need only buys a preemption (and a recompute) on a later step. (This step's decode
        # rows already hold their blocks.)
        reserved = sum(self.blocks.blocks_needed(r.num_tokens - self.blocks.num_tokens(r.row) + 1, r.row)
                       for r in self.running[self.num_decoding:])
        tokens = request.all_token_ids
        admit = self.blocks.blocks_to_admit(tokens, adopt=_adopts_prefix(request), hashes=_hashes(request, tokens))
        return admit + reserved + len(self.running) <= self.blocks.pool.num_free

    def _tokens_that_fit(self, row: int) -> int:
        """Tokens the row can grow by now: the rest of its last block, then whole free blocks."""
        slack = -self.blocks.num_tokens(row) % self.blocks.block_size
        return slack + self.blocks.pool.num_free * self.blocks.block_size

    def _admit(self, request: Request) -> None:
        row = len(self.running)
        if _adopts_prefix(request):  # else its first chunk claims the row
            tokens = request.all_token_ids
            hashes = _hashes(request, tokens)
            slot = self.blocks.ring_to_restore(hashes, self.blocks.claim_prefix(row, tokens, hashes))
            if slot is not None:  # the window layers' last positions of the prefix come back too
                self._row_changes.append(RingRestore(slot, row))
        request.row = row
        request.draft_computed = 0  # a draft catches up on what it adopts: a prefill writes the target's K/V alone
        request.status = RequestStatus.PREFILLING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.perf_counter()
        self.running.append(request)

    def _chunk(self, request: Request, length: int) -> PrefillChunk:
        start = self.blocks.num_tokens(request.row)  # the row's K/V: adopted or computed
        end = start + length
        self.blocks.grow(request.row, length)
        tokens = request.all_token_ids
        # Findable from now on: this step's forward writes them before anything reads them.
        self._registered += self.blocks.cache_full_blocks(request.row, tokens[:end], _hashes(request, tokens))
        is_last = end == request.num_tokens
        if is_last:  # it decodes from the next step on; its row is the first prefilling one
            request.status = RequestStatus.RUNNING
            if self.blocks.snapshots is not None and end == len(request.prompt_token_ids):
                self._ring_saves.append(request)
        chunk = PrefillChunk(request.request_id, request.row, start, tuple(tokens[start:end]),
                             tuple(self.blocks.slots_of(request.row, end)), is_last)
        if request.params.pooling in ("last", "mean", "cls"):
            chunk = dataclasses.replace(chunk, pool=request.params.pooling)
        if _scores(request, start):  # position p's logits score prompt token p + 1
            prompt = request.prompt_token_ids
            targets = tuple(prompt[start + 1:min(end, len(prompt) - 1) + 1])
            chunk = dataclasses.replace(chunk, score_top=request.params.prompt_logprobs, score_targets=targets)
        return chunk

    def _count(self, plan: StepPlan) -> None:
        s = self.stats
        s.steps += 1
        if plan.prefill:
            s.prefill_steps += 1
            s.prefill_tokens += sum(chunk.length for chunk in plan.prefill)
        if plan.decode is not None:
            n = plan.decode.num_rows
            s.decode_steps += 1
            s.decode_tokens += n
            s.decode_rows_total += n
            s.max_decode_rows = max(s.max_decode_rows, n)

    def _check_regions(self) -> None:
        """Engine fault if rows are not [decoding..., prefilling...] with running[i].row == i."""
        d = self.num_decoding
        bad = [i for i, r in enumerate(self.running)
               if r.row != i or (r.status is RequestStatus.RUNNING) != (i < d)]
        if bad:
            states = [(r.request_id, r.row, r.status.value) for r in self.running]
            raise RuntimeError(f"scheduler rows out of order at {bad}: decoding rows must be 0..{d - 1} "
                               f"and prefilling rows after them; running = {states}")

    # -- giving way --------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self._release(victim)
        victim.spec_tokens, victim.spec_draft, victim.draft_computed = [], 0, 0
        victim.status = RequestStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _preempt_stuck_prefill(self) -> None:
        # Nothing could run: prefilling rows hold the pool and none can grow. The newest gives way.
        if len(self.running) == 1:
            only = self.running[0]
            raise RuntimeError(f"request {only.request_id} alone on the pool cannot prefill its next chunk "
                               f"({self.blocks.num_tokens(only.row)}/{only.num_tokens} tokens computed, "
                               f"{self.blocks.pool.num_free} blocks free)")
        self._preempt(max(self.running, key=lambda r: r.metrics.arrival_time))

    # -- leaving -----------------------------------------------------------------------------
    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request wherever it is; its blocks and row go back at once."""
        if request.finished:
            return
        if request.row is not None:
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        request.metrics.finish_time = time.perf_counter()
        counter = {"abort": "aborted", "error": "failed"}.get(reason, "finished")
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _release(self, request: Request) -> None:
        row, decoding = request.row, self.num_decoding
        # Its K/V stays findable (with prefix caching): a later turn or a recompute adopts it.
        tokens = request.all_token_ids
        self.blocks.cache_full_blocks(row, tokens[:self.blocks.num_tokens(row)], _hashes(request, tokens))
        self._save_rings(row, request, self.blocks.num_tokens(row))
        self.blocks.free(row)
        self._row_changes.append(RowFree(row))
        hole = row
        if row < decoding - 1:  # the last decoding row fills a decode hole
            self._move(decoding - 1, hole)
            hole = decoding - 1
        last = len(self.running) - 1
        if hole != last:  # the last row fills what is left, so rows stay a prefix
            self._move(last, hole)
        self.running.pop()
        request.row = None

    def _save_rings(self, row: int, request: Request, num_tokens: int) -> None:
        """With ring snapshots: the row's window rings, holding its first ``num_tokens`` tokens,
        are saved at the last block boundary among them (a later row adopting that prefix
        restores them)."""
        if self.blocks.snapshots is None or request.block_hashes is None:
            return
        tokens = request.all_token_ids[:num_tokens]
        saved = self.blocks.ring_to_save(_hashes(request, tokens), num_tokens)
        if saved is not None:
            self._row_changes.append(RingSave(row, *saved))

    def _move(self, src: int, dst: int) -> None:
        mover = self.running[src]
        self._row_changes.append(RowMove(src, dst, self.blocks.num_tokens(src)))
        self.blocks.move(src, dst)
        mover.row = dst
        self.running[dst] = mover
        self.stats.compactions += 1


def _adopts_prefix(request: Request) -> bool:
    """Whether a request adopts its longest cached prefix on admission. One that scores its
    prompt, or pools over it (mean, cls), needs every prompt token's hidden state (the first
    one's), so it adopts nothing: its prompt is computed whole (its blocks are still cached for
    others). Last-token pooling and rank need only the last position, always computed."""
    return request.params.prompt_logprobs is None and request.params.pooling not in ("mean", "cls")


def _hashes(request: Request, tokens: list[int]):
    """The request's block hashes over `tokens` (its own), each block hashed once; None without prefix caching."""
    return None if request.block_hashes is None else request.block_hashes.update(tokens)


def _scores(request: Request, start: int) -> bool:
    """Whether a chunk from `start` covers prompt positions still to be scored (the first
    prefill scores; a recompute after preemption finds the scores already made)."""
    if request.params.prompt_logprobs is None:
        return False
    scored = 0 if request.prompt_logprobs is None else len(request.prompt_logprobs)
    return scored < len(request.prompt_token_ids) and start < len(request.prompt_token_ids)
