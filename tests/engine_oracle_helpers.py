"""Engine helpers shared by the chunked-prefill and prefix-caching suites: an engine sized for
them, a bounded step loop and the dense oracle's greedy tokens with logprobs."""

from __future__ import annotations

import torch

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.llama import dense_forward

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, 4 slots, fp32


def engine_for(model, max_num_batched_tokens: int, **kwargs):
    options = dict(max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4, max_model_len=128,
                   max_num_batched_tokens=max_num_batched_tokens)
    return build_engine(model, **{**options, **kwargs})


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(engine, max_steps: int = 2000) -> dict:
    """Step until nothing is left; the finished outputs by request id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    raise AssertionError(f"engine still busy after {max_steps} steps: {engine.stats()}")


def generate(engine, prompts, params) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    done = run(engine)
    return [done[i] for i in ids]


def dense_greedy_with_logprobs(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(max_tokens):
        row = torch.log_softmax(dense_forward(model, torch.tensor([ids]))[0, -1].float(), dim=-1)
        ids.append(int(row.argmax()))
        logprobs.append(float(row.max()))
    return ids[len(prompt):], logprobs


def assert_greedy_agrees_up_to_near_ties(got, ref, tolerance: float) -> None:
    """Two greedy runs of one prompt whose logits may differ by rounding (eager vs compiled,
    another kernel tier): every logprob both runs computed agrees within ``tolerance``, and the
    tokens are equal up to the first step where ``ref``'s top two logprobs are closer than twice
    it. Each run's logprobs lie within ``tolerance`` of the exact ones, so a flip needs a margin
    below 2 * tolerance: only there may the runs part (and then nothing after is comparable).
    Both outputs need ``logprobs >= 2``."""
    for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)):
        top = ref.logprobs[i].top
        assert abs(got.logprobs[i].logprob - ref.logprobs[i].logprob) <= tolerance or a != b, (i, got.logprobs[i], top)
        if a != b:
            (_, first), (_, second) = top[:2]
            assert first - second < 2 * tolerance, f"the runs parted at token {i} with a margin of {first - second}"
            return
    assert len(got.token_ids) == len(ref.token_ids)


def dequantised_logits_bound(path, plan, want: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """How far a GGUF's packed logits may stand from ``want``, its fp32 dequantisation's: through
    torch's kernel, which rounds every scale to bf16 besides, 0.2 of the largest logit (its layer
    products are checked on their own); where ``plan`` computes in bf16, twice as far as the same
    weights held dense in bf16 come; in fp32, 2e-3 of the largest logit."""
    from nanoserve.model.formats.loader import load_model
    from nanoserve.model.quant.weight_plan import WeightPlan

    if plan.tier == "torch":
        return 0.2 * want.abs().max()
    if plan.dtype != torch.bfloat16:
        return 2e-3 * want.abs().max()
    bf16, _ = load_model(str(path), weights=WeightPlan("bf16"))
    return 2 * (dense_forward(bf16, ids)[0].float() - want).abs().max()
