"""Rejection sampling through the engine keeps the target's law: a deliberately bad draft model
(another random model, its mass far from the target's) proposes, the engine verifies, and the
tokens a few thousand seeded requests emit follow the exact law computed from the target's
logits (softmax of logits / temperature, top-k as the sampler cuts it), by a chi-square test at
p = 0.001. A 16-token vocabulary keeps every bin's expected count large.

The first token comes from the prompt's prefill (no proposal precedes it); the second and third
come out of verify steps: an accepted draft token, a residual redraw after a rejection, or the
bonus token after an acceptance. Each is tested against its law given the most frequent tokens
before it. The test is seeded: its outcome is fixed, not flaky."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config

# Upper 0.1% points of the chi-square distribution by degrees of freedom: NIST/SEMATECH
# e-Handbook of Statistical Methods, section 1.3.6.7.4 ("Critical values of the chi-square
# distribution", upper tail, column 0.999).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
            9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}
MIN_EXPECTED = 5  # bins expected to hold fewer are merged
CONFIG = tiny_config(vocab_size=16)
TARGET = random_model(CONFIG, seed=0)
BAD_DRAFT = random_model(CONFIG, seed=7)
PROMPT = [3, 1, 4, 1, 5]
REQUESTS = 4000


@torch.no_grad()
def target_law(tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """The exact law of the token after ``tokens``: the dense forward's logits, scaled by the
    temperature, top-k kept (ties with the k-th stay in, as the sampler keeps them)."""
    logits = dense_forward(TARGET, torch.tensor([tokens]))[0, -1].double()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k:
        probs = probs.where(probs >= probs.topk(params.top_k).values[-1], 0.0)
    return probs / probs.sum()


def chi_square(samples: list[int], law: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the samples' counts against ``law``, the bins expected
    to hold fewer than MIN_EXPECTED merged (smallest first) until the merged bin holds enough. A
    token outside the law's support fails at once."""
    counts = torch.bincount(torch.tensor(samples), minlength=len(law)).double()
    support = law > 0
    assert counts[~support].sum() == 0, f"tokens the target cannot emit: {counts[~support]}"
    expected = len(samples) * law[support]
    observed = counts[support]
    order = expected.argsort()
    bins, merged_e, merged_o = [], 0.0, 0.0
    for i in order.tolist():
        if merged_e < MIN_EXPECTED:
            merged_e, merged_o = merged_e + expected[i].item(), merged_o + observed[i].item()
        else:
            bins.append((expected[i].item(), observed[i].item()))
    if bins and merged_e < MIN_EXPECTED:  # what is left joins the smallest whole bin
        e, o = bins.pop(0)
        merged_e, merged_o = merged_e + e, merged_o + o
    bins.append((merged_e, merged_o))
    assert len(bins) >= 2, "too few samples to test"
    return sum((o - e) ** 2 / e for e, o in bins), len(bins) - 1


def assert_law(samples: list[int], law: torch.Tensor, what: str) -> None:
    stat, df = chi_square(samples, law)
    assert stat < CHI2_999[df], f"{what}: chi-square {stat:.1f} over {df} dof (n={len(samples)}): not the target's law"


def test_chi_square_merges_thin_bins_and_catches_a_wrong_law():
    law = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01], dtype=torch.float64)
    samples = torch.multinomial(law, 2000, replacement=True, generator=torch.Generator().manual_seed(0)).tolist()
    stat, df = chi_square(samples, law)
    assert df == 4 and stat < CHI2_999[df]
    assert chi_square(samples[:100], law)[1] == 3  # 100 samples: the two thinnest bins are one
    wrong = torch.tensor([0.45, 0.35, 0.15, 0.04, 0.01], dtype=torch.float64)
    assert chi_square(samples, wrong)[0] > CHI2_999[4]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True)],
                         ids=["temperature-1", "top-k-6"])
def test_speculated_tokens_follow_the_targets_law(params):
    engine = build_engine(TARGET, max_batch_size=8, kv_cache_bytes=1 << 20, block_size=4, max_model_len=32,
                          speculative={"method": "draft", "model": BAD_DRAFT, "num_speculative_tokens": 2,
                                       "adaptive": False, "disable_by_batch_size": 9})
    seeded = [dataclasses.replace(params, seed=seed) for seed in range(REQUESTS)]
    outputs = [o.token_ids for o in engine.generate([PROMPT] * REQUESTS, seeded, use_tqdm=False)]
    assert all(len(t) == 4 for t in outputs)
    s = engine.stats()
    # Most steps verify; proposals are both accepted and rejected (each residual redraw is tested).
    assert s.spec_verify_steps > s.steps // 2, s
    assert 0.1 * s.spec_proposed_tokens < s.spec_accepted_tokens < 0.9 * s.spec_proposed_tokens, s
    engine.check_drained()

    assert_law([t[0] for t in outputs], target_law(PROMPT, params), "first token (prefill)")
    # Each later position given the most frequent tokens before it.
    prefix: list[int] = []
    tested = 0
    for position in (1, 2, 3):
        before = [t for t in outputs if t[:position - 1] == prefix]
        ((mode, _),) = Counter(t[position - 1] for t in before).most_common(1)
        prefix = prefix + [mode]
        given = [t for t in before if t[position - 1] == mode]
        if len(given) < 300:
            break
        assert_law([t[position] for t in given], target_law(PROMPT + prefix, params), f"token {position} given {prefix}")
        tested += 1
    assert tested >= 2  # the second and third tokens (both out of verify steps) were tested
