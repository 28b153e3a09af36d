"""The prefill backend's grouped attention against a plain reference: every query head over
its own K/V head, an explicit causal softmax in fp64. Random shapes, start offsets and groups."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.worker.attention import grouped_causal_attention, grouped_causal_mask


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None = None) -> torch.Tensor:
    """q [T, H, D] at positions start.. over k, v [start + T, KV, D] (the last ``window`` keys
    of each query's own position only, when given); [T, H, D] in fp64."""
    length, heads, dim = q.shape
    group = heads // k.shape[1]
    keys, values = (x.double().repeat_interleave(group, dim=1) for x in (k, v))  # [C, H, D]
    scores = torch.einsum("thd,chd->htc", q.double(), keys) / dim ** 0.5
    future = torch.arange(start + length).view(1, -1) > torch.arange(start, start + length).view(-1, 1)
    if window is not None:
        future |= torch.arange(start + length).view(1, -1) <= torch.arange(start, start + length).view(-1, 1) - window
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("htc,chd->thd", probs, values)


@given(length=st.integers(1, 24), start=st.integers(0, 40), kv_heads=st.integers(1, 3),
       group=st.integers(1, 4), dim=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**16))
def test_grouped_causal_attention_equals_per_head_causal_attention(length, start, kv_heads, group, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, kv_heads * group, dim, generator=gen)
    k, v = (torch.randn(start + length, kv_heads, dim, generator=gen) for _ in range(2))
    mask = grouped_causal_mask(start, length, group, q.dtype, q.device)
    out = grouped_causal_attention(q, k, v, mask)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, start), atol=1e-5, rtol=1e-5)


def test_the_mask_hides_exactly_the_future_of_each_grouped_row():
    mask = grouped_causal_mask(3, 2, 2, torch.float32, torch.device("cpu"))
    visible = (mask == 0).int().tolist()
    # rows: (g0, pos 3), (g0, pos 4), (g1, pos 3), (g1, pos 4); columns 0..4
    assert visible == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]] * 2


@given(length=st.integers(1, 24), start=st.integers(0, 40), window=st.integers(1, 12), group=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_a_sliding_window_chunk_attends_to_the_last_window_positions_of_each_query(length, start, window, group,
                                                                                   seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, 2 * group, 16, generator=gen)
    k, v = (torch.randn(start + length, 2, 16, generator=gen) for _ in range(2))
    mask = grouped_causal_mask(start, length, group, q.dtype, q.device, window)
    out = grouped_causal_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), reference(q, k, v, start, window), atol=1e-5, rtol=1e-5)


def test_the_window_mask_is_a_band_of_window_columns_ending_at_each_position():
    mask = grouped_causal_mask(3, 2, 1, torch.float32, torch.device("cpu"), window=2)
    # rows: positions 3 and 4; columns 0..4
    assert (mask == 0).int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
