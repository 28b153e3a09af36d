"""The GPU path: reduce-overhead decode records CUDA graphs once per bucket and replays them,
reading the slot table where it lives. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3], list(range(10, 40)), [7] * 5]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def cuda_engine(model, **kwargs):
    options = dict(max_batch_size=4, kv_cache_bytes=1 << 22, block_size=16, max_model_len=128,
                   device="cuda", dtype=torch.float32)
    options.update(kwargs)
    return build_engine(model, **options)


@pytest.fixture
def graph_calls(monkeypatch):
    """Counts CUDA graph captures and replays, whoever makes them."""
    calls = {"captures": 0, "replays": 0}
    begin, replay = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.replay

    def counting_begin(self, *args, **kwargs):
        calls["captures"] += 1
        return begin(self, *args, **kwargs)

    def counting_replay(self, *args, **kwargs):
        calls["replays"] += 1
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting_begin)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting_replay)
    return calls


def test_reduce_overhead_records_once_per_bucket_and_replays_every_step(graph_calls):
    model = random_model(tiny_config(), seed=0)
    # Four buckets keep the check short; the contract is per bucket, not per grid size.
    compiled = cuda_engine(model, compile=True, row_buckets=(1, 4), width_buckets=(32, 128),
                           warmup="eager")
    grid = compiled.worker.decode_step.buckets.grid
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    captured_at_warmup = graph_calls["captures"]
    # One more capture than buckets at most: the cudagraph tree manager opens with an empty
    # capture that keeps its memory pool alive.
    assert 0 < captured_at_warmup <= len(grid) + 1
    replays_before = graph_calls["replays"]
    got = compiled.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = compiled.stats()
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips == 0
    assert graph_calls["captures"] == captured_at_warmup, "a graph was recorded after warm-up"
    assert graph_calls["replays"] - replays_before >= stats.decode_steps
    assert stats.recompiles_after_warmup == 0
    want = cuda_engine(model).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_window_is_the_table_buffer_for_every_bucket():
    model = random_model(tiny_config(), seed=0)
    engine = cuda_engine(model, compile=True, compile_backend="eager", row_buckets=(1, 2, 4),
                         width_buckets=(32, 64, 128))
    buffer = engine.worker.cache.slot_table.slots
    for rows, width in engine.worker.decode_step.buckets.grid:
        window = buffer[:rows, :width]
        assert window.data_ptr() == buffer.data_ptr() and window.stride(0) == buffer.stride(0)
    engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert engine.stats().gathers == 0 and engine.stats().windows > 0


def test_bf16_is_the_cuda_default_and_decodes():
    model = random_model(tiny_config(), seed=0)
    engine = cuda_engine(model, dtype=None)
    assert engine.worker.cache.layers.k_cells[0].dtype == torch.bfloat16
    out = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 40 for o in out)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_verify_graphs_give_the_plain_greedy_tokens(method):
    """A verify step is one more recorded shape, [rows, k + 1, width]: its greedy tokens are the
    plain engine's, with no recompile after warm-up."""
    model = random_model(tiny_config(), seed=0)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 9, 8, 9, 8], list(range(10, 30))]
    want = cuda_engine(model, compile=True).generate(prompts, GREEDY, use_tqdm=False)
    speculative = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    if method == "draft":
        speculative.pop("prompt_lookup_min")
    engine = cuda_engine(model, compile=True, speculative=speculative)
    got = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_accepted_tokens > 0 and stats.verify_bucket_hits
    assert stats.recompiles_after_warmup == 0 and stats.spec_draft_recompiles == 0
    engine.check_drained()


def test_q8_0_cells_and_window_rings_replay_as_the_eager_steps_on_cuda():
    """The cache's other layouts on a GPU: q8_0 cells (written and dequantised in the recorded
    graph) and sliding-window layers in rings (prefix caching off), their greedy tokens the
    eager steps'."""
    config = tiny_config(hidden_size=128, head_dim=32, num_layers=4, sliding_window=6,
                         layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"))
    model = random_model(config, seed=5)
    options = dict(kv_cache_dtype="q8_0", enable_prefix_caching=False)
    want = cuda_engine(model, **options).generate(PROMPTS, GREEDY, use_tqdm=False)
    engine = cuda_engine(model, compile=True, **options)
    assert engine.worker.cache.ring is not None
    got = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats().recompiles_after_warmup == 0
    engine.check_drained()
