"""compile=True: bucketed static shapes through torch.compile, equal to eager, and never a
recompile after warm-up."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.model.quant import cpu_kernels

PROMPTS = [[1, 2, 3], list(range(10, 40)), [7] * 5]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Compiled code lives on decode_forward's code object, shared by every engine in the
    # process; each test counts its own graphs from a clean slate.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def tiny():
    return random_model(tiny_config(), seed=0)


def engine(model, **kwargs):
    options = dict(max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4, max_model_len=128)
    options.update(kwargs)
    return build_engine(model, **options)


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_compiled_decode_equals_eager_across_row_and_width_buckets(tiny):
    # Three rows that become two (row bucket 4 -> 2) while contexts cross width 48 -> 96.
    params = [greedy(64), greedy(64), greedy(20)]
    compiled = engine(tiny, compile=True, row_buckets=(2, 4), width_buckets=(48, 96, 128), warmup="eager")
    eager = engine(tiny)
    got = compiled.generate(PROMPTS, params, use_tqdm=False)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    hits = compiled.stats().bucket_hits
    assert {(4, 48), (2, 96)} <= set(hits), hits
    assert compiled.stats().recompiles_after_warmup == 0


@torch.inference_mode()
def test_compiled_logits_match_eager_within_1e4(tiny):
    compiled = engine(tiny, compile=True, row_buckets=(4,), width_buckets=(64, 128), warmup="eager")
    eager = engine(tiny)
    for e in (compiled, eager):
        e.generate(PROMPTS, greedy(1), use_tqdm=False)  # nothing left running: fresh rows
    logits = []
    for e in (compiled, eager):
        for p in PROMPTS:
            e.add_request(p, greedy(8))
        e.step()  # prefill
        logits.append(e.worker.forward(e.scheduler.schedule()).logits.clone())  # the first decode step
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def drive_through_every_bucket(e) -> None:
    """Rows 1..4 and contexts in every width bucket (21-34, 51-64, 101-114 tokens)."""
    for rows in (1, 2, 3):
        for prompt_len in (20, 50, 100):
            e.generate([[5] * prompt_len] * rows, [greedy(14)] * rows, use_tqdm=False)


def test_zero_recompiles_after_warmup_over_every_bucket(tiny):
    e = engine(tiny, compile=True, compile_backend="eager", row_buckets=(1, 2, 4),
               width_buckets=(32, 64, 128), warmup="eager")
    assert e.stats().warmup_seconds > 0
    grid = e.worker.decode_step.buckets.grid
    assert e.stats().graphs_built <= len(grid)
    drive_through_every_bucket(e)
    stats = e.stats()
    assert set(stats.bucket_hits) == set(grid)
    assert stats.recompiles_after_warmup == 0
    assert stats.graphs_built <= len(grid)
    assert stats.gathers == 0


def test_without_bucketing_shapes_grow_and_graphs_outnumber_the_grid(tiny):
    e = engine(tiny, compile=True, compile_backend="eager", bucketing=False)
    e.generate([[5] * 20], [greedy(14)], use_tqdm=False)
    # One request, 13 decode steps, 13 widths: a graph per step where buckets would give 1.
    assert e.stats().graphs_built == 13


def test_a_stray_shape_after_warmup_is_an_error_not_a_rebuild(tiny):
    e = engine(tiny, compile=True, compile_backend="eager", row_buckets=(2,), width_buckets=(32,),
               warmup="eager")
    step = e.worker.decode_step
    step.input_ids = step.input_ids.to(torch.int32)  # a buffer that no longer matches the guards
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        step._call(2, 32)


def test_padded_rows_write_only_the_scratch_slot(tiny):
    e = engine(tiny, compile=True, compile_backend="eager", row_buckets=(4,), width_buckets=(128,))
    e.generate([[1, 2, 3]], greedy(5), use_tqdm=False)
    step = e.worker.decode_step
    assert step.write_slots[1:4].tolist() == [e.scheduler.blocks.scratch_slot] * 3
    assert step.context_lens[1:4].tolist() == [0, 0, 0]
    assert step.stats.waste.padded_cells > 0


def test_two_engines_in_one_process_count_only_their_own_graphs(tiny):
    first = engine(tiny, compile=True, compile_backend="eager", row_buckets=(1,), width_buckets=(32,),
                   warmup="eager")
    assert first.stats().graphs_built == 1
    second = engine(tiny, compile=True, compile_backend="eager", row_buckets=(1, 2), width_buckets=(32,),
                    warmup="eager")
    assert second.stats().graphs_built == 2  # its own grid, compiled for its own buffers
    assert first.stats().graphs_built == 1  # untouched by the second engine's compiles
    first.generate([[5] * 10], [greedy(4)], use_tqdm=False)
    assert first.stats().recompiles_after_warmup == 0 and second.stats().graphs_built == 2


def test_engines_over_different_models_never_share_a_graph():
    # DecodeStep drops the guards on the model's modules; each step's own backend is what keeps
    # the second engine off the first one's graph, in which the norm's eps is a baked constant.
    models = [random_model(tiny_config(), seed=0), random_model(tiny_config(rms_norm_eps=0.5), seed=0)]
    eager = [[o.token_ids for o in engine(m).generate(PROMPTS, greedy(6), use_tqdm=False)] for m in models]
    assert eager[0] != eager[1]
    compiled = [engine(m, compile=True, compile_backend="eager", row_buckets=(4,), width_buckets=(64, 128))
                for m in models]
    for _ in range(2):  # the first round compiles, the second runs what each compiled
        for built, want in zip(compiled, eager):
            assert [o.token_ids for o in built.generate(PROMPTS, greedy(6), use_tqdm=False)] == want
    assert all(e.stats().recompiles_after_warmup == 0 for e in compiled)


def test_the_cpu_decode_kernel_gets_one_width_bucket_and_one_graph_per_row_bucket(monkeypatch):
    # The kernel reads each row's own cells whatever the window's width, so a bf16 engine on the
    # CPU compiles one width (max_model_len): decoding from 3 to 60 tokens of context builds one
    # graph per row bucket, not one per width, and gives eager's tokens. The waste figure counts
    # what the kernel reads: each real row's cells and one cell per padded row.
    monkeypatch.setenv(cpu_kernels.ENV, next(t for t in cpu_kernels.host_tiers() if t != "torch"))
    model = random_model(tiny_config(), seed=1)
    eager = engine(model, weights="bf16")
    compiled = engine(random_model(tiny_config(), seed=1), weights="bf16", compile=True, row_buckets=(2, 4), warmup="eager")
    step = compiled.worker.decode_step
    assert step.attention_kernel is not None and step.buckets.widths == (compiled.scheduler.blocks.max_model_len,)
    prompts = [[1, 2, 3], list(range(10, 40)), [7] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    want = eager.generate(prompts, params, use_tqdm=False)
    for got, ref in zip(compiled.generate(prompts, params, use_tqdm=False), want):
        # bf16 logits can tie: the two paths may break a tie apart, and only at a tie.
        same = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b), len(ref.token_ids))
        for i in range(same):
            assert got.logprobs[i].logprob == pytest.approx(ref.logprobs[i].logprob, abs=0.05)
        if same < len(ref.token_ids):
            (_, first), (_, second) = ref.logprobs[same].top[:2]
            assert first - second < 0.05, f"compiled left eager's tokens at {same} without a tie"
    stats = compiled.stats()
    assert {shape[1] for shape in stats.bucket_hits} == {compiled.scheduler.blocks.max_model_len}
    assert stats.graphs_built + stats.graphs_loaded == len(step.shapes) == 2 and stats.recompiles_after_warmup == 0
    padded_rows = sum(hits * (rows - 3) for (rows, _), hits in stats.bucket_hits.items() if rows == 4)
    assert step.stats.waste.padded_cells <= padded_rows  # 3 rows in the 4-row bucket, then fewer in 2
    # Asked for, width buckets still apply.
    assert engine(model, weights="bf16", compile=True, width_buckets=(32, 64, 128)).worker.decode_step.buckets.widths \
        == (32, 64, 128)
