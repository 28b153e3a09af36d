"""A row's speculation length: full while proposals are accepted, off (with probes that back
off) while they are rejected, and back up when they are accepted again."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.speculative.adaptive import FIRST_PROBE_WAIT, MAX_PROBE_WAIT, SpeculationLength, best_k

MAX_K = 8


def verify(length: SpeculationLength, accept: bool) -> int:
    """One step: propose next_k tokens, accept all or none; returns the k used."""
    k = length.next_k()
    length.record(k, k if accept else 0)
    return k


def switched_off(max_k: int = MAX_K) -> SpeculationLength:
    length = SpeculationLength(max_k)
    while length.next_k() > 0:
        verify(length, accept=False)
    return length


def steps_until_probe(length: SpeculationLength, limit: int = 10 * MAX_PROBE_WAIT) -> int:
    """Idle steps (nothing verified) until the row asks for a probe."""
    for steps in range(limit):
        if length.next_k() > 0:
            return steps
        length.record(0, 0)
    raise AssertionError(f"no probe within {limit} steps: {length!r}")


def test_a_new_row_that_is_always_accepted_stays_at_max_k():
    length = SpeculationLength(MAX_K)
    assert [verify(length, accept=True) for _ in range(50)] == [MAX_K] * 50


def test_an_accepted_row_returns_to_max_k_after_a_few_rejections():
    length = SpeculationLength(MAX_K)
    for _ in range(50):
        verify(length, accept=True)
    for _ in range(4):
        verify(length, accept=False)
    assert 0 < length.next_k() < MAX_K, length
    ks = [verify(length, accept=True) for _ in range(5)]
    assert length.next_k() == MAX_K, (ks, length)


def test_a_row_that_is_always_rejected_stops_speculating_within_a_bound():
    length = SpeculationLength(MAX_K)
    for _ in range(200):  # a long run of full acceptance is the slowest to unlearn
        verify(length, accept=True)
    ks = [verify(length, accept=False) for _ in range(20)]
    assert 0 in ks, (ks, length)
    assert ks.index(0) <= 15 and set(ks[ks.index(0):]) == {0}, ks


def test_an_off_row_costs_nothing_until_it_probes_with_one_token():
    length = switched_off()
    assert steps_until_probe(length) == FIRST_PROBE_WAIT
    assert length.next_k() == 1


def test_failed_probes_double_the_wait_up_to_a_ceiling():
    length = switched_off()
    waits = []
    for _ in range(12):
        waits.append(steps_until_probe(length))
        verify(length, accept=False)
    expected = [min(FIRST_PROBE_WAIT * 2 ** i, MAX_PROBE_WAIT) for i in range(12)]
    assert waits == expected


def test_a_probe_that_found_nothing_to_propose_stays_pending():
    length = switched_off()
    steps_until_probe(length)
    for _ in range(3):
        length.record(0, 0)  # the proposer had no match: nothing was tested
        assert length.next_k() == 1


def test_a_row_that_starts_accepting_again_climbs_back_to_max_k():
    length = switched_off()
    for _ in range(3):  # a few failed probes first: a long wait must not slow the climb
        steps_until_probe(length)
        verify(length, accept=False)
    steps_until_probe(length)
    assert verify(length, accept=True) == 1
    ks = [verify(length, accept=True) for _ in range(6)]
    assert ks[-1] == MAX_K and ks == sorted(ks), ks
    # And a later failure starts from the first wait again, not the backed-off one.
    while length.next_k() > 0:
        verify(length, accept=False)
    assert steps_until_probe(length) == FIRST_PROBE_WAIT


def test_steps_without_a_verify_leave_a_speculating_row_alone():
    length = SpeculationLength(MAX_K)
    verify(length, accept=False)
    before = (length.next_k(), repr(length))
    for _ in range(100):
        length.record(0, 0)
    assert (length.next_k(), repr(length)) == before
    # Nor do they count towards a probe once the row goes off: the wait starts at its last verify.
    while length.next_k() > 0:
        verify(length, accept=False)
    assert steps_until_probe(length) == FIRST_PROBE_WAIT


def test_expected_gain_rule_at_its_ends():
    assert best_k(0.0, MAX_K, 0.1) == 0
    assert best_k(1.0, MAX_K, 0.1) == MAX_K
    assert best_k(0.5, MAX_K, 0.0) == MAX_K  # free verification: always propose all
    assert best_k(1.0, MAX_K, 1.0) == 0  # a token costs a whole step: never worth it
    assert best_k(0.09, MAX_K, 0.1) == 0 and best_k(0.11, MAX_K, 0.1) == 1  # k=1 pays iff a > cost


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 0.5))
def test_expected_gain_rule_never_proposes_fewer_for_a_better_acceptance(a, b, cost):
    low, high = sorted((a, b))
    assert best_k(low, MAX_K, cost) <= best_k(high, MAX_K, cost)


@pytest.mark.parametrize("max_k, cost", [(0, 0.1), (-1, 0.1), (4, -0.5)])
def test_bad_construction_raises(max_k, cost):
    with pytest.raises(ValueError, match="must be >= "):
        SpeculationLength(max_k, cost)


@pytest.mark.parametrize("proposed, accepted", [(2, 3), (-1, 0), (3, -1)])
def test_bad_records_raise_and_change_nothing(proposed, accepted):
    length = SpeculationLength(MAX_K)
    before = repr(length)
    with pytest.raises(ValueError, match="accepted"):
        length.record(proposed, accepted)
    assert repr(length) == before


@given(max_k=st.integers(1, 12),
       outcomes=st.lists(st.tuples(st.integers(0, 16), st.floats(0, 1)), max_size=300))
def test_next_k_stays_within_0_and_max_k(max_k, outcomes):
    length = SpeculationLength(max_k)
    for proposed, accepted_share in outcomes:
        k = length.next_k()
        assert 0 <= k <= max_k, length
        length.record(proposed, int(proposed * accepted_share))
    assert 0 <= length.next_k() <= max_k
