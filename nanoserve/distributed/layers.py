"""The collective edges of a tensor-parallel model: a row-parallel linear's all-reduce, the
vocabulary-split embedding's all-reduce and the LM head's all-gather.

Each wraps the module that computes the rank's own part (dense or packed, whatever format
nanoserve.model.quant.linear made of the shard), so one wrapper serves every weight format. The
collectives are torch's functional ones: the same call runs eagerly and inside a compiled
decode graph, on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# Gathers along dim 0: torch 2.13 names it all_gather_single (its old name, all_gather_tensor,
# warns there); earlier releases (2.11, the GPU images', among them) have only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class RowParallel(nn.Module):
    """A linear whose input features are split over the ranks: each rank multiplies its slice
    (``inner``, holding the bias on rank 0 only) and one all-reduce sums the parts."""

    def __init__(self, inner: nn.Module, group) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.inner(x), "sum", self.group)


class VocabParallelEmbedding(nn.Module):
    """The token embedding split over the vocabulary: rank r holds rows [start, start + size)
    (``inner``: any embedding module of that many rows). A token outside them reads row 0 and is
    zeroed, and the all-reduce gives every rank each token's one true row."""

    def __init__(self, inner: nn.Module, start: int, size: int, group) -> None:
        super().__init__()
        self.inner, self.start, self.size, self.group = inner, start, size, group

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.start
        mine = (local >= 0) & (local < self.size)
        rows = self.inner(torch.where(mine, local, torch.zeros_like(local)))
        return funcol.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), "sum", self.group)


class TiedHead(nn.Module):
    """A dense LM head that is the (rank's slice of the) embedding table itself."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embedding.weight)


class GatheredHead(nn.Module):
    """The LM head split over the vocabulary: each rank computes logits for its rows (``inner``,
    [M, shard] with every shard the same size, the last one padded), an all-gather puts the
    shards side by side on every rank, and the padding is cut: [M, vocab_size], as one rank's
    head would give."""

    def __init__(self, inner: nn.Module, vocab_size: int, world_size: int, group) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.world_size, self.group = inner, vocab_size, world_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden)
        rows, shard = local.shape
        gathered = _all_gather(local.contiguous(), 0, self.group)  # [world * M, shard]
        logits = gathered.view(self.world_size, rows, shard).permute(1, 0, 2).reshape(rows, self.world_size * shard)
        return logits[:, :self.vocab_size]
