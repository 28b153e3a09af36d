"""The reference paged read equals dense attention over the same tokens."""

from __future__ import annotations

import pytest
import torch
from attention_support import paged_attention, paged_attention_reference
from paired_cache import PairedCache

from nanoserve.worker.attention import (
    WindowAttention,
    attend_window,
    gather_rows,
    window_mask,
)
from nanoserve.worker.kv_cells import KVLayers


def dense_attention(q, keys, values, scale=None):
    """One query per row over that row's own [t, KV, D] keys and values, GQA by repeating heads."""
    group = q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = []
    for i, (k, v) in enumerate(zip(keys, values)):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [t, H, D]
        scores = torch.einsum("hd,thd->ht", q[i].double(), k.double()) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v.double()))
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_read_equals_dense_attention(device, num_heads, num_kv_heads):
    torch.manual_seed(0)
    head_dim, lengths = 8, [5, 1, 13, 9]
    cache = PairedCache(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, num_blocks=24,
                                block_size=4, max_batch_size=4, max_model_len=32, device=device)
    keys, values = [], []
    for row, n in enumerate(lengths):  # interleaved prompts: each row's blocks are scattered in the pool
        k = torch.randn(n, num_kv_heads, head_dim, device=device)
        v = torch.randn(n, num_kv_heads, head_dim, device=device)
        cache.write_kv(0, cache.allocate_prompt(row, n), k, v)
        keys.append(k)
        values.append(v)
    plan = cache.plan_decode(range(4))  # one more token per row, written now
    k_new = torch.randn(4, num_kv_heads, head_dim, device=device)
    v_new = torch.randn(4, num_kv_heads, head_dim, device=device)
    cache.write_kv(0, plan.write_slots, k_new, v_new)
    q = torch.randn(4, num_heads, head_dim, device=device)
    got = paged_attention_reference(q, cache.layers.k_cells[0], cache.layers.v_cells[0], plan.slot_mapping, plan.context_lens)
    want = dense_attention(q, [torch.cat([k, k_new[i:i + 1]]) for i, k in enumerate(keys)],
                           [torch.cat([v, v_new[i:i + 1]]) for i, v in enumerate(values)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_is_masked_whatever_slot_it_names():
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(32, 2, 4), torch.randn(32, 2, 4)
    q = torch.randn(2, 2, 4)
    slots = torch.tensor([[3, 7, 9, 0], [5, 6, 0, 0]])
    garbage = torch.tensor([[3, 7, 9, 31], [5, 6, 17, 2]])  # padding columns point anywhere legal
    lens = torch.tensor([3, 2])
    torch.testing.assert_close(paged_attention_reference(q, k_cache, v_cache, slots, lens),
                               paged_attention_reference(q, k_cache, v_cache, garbage, lens))


def test_padded_rows_with_no_context_give_zeros_not_nan():
    k_cache, v_cache = torch.randn(16, 1, 4), torch.randn(16, 1, 4)
    out = paged_attention_reference(torch.randn(3, 2, 4), k_cache, v_cache, torch.zeros(3, 5, dtype=torch.long),
                                    torch.tensor([2, 0, 0]))
    assert torch.isfinite(out).all() and out[1:].abs().sum() == 0


def test_scale_is_honoured():
    torch.manual_seed(2)
    k_cache, v_cache, q = torch.randn(8, 1, 4), torch.randn(8, 1, 4), torch.randn(1, 1, 4)
    slots, lens = torch.tensor([[0, 1, 2]]), torch.tensor([3])
    got = paged_attention_reference(q, k_cache, v_cache, slots, lens, scale=0.1)
    want = dense_attention(q, [k_cache[:3]], [v_cache[:3]], scale=0.1)
    torch.testing.assert_close(got, want)


def test_half_precision_computes_softmax_in_float32():
    torch.manual_seed(3)
    k_cache, v_cache, q = torch.randn(8, 2, 8), torch.randn(8, 2, 8), torch.randn(2, 4, 8)
    slots, lens = torch.tensor([[0, 1, 2], [4, 5, 0]]), torch.tensor([3, 2])
    full = paged_attention_reference(q, k_cache, v_cache, slots, lens)
    half = paged_attention_reference(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), slots, lens)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.05)


def test_mismatched_heads_are_refused():
    with pytest.raises(ValueError, match="shapes disagree"):
        paged_attention_reference(torch.randn(1, 3, 4), torch.randn(8, 2, 4), torch.randn(8, 2, 4),
                                  torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_read_equals_the_reference_read(device, num_heads, num_kv_heads, dtype):
    torch.manual_seed(1)
    n, width, head_dim, slots = 5, 24, 16, 200
    k_cache = torch.randn(slots, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(n, num_heads, head_dim, device=device, dtype=dtype)
    slot_mapping = torch.randint(0, slots, (n, width), device=device)
    context_lens = torch.tensor([24, 1, 0, 17, 9], device=device)  # row 2 is padding
    got = paged_attention(q, k_cache, v_cache, slot_mapping, context_lens)
    want = paged_attention_reference(q, k_cache, v_cache, slot_mapping, context_lens)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_window_mask_hides_exactly_the_columns_past_each_length():
    mask = window_mask(torch.tensor([3, 1, 0, 5]), 5, torch.float32)
    assert mask.shape == (4, 1, 1, 5)
    hidden = torch.isinf(mask.view(4, 5))
    assert hidden.tolist() == [[False, False, False, True, True], [False, True, True, True, True],
                               [False, True, True, True, True],  # padding sees column 0, never nothing
                               [False] * 5]
    assert torch.equal(mask.view(4, 5)[~hidden], torch.zeros(int((~hidden).sum())))


def test_one_mask_serves_every_layer_of_a_step():
    # The decode step builds the mask once and reads each layer's cache through it.
    torch.manual_seed(2)
    slot_mapping = torch.randint(0, 64, (3, 8))
    context_lens = torch.tensor([8, 5, 2])
    mask = window_mask(context_lens, 8, torch.float32)
    for _layer in range(3):
        k_cache, v_cache, q = torch.randn(64, 2, 8), torch.randn(64, 2, 8), torch.randn(3, 6, 8)
        keys, values = gather_rows(k_cache, slot_mapping), gather_rows(v_cache, slot_mapping)
        torch.testing.assert_close(attend_window(q, keys, values, mask),
                                   paged_attention_reference(q, k_cache, v_cache, slot_mapping, context_lens))


@pytest.mark.parametrize("head_dim", [8, 24])
def test_a_head_size_the_kernel_cannot_take_decodes_through_sdpa(head_dim):
    # K/V with a head_dim that is not a multiple of 16: the engine keeps SDPA instead of
    # handing the kernel a shape it refuses (which failed every decode step), eager and compiled.
    from nanoserve.engine import SamplingParams, build_engine
    from nanoserve.model.network.synthetic import random_model, tiny_config
    from nanoserve.worker.attention import decode_attention_kernel

    assert decode_attention_kernel("cpu", torch.bfloat16, head_dim, "scalar") is None
    config = tiny_config(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=head_dim)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[3, 9, 27, 81, 243 % 256], [5, 7]]
    for weights, compile in (("bf16", False), ("int4", True)):
        engine = build_engine(random_model(config), weights=weights, max_batch_size=2, max_model_len=64,
                              compile=compile)
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [out.error for out in outs] == [None, None]
        assert [len(out.token_ids) for out in outs] == [12, 12]


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_a_sliding_window_read_is_the_read_of_each_rows_last_window_cells(window):
    """Restricting a row of length L to columns L - window .. L - 1 is the plain read of a
    row made of those cells alone; the SDPA path's banded mask gives the same."""
    torch.manual_seed(window)
    n, width, slots = 4, 24, 200
    k_cache, v_cache, q = torch.randn(slots, 2, 16), torch.randn(slots, 2, 16), torch.randn(n, 6, 16)
    slot_mapping = torch.randint(0, slots, (n, width))
    context_lens = torch.tensor([24, 1, 11, 5])
    got = paged_attention_reference(q, k_cache, v_cache, slot_mapping, context_lens, window=window)
    for row, length in enumerate(context_lens.tolist()):
        first = max(length - window, 0)
        alone = paged_attention_reference(q[row:row + 1], k_cache, v_cache, slot_mapping[row:row + 1, first:length],
                                          torch.tensor([length - first]))
        torch.testing.assert_close(got[row:row + 1], alone)
    fused = paged_attention(q, k_cache, v_cache, slot_mapping, context_lens, window=window)
    torch.testing.assert_close(fused, got, rtol=1e-5, atol=1e-5)


def test_window_mask_with_a_window_hides_the_columns_before_it():
    hidden = torch.isinf(window_mask(torch.tensor([5, 2, 0]), 6, torch.float32, window=3).view(3, 6))
    assert hidden.int().tolist() == [[1, 1, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("queries", [2, 5])
def test_a_verify_steps_sdpa_read_is_each_query_over_its_own_cells(queries):
    """A verify step through SDPA: each row's cells gathered once for its queries, query j of a
    row seeing its cells up to its own length, as the reference reads one query at a time."""
    torch.manual_seed(queries)
    rows, slots, width, kv, group, head_dim = 3, 200, 24, 2, 3, 16
    k_cache, v_cache = torch.randn(slots, kv, head_dim), torch.randn(slots, kv, head_dim)
    q = torch.randn(rows * queries, kv * group, head_dim)
    mapping = torch.randint(1, slots, (rows, width))
    lengths = torch.tensor([start + j + 1 for start in (5, 0, 18) for j in range(queries)])
    attention = WindowAttention(KVLayers([k_cache], [v_cache], [], []), torch.zeros(rows * queries, dtype=torch.long), mapping, lengths)
    fresh = torch.zeros(rows * queries, kv, head_dim)  # this step's own K/V go to slot 0, which no row reads
    got = attention(0, q, fresh, fresh)
    want = paged_attention_reference(q, k_cache, v_cache, mapping.repeat_interleave(queries, 0), lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
