"""Speculation over two tensor-parallel ranks on gloo: the verify step's plan (the rows'
proposals, their slots and the trims after) travels to both ranks, and greedy outputs are the
plain one-process engine's. The n-gram proposer runs on the host; the draft model on rank 0
alone, beside the sharded target."""

from __future__ import annotations

import pytest
from engine_oracle_helpers import engine_for, generate, greedy
from spec_helpers import MODEL, PROMPTS, PROPOSERS, assert_drained, tokens
from test_tensor_parallel import no_workers_left


@pytest.mark.parametrize("spec", ["ngram", "draft-perfect"])
def test_two_ranks_speculate_the_plain_engines_greedy_tokens(spec):
    want = tokens(generate(engine_for(MODEL, 16), PROMPTS, greedy(20)))
    with engine_for(MODEL, 16, tensor_parallel_size=2, speculative=PROPOSERS[spec]) as engine:
        assert tokens(generate(engine, PROMPTS, greedy(20))) == want
        s = engine.stats()
        assert s.spec_verify_steps > 0 and s.spec_accepted_tokens > 0, s
        assert_drained(engine)
    assert no_workers_left()
