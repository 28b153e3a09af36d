"""Shared by the speculative-decoding engine suites: the target, the proposers (the n-gram
lookup, the target as its own perfect draft, another random model as a bad one), repetitive
prompts the n-gram proposer finds matches in, and the drained check (the draft's pool too)."""

from __future__ import annotations

from nanoserve.model.network.synthetic import random_model, tiny_config

MODEL = random_model(tiny_config())
BAD_DRAFT = random_model(tiny_config(), seed=1)

PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft-perfect": {"method": "draft", "num_speculative_tokens": 3, "model": None},
    "draft-bad": {"method": "draft", "num_speculative_tokens": 3, "model": BAD_DRAFT},
}

PROMPTS = [
    [5, 6, 7, 8] * 3 + [5, 6],
    [1, 2, 3] * 4,
    [9, 10, 11, 12, 13, 9, 10, 11, 12],
    list(range(20, 40)),
    [70, 71, 70, 71, 70, 72, 70, 71],
    [100, 101, 102, 103, 104, 105, 100, 101, 102],
]


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def assert_drained(engine) -> None:
    """Every block and row of the target back; the draft's pool all free but its scratch block."""
    engine.check_drained()
    proposer = engine.speculator.proposer
    if hasattr(proposer, "pool"):
        assert proposer.pool.num_free == proposer.pool.num_blocks - 1
        assert not proposer.states
