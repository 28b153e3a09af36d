"""Token masks: which tokens each constrained row may sample next, as llguidance's bitmask
(one bit per vocabulary entry, 32 to an int32 word), and their application to logits."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch


@dataclass
class TokenMasks:
    """``bitmask[i]`` is the allowed-token bitmask of sampled row ``rows[i]``; rows not listed
    are unconstrained."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on the host

    def select(self, row: int) -> TokenMasks | None:
        """The mask of one row, as the masks of a batch of that row alone (None: unconstrained)."""
        if row not in self.rows:
            return None
        index = self.rows.index(row)
        return TokenMasks([0], self.bitmask[index:index + 1])


@dataclass
class PendingMasks:
    """A step's masks being filled beside the forward: ``future`` gives (bitmask, seconds spent
    filling it) for sampled rows ``rows``. The worker waits for them after its forward."""

    rows: list[int]
    future: concurrent.futures.Future

    def wait(self) -> TokenMasks:
        return TokenMasks(self.rows, self.future.result()[0])


def split_masks(masks: TokenMasks | None, n: int) -> tuple[TokenMasks | None, TokenMasks | None]:
    """The masks of rows [0, n) and of the rows after them (renumbered from 0)."""
    if masks is None:
        return None, None
    head = [i for i, row in enumerate(masks.rows) if row < n]
    tail = [i for i, row in enumerate(masks.rows) if row >= n]
    return (TokenMasks([masks.rows[i] for i in head], masks.bitmask[head]) if head else None,
            TokenMasks([masks.rows[i] - n for i in tail], masks.bitmask[tail]) if tail else None)


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks | None) -> torch.Tensor:
    """`logits` [n, vocab] with every token a constrained row may not take set to -inf; the
    unconstrained rows are returned as they were (bit for bit)."""
    if masks is None or not masks.rows:
        return logits
    vocab = logits.shape[-1]
    words = masks.bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    rows = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
