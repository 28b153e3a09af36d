"""The model layer's reference attention: causal attention over a chunk of queries, with an
optional sliding ``window`` and optional per-head ``sinks`` (gpt-oss), written once.

Two callers hand it to the network as its ``Attention``: ``DenseCausalAttention``, no cache,
a [batch, seq_len] rectangle at once (the oracle ``llama.dense_forward`` grades the engine
against), and ``ChunkedCausalAttention``, one sequence fed a chunk at a time over the keys it
has kept (fidelity's teacher-forced logits at a decode-like row count). Both build their masks
with ``causal_visibility`` and attend through ``causal_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax([q k^T * scale + mask, sink]) v without the sink's column: attention whose
    softmax has one more logit per query row, the head's sink (gpt-oss's reference arithmetic,
    in fp32). q [..., Q, D]; k, v [..., S, D] with the same leading dimensions as q (heads
    already matched to q's); mask: bool (True: visible) or additive, broadcastable to the
    scores [..., Q, S], or None (all visible); sinks broadcastable to [..., Q, 1]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def causal_visibility(queries: int, keys: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """bool [queries, keys], True where visible: the queries are the last ``queries`` of
    ``keys`` positions, and query position p sees keys p - window + 1 .. p (all of 0 .. p
    without a ``window``)."""
    past = keys - queries
    back = torch.arange(past, keys, device=device).view(-1, 1) - torch.arange(keys, device=device).view(1, -1)
    return (back >= 0) if window is None else (back >= 0) & (back < window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D] over k, v [B, KV, S, D] (H a multiple of KV) -> [B, H, Q, D], scores
    scaled by 1/sqrt(D). ``mask``: bool (True: visible) broadcastable to [B, H, Q, S], or None
    for plain causal attention with Q == S. ``sinks`` [H]: through ``attend_with_sinks``."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    if mask is None:
        mask = causal_visibility(q.shape[2], k.shape[2], None, q.device)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return attend_with_sinks(q, k, v, mask, sinks.view(-1, 1, 1))


class DenseCausalAttention:
    """No-cache causal attention over a [batch, seq_len] rectangle of flat tokens.

    `attention_mask` [B, T] (1 = real token, 0 = left padding) hides padded keys. A padded query
    still sees itself so its row stays finite (its output is garbage and must be ignored). A
    sliding-window layer's call sees only its window's keys.
    """

    def __init__(self, batch: int, seq_len: int, attention_mask: torch.Tensor | None = None) -> None:
        self.batch, self.seq_len = batch, seq_len
        self.attention_mask = attention_mask
        self.masks: dict[int | None, torch.Tensor | None] = {}  # by window, shared by the layers

    def _mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        if window not in self.masks:
            self.masks[window] = self._build_mask(self.attention_mask, self.seq_len, window, device)
        return self.masks[window]

    @staticmethod
    def _build_mask(attention_mask: torch.Tensor | None, seq_len: int, window: int | None,
                    device: torch.device) -> torch.Tensor | None:
        if attention_mask is None and window is None:
            return None  # plain causal: SDPA's is_causal
        visible = causal_visibility(seq_len, seq_len, window, device)
        if attention_mask is None:
            return visible[None, None]
        mask = visible[None] & attention_mask.bool()[:, None, :]
        mask |= torch.eye(seq_len, dtype=torch.bool, device=device)[None]
        return mask[:, None]  # [B, 1, T, T], broadcast over heads

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        b, t = self.batch, self.seq_len
        mask = self._mask(window, q.device)
        q, k, v = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = causal_attention(q, k, v, mask, sinks)
        return out.transpose(1, 2).reshape(b * t, out.shape[1], out.shape[3])


class ChunkedCausalAttention:
    """Causal attention over everything read so far, for one sequence fed a chunk at a time:
    each layer keeps every chunk's keys and values, and a chunk's queries [rows, H, D] (the
    last ``rows`` positions read) attend over all of them, a sliding layer over its window.
    ``stored`` (k, v) -> (k, v): what a cache gives back of them (KVLayers.as_stored: q8_0
    cells round them), applied as they are kept."""

    def __init__(self, num_layers: int, stored=None) -> None:
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.stored = stored

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.stored is not None:
            k, v = self.stored(k, v)
        keys = torch.cat([*self.keys[layer_idx], k])
        values = torch.cat([*self.values[layer_idx], v])
        # One tensor kept per layer: a chunk's small tensors, each kept for the whole text between
        # the large ones made and freed every chunk, fragmented the heap past 24 GB at one row a chunk.
        self.keys[layer_idx], self.values[layer_idx] = [keys], [values]
        mask = causal_visibility(q.shape[0], keys.shape[0], window, q.device)
        out = causal_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                               values.transpose(0, 1)[None], mask, sinks)
        return out[0].transpose(0, 1)
