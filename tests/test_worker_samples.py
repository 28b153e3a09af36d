"""The worker chooses the tokens: ``Worker.execute(plan, sampling)`` answers each sampled row
with its tokens (the argmax of its own forward's logits for a greedy row), never logits; without
sampling inputs (a tensor-parallel rank past 0) it runs the forward alone; it prices its own step
(seconds, graphs built, eager steps), and the speculator's step times are those prices. The
engine package reads no logits and none of the worker's insides."""

from __future__ import annotations

import ast
from pathlib import Path

from engine_oracle_helpers import engine_for, greedy, run
from spec_helpers import MODEL, PROMPTS, PROPOSERS

from nanoserve.engine.engine import row_sampling
from nanoserve.worker.sampling import StepSampling

ROOT = Path(__file__).resolve().parents[1]


def test_a_step_answers_tokens_equal_to_the_argmax_of_its_own_forward():
    engine = engine_for(MODEL, 64)
    for p in PROMPTS[:3]:
        engine.add_request(p, greedy(4))
    engine.step()  # the prefill
    plan = engine.scheduler.schedule()
    sampled = [engine.requests[request_id] for request_id in plan.sampled]
    seen = []
    forward = engine.worker.forward
    engine.worker.forward = lambda p: seen.append(forward(p)) or seen[-1]
    out = engine.worker.execute(plan, StepSampling([row_sampling(r) for r in sampled]))
    assert [row.token_ids for row in out.rows] == [[t] for t in seen[0].logits.argmax(dim=-1).tolist()]
    assert out.seconds > 0 and not hasattr(out, "logits")


def test_without_sampling_inputs_the_worker_runs_the_forward_alone():
    engine = engine_for(MODEL, 64)
    engine.add_request(PROMPTS[0], greedy(2))
    out = engine.worker.execute(engine.scheduler.schedule())  # what a rank past 0 runs
    assert out.rows == [] and out.seconds > 0


def test_a_step_counts_the_graphs_built_while_it_ran():
    engine = engine_for(MODEL, 64, compile=True, compile_backend="eager", row_buckets=(4,), width_buckets=(64,),
                        warmup="none")
    outputs = []
    execute = engine.worker.execute
    engine.worker.execute = lambda plan, sampling=None: outputs.append(execute(plan, sampling)) or outputs[-1]
    engine.add_request(PROMPTS[0], greedy(3))
    run(engine)
    built = [o.graphs_built for o in outputs]
    assert built[0] == 0 and built[1] == 1 and sum(built) == 1  # the prefill, the bucket's first step, the rest


def test_the_speculators_step_times_are_the_workers_own():
    engine = engine_for(MODEL, 64, speculative=PROPOSERS["ngram"])
    verify_seconds = []
    execute = engine.worker.execute

    def recorded(plan, sampling=None):
        out = execute(plan, sampling)
        if plan.decode is not None and plan.decode.queries > 1:
            verify_seconds.append(out.seconds)
        return out

    engine.worker.execute = recorded
    for p in PROMPTS:
        engine.add_request(p, greedy(12))
    run(engine)
    stats = engine.speculator.stats
    assert stats.verify_steps == len(verify_seconds) > 0
    assert abs(stats.verify_seconds - sum(verify_seconds)) < 1e-9


def test_the_engine_package_reads_no_logits_and_no_worker_insides():
    reads = []
    for path in (ROOT / "nanoserve" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
            if node.attr in ("logits", "decode_step") or (owner == "worker" and node.attr in ("cache", "sampler")):
                reads.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
    assert not reads

