"""Tensor parallelism on gloo: a sharded engine gives the one-process engine's logits and
tokens (eager and compiled, with prefix caching, chunked prefill and preemption in play), the
default model split three ways keeps its greedy tokens, faults end every process, and
configurations that cannot be cut are refused before any process starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from engine_oracle_helpers import assert_greedy_agrees_up_to_near_ties

from nanoserve.distributed.shard import check_tensor_parallel, vocab_shard
from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant.weight_plan import WeightPlan

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 K/V heads, head_dim 16, 4 slots, fp32
# A pool of 18 blocks for four rows of up to 64 tokens: the long requests preempt each other;
# an 8-token budget splits every prompt into chunks.
OPTIONS = dict(max_batch_size=4, kv_cache_bytes=18 * BLOCK_BYTES, block_size=4, max_model_len=64,
               max_num_batched_tokens=8)
SHARED = list(range(10, 30))  # a prefix the later prompts find cached
PROMPTS = [SHARED + [1, 2, 3], SHARED + [4, 5], list(range(40, 61)), [7, 8, 9], SHARED + [6]]


def run_recorded(engine, prompts, params):
    """Run the prompts, keeping each step's logits (its worker's forward's: under tensor
    parallelism rank 0's, where the driving worker runs its own)."""
    worker = getattr(engine.worker, "worker", engine.worker)
    forward, logits = worker.forward, []

    def recording(plan):
        out = forward(plan)
        logits.append(out.logits.clone())
        return out

    worker.forward = recording
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids], logits, engine.stats()


# Two ranks sum a row-parallel product's halves apart, then add them: fp32 rounding in another
# order, a few ulps of the logits' scale, more where the BLAS blocks its sums otherwise (torch
# capped at AVX2 measured 1.5e-5).
SHARDED_RTOL = 5e-5


def assert_close(got: list[torch.Tensor], ref: list[torch.Tensor], rtol: float) -> None:
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape, step
        if not b.numel():
            continue
        error = (a - b).abs().max().item() / b.abs().max().item()
        assert error <= rtol, f"step {step}: relative error {error}"


def no_workers_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-tp")]


@pytest.fixture(scope="module")
def tiny():
    # Biases on q/k/v and o: each shard keeps its heads' biases, o's on rank 0 alone; a vocabulary
    # of 255 leaves the second shard one padded row.
    return random_model(tiny_config(vocab_size=255, attention_bias=True, attention_out_bias=True), seed=3)


def params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, prompt_logprobs=1)
              for _ in PROMPTS[:-1]]
    return greedy + [SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=14, ignore_eos=True)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_ranks_give_one_rank_logits_and_tokens(tiny, compiled):
    options = dict(OPTIONS, compile=compiled, row_buckets=(4,), width_buckets=(64,), warmup="eager") \
        if compiled else OPTIONS
    ref, ref_logits, ref_stats = run_recorded(build_engine(tiny, **options), PROMPTS, params())
    assert ref_stats.preemptions > 0 and ref_stats.prefix_cache_hits > 0  # the paths are in play
    with build_engine(tiny, tensor_parallel_size=2, **options) as engine:
        got, logits, stats = run_recorded(engine, PROMPTS, params())
        engine.check_drained()
    assert_close(logits, ref_logits, rtol=SHARDED_RTOL)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids  # greedy and seeded sampling alike
        if b.prompt_logprobs:
            assert [p and p.token_id for p in a.prompt_logprobs] == [p and p.token_id for p in b.prompt_logprobs]
            assert all(abs(p.logprob - q.logprob) <= 1e-4 for p, q in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
    assert (stats.preemptions, stats.prefix_cache_hits) == (ref_stats.preemptions, ref_stats.prefix_cache_hits)
    if compiled:
        assert stats.graphs_built + stats.graphs_loaded == 1 and stats.recompiles_after_warmup == 0
    assert no_workers_left()


def test_tensor_parallel_ranks_keep_their_graphs_in_the_compile_cache(tiny):
    # Each rank builds its own graphs (they hold its collectives) into the cache, keyed by its
    # place; the next engine's ranks load them and compile nothing, with the same tokens.
    options = dict(OPTIONS, compile=True, row_buckets=(2, 4), width_buckets=(64,))
    with build_engine(tiny, tensor_parallel_size=2, warmup="eager", **options) as engine:
        first, _, _ = run_recorded(engine, PROMPTS, params())
    with build_engine(tiny, tensor_parallel_size=2, warmup="lazy", **options) as engine:
        assert (engine.stats().graphs_loaded, engine.stats().graphs_built, engine.stats().graphs_ready) == (2, 0, 2)
        again, _, stats = run_recorded(engine, PROMPTS, params())
        assert (stats.graphs_built, stats.eager_steps, stats.recompiles_after_warmup) == (0, 0, 0)
    assert [a.token_ids for a in again] == [a.token_ids for a in first]
    assert no_workers_left()


@pytest.mark.parametrize("variant,cache", [("qwen3", {}), ("gemma3", {}),
                                           ("gemma3", dict(enable_prefix_caching=False, kv_cache_dtype="q8_0"))],
                         ids=["qwen3", "gemma3", "gemma3-rings-q8_0"])
def test_per_head_norms_and_sliding_windows_shard_with_their_heads(variant, cache, tmp_path):
    """Qwen3's and Gemma 3's q/k norms (one weight for every head), Gemma's sandwich norms,
    scaled embeddings, soft-capped logits and sliding-window layers, at two ranks; and each
    rank's share of a cache whose window layers keep rings (saved for prefix caching, or not)
    and whose cells are q8_0."""
    pytest.importorskip("transformers")
    from arch_models import make_hf_model

    from nanoserve.model.formats.hf_loader import load_hf_state_dict, read_hf_config
    from nanoserve.model.formats.loader import build_model

    make_hf_model(variant).save_pretrained(tmp_path, safe_serialization=True)
    model = build_model(read_hf_config(tmp_path), load_hf_state_dict(tmp_path))
    options = dict(OPTIONS, kv_cache_bytes=1 << 20, max_model_len=64, **cache)
    p = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3
    prompts = PROMPTS[:3]
    alone = build_engine(model, **options)
    assert (alone.worker.cache.ring is not None) == (variant == "gemma3")  # rings with or without prefix caching
    ref, ref_logits, _ = run_recorded(alone, prompts, p)
    with build_engine(model, tensor_parallel_size=2, **options) as engine:
        got, logits, _ = run_recorded(engine, prompts, p)
    assert_close(logits, ref_logits, rtol=SHARDED_RTOL)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_every_weight_format_shards(tiny, weights):
    """bf16 rounds each shard's partial sum; int8 scales each shard's channels over its own
    slice of K; int4 cuts on group boundaries, its groups unchanged. Greedy tokens agree up to
    near ties."""
    model = random_model(tiny_config(), seed=5)  # no biases: the packed kernels' plain shape
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    with build_engine(model, weights=weights, tensor_parallel_size=2, **OPTIONS) as engine:
        got = engine.generate(PROMPTS, p, use_tqdm=False)
    # After: a one-process engine packs the model it is given in place (the ranks shard copies).
    ref = build_engine(model, weights=weights, **OPTIONS).generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(got, ref):
        assert_greedy_agrees_up_to_near_ties(a, b, tolerance=0.1)


def test_default_model_over_three_ranks_keeps_greedy_tokens(smollm2_path):
    """9 query heads, 3 K/V heads, int4 with the int8 head: each rank holds 3 and 1, its groups
    whole. The shards' partial sums round apart in bf16, hence the near-tie comparison."""
    options = dict(max_batch_size=4, max_model_len=256)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    ref = build_engine(str(smollm2_path), **options).generate(prompts, p, use_tqdm=False)
    with build_engine(str(smollm2_path), tensor_parallel_size=3, **options) as engine:
        got = engine.generate(prompts, p, use_tqdm=False)
    for a, b in zip(got, ref):
        assert_greedy_agrees_up_to_near_ties(a, b, tolerance=0.25)
    assert no_workers_left()


def test_a_killed_worker_ends_the_engine_loudly(tiny):
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = build_engine(tiny, tensor_parallel_size=2, **OPTIONS)
    engine.generate([[1, 2, 3]], p, use_tqdm=False)
    (worker,) = engine.worker.driver.workers
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match=r"nanoserve-tp1 \(pid \d+\) exited with code -9"):
        engine.generate([[4, 5, 6]], p, use_tqdm=False)
    assert no_workers_left()
    engine.close()  # closing a failed engine is a no-op


def test_a_hung_worker_times_out_and_every_process_ends(tiny):
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = build_engine(tiny, tensor_parallel_size=2, tensor_parallel_timeout=3.0, **OPTIONS)
    (worker,) = engine.worker.driver.workers
    os.kill(worker.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        engine.generate([[4, 5, 6]], p, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert no_workers_left()


def test_indivisible_configurations_are_refused_before_any_process_starts(tiny):
    odd_heads = random_model(tiny_config(num_heads=3, num_kv_heads=1, head_dim=16, hidden_size=48), seed=0)
    with pytest.raises(ValueError, match=r"attention heads \(3\) are not divisible by 2.*K/V heads \(1\)"):
        build_engine(odd_heads, tensor_parallel_size=2, **OPTIONS)
    assert no_workers_left()
    packed = random_model(tiny_config(), seed=0)
    build_engine(packed, weights="int8", **OPTIONS)  # a one-process engine packs it in place
    with pytest.raises(ValueError, match="packed already"):
        build_engine(packed, tensor_parallel_size=2, **OPTIONS)
    assert no_workers_left()
    # int4 groups run along K: down_proj's 96 inputs split two ways cut a group of 32.
    config = tiny_config(intermediate_size=96)
    check_tensor_parallel(config, 2, None)  # dense: any cut is fine
    with pytest.raises(ValueError, match=r"down_proj's 96 input features split 2 ways \(48 each\) cut"):
        check_tensor_parallel(config, 2, WeightPlan("int4"))
    three_ways = tiny_config(num_heads=6, num_kv_heads=3, hidden_size=96, intermediate_size=96)
    check_tensor_parallel(three_ways, 3, WeightPlan("int4"))  # o_proj and down_proj: 32 each, whole groups


def test_vocab_shards_cover_the_vocabulary_in_equal_parts():
    for vocab, size in ((255, 2), (49152, 3), (7, 4)):
        shards = [vocab_shard(vocab, r, size) for r in range(size)]
        assert len({rows for _, rows in shards}) == 1
        assert shards[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(shards, shards[1:]))
        assert shards[-1][0] + shards[-1][1] >= vocab


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_two_gpus_keep_one_gpu_greedy_tokens(tiny):
    """NCCL for the forward, rank r on GPU r; bf16, so the shards' partial sums round apart."""
    options = dict(OPTIONS, device="cuda")
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    ref = build_engine(tiny, **options).generate(PROMPTS, p, use_tqdm=False)
    with build_engine(tiny, tensor_parallel_size=2, **options) as engine:
        got = engine.generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(got, ref):
        assert_greedy_agrees_up_to_near_ties(a, b, tolerance=0.1)
    assert no_workers_left()


@pytest.mark.parametrize(("cut", "width"), [(256, 512), (64, 128)], ids=["on-super-blocks", "inside-a-super-block"])
def test_a_k_quants_shards_hold_exactly_their_slice_of_the_weight(cut, width):
    """A Q4_K weight's shards (output rows, input columns on or inside its 256-weight super-blocks)
    dequantise to exactly their slice of the whole weight: codes, per-group numbers and factors cut together."""
    from nanoserve.distributed.shard import _input_columns, _output_rows
    from nanoserve.model.quant.group_codes import GroupCodes, SuperScales

    g = torch.Generator().manual_seed(0)
    n, k, group = 8, 512, 32
    supers = torch.rand(n, k // 256, generator=g).half().float()
    scale_m = torch.randint(0, 64, (n, k // group), generator=g, dtype=torch.int8)
    min_m = torch.randint(0, 64, (n, k // group), generator=g, dtype=torch.int8)
    scale_f, min_f = SuperScales(supers, scale_m), SuperScales(-supers, min_m)
    weight = GroupCodes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scale_f.values(),
                        min_f.values(), bits=4, group=group, scale_factors=scale_f, min_factors=min_f)
    whole = weight.dequantize()
    cols = slice(cut, cut + width)
    part = _input_columns(weight, cols)
    assert torch.equal(part.dequantize(), whole[:, cols])
    assert (part.scale_factors is None) == (cut % 256 != 0 or width % 256 != 0)
    if part.scale_factors is not None:
        assert torch.equal(part.scale_factors.values(), part.scales)
    rows = _output_rows(weight, slice(2, 6))
    assert torch.equal(rows.dequantize(), whole[2:6]) and torch.equal(rows.scale_factors.values(), rows.scales)
