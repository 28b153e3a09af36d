"""Sampling parameters under speculation behave as without it (greedy rows): penalties see each
proposal's history, stop strings and stop_token_ids end a reply in the middle of an accepted
run with nothing after them kept, max_tokens is never passed, and logprobs and prompt logprobs
are the model's own (within 1e-4 of the plain engine's). The perfect draft (the target itself)
gives long accepted runs, the n-gram proposer accepted and rejected ones."""

from __future__ import annotations

import pytest
from engine_oracle_helpers import engine_for, greedy
from spec_helpers import MODEL, PROMPTS, PROPOSERS, assert_drained, tokens

SPECS = ["ngram", "draft-perfect"]


class HexTokenizer:
    """Two hex digits per token: stop strings can begin inside a token and end inside another."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"{i:02x}" for i in ids)


def generate(engine, prompts, params):
    """One output per prompt, in order; ``params`` one for all or one per prompt."""
    return engine.generate(prompts, params, use_tqdm=False)


@pytest.fixture(autouse=True)
def gates(monkeypatch):
    monkeypatch.setenv("NANOSERVE_CHECKS", "1")


def pair(spec: str, **options):
    """A plain engine and a speculating one, otherwise alike."""
    plain = engine_for(MODEL, 64, tokenizer=HexTokenizer(), **options)
    return plain, engine_for(MODEL, 64, tokenizer=HexTokenizer(), speculative=PROPOSERS[spec], **options)


def both(spec: str, prompts, params, **options):
    plain, engine = pair(spec, **options)
    want = generate(plain, prompts, params)
    got = generate(engine, prompts, params)
    s = engine.stats()
    assert s.spec_verify_steps > 0 and s.spec_proposed_tokens > 0, s
    assert_drained(engine)
    return got, want, s


def assert_same(got, want) -> None:
    assert tokens(got) == tokens(want)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.text for o in got] == [o.text for o in want]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.3), dict(presence_penalty=0.8),
                                     dict(frequency_penalty=0.5),
                                     dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)])
def test_penalties(spec, penalty):
    got, want, _ = both(spec, PROMPTS, greedy(24, **penalty))
    assert_same(got, want)
    assert tokens(want) != tokens(generate(engine_for(MODEL, 64), PROMPTS, greedy(24)))  # the penalty bites


@pytest.mark.parametrize("spec", SPECS)
def test_stop_strings_end_an_accepted_run(spec):
    plain, _ = pair(spec)
    full = generate(plain, PROMPTS, greedy(24))
    # Per prompt, 3 characters from the middle of its reply (from the second digit of a token).
    prompts, params = [], []
    for prompt, out in zip(PROMPTS, full):
        for start in (9, 21, 33):
            prompts.append(prompt)
            params.append(greedy(24, stop=(out.text[start:start + 3],)))
    plain, engine = pair(spec)
    want = generate(plain, prompts, params)
    got = generate(engine, prompts, params)
    assert_same(got, want)
    assert sum(o.finish_reason == "stop" for o in want) >= len(want) // 2
    assert engine.stats().spec_accepted_tokens > 0
    assert_drained(engine)


@pytest.mark.parametrize("spec", SPECS)
def test_stop_token_ids_end_an_accepted_run(spec):
    plain, _ = pair(spec)
    full = tokens(generate(plain, PROMPTS, greedy(24)))
    prompts = [p for p in PROMPTS for _ in range(3)]
    params = [greedy(24, stop_token_ids=[out[i]]) for out in full for i in (3, 8, 15)]
    got, want, s = both(spec, prompts, params)
    assert_same(got, want)
    assert all(o.finish_reason == "stop" and o.token_ids[-1] in p.stop_token_ids for o, p in zip(want, params))
    assert s.spec_accepted_tokens > 0


@pytest.mark.parametrize("spec", SPECS)
def test_max_tokens_anywhere_in_a_run(spec):
    """max_tokens 2..9 against runs of up to 4 tokens a step (3 proposals and the target's own)."""
    prompts = [p for p in PROMPTS[:3] for _ in range(2, 10)]
    params = [greedy(m) for _ in PROMPTS[:3] for m in range(2, 10)]
    plain, engine = pair(spec)
    want = generate(plain, prompts, params)
    got = generate(engine, prompts, params)
    assert_same(got, want)
    assert [len(o.token_ids) for o in got] == [p.max_tokens for p in params]
    assert engine.stats().spec_accepted_tokens > 0
    assert_drained(engine)


@pytest.mark.parametrize("spec", SPECS)
def test_logprobs_and_prompt_logprobs(spec):
    params = greedy(20, logprobs=3, prompt_logprobs=2)
    got, want, s = both(spec, PROMPTS, params)
    assert tokens(got) == tokens(want) and s.spec_accepted_tokens > 0
    for a, b in zip(got, want):
        assert len(a.logprobs) == len(b.logprobs) == 20
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4
            assert len(x.top) == len(y.top) == 3
            assert x.top[0][0] == y.top[0][0]
            assert all(abs(p - q) <= 1e-4 for (_, p), (_, q) in zip(x.top, y.top))
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4
            assert all(abs(p - q) <= 1e-4 for (_, p), (_, q) in zip(x.top, y.top))
