"""Per architecture, the engine against transformers: tiny random models in transformers' own
implementation, batched through the paged cache with prefix caching and chunked prefill, eager
and compiled, give transformers' greedy tokens and logprobs (fp32, within 1e-4, near-tie aware),
with prompts several times longer than the sliding window."""

from __future__ import annotations

import random

import pytest
import torch
from arch_models import ARCHITECTURES, VOCAB, WINDOW, hf_and_ours, make_hf_model
from engine_oracle_helpers import engine_for, generate, greedy

from nanoserve.model.formats.hf_loader import load_hf_state_dict, read_hf_config
from nanoserve.model.formats.loader import build_model
from nanoserve.model.quant import cpu_kernels

transformers = pytest.importorskip("transformers")
MAX_TOKENS = 10
TOLERANCE = 1e-4


def prompts() -> list[list[int]]:
    """A shared system prefix (three blocks of 4 and a bit) under most prompts, and lengths from
    below the window to five windows."""
    rng = random.Random(0)
    system = [rng.randrange(3, VOCAB) for _ in range(13)]
    return [system + [rng.randrange(3, VOCAB) for _ in range(27)], system + [7, 8, 9],
            [rng.randrange(3, VOCAB) for _ in range(WINDOW - 3)], system + [rng.randrange(3, VOCAB) for _ in range(20)]]


@pytest.fixture
def fresh_dynamo():
    # Compiled code lives on decode_forward's code object, shared by every engine in the process.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_models(request, tmp_path_factory):
    return (request.param, *hf_and_ours(request.param, tmp_path_factory.mktemp(request.param)))


def transformers_greedy(hf, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-softmaxed scores."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float().log_softmax(-1) for s in out.scores]


def assert_matches_transformers(output, hf, prompt: list[int], tolerance: float = TOLERANCE) -> None:
    """The engine's tokens are transformers' and its logprobs within ``tolerance``, up to the
    first step where transformers' top two are closer than twice it (there the two may part)."""
    ref_tokens, ref_logprobs = transformers_greedy(hf, prompt)
    for i, (ours, ref) in enumerate(zip(output.token_ids, ref_tokens)):
        row = ref_logprobs[i]
        if ours != ref:
            first, second = row.topk(2).values.tolist()
            assert first - second < 2 * tolerance, f"parted at token {i} with a margin of {first - second}"
            return
        assert abs(output.logprobs[i].logprob - row[ref].item()) <= tolerance, (i, output.logprobs[i], row[ref])
    assert len(output.token_ids) == MAX_TOKENS


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_batched_chunked_prefix_cached_greedy_equals_transformers(arch_models, compiled, fresh_dynamo):
    _, hf, model = arch_models
    options = dict(compile=True, compile_backend="eager", row_buckets=(1, 2, 4), width_buckets=(64,),
                   warmup="eager") if compiled else {}
    engine = engine_for(model, max_num_batched_tokens=11, max_model_len=64, **options)
    batch = prompts()
    first = generate(engine, batch, greedy(MAX_TOKENS, logprobs=2))
    again = generate(engine, batch[1:], greedy(MAX_TOKENS, logprobs=2))  # from the cached prefixes
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefill_steps > len(batch)
    if compiled:  # the window is a per-layer constant: no graph beyond the buckets, no recompile
        assert stats.recompiles_after_warmup == 0
        assert stats.graphs_built <= len(engine.worker.decode_step.buckets.grid)
    for output, prompt in zip(first + again, batch + batch[1:]):
        assert_matches_transformers(output, hf, prompt)
    engine.check_drained()


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_gemma3_windowed_decode_through_inductor_equals_transformers(weights, fresh_dynamo, tmp_path):
    """One windowed family through inductor's graphs: fp32 reads through SDPA's banded mask, bf16
    through nanoserve's decode kernel with the layer's window (bf16 within its own tolerance)."""
    hf = make_hf_model("gemma3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = build_model(read_hf_config(tmp_path), load_hf_state_dict(tmp_path))
    engine = engine_for(model, max_num_batched_tokens=11, max_model_len=64, weights=weights, compile=True,
                        row_buckets=(4,), width_buckets=(64,), warmup="eager")
    # nanoserve's kernel reads bf16 K/V on every tier but torch's (SDPA there)
    kernel_read = weights == "bf16" and cpu_kernels.resolve_tier() != "torch"
    assert (engine.worker.decode_step.attention_kernel is not None) == kernel_read
    batch = prompts()
    outputs = generate(engine, batch, greedy(MAX_TOKENS, logprobs=2))
    assert engine.stats().recompiles_after_warmup == 0
    for output, prompt in zip(outputs, batch):
        assert_matches_transformers(output, hf, prompt, TOLERANCE if weights == "fp32" else 0.1)
