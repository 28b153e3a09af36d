"""The prompt-lookup proposer: which earlier copy it continues, and how much it proposes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.speculative.ngram import NgramProposer


def reference_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule spelled out: longest suffix first, then the latest earlier copy of it."""
    if k == 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # copies ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "7 8 9" occurs once early; "8 9" alone occurs later (after 5); the 3-gram's copy wins.
    tokens = [7, 8, 9, 1, 2, 5, 8, 9, 3, 4, 7, 8, 9]
    assert NgramProposer(max_n=3, min_n=1).propose(tokens, 2) == [1, 2]
    assert NgramProposer(max_n=2, min_n=1).propose(tokens, 2) == [3, 4]


def test_most_recent_copy_of_the_same_ngram_wins():
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 30, 31, 1, 2]
    assert NgramProposer(max_n=2, min_n=2).propose(tokens, 2) == [30, 31]


def test_continuation_is_cut_by_the_end_of_history():
    tokens = [5, 6, 7, 0, 5, 6]
    assert NgramProposer(max_n=2, min_n=2).propose(tokens, 10) == [7, 0, 5, 6]


def test_the_suffix_never_matches_itself():
    assert NgramProposer(max_n=3, min_n=1).propose([1, 2, 3], 4) == []
    # A copy overlapping the suffix is an earlier copy: 9 9 9 after the first three 9s.
    assert NgramProposer(max_n=3, min_n=3).propose([9, 9, 9, 9], 4) == [9]


def test_a_copy_cannot_start_before_the_history():
    # Only the single 5 at index 0 could end a copy of "5 5"; there is no token before it.
    assert NgramProposer(max_n=2, min_n=2).propose([5, 7, 5, 5], 2) == []


def test_k_zero_proposes_nothing():
    assert NgramProposer(max_n=2, min_n=1).propose([1, 2, 1, 2], 0) == []


def test_min_n_longer_than_history_proposes_nothing():
    assert NgramProposer(max_n=5, min_n=5).propose([1, 1, 1], 3) == []
    assert NgramProposer(max_n=5, min_n=4).propose([1, 1, 1, 1], 3) == []


def test_no_match_proposes_nothing():
    assert NgramProposer(max_n=3, min_n=2).propose([1, 2, 3, 4, 5, 2], 3) == []


def test_accepts_arrays_of_any_integer_width_and_returns_python_ints():
    tokens = [4, 5, 6, 4, 5]
    proposer = NgramProposer(max_n=2, min_n=1)
    for history in (tokens, np.array(tokens, dtype=np.int32), np.array(tokens, dtype=np.int64)):
        proposed = proposer.propose(history, 3)
        assert proposed == [6, 4, 5] and all(type(t) is int for t in proposed)


@pytest.mark.parametrize("max_n, min_n", [(2, 0), (1, 2), (0, 0), (3, -1)])
def test_bad_ngram_sizes_raise(max_n, min_n):
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=max_n, min_n=min_n)


def test_bad_calls_raise():
    proposer = NgramProposer(max_n=2, min_n=1)
    with pytest.raises(ValueError, match="k must be"):
        proposer.propose([1, 2, 1], -1)
    with pytest.raises(ValueError, match="one-dimensional"):
        proposer.propose(np.zeros((2, 3), dtype=np.int64), 2)


@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(0, 6),
       sizes=st.tuples(st.integers(1, 5), st.integers(1, 5)).map(sorted))
def test_matches_the_plain_python_rule(tokens, k, sizes):
    min_n, max_n = sizes
    proposer = NgramProposer(max_n=max_n, min_n=min_n)
    expected = reference_propose(tokens, k, max_n, min_n)
    assert proposer.propose(tokens, k) == expected
    assert proposer.propose(np.array(tokens, dtype=np.int64), k) == expected
