"""SamplingParams validation and the vectorised sampler's per-row behaviour."""

import pytest
import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.worker.sampler import Sampler, apply_top_k_top_p, inverse_cdf_draw


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", 1.2), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("seed", -1), ("logprobs", -1), ("stop", [""]),
    ("max_tokens", 2.5), ("temperature", float("nan")),
    # Beyond what the sampler's tensors and the generator can hold, and non-finite floats.
    ("max_tokens", 2**63), ("top_k", 2**63), ("seed", 2**64), ("stop_token_ids", [2**63]),
    ("logprobs", 2**63), ("prompt_logprobs", -1), ("temperature", float("inf")),
    ("repetition_penalty", float("inf")), ("temperature", 10**400), ("max_tokens", True),
])
def test_invalid_sampling_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_the_widest_values_that_fit_are_accepted():
    params = SamplingParams(max_tokens=0, top_k=2**63 - 1, seed=2**64 - 1, logprobs=2**63 - 1,
                            stop_token_ids=[2**63 - 1], temperature=1e308)
    torch.Generator().manual_seed(params.seed)  # the generator takes the whole seed range


def test_huge_top_k_and_logprobs_are_clamped_to_the_vocabulary():
    logits = torch.randn(2, 50)
    params = [SamplingParams(top_k=2**63 - 1, logprobs=2**63 - 1), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, params, [_gen(0), None])
    assert len(out.logprobs[0].top) == 50 and out.logprobs[1] is None


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    out = Sampler()(logits, params, [None] * 5)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = Sampler()(logits, params, [None] * 4)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_seeded_row_is_reproducible_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=1.0, seed=7)
    gen = _gen(7)
    alone = []
    for _ in range(20):
        alone.append(Sampler()(logits[1:2], [seeded], [gen]).token_ids.item())
    gen = _gen(7)
    batched = []
    for _ in range(20):
        out = Sampler()(logits, [SamplingParams(temperature=1.3), seeded, SamplingParams(top_k=3)],
                        [None, gen, None])
        batched.append(out.token_ids[1].item())
    assert alone == batched


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.7])
    logits = probs.log().repeat(4000, 1)
    out = Sampler()(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    freq = torch.bincount(out.token_ids, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_k_keeps_only_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    masked = apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.75]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[0.9, 0.05, 0.05]]).log()
    masked = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.01]))
    assert torch.isfinite(masked).tolist() == [[True, False, False]]


def test_min_p_drops_tokens_below_the_scaled_floor():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log().repeat(500, 1)
    out = Sampler()(logits, [SamplingParams(min_p=0.4)] * 500, [None] * 500)
    assert set(out.token_ids.tolist()) <= {0, 1}


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler()(logits, [p], [None], histories=[([0], [])])
    assert out.token_ids.item() == 1


def test_frequency_penalty_scales_with_count():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    once = Sampler()(logits, [p], [None], histories=[([], [0])]).token_ids.item()
    twice = Sampler()(logits, [p], [None], histories=[([], [0, 0])]).token_ids.item()
    assert (once, twice) == (0, 1)


def test_logprobs_report_the_chosen_token_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits, -1)[0]
    assert lp.token_id == 1 and lp.logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in lp.top] == [1, 2]


def test_seeded_and_global_draws_of_the_race_are_pinned():
    # The exponential race (the GPU's path), recorded before Sampler.distribution was split out
    # of __call__: a refactor must draw the same tokens from the same generator states (torch's
    # CPU RNG). The CPU op's draws are pinned by test_sample_rows_* below.
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.8, seed=11),
              SamplingParams(top_p=0.9, min_p=0.05)]
    gen = _gen(11)
    torch.manual_seed(3)
    draws = [Sampler(cpu_op=False)(logits, params, [None, gen, None]).token_ids.tolist() for _ in range(5)]
    assert draws == [[62, 98, 46], [23, 16, 60], [59, 10, 37], [96, 24, 44], [62, 82, 70]]


def test_distribution_is_what_call_argmaxes_and_samples_from():
    logits = torch.randn(2, 30)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.7, top_k=5)]
    histories = [([1, 2], [3]), ([], [])]
    processed, probs = Sampler().distribution(logits, params, histories)
    out = Sampler()(logits, params, [None, None], histories)
    assert out.token_ids[0] == processed[0].argmax()
    assert (probs[1] > 0).sum() == 5 and probs[1, out.token_ids[1]] > 0
    top = logits[1].topk(5).indices
    expected = torch.zeros(30).index_put_((top,), torch.softmax(logits[1, top] / 0.7, -1))
    assert torch.allclose(probs[1], expected)


def _dense_penalties(logits, params, histories):
    """The penalties' definition over the whole vocabulary (what apply_penalties computes sparsely)."""
    n, vocab = logits.shape
    counts = torch.zeros(n, vocab)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    for row, (prompt, output) in enumerate(histories):
        if output:
            counts[row].index_add_(0, torch.tensor(output), torch.ones(len(output)))
        if prompt:
            seen[row, torch.tensor(prompt)] = True
    seen |= counts > 0
    rep = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    return logits - presence * (counts > 0) - frequency * counts


def test_penalties_change_only_seen_tokens_exactly_as_their_dense_definition():
    import random

    from nanoserve.worker.sampler import apply_penalties

    rng = random.Random(0)
    for _ in range(30):
        n, vocab = rng.randint(1, 5), rng.choice([50, 1000, 49152])
        logits = torch.randn(n, vocab) * 3
        params = [SamplingParams(repetition_penalty=rng.choice([1.0, 1.1, 1.5]),
                                 presence_penalty=rng.choice([0.0, 0.5, -1.0]),
                                 frequency_penalty=rng.choice([0.0, 0.3])) for _ in range(n)]
        histories = [([rng.randrange(vocab) for _ in range(rng.randint(0, 30))],
                      [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]) for _ in range(n)]
        before = logits.clone()
        assert torch.equal(apply_penalties(logits, params, histories), _dense_penalties(logits, params, histories))
        assert torch.equal(logits, before)  # the caller's logits untouched


def test_inverse_cdf_draw_draws_each_token_with_its_probability_and_a_seeded_row_from_its_own_generator():
    # Unnormalised, with zeros between and after: a token of no mass is never drawn.
    probs = torch.tensor([0.0, 3.0, 0.0, 1.0, 4.0, 0.0, 2.0, 0.0, 0.0])
    torch.manual_seed(0)
    draws = torch.cat([inverse_cdf_draw(probs.expand(500, -1), [None] * 500) for _ in range(40)])
    freq = torch.bincount(draws, minlength=probs.numel()).double() / draws.numel()
    assert (freq[probs == 0] == 0).all()
    # 20000 draws: a share's standard deviation is at most 0.0035; 5 of them.
    assert (freq - probs.double() / probs.sum()).abs().max() < 0.018
    # A seeded row draws the same token in any batch, whatever the global RNG did before.
    law = torch.rand(64) + 0.1
    alone = [inverse_cdf_draw(law.unsqueeze(0), [torch.Generator().manual_seed(seed)])[0] for seed in range(8)]
    for seed in range(8):
        torch.manual_seed(100 + seed)
        batch = torch.stack([torch.rand(64), law, torch.rand(64)])
        assert inverse_cdf_draw(batch, [None, torch.Generator().manual_seed(seed), None])[1] == alone[seed]
    assert len(set(int(t) for t in alone)) > 1  # the seed matters
