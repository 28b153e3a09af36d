"""Shared by the speculative-decoding engine suites: the target, the proposers (the n-gram
lookup, the target as its own perfect draft, another random model as a bad one), repetitive
prompts the n-gram proposer finds matches in, and the drained check."""

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
    """Every block and row back: a draft model's K/V lives in the target's pool, so that pool
    is the only one to drain."""
    engine.check_drained()
