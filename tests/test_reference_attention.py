"""The model layer's reference attention against softmax written out here, query by query."""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve.model.network.reference_attention import (
    ChunkedCausalAttention,
    DenseCausalAttention,
    causal_visibility,
)

HEADS, KV_HEADS, DIM = 4, 2, 8


def direct_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D], k, v [T, KV, D] of one sequence at positions 0..T-1 -> [T, H, D], in float64:
    query p of head h weighs key j (p - window < j <= p) by exp(s_j) / (sum exp(s) + exp(sink_h))."""
    t, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for p in range(t):
        first = 0 if window is None else max(p - window + 1, 0)
        for h in range(heads):
            keys, values = k[first:p + 1, h // group].double(), v[first:p + 1, h // group].double()
            scores = keys @ q[p, h].double() / math.sqrt(dim)
            weights = scores.exp()
            denominator = weights.sum() + (0.0 if sinks is None else math.exp(float(sinks[h])))
            out[p, h] = (weights / denominator) @ values
    return out


def random_inputs(t: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, heads, DIM, generator=g) for heads in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, torch.randn(HEADS, generator=g)


def test_causal_visibility_of_a_chunk_is_its_window_of_the_positions_read():
    # Queries at positions 3, 4 of 5 keys, window 2: position p sees p - 1 and p.
    want = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_visibility(2, 5, 2, "cpu"), want)
    assert torch.equal(causal_visibility(3, 3, None, "cpu"), torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_dense_attention_equals_the_direct_softmax(window, with_sinks):
    q, k, v, sinks = random_inputs(7, seed=1)
    sinks = sinks if with_sinks else None
    extra = {} if window is None else {"window": window}
    got = DenseCausalAttention(1, 7)(0, q, k, v, sinks=sinks, **extra)
    torch.testing.assert_close(got.double(), direct_attention(q, k, v, window, sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_windowed_sinked_attention_equals_the_direct_softmax(chunk):
    q, k, v, sinks = random_inputs(7, seed=2)
    attention = ChunkedCausalAttention(num_layers=1)
    got = torch.cat([attention(0, q[s:s + chunk], k[s:s + chunk], v[s:s + chunk], window=3, sinks=sinks)
                     for s in range(0, 7, chunk)])
    torch.testing.assert_close(got.double(), direct_attention(q, k, v, 3, sinks), atol=1e-5, rtol=1e-5)


def test_dense_attention_hides_left_padding_from_each_row():
    # Two rows of the same 6 tokens; row 0's first two are left padding, so its last four
    # attend as a sequence of 4 would, and row 1 as the whole sequence.
    q, k, v, sinks = random_inputs(6, seed=3)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    got = DenseCausalAttention(2, 6, mask)(0, q.repeat(2, 1, 1), k.repeat(2, 1, 1), v.repeat(2, 1, 1),
                                           window=2, sinks=sinks)
    torch.testing.assert_close(got[2:6].double(), direct_attention(q[2:], k[2:], v[2:], 2, sinks),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[6:].double(), direct_attention(q, k, v, 2, sinks), atol=1e-5, rtol=1e-5)


def test_a_windowed_models_chunked_reading_equals_its_dense_forward():
    """fidelity's chunked path honours the window: a model whose window is shorter than the
    text gives the dense forward's logits chunk by chunk."""
    from nanoserve.model.network.fidelity import teacher_forced_logits
    from nanoserve.model.network.synthetic import random_model, tiny_config

    model = random_model(tiny_config(sliding_window=4, layer_types=("sliding_attention", "full_attention")))
    ids = list(range(3, 20))
    dense, chunked = teacher_forced_logits(model, ids), teacher_forced_logits(model, ids, chunk_rows=5)
    torch.testing.assert_close(chunked, dense, atol=1e-4, rtol=1e-4)
    unwindowed = teacher_forced_logits(random_model(tiny_config()), ids)
    assert not torch.allclose(unwindowed[4:], dense[4:], atol=1e-2)  # the window changed what was read
