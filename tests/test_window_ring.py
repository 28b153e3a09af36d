"""Sliding-window layers keep their window (window_ring): each row keeps a ring of its window's
cells for them, and an engine so built gives the tokens and logprobs of the same engine keeping
every position (swa_full) while its K/V cost the global layers' share plus the rings; through
chunked prefill, rows that move, speculative verify steps and compiled steps. With prefix
caching, rings are saved at block boundaries and a row adopting a cached prefix restores them."""

from __future__ import annotations

import pytest
import torch
from engine_oracle_helpers import assert_greedy_agrees_up_to_near_ties, engine_for, generate, greedy, run

from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.summary import describe_engine
from nanoserve.worker.window_ring import WindowRing, ring_size, ring_writes

WINDOW = 6
# Three sliding layers around one full one: the Gemma 3 / gpt-oss pattern in small.
CONFIG = tiny_config(num_layers=4, sliding_window=WINDOW,
                     layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"))


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=5)


def test_a_ring_holds_the_window_and_what_a_step_writes_or_is_not_kept():
    assert ring_size([None, 8, 8], max_queries=1, max_model_len=100) == 8
    assert ring_size([None, 8, 4], max_queries=4, max_model_len=100) == 11  # a verify step's 1 + 3 queries
    assert ring_size([None, None], 1, 100) is None  # no window
    assert ring_size([8, 8], 1, 100) is None  # no full layer: nothing keeps the pool
    assert ring_size([None, 8], 1, 8) is None  # as long as a row: nothing saved


def test_the_ring_table_addresses_each_rows_positions_modulo_its_ring():
    ring = WindowRing(4, 3, 10, torch.device("cpu"))
    assert ring.num_cells == 15 and ring.row_cells(1) == slice(5, 10)
    assert ring.table[1].tolist() == [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9]  # the last column: row 1's scratch
    writes = ring_writes(ring.table, torch.tensor([0, 2, 2]), torch.tensor([5, 3, 0]), torch.tensor([6, 4, 0]))
    assert writes.tolist() == [1, 13, 14]  # a padded query (length 0) writes its row's scratch


def engines(model, **options):
    """The same engine keeping every position (swa_full) and keeping rings, prefix caching off."""
    options = dict(max_num_batched_tokens=10, enable_prefix_caching=False, **options)
    return engine_for(model, swa_full=True, **options), engine_for(model, **options)


def assert_same_runs(full, ringed, prompts, params) -> None:
    for got, want in zip(generate(ringed, prompts, params), generate(full, prompts, params)):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    ringed.check_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_rings_give_the_full_caches_tokens_and_logprobs(model, chunked):
    full, ringed = engines(model, enable_chunked_prefill=chunked)
    assert full.worker.cache.ring is None and ringed.worker.cache.ring.ring == WINDOW
    assert ringed.worker.cache.ring_layers == [0, 2, 3]
    # Prompts longer than the window and than a chunk; rows finishing apart, so rows move.
    prompts = [[(3 * i + 7 * j) % 256 for j in range(length)] for i, length in enumerate([23, 4, 15, 9, 31, 2])]
    params = [greedy(n, logprobs=0) for n in (12, 3, 20, 7, 5, 16)]
    moves, move = [], ringed.worker.cache.move
    ringed.worker.cache.move = lambda src, dst, length: (moves.append(src), move(src, dst, length))
    got = [ringed.add_request(p, q) for p, q in zip(prompts, params)]
    want = [full.add_request(p, q) for p, q in zip(prompts, params)]
    done_ringed, done_full = run(ringed), run(full)
    for a, b in zip(got, want):
        assert done_ringed[a].token_ids == done_full[b].token_ids
        assert [lp.logprob for lp in done_ringed[a].logprobs] == pytest.approx(
            [lp.logprob for lp in done_full[b].logprobs], abs=1e-5)
    assert moves  # a request changed rows, its ring with it
    ringed.check_drained()


def test_the_rings_cost_the_window_not_the_row(model):
    sizes = dict(max_batch_size=4, kv_cache_bytes=None, block_size=4, max_model_len=128)
    full, ringed = engines(model, **sizes)
    per_position = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    # the full layer in the pool's blocks, each sliding layer in a ring of the window (+ its scratch) a row
    assert ringed.worker.cache.ring_bytes == 3 * 4 * (WINDOW + 1) * per_position
    assert ringed.worker.cache.kv_bytes == ringed.resolved.num_blocks * 4 * per_position + ringed.worker.cache.ring_bytes
    assert full.worker.cache.kv_bytes == full.resolved.num_blocks * 4 * 4 * per_position
    assert ringed.resolved.kv_cache_bytes == ringed.worker.cache.kv_bytes
    assert ringed.worker.cache.kv_bytes < full.worker.cache.kv_bytes / 3
    line = next(x for x in describe_engine(ringed, "tiny", 0.0) if x.startswith("sliding-window layers"))
    assert "(3 of 4) keep each row's last 6 positions in a ring" in line
    assert not any(x.startswith("sliding-window") for x in describe_engine(full, "tiny", 0.0))


def test_prefix_caching_keeps_rings_and_saved_copies_of_them(model):
    engine = engine_for(model, max_num_batched_tokens=10)  # prefix caching on (the default)
    ring = engine.worker.cache.ring
    assert ring.ring == WINDOW + 4 - 1  # a block's positions more: a saved ring holds the window before its boundary
    assert ring.snapshots == 8 and engine.scheduler.blocks.snapshots.capacity == 8  # two per row
    per_position = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    assert engine.worker.cache.ring_bytes == 3 * (4 + 8) * (ring.ring + 1) * per_position
    assert engine.resolved.kv_cache_bytes == engine.worker.cache.kv_bytes
    line = next(x for x in describe_engine(engine, "tiny", 0.0) if x.startswith("sliding-window layers"))
    assert "8 saved rows of rings for cached prefixes" in line
    none = engine_for(model, max_num_batched_tokens=10, ring_snapshots=0)  # rings, no saved copy: nothing adopted
    assert none.worker.cache.ring.ring == WINDOW and none.scheduler.blocks.snapshots.capacity == 0


def prefix_engines(model, **options):
    """The same engine keeping every position (swa_full) and keeping rings, prefix caching on."""
    options = dict(max_num_batched_tokens=10, **options)
    return engine_for(model, swa_full=True, **options), engine_for(model, **options)


def test_a_later_turn_adopts_its_prefix_and_restores_the_window(model):
    """Second turns extend the first turns' whole conversations, and a prompt comes back as it
    was: each adopts its cached prefix up to a saved ring (a release's, a prompt end's), restores
    the window layers from it, and gives the tokens and logprobs of the engine keeping every
    position; rows move and rings are overwritten in between. (Four rows keep eight saved rings:
    the first turns' four prompt ends and four releases, until the second turns' saves displace
    the least recently used.)"""
    full, ringed = prefix_engines(model)
    prompts = [[(3 * i + 7 * j) % 256 for j in range(length)] for i, length in enumerate([23, 14, 30, 9])]
    first = generate(ringed, prompts, greedy(11, logprobs=0))
    assert [o.token_ids for o in first] == [o.token_ids for o in generate(full, prompts, greedy(11, logprobs=0))]
    turns = [prompts[2]] + [p + o.token_ids + [5, 6, 7] for p, o in zip(prompts, first)]
    params = greedy(9, logprobs=0)
    hits = ringed.stats().prefix_cache_hits
    for got, want in zip(generate(ringed, turns, params), generate(full, turns, params)):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    snapshots = ringed.scheduler.blocks.snapshots
    assert snapshots.restored >= len(turns) and ringed.stats().prefix_cache_hits > hits
    ringed.check_drained()


def test_a_prefix_without_a_saved_ring_is_computed(model):
    """A burst sharing an uncached stem: the stem's blocks are cached as the first prompt's chunk
    is planned, but no ring holds its window yet, so the others compute it (the engine keeping
    every position adopts it); the tokens agree."""
    full, ringed = prefix_engines(model)
    stem = list(range(40, 62))
    prompts = [stem + [i, i + 1] for i in range(3)]
    for got, want in zip(generate(ringed, prompts, greedy(6)), generate(full, prompts, greedy(6))):
        assert got.token_ids == want.token_ids
    assert ringed.stats().prefix_cache_hits < full.stats().prefix_cache_hits
    ringed.check_drained()


def test_preempted_rows_recompute_or_restore_and_give_the_full_caches_tokens(model):
    """A pool too small for every row: rows are preempted (their rings saved as they go) and
    readmitted, adopting what is still cached of their prefix up to a saved ring; the tokens
    are the full cache's."""
    full = engine_for(model, max_num_batched_tokens=10, swa_full=True, max_batch_size=4)
    pool = 12 * 4 * 2 * 2 * 16 * 4  # 12 blocks of 4 tokens of the full layer's K and V (fp32)
    ringed = engine_for(model, max_num_batched_tokens=10, max_batch_size=4, max_model_len=44,
                        kv_cache_bytes=pool + 3 * (4 + 8) * (WINDOW + 4) * 2 * 2 * 16 * 4)
    prompts = [[(5 * i + 3 * j) % 256 for j in range(14)] for i in range(4)]
    for got, want in zip(generate(ringed, prompts, greedy(24)), generate(full, prompts, greedy(24))):
        assert got.token_ids == want.token_ids
    assert ringed.stats().preemptions > 0 and ringed.scheduler.blocks.snapshots.saved > 0
    ringed.check_drained()


def test_rings_under_speculative_verify_steps_give_the_full_caches_tokens(model):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    full, ringed = engines(model, speculative=spec)
    assert ringed.worker.cache.ring.ring == WINDOW + 3  # a verify step writes 4 positions before it reads
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5], [9] * 13]
    assert_same_runs(full, ringed, prompts, greedy(16, logprobs=0))
    assert ringed.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["sdpa-fp32", "kernel-bf16"])
def test_compiled_steps_read_and_write_the_rings(dtype):
    torch._dynamo.reset()
    options = dict(dtype=dtype, max_num_batched_tokens=10, enable_prefix_caching=False)
    eager = engine_for(random_model(CONFIG, seed=5), **options)
    compiled = engine_for(random_model(CONFIG, seed=5), compile=True, row_buckets=(2, 4), width_buckets=(64, 128),
                          warmup="eager", **options)
    assert compiled.worker.cache.ring is not None
    prompts, params = [[1, 2, 3], list(range(10, 40)), [7] * 5], greedy(20, logprobs=2)
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for got, ref in zip(generate(compiled, prompts, params), generate(eager, prompts, params)):
        assert_greedy_agrees_up_to_near_ties(got, ref, tolerance)
    assert compiled.stats().recompiles_after_warmup == 0 and compiled.stats().bucket_hits
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_saved_rings_under_speculation_give_the_full_caches_tokens(model, method):
    """Verify steps write past a row's kept tokens before a ring is saved at its release: the
    ring's extra block of cells keeps the window a later turn restores. A draft model keeps its
    window layers in the pool (no rings of its own) beside the target's rings."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    full, ringed = prefix_engines(model, speculative=spec)
    assert ringed.worker.cache.ring.ring == WINDOW + 3 + 4 - 1
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5, 7, 8], [9] * 13]
    first = generate(ringed, prompts, greedy(14))
    assert [o.token_ids for o in first] == [o.token_ids for o in generate(full, prompts, greedy(14))]
    turns = [p + o.token_ids + [4, 4] for p, o in zip(prompts, first)]
    restored = ringed.scheduler.blocks.snapshots.restored
    for got, want in zip(generate(ringed, turns, greedy(10)), generate(full, turns, greedy(10))):
        assert got.token_ids == want.token_ids
    assert ringed.scheduler.blocks.snapshots.restored >= restored + len(turns)
    assert ringed.stats().spec_accepted_tokens > 0
    ringed.check_drained()
