"""The step plan: everything one step does, decided and allocated by the scheduler, as plain data.

A plan holds ints, strings and tuples only (no tensors, no cache, no requests), so it can be
copied, pickled and sent to another process. It is the only thing the scheduler tells the
worker, which applies it in one direction: row changes (frees, moves), then the decode rows'
write cells, then each chunk's slots, then the forward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowMove:
    """Compaction: the request on row ``src`` now lives on row ``dst``, with ``length`` cells."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class RowTrim:
    """The request on ``row`` keeps its first ``length`` cells: speculative tokens past them
    were rejected, so their K/V (written, never to be read) fall outside the row."""

    row: int
    length: int


@dataclass(frozen=True)
class RowFree:
    """The request on ``row`` left (finished, aborted or preempted): the row holds nothing."""

    row: int


@dataclass(frozen=True)
class RingSave:
    """The sliding-window rings of the request on ``row`` are copied to snapshot ``slot``: they
    hold its window layers' K/V up to block boundary ``position`` (cache/ring_snapshots.py)."""

    row: int
    slot: int
    position: int


@dataclass(frozen=True)
class RingRestore:
    """The request on ``row`` adopted a cached prefix: its rings become a copy of snapshot ``slot``."""

    slot: int
    row: int


RowChange = RowFree | RowMove | RowTrim | RingSave | RingRestore


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, end) of the request on ``row``. ``slots`` address the row's tokens
    [0, end): the first ``start`` are already in the cache (computed or adopted) and are its
    context, the rest are where this chunk's K/V go."""

    request_id: str
    row: int
    start: int
    token_ids: tuple[int, ...]
    slots: tuple[int, ...]
    is_last: bool  # the request's prefill ends here: its logits give its next token
    # prompt_logprobs: the worker scores position start + i against score_targets[i], with
    # score_top alternatives each (None: no scoring)
    score_top: int | None = None
    score_targets: tuple[int, ...] = ()
    # pooling: the worker returns this chunk's part of the request's pooled hidden state ("last":
    # the last position's, when is_last; "mean": the sum over the chunk's positions; "cls":
    # position 0's, when start is 0)
    pool: str | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def write_slots(self) -> tuple[int, ...]:
        return self.slots[self.start:]


@dataclass(frozen=True)
class DraftRows:
    """A verify step whose proposals the worker's draft model makes (speculative/draft.py):
    decode row i drafts ``counts[i]`` tokens (0: none; its proposal slots are already in the
    step's plan). First it catches up on ``tokens[i]``, the row's tokens just before its
    position whose draft K/V it lacks, and whose K/V the target already holds at ``slots[i]``.
    The draft's layers live in the target's pool, at the same slots."""

    counts: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DecodeBatch:
    """Rows ``row_ids`` decode one token each: row ``row_ids[i]`` feeds ``token_ids[i]`` at
    ``positions[i]`` and writes its K/V to ``write_slots[i]`` (already appended to its block
    table). The scheduler keeps them the prefix 0..n-1, so the forward reads the slot table's
    window ``[rows, width]`` (the bucketed shape a compiled graph was built for; exact without
    buckets); rows past n are padding.

    Speculation (a verify step): row i also feeds its ``proposals[i]`` at the positions after
    ``positions[i]``, writing their K/V to ``proposal_slots[i]`` (appended too), so it sends
    ``1 + len(proposals[i])`` queries; every row is padded to ``queries`` (the bucketed most) and
    each query attends to the row's cells up to its own. Without proposals ``queries`` is 1.
    With ``draft`` the worker's draft model makes the proposals (``proposals`` stays empty in
    the scheduler's plan and is filled on the worker before the verify forward)."""

    request_ids: tuple[str, ...]
    row_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    write_slots: tuple[int, ...]
    rows: int
    width: int
    proposals: tuple[tuple[int, ...], ...] = ()  # per row, or () when no row speculates
    proposal_slots: tuple[tuple[int, ...], ...] = ()
    queries: int = 1
    draft: DraftRows | None = None

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def num_proposed(self) -> tuple[int, ...]:
        """Proposed tokens per row (zeros without speculation)."""
        if self.proposals:
            return tuple(map(len, self.proposals))
        return self.draft.counts if self.draft is not None else (0,) * self.num_rows

    @property
    def num_tokens(self) -> int:
        """Tokens the decode rows feed this step, proposals included."""
        return self.num_rows + sum(self.num_proposed)

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens each row holds after this step's writes (its proposals included)."""
        return tuple(p + 1 + k for p, k in zip(self.positions, self.num_proposed))

    def row_slots(self, i: int) -> tuple[int, ...]:
        """The slots row i writes this step, in position order."""
        return (self.write_slots[i], *(self.proposal_slots[i] if self.proposal_slots else ()))


@dataclass(frozen=True)
class StepPlan:
    """One step. ``row_changes`` happened since the last plan (rows trimmed to their accepted
    tokens, rows freed by finishes and preemptions, rows moved to fill them, window rings saved
    and restored), in order;
    ``prefill`` chunks sit on rows after the decode rows, in row order. ``registered`` names the
    blocks this step's forward fills that the prefix cache now lists (a later request in the
    same step may already adopt them: the forward writes every chunk's K/V of a layer before
    any chunk reads its context there)."""

    row_changes: tuple[RowChange, ...]
    decode: DecodeBatch | None
    prefill: tuple[PrefillChunk, ...]
    registered: tuple[int, ...] = ()

    @property
    def sampled(self) -> tuple[str, ...]:
        """The requests that get a token this step, in logits order: the decode rows (a
        verifying row's 1 + k logits in a run), then each request whose prefill ends here."""
        decoding = self.decode.request_ids if self.decode is not None else ()
        return decoding + tuple(c.request_id for c in self.prefill if c.is_last)
