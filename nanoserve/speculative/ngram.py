"""Prompt-lookup proposer: guess a row's next tokens by finding its last few tokens earlier in
its own history and copying what followed them there (vLLM's ``ngram`` method, llama.cpp's
prompt lookup decoding). It pays off when the reply copies its input: code edits, quoting,
summaries, structured data.

Contract: ``propose(tokens, k)`` takes the row's whole history (prompt + output so far, the last
token being the one about to be fed) and returns at most ``k`` tokens, possibly none. The
longest n-gram in [min_n, max_n] that has an earlier copy wins; among its copies, the most
recent. Host-only and stateless; it runs every step for every speculating row, so one call is
a single vectorised compare over the history plus work proportional to the candidate copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes the continuation of the latest earlier copy of the history's longest matching
    suffix of ``min_n`` to ``max_n`` tokens."""

    def __init__(self, max_n: int, min_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the match ([] when nothing matches or k == 0;
        fewer than k when the history ends first). Raises ValueError for k < 0 or a history
        that is not one-dimensional. Pass an ndarray to skip converting a list each call."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if isinstance(tokens, np.ndarray):
            history = tokens
        else:  # fromiter with a known count converts a list faster than np.asarray
            history = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
        if history.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {history.shape}")
        end = self._match_end(history) if k > 0 else None
        if end is None:
            return []
        return history[end + 1:end + 1 + k].tolist()

    def _match_end(self, history: np.ndarray) -> int | None:
        """Index of the last token of the chosen earlier copy, or None."""
        size = len(history)
        if size < self.min_n + 1:  # an earlier copy of min_n tokens needs min_n + 1 tokens in all
            return None
        # Copies ending before the last token that match the last `length` tokens; each round
        # keeps those whose previous token matches too, so the list only shrinks.
        ends = np.flatnonzero(history[:-1] == history[-1])
        best = None
        for length in range(1, self.max_n + 1):
            if ends.size == 0:
                break
            if length >= self.min_n:
                best = int(ends[-1])  # the latest copy is usually the one the reply is continuing
            if length == self.max_n:
                break
            ends = ends[ends >= length]
            ends = ends[history[ends - length] == history[size - 1 - length]]
        return best
