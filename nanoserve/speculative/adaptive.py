"""How many tokens one row proposes each step, adapted from how often its proposals have been
accepted lately.

Rule: keep an estimate ``a`` of the chance that a proposed token is accepted, and propose the k
that maximises expected tokens per unit of cost. A verify of k proposals yields
``1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)`` tokens on average (the accepted run plus the
target model's own token) and costs ``1 + cost * k`` decode steps. When k = 0 wins the row
stops speculating, so it costs nothing; it then probes with k = 1 after a wait that doubles
each time a probe fails, so a reply that starts copying late still gets speculated.

Contract: call ``next_k()`` before proposing and ``record(proposed, accepted)`` once after every
decode step of the row, with ``proposed = 0`` when nothing was verified (the proposer found
nothing, or k was 0): those steps are what the wait before a probe counts.
"""

from __future__ import annotations

# Weight of the previous estimate at each verify: about the last three verifies count, so a
# row that stops matching stops speculating within a few steps.
DECAY = 0.7
FIRST_PROBE_WAIT = 8  # steps without speculation before the first probe
MAX_PROBE_WAIT = 256  # a row that never accepts still probes this often


def best_k(acceptance: float, max_k: int, cost: float) -> int:
    """The k in 0..max_k with the most expected tokens per unit of cost (the smallest on ties)."""
    best, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= acceptance
        expected += term
        rate = expected / (1.0 + cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class SpeculationLength:
    """One row's speculation length. ``cost`` is the price of verifying one more token, in
    decode steps. The default 0.1 takes a small-batch CPU step to be bound by reading the
    weights, which it does once however many tokens it verifies, so each extra token adds about
    a tenth of a step. A row speculates at all only while its acceptance exceeds ``cost``."""

    def __init__(self, max_k: int, cost: float = 0.1) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if cost < 0:
            raise ValueError(f"cost must be >= 0, got {cost}")
        self.max_k, self.cost = max_k, cost
        # Decayed counts of accepted and tested tokens; a new row starts as if one token had
        # been accepted, so it speculates fully until its first verify says otherwise.
        self._accepted, self._tested = 1.0, 1.0
        self._k = best_k(1.0, max_k, cost)  # the rule's choice; 0 means off, probing
        self._idle_steps = 0  # steps since the last verify
        self._probe_wait = FIRST_PROBE_WAIT

    def next_k(self) -> int:
        """How many tokens to propose this step, 0..max_k (1 when an off row probes)."""
        if self._k > 0:
            return self._k
        return 1 if self._idle_steps >= self._probe_wait else 0

    def record(self, proposed: int, accepted: int) -> None:
        """Take the outcome of this step's verify: `accepted` of the `proposed` tokens were kept.
        Raises ValueError unless 0 <= accepted <= proposed."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted}, proposed={proposed}")
        if proposed == 0:
            self._idle_steps += 1
            return
        # Tokens after the first rejection were never tested, so they are not counted as failures.
        tested = accepted + (1 if accepted < proposed else 0)
        self._accepted = DECAY * self._accepted + accepted
        self._tested = DECAY * self._tested + tested
        was_off = self._k == 0
        self._k = best_k(self._accepted / self._tested, self.max_k, self.cost)
        self._idle_steps = 0
        if was_off:  # that verify was a probe
            failed = self._k == 0
            self._probe_wait = min(2 * self._probe_wait, MAX_PROBE_WAIT) if failed else FIRST_PROBE_WAIT

    def __repr__(self) -> str:
        acceptance = self._accepted / self._tested
        if self._k > 0:
            return f"SpeculationLength(k={self._k} of {self.max_k}, acceptance {acceptance:.2f})"
        return (f"SpeculationLength(off, acceptance {acceptance:.2f}, "
                f"probe after {self._idle_steps} of {self._probe_wait} steps without a verify)")
