"""Speculative acceptance: greedy rows emit exactly the plain sampler's tokens, sampling rows
the target's law (chi-square over many trials), seeded rows reproduce, failures stay in their row."""

import pytest
import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.structured.masks import TokenMasks
from nanoserve.worker.acceptance import RowVerdict, verify
from nanoserve.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 40


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _plain_chain(logits, params, history):
    """What non-speculative greedy decoding emits at each position, the history growing by its
    own tokens."""
    prompt, output = history
    tokens = []
    for j in range(logits.shape[0]):
        out = Sampler()(logits[j:j + 1], [params], [None], [(prompt, output + tokens)])
        tokens.append(out.token_ids.item())
    return tokens


def _wrong(token):
    return (token + 1) % VOCAB


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.0, repetition_penalty=1.8,
                                                           frequency_penalty=0.9, presence_penalty=0.5)])
def test_greedy_rows_emit_the_plain_samplers_tokens(params):
    torch.manual_seed(1)
    history = ([1, 2, 3], [4, 5, 4])
    row_logits = [torch.randn(5, VOCAB) for _ in range(4)]
    for logits, hot in zip(row_logits, ([4, 5, 1, 2, 3], [2, 2, 4, 1, 2], [3, 4, 3, 1, 1], [5, 4, 3, 2, 1])):
        logits[torch.arange(5), torch.tensor(hot)] += 4.0  # seen tokens lead: penalties change the chain
    chains = [_plain_chain(logits, params, history) for logits in row_logits]
    if params.uses_penalties:
        assert any(chain != logits.argmax(-1).tolist() for chain, logits in zip(chains, row_logits))
    right, first_wrong, middle_wrong, none = chains
    proposals = [tuple(right[:4]), [_wrong(first_wrong[0])] + first_wrong[1:4],
                 middle_wrong[:2] + [_wrong(middle_wrong[2]), middle_wrong[3]], []]
    logits = torch.cat([row_logits[0], row_logits[1], row_logits[2], row_logits[3][:1]])
    verdicts, failed = verify(Sampler(), logits, proposals, [params] * 4, [None] * 4, [history] * 4)
    assert failed == {}
    assert [v.token_ids for v in verdicts] == [right, first_wrong[:1], middle_wrong[:3], none[:1]]
    assert [v.accepted for v in verdicts] == [4, 0, 2, 0]
    assert all(lp is None for v in verdicts for lp in v.logprobs)


def test_logprobs_are_the_plain_samplers_at_each_emitted_position():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.3)
    history = ([7], [8, 9])
    chain = _plain_chain(logits, params, history)
    sampled = SamplingParams(temperature=1.0, logprobs=0)
    verdicts, _ = verify(Sampler(), torch.cat([logits, logits[:2]]), [chain[:3], [chain[0]]],
                         [params, sampled], [None, _gen(0)], [history, ([], [])])
    prompt, output = history
    for j, lp in enumerate(verdicts[0].logprobs):
        plain = Sampler()(logits[j:j + 1], [params], [None], [(prompt, output + chain[:j])]).logprobs[0]
        assert (lp.token_id, lp.logprob, lp.top) == (plain.token_id, plain.logprob, plain.top)
    raw = torch.log_softmax(logits, -1)
    for j, (token, lp) in enumerate(zip(verdicts[1].token_ids, verdicts[1].logprobs)):
        assert lp.token_id == token and lp.logprob == raw[j, token].item() and lp.top == []


def _bitmask(allowed, rows):
    words = torch.zeros(rows, (VOCAB + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[:, t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)


def test_a_masked_row_takes_its_mask_at_its_single_position():
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB)
    masks = TokenMasks([1, 2], _bitmask({3, 7}, 2))
    for seed in range(20):
        verdicts, failed = verify(Sampler(), logits, [[int(logits[0].argmax())], [], []],
                                  [GREEDY, GREEDY, SamplingParams(temperature=2.0)], [None, None, _gen(seed)],
                                  masks=masks)
        assert failed == {} and verdicts[0].accepted == 1
        assert verdicts[1].token_ids == [3 if logits[2, 3] > logits[2, 7] else 7]
        assert verdicts[2].token_ids[0] in {3, 7}


def test_a_masked_row_with_proposals_is_refused():
    with pytest.raises(ValueError, match="mask"):
        verify(Sampler(), torch.randn(3, VOCAB), [[1, 2]], [GREEDY], [None], masks=TokenMasks([0], _bitmask({1}, 1)))


def _sampling_batch(step, companions):
    """One step's logits and proposals for a seeded row 0 and ``companions`` other rows."""
    torch.manual_seed(100 + step)
    logits, proposals, draft = [torch.randn(4, VOCAB)], [[1, 2, 3]], torch.randn(3, VOCAB)
    logits[0][[0, 1, 2], [1, 2, 3]] += 3.0  # likely enough that some steps keep some
    draft[[0, 1, 2], [1, 2, 3]] += 5.0  # the draft likes them more than the target does
    drafts = [torch.softmax(draft, -1)]
    for c in range(companions):
        k = c % 3
        logits.append(torch.randn(1 + k, VOCAB))
        proposals.append(list(range(k)))
        drafts.append(None)
    return torch.cat(logits), proposals, drafts


@pytest.mark.parametrize("with_drafts", [False, True])
def test_a_seeded_row_reproduces_whatever_shares_the_batch(with_drafts):
    seeded = SamplingParams(temperature=1.5, seed=5)
    runs = []
    for companions in (0, 5):
        gen = _gen(5)
        verdicts = []
        for step in range(12):
            logits, proposals, drafts = _sampling_batch(step, companions)
            torch.manual_seed(companions)  # the global RNG differs between the runs
            params = [seeded] + [SamplingParams(temperature=0.9)] * companions
            out, failed = verify(Sampler(), logits, proposals, params, [gen] + [None] * companions,
                                 draft_probs=drafts if with_drafts else None)
            assert failed == {}
            verdicts.append(out[0])
        runs.append(verdicts)
    assert runs[0] == runs[1]
    assert len({v.accepted for v in runs[0]}) > 1  # the steps really differ in what they accept


def test_a_failing_row_fails_alone():
    torch.manual_seed(4)
    logits = torch.randn(2 + 3 + 3 + 4 + 1, VOCAB)
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.2)
    seeded = SamplingParams(temperature=1.0, seed=3)
    proposals = [[1], [2, 3], [VOCAB, 1], [4, 5, 6], []]
    histories = [([], [])] * 5
    histories[1] = ([10**6], [])  # an impossible token in row 1's history
    drafts = [None, None, None, torch.ones(2, VOCAB) / VOCAB, None]  # row 3's is one position short
    verdicts, failed = verify(Sampler(), logits, proposals, [seeded, penalised, GREEDY, seeded, GREEDY],
                              [_gen(3), None, None, _gen(3), None], histories, draft_probs=drafts)
    assert sorted(failed) == [1, 2, 3] and all(verdicts[r] is None for r in failed)
    assert "vocabulary" in failed[2] and "draft probs" in failed[3]
    alone, _ = verify(Sampler(), logits[:2], [[1]], [seeded], [_gen(3)])
    assert verdicts[0] == alone[0]  # the generator was rewound before the row was redone
    assert verdicts[4] == RowVerdict([int(logits[-1].argmax())], [None], 0)


def test_an_empty_batch_and_mismatched_logits():
    assert verify(Sampler(), torch.zeros(0, VOCAB), [], [], []) == ([], {})
    with pytest.raises(ValueError, match="positions"):
        verify(Sampler(), torch.zeros(2, VOCAB), [[1, 2]], [GREEDY], [None])


# --- The law: chi-square over many trials ------------------------------------------------------

# Upper 0.1% points of the chi-square distribution by degrees of freedom: NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.4 ("Critical values of the chi-square
# distribution", column 0.999).
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515, 9: 27.877}
TRIALS = 30_000
P = torch.tensor([[0.30, 0.05, 0.10, 0.02, 0.15, 0.08, 0.05, 0.10, 0.10, 0.05],  # the target's law at
                  [0.05, 0.25, 0.05, 0.20, 0.05, 0.10, 0.10, 0.05, 0.05, 0.10],  # positions 0, 1, 2,
                  [0.02, 0.08, 0.20, 0.13, 0.11, 0.09, 0.12, 0.07, 0.10, 0.08]])  # whatever came before
Q = torch.tensor([[0.0125, 0.30, 0.0125, 0.60, 0.0125, 0.0125, 0.0125, 0.0125, 0.0125, 0.0125],  # a bad draft:
                  [0.70] + [0.3 / 9] * 9])  # its mass where the target's is least
# How often a deterministic proposer guesses each token (verify is not told): skewed, since with
# guesses spread evenly, redrawing a rejection from p instead of p without x keeps the law.
GUESSES = torch.tensor([[0.40, 0.0375, 0.0375, 0.0375, 0.30, 0.0375, 0.0375, 0.0375, 0.0375, 0.0375],
                        [0.04, 0.64, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04]])


def _processed(law, params):
    """The target's law after temperature, top-k and min-p, computed by hand."""
    scaled = torch.softmax(law.log() / params.temperature, -1)
    if params.top_k:
        scaled = scaled.where(scaled >= scaled.topk(params.top_k).values[-1], 0.0)  # ties with the k-th stay in
    scaled = scaled.where(scaled >= scaled.max() * params.min_p, 0.0)
    return scaled / scaled.sum()


def _chi_square(tokens, law):
    """(statistic, degrees of freedom) of the tokens' counts against ``law``; a token outside
    the law's support fails at once."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(law)).double()
    support = law > 0
    assert counts[~support].sum() == 0, "a token the target cannot emit was emitted"
    expected = counts.sum() * law[support].double() / law[support].sum()
    assert expected.min() >= 5, "too few trials for the chi-square approximation"
    return ((counts[support] - expected) ** 2 / expected).sum().item(), int(support.sum()) - 1


def _check_law(tokens, law):
    stat, df = _chi_square(tokens, law)
    assert stat < CHI2_999[df], f"chi-square {stat:.1f} over {df} dof: not the target's law"


@pytest.mark.parametrize("draft", ["bad", "deterministic"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=6, min_p=0.2)], ids=["plain", "processed"])
def test_emitted_tokens_follow_the_targets_law(draft, params):
    torch.manual_seed(7)
    proposer = _gen(8)
    guesses = Q if draft == "bad" else GUESSES
    proposals = torch.stack([torch.multinomial(guesses[j], TRIALS, replacement=True, generator=proposer)
                             for j in range(2)], 1).tolist()
    drafts = [Q] * TRIALS if draft == "bad" else None  # told the law of Q; a deterministic proposer's is one-hot
    logits = P.log().repeat(TRIALS, 1)
    verdicts, failed = verify(Sampler(), logits, proposals, [params] * TRIALS, [None] * TRIALS,
                              draft_probs=drafts)
    assert failed == {}
    law = [_processed(P[j], params) for j in range(3)]
    if params.min_p:
        assert [int((p > 0).sum()) for p in law] == [5, 5, 6]  # min-p cut inside top-k, so it is tested
    _check_law([v.token_ids[0] for v in verdicts], law[0])
    # Given the first token was a kept proposal, the second has position 1's law whatever the first.
    for first in range(10):
        seconds = [v.token_ids[1] for v in verdicts if v.accepted >= 1 and v.token_ids[0] == first]
        if len(seconds) >= 300:
            _check_law(seconds, law[1])
    _check_law([v.token_ids[2] for v in verdicts if v.accepted == 2], law[2])
    assert 0 < sum(v.accepted for v in verdicts) < 2 * TRIALS


def test_greedy_rows_ignore_sampling_companions_and_drafts():
    torch.manual_seed(9)
    logits = torch.randn(3 + 4, VOCAB)
    chain = logits[:3].argmax(-1).tolist()
    proposals = [chain[:2], [5, 6, 7]]
    drafts = [torch.full((1, VOCAB), 1.0 / VOCAB), torch.softmax(torch.randn(3, VOCAB), -1)]  # row 0's: ignored
    alone, _ = verify(Sampler(), logits[:3], proposals[:1], [GREEDY], [None])
    mixed, failed = verify(Sampler(), logits, proposals, [GREEDY, SamplingParams(top_p=0.9)], [None, _gen(1)],
                           draft_probs=drafts)
    assert failed == {} and mixed[0] == alone[0] == RowVerdict(chain, [None] * 3, 2)
