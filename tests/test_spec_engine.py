"""Speculative decoding through the whole engine: greedy outputs are the plain engine's token for
token, for the n-gram proposer (repetitive prompts: proposals accepted and rejected) and the
draft proposer (a perfect draft, the target itself, and a bad one, another random model),
batched and staggered, with prefix caching, chunked prefill, preemption, aborts, and the
compiled step. Every engine here runs the gates on every step (NANOSERVE_CHECKS=1): the plan
against the block tables before the worker, the slot table against them after, so the K/V of
a rejected token, trimmed off its row, is never addressed again. Every test checks that
speculation happened (no test passes vacuously) and that the engine drains (every block and
row back: the draft's K/V lives in the same pool)."""

from __future__ import annotations

import functools

import pytest
from engine_oracle_helpers import BLOCK_BYTES, engine_for, generate, greedy
from spec_helpers import MODEL, PROMPTS, PROPOSERS, assert_drained, tokens


@pytest.fixture(autouse=True)
def gates(monkeypatch):
    monkeypatch.setenv("NANOSERVE_CHECKS", "1")


def build(budget: int = 64, spec: str | None = None, **options):
    engine = engine_for(MODEL, budget, speculative=PROPOSERS[spec] if spec else None, **options)
    assert engine.checks
    return engine


@functools.cache
def plain(prompts: tuple[tuple[int, ...], ...], max_tokens: int, budget: int = 64, **options) -> list[list[int]]:
    """The plain engine's greedy tokens (shared by the proposers' runs)."""
    return tokens(generate(build(budget, **options), [list(p) for p in prompts], greedy(max_tokens)))


def as_key(prompts) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, prompts))


def assert_speculated(engine, spec: str) -> None:
    """Proposals were verified; accepted where the proposer can be right, rejected where it can be wrong."""
    s = engine.stats()
    assert s.spec_verify_steps > 0 and s.spec_proposed_tokens > 0, s
    if spec == "ngram":
        assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens, s
    elif spec == "draft-perfect":
        assert s.spec_accepted_tokens >= 0.9 * s.spec_proposed_tokens, s
    else:
        assert s.spec_accepted_tokens < s.spec_proposed_tokens, s


@pytest.mark.parametrize("spec", PROPOSERS)
def test_batched_greedy_is_the_plain_engines(spec):
    want = plain(as_key(PROMPTS), 24)
    engine = build(spec=spec)
    got = generate(engine, PROMPTS, greedy(24))
    assert tokens(got) == want
    assert all(o.finish_reason == "length" for o in got)
    assert_speculated(engine, spec)
    assert_drained(engine)


@pytest.mark.parametrize("spec", PROPOSERS)
def test_staggered_arrivals_join_speculating_rows(spec):
    """Requests arrive every few steps while the others decode (and verify)."""
    want = plain(as_key(PROMPTS), 20)
    engine = build(spec=spec)
    ids, done, pending = [], {}, list(PROMPTS)
    for step in range(2000):
        if pending and step % 3 == 0:
            ids.append(engine.add_request(pending.pop(0), greedy(20)))
        if not pending and not engine.has_unfinished():
            break
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [done[i].token_ids for i in ids] == want
    assert_speculated(engine, spec)
    assert_drained(engine)


SHARED = [5, 6, 7, 8] * 3
FIRST_TURNS = [SHARED + [1, 2], SHARED + [3], SHARED + [9, 10, 11]]


def two_turns(engine) -> list[list[int]]:
    one = generate(engine, FIRST_TURNS, greedy(12))
    second = [p + o.token_ids + [40, 41] for p, o in zip(FIRST_TURNS, one)]
    return tokens(one) + tokens(generate(engine, second, greedy(12)))


@functools.cache
def plain_two_turns() -> list[list[int]]:
    return two_turns(build())


@pytest.mark.parametrize("spec", PROPOSERS)
def test_prefix_caching_shared_prefixes_and_a_second_turn(spec):
    """Prompts share a prefix; a second turn extends each first turn with its reply and adopts
    the first turn's blocks, speculated tokens included."""
    engine = build(spec=spec)
    assert two_turns(engine) == plain_two_turns()
    s = engine.stats()
    assert s.prefix_cache_hits >= 5, s  # the shared prefix, then every second turn
    assert_speculated(engine, spec)
    assert_drained(engine)


@pytest.mark.parametrize("spec", PROPOSERS)
def test_chunked_prefill_beside_verifying_rows(spec):
    """A 6-token budget: long prompts prefill in chunks while the rows that finished theirs
    verify, their proposals cut to what the budget leaves."""
    prompts = [p * 2 for p in PROMPTS[:4]]
    want = plain(as_key(prompts), 16)
    engine = build(6, spec=spec)
    assert tokens(generate(engine, prompts, greedy(16))) == want
    s = engine.stats()
    assert s.prefill_steps >= sum(-(-len(p) // 6) for p in prompts), s  # every prompt was chunked
    assert_speculated(engine, spec)
    assert_drained(engine)


@pytest.mark.parametrize("spec", PROPOSERS)
def test_preemption_on_a_tiny_pool(spec):
    """18 blocks of 4 tokens for four rows growing to ~50 tokens: rows are preempted and
    recomputed, proposals are cut to what the pool holds."""
    options = dict(kv_cache_bytes=18 * BLOCK_BYTES, max_model_len=64)
    prompts = PROMPTS[:5]
    want = plain(as_key(prompts), 36, 16, **options)
    # A draft's K/V layers sit in the same blocks: a draft of the target's shape doubles a block's bytes.
    blocks = dict(options, kv_cache_bytes=18 * BLOCK_BYTES * (2 if spec.startswith("draft") else 1))
    engine = build(16, spec=spec, **blocks)
    assert engine.stats().blocks_total == 18
    assert tokens(generate(engine, prompts, greedy(36))) == want
    assert engine.stats().preemptions > 0
    assert_speculated(engine, spec)
    assert_drained(engine)


@pytest.mark.parametrize("spec", PROPOSERS)
def test_aborts_mid_run(spec):
    """Aborting a verifying row, a waiting request and, last, the only row left (no step
    follows but the one that reports it): the others' outputs stand, each aborted one is a
    prefix of its plain output, and everything drains."""
    params = greedy(40)
    want = dict(zip(as_key(PROMPTS), plain(as_key(PROMPTS), 40)))
    engine = build(spec=spec, max_batch_size=3)
    prompts = {engine.add_request(p, params): tuple(p) for p in PROMPTS}
    outputs, aborted = {}, set()

    def step(n: int = 1) -> None:
        for _ in range(n):
            outputs.update((o.request_id, o) for o in engine.step())

    def abort(request) -> None:
        engine.abort(request.request_id)
        aborted.add(request.request_id)

    while engine.stats().spec_verify_steps < 2:
        step()
    abort(engine.scheduler.running[0])  # decoding (and speculating): the last decoding row moves into its place
    abort(engine.scheduler.waiting[-1])  # still waiting for a row
    step(3)
    abort(engine.scheduler.running[-1])
    while len(engine.scheduler.running) + len(engine.scheduler.waiting) > 1:
        step()
    abort(engine.scheduler.running[0])  # the only one left
    step()
    assert not engine.has_unfinished() and len(aborted) == 4
    for request_id, prompt in prompts.items():
        out = outputs.get(request_id)
        got = out.token_ids if out is not None else []
        if request_id in aborted:
            assert out is not None and out.finish_reason == "abort"
            assert got == want[prompt][:len(got)]
        else:
            assert got == want[prompt]
    assert_speculated(engine, spec)
    assert_drained(engine)


@pytest.mark.parametrize("spec", PROPOSERS)
def test_compiled_step_with_verify_buckets(spec):
    """compile=True on the "eager" backend: dynamo traces the decode and verify steps over the
    bucketed shapes, and no shape outside the grid shows up after warm-up."""
    options = dict(compile=True, compile_backend="eager", row_buckets=(1, 2, 4), width_buckets=(64, 128))
    want = plain(as_key(PROMPTS[:4]), 20)
    engine = build(spec=spec, **options)
    assert tokens(generate(engine, PROMPTS[:4], greedy(20))) == want
    s = engine.stats()
    assert s.verify_bucket_hits and s.recompiles_after_warmup == 0, s
    assert_speculated(engine, spec)
    assert_drained(engine)


def test_verify_steps_keep_every_row_at_its_accepted_tokens():
    """After every step each decoding row's block table holds exactly its tokens less the last
    (whose K/V the next step writes): the K/V of a rejected proposal is cut off its row."""
    engine = build(spec="ngram")
    for prompt in PROMPTS:
        engine.add_request(prompt, greedy(24))
    blocks = engine.scheduler.blocks
    rejected = 0
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running[:engine.scheduler.num_decoding]:
            assert blocks.num_tokens(request.row) == request.num_tokens - 1
        rejected = engine.stats().spec_proposed_tokens - engine.stats().spec_accepted_tokens
    assert rejected > 0
    assert_drained(engine)



def test_the_draft_keeps_its_k_v_in_the_targets_pool():
    """One pool: the draft's layers span the target's slots and read the target's slot table,
    the budget pays for both models' K/V a block, and the stats say the draft's share. (The
    perfect draft's acceptance above is what shows its K/V sits at the slots it reads.)"""
    engine = build(spec="draft-bad")
    target, draft = engine.worker.cache, engine.worker.draft.worker.cache
    assert draft.slot_table is target.slot_table
    slots = target.num_blocks * target.block_size
    assert all(t.shape[0] == slots for t in draft.layers.tensors())
    assert engine.resolved.kv_cache_bytes == target.kv_bytes + draft.kv_bytes
    generate(engine, PROMPTS[:3], greedy(12))
    s = engine.stats()
    assert s.spec_draft_kv_bytes == draft.kv_bytes > 0 and s.blocks_total == target.num_blocks
    assert_speculated(engine, "draft-bad")
    assert_drained(engine)
