"""Continuous batching: who runs this step, on which row, and who gives way when blocks run out.

Rows are kept a prefix ``0..n-1`` of the slot table (the running list is indexed by row), so
every decode read is a window: admission takes row ``n``, and a row that leaves from the
middle is filled by moving the last row into the hole (compaction, through the cache's
``move_row``, which resyncs the slot table).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.engine.request import Request, RequestStatus


@dataclass
class PrefillBatch:
    requests: list[Request]
    write_slots: list[torch.Tensor]  # per request, where its tokens' K/V go


@dataclass
class DecodeBatch:
    requests: list[Request]  # requests[i].row == i


@dataclass
class SchedulerStats:
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    compactions: int = 0
    decode_rows_total: int = 0
    max_decode_rows: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0


class Scheduler:
    def __init__(self, cache, max_batch_size: int, max_num_batched_tokens: int,
                 on_row_move: Callable[[int, int], None] | None = None) -> None:
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_row_move = on_row_move
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i].row == i
        self.stats = SchedulerStats()

    # -- queue -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> PrefillBatch | DecodeBatch | None:
        """Prefill first (new or preempted requests), else one decode step for every row."""
        prefill = self._admit()
        if prefill.requests:
            self.stats.prefill_steps += 1
            self.stats.prefill_tokens += sum(r.num_tokens for r in prefill.requests)
            return prefill
        if not self.running:
            return None
        self._make_room_for_one_token_per_row()
        n = len(self.running)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += n
        self.stats.decode_rows_total += n
        self.stats.max_decode_rows = max(self.stats.max_decode_rows, n)
        return DecodeBatch(list(self.running))

    def _admit(self) -> PrefillBatch:
        batch = PrefillBatch([], [])
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            need = request.num_tokens
            # One request larger than the budget still runs alone; otherwise respect it.
            if batch.requests and need > budget:
                break
            # Room for the prompt and its first decode token, plus a block of headroom for
            # every running row: admitting into a pool the running rows are about to need
            # only buys a preemption (and a recompute) on the next decode step.
            headroom = len(self.running) + len(batch.requests)
            if self.cache.blocks_needed(need + 1) + headroom > self.cache.pool.num_free:
                break
            self.waiting.popleft()
            row = len(self.running)
            batch.write_slots.append(self.cache.allocate_prompt(row, need))
            request.row = row
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(request)
            batch.requests.append(request)
            budget -= need
        return batch

    def _make_room_for_one_token_per_row(self) -> None:
        # Preempt by recompute, newest first, until every remaining row can grow by one.
        while len(self.running) > 1 and not self.cache.can_append(range(len(self.running))):
            victim = max(self.running, key=lambda r: r.metrics.arrival_time)
            self._release(victim)
            victim.status = RequestStatus.WAITING
            victim.metrics.num_preemptions += 1
            self.waiting.appendleft(victim)
            self.stats.preemptions += 1

    # -- leaving -----------------------------------------------------------------------------
    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request wherever it is; its blocks and row go back at once."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
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
        row = request.row
        self.cache.free(row)
        last = len(self.running) - 1
        if row != last:  # compaction: the last row fills the hole, so rows stay a prefix
            mover = self.running[last]
            self.cache.move_row(last, row)
            if self.on_row_move is not None:
                self.on_row_move(last, row)
            mover.row = row
            self.running[row] = mover
            self.stats.compactions += 1
        self.running.pop()
        request.row = None
