"""Accept/reject sequences chosen by hypothesis: a scripted proposer guesses each speculating
row's next tokens (a prefix of the true greedy continuation, then wrong tokens, as the step's
script says), while requests arrive (sharing prefixes), are prefilled in chunks, preempted on a
small pool and aborted. Under the gates (NANOSERVE_CHECKS=1) every step's plan agrees with the
block tables before the worker runs it and the slot table after; after every rule each decoding
row holds the K/V of exactly its accepted tokens (the trim cut the rejected ones off), each
verify accepted exactly the proposals that were right, and every finished request's tokens are
the plain greedy oracle's."""

from __future__ import annotations

import functools
from collections import Counter

import hypothesis.strategies as st
import torch
from conftest import while_unfinished
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.engine.request import RequestStatus
from nanoserve.model.network.llama import dense_forward
from nanoserve.model.network.synthetic import random_model, tiny_config

VOCAB = 64
MODEL = random_model(tiny_config(num_layers=1, vocab_size=VOCAB), seed=0)
MAX_TOKENS = 16
BLOCK_BYTES = 2 * 1 * 2 * 16 * 4 * 4  # K and V, 1 layer, 2 K/V heads, head_dim 16, 4 slots, fp32
TIE = 1e-4  # a greedy step whose top two logits are closer may go either way between two forwards
TOTALS = Counter()  # over every example: proposals accepted and rejected (no vacuous pass)


@functools.cache
def oracle(prompt: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The dense model's greedy continuation of ``prompt`` (MAX_TOKENS tokens) and each step's
    margin between its top two logits."""
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = dense_forward(MODEL, torch.tensor([ids]))[0, -1]
            top = logits.topk(2).values
            ids.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
    return tuple(ids[len(prompt):]), tuple(margins)


def on_track(request) -> bool:
    """The request's tokens so far are the oracle's, and no step up to the next few is a near tie."""
    want, margins = oracle(tuple(request.prompt_token_ids))
    n = len(request.output_token_ids)
    return list(want[:n]) == request.output_token_ids and min(margins[:n + 6], default=1.0) >= TIE


class ScriptedProposer:
    """Proposes, for row i, the true continuation's first ``script[i][0]`` tokens then the wrong
    tokens ``script[i][1]`` (each shifted off the true token at its place); the script is set by
    the step rule before each step and cycles over the rows."""

    def __init__(self) -> None:
        self.script: list[tuple[int, list[int]]] = [(2, [1]), (5, [])]  # until a step rule sets it
        self.made: dict[str, list[int]] = {}  # request id -> its last proposal

    def propose(self, requests, ks):
        proposals = []
        for i, request in enumerate(requests):
            right, wrong = self.script[i % len(self.script)]
            want, _ = oracle(tuple(request.prompt_token_ids))
            true = list(want[len(request.output_token_ids):]) + [0] * 8
            tokens = true[:right] + [(true[right + j] + shift) % VOCAB for j, shift in enumerate(wrong)]
            self.made[request.request_id] = tokens
            proposals.append(tokens)  # may exceed k: the speculator cuts it
        return proposals

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.made.pop(request_id, None)

    def close(self) -> None:
        pass


class SpeculationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # 14 blocks of 4 tokens for four rows of up to 36: rows are preempted; a budget of 9
        # splits prompts into chunks beside the verifying rows and cuts their proposals.
        self.engine = build_engine(MODEL, max_batch_size=4, block_size=4, max_model_len=40,
                                   kv_cache_bytes=14 * BLOCK_BYTES, max_num_batched_tokens=9,
                                   speculative={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
        assert self.engine.checks
        self.proposer = ScriptedProposer()
        self.engine.speculator.proposer = self.proposer
        record = self.engine.speculator.record

        def record_and_check(request, proposed, accepted):
            # The row verified the first `proposed` of its proposal: exactly the right ones stand.
            if on_track(request):
                want, _ = oracle(tuple(request.prompt_token_ids))
                true = want[len(request.output_token_ids):]
                made = self.proposer.made[request.request_id][:proposed]
                right = next((j for j, (a, b) in enumerate(zip(made, true)) if a != b), min(len(made), len(true)))
                assert accepted == right, (request.request_id, made, true, accepted)
            TOTALS["accepted"] += accepted
            TOTALS["rejected"] += proposed - accepted
            record(request, proposed, accepted)

        self.engine.speculator.record = record_and_check
        self.live: dict[str, tuple[tuple[int, ...], int]] = {}  # request id -> prompt, max_tokens
        self.aborted: set[str] = set()

    @rule(stem=st.integers(0, 2), shared=st.integers(0, 12), own=st.lists(st.integers(0, VOCAB - 1), max_size=8),
          max_tokens=st.lists(st.integers(1, MAX_TOKENS), min_size=1, max_size=3))
    def arrive(self, stem, shared, own, max_tokens):
        """One to three requests sharing a stem (the prefix cache finds it), each with its own length."""
        for i, n in enumerate(max_tokens):
            prompt = [stem] * shared + own[i:] or [stem]
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            self.live[self.engine.add_request(prompt, params)] = (tuple(prompt), n)

    @rule(script=st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(1, VOCAB - 1), max_size=3)),
                          min_size=1, max_size=4), steps=st.integers(1, 4))
    def step(self, script, steps):
        self.proposer.script = script
        for _ in range(steps):
            self.step_once()

    def step_once(self) -> None:
        for out in self.engine.step():
            if out.finished:
                self.finished(out)

    @rule(data=st.data())
    def abort(self, data):
        if self.live:
            request_id = data.draw(st.sampled_from(sorted(self.live)))
            self.engine.abort(request_id)
            self.aborted.add(request_id)

    def finished(self, out) -> None:
        """A finished request's tokens are the oracle's (up to a near tie, past which nothing
        compares); an aborted one's a prefix of them."""
        prompt, max_tokens = self.live.pop(out.request_id)
        want, margins = oracle(prompt)
        got = out.token_ids
        aborted = out.request_id in self.aborted
        assert out.finish_reason == ("abort" if aborted else "length"), out
        assert len(got) <= max_tokens and (aborted or len(got) == max_tokens), out
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                assert margins[i] < TIE, f"{out.request_id}: token {i} is {a}, the oracle's {b}"
                return

    @invariant()
    def rows_hold_exactly_their_accepted_tokens(self):
        scheduler = self.engine.scheduler
        blocks = scheduler.blocks
        for request in scheduler.running:
            held = blocks.num_tokens(request.row)
            if request.status is RequestStatus.RUNNING:
                assert held == request.num_tokens - 1, (request.request_id, held, request.num_tokens)
            else:
                assert held <= request.num_tokens
        holders = Counter(block for t in blocks.tables for block in t.blocks)
        assert len(holders) + 1 == blocks.pool.num_used  # + the scratch block
        assert all(blocks.pool.ref_count(block) == n for block, n in holders.items())

    def teardown(self):
        self.proposer.script = [(2, [1]), (5, []), (0, [3])]  # the rows still running verify to the end
        for _ in while_unfinished(self.engine):
            self.step_once()
        self.step_once()  # an abort reports on the next step, which may have nothing else to do
        assert not self.live
        self.engine.check_drained()
        stats = self.engine.stats()
        TOTALS["verify_steps"] += stats.spec_verify_steps
        TOTALS["preemptions"] += stats.preemptions
        TOTALS["prefix_cache_hits"] += stats.prefix_cache_hits


def test_scripted_accepts_and_rejects_keep_greedy_outputs_and_the_tables(monkeypatch):
    monkeypatch.setenv("NANOSERVE_CHECKS", "1")
    TOTALS.clear()
    run_state_machine_as_test(SpeculationMachine)
    assert TOTALS["accepted"] > 0 and TOTALS["rejected"] > 0, TOTALS



DRAFT = random_model(tiny_config(num_layers=1, vocab_size=VOCAB), seed=3)  # a bad draft: most proposals fail


class DraftMachine(SpeculationMachine):
    """The same rules with a draft model proposing on the worker, its K/V in the target's pool
    (14 blocks of both models' K/V): it catches up over chunked prompts, adopted prefixes,
    preemptions and rows that did not draft, writes the shared slot table, and the gates, the
    rows' held tokens and the greedy outputs hold as with the scripted proposer."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.engine = build_engine(MODEL, max_batch_size=4, block_size=4, max_model_len=40,
                                   kv_cache_bytes=14 * 2 * BLOCK_BYTES, max_num_batched_tokens=9,
                                   speculative={"method": "draft", "model": DRAFT, "num_speculative_tokens": 4,
                                                "adaptive": False})
        assert self.engine.checks and self.engine.stats().blocks_total == 14
        self.proposer = ScriptedProposer()  # the rules set its script; the draft proposes instead
        record = self.engine.speculator.record

        def record_and_count(request, proposed, accepted):
            TOTALS["accepted"] += accepted
            TOTALS["rejected"] += proposed - accepted
            record(request, proposed, accepted)

        self.engine.speculator.record = record_and_count
        self.live, self.aborted = {}, set()


def test_a_draft_in_the_targets_pool_keeps_greedy_outputs_and_the_tables(monkeypatch):
    monkeypatch.setenv("NANOSERVE_CHECKS", "1")
    TOTALS.clear()
    run_state_machine_as_test(DraftMachine)
    assert TOTALS["accepted"] > 0 and TOTALS["rejected"] > 0, TOTALS
