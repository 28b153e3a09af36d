"""Constrained decoding in the engine on the default model: every reply matches its schema,
regex or choice (greedy and sampled), a constrained row leaves its unconstrained neighbours'
tokens alone, and a bad grammar fails its request alone."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from structured_schemas import json_schemas

from nanoserve import SamplingParams, build_engine
from nanoserve.engine.inputs import RequestError
from nanoserve.structured import StructuredOutputs
from nanoserve.structured.masks import TokenMasks, apply_token_masks

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.model
# Few examples by default (each decodes a batch on the real model); NANOSERVE_HYPOTHESIS=long scales it.
EXAMPLES = max(4, settings().max_examples // 8)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with build_engine(str(smollm2_path), max_batch_size=8, max_model_len=1024, compile=False) as engine:
        yield engine


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def constrained(temperature: float = 0.0, seed: int | None = None, max_tokens: int = 200, **kind) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured=StructuredOutputs(**kind))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas())
def test_every_reply_validates_against_its_json_schema_greedy_and_sampled(engine, schema):
    prompt = chat(engine, "Reply in JSON matching this schema: " + json.dumps(schema))
    params = [constrained(json=schema), constrained(1.0, seed=1, json=schema),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=2, max_tokens=200,
                             structured=StructuredOutputs(json=schema))]
    for output in engine.generate([prompt] * len(params), params, use_tqdm=False):
        assert output.finish_reason == "stop", (output.text, output.error)
        jsonschema.validate(json.loads(output.text), schema)


def test_a_schema_admitting_one_string_produces_exactly_it(engine):
    schema = {"type": "string", "enum": ["paged attention, continuous batching"]}
    for params in (constrained(json=schema), constrained(1.5, seed=3, json=schema)):
        output = engine.generate([chat(engine, "Say anything.")], params, use_tqdm=False)[0]
        assert output.text == '"paged attention, continuous batching"'
        assert output.finish_reason == "stop"


def test_an_unconstrained_row_keeps_its_greedy_tokens_beside_constrained_rows(smollm2_path):
    # fp32 weights: the packed kernels' rounding depends on the batch's size (a near-tie can flip
    # whatever the masks do); the dense path's rows do not, so only the masks could change a token.
    engine = build_engine(str(smollm2_path), max_batch_size=4, max_model_len=256, weights="fp32")
    prompts = [chat(engine, "Name three colours."), chat(engine, "Give a person as JSON.")]
    alone = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    mixed = engine.generate([prompts[0], prompts[1], prompts[1]],
                            [SamplingParams(temperature=0, max_tokens=24), constrained(json=schema),
                             constrained(regex=r"[0-9]{3}-[a-z]{2}")], use_tqdm=False)
    assert mixed[0].token_ids == alone.token_ids
    assert json.loads(mixed[1].text)["name"] is not None
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", mixed[2].text)


def test_regex_and_choice_replies_match(engine):
    prompt = chat(engine, "Is the sky blue? Then give a date.")
    choices = ["yes", "no", "it depends"]
    outputs = engine.generate([prompt] * 4, [
        constrained(choice=choices), constrained(1.0, seed=5, choice=choices),
        constrained(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
        constrained(1.0, seed=6, regex=r"(red|green|blue)( and (red|green|blue))?")], use_tqdm=False)
    assert outputs[0].text in choices and outputs[1].text in choices
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", outputs[2].text)
    assert re.fullmatch(r"(red|green|blue)( and (red|green|blue))?", outputs[3].text)
    assert all(o.finish_reason == "stop" for o in outputs)


def test_a_lark_grammar_and_a_gbnf_grammar_are_enforced(engine):
    lark = 'start: "(" NUM " + " NUM ")"\nNUM: /[1-9][0-9]?/'
    gbnf = 'root ::= "colour: " ("red" | "green")'
    outputs = engine.generate([chat(engine, "Anything.")] * 2,
                              [constrained(grammar=lark), constrained(grammar=gbnf)], use_tqdm=False)
    assert re.fullmatch(r"\([1-9][0-9]? \+ [1-9][0-9]?\)", outputs[0].text)
    assert outputs[1].text in ("colour: red", "colour: green")


def test_max_tokens_inside_an_unfinished_structure_finishes_with_length(engine):
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 50}
    output = engine.generate([chat(engine, "List words.")], constrained(json=schema, max_tokens=6), use_tqdm=False)[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 6
    assert output.text.startswith("[")


def test_a_bad_grammar_fails_its_request_alone(engine):
    with pytest.raises(RequestError, match="regex"):
        engine.add_request("x", constrained(regex="a(b"))
    outputs = engine.generate(["Hello", "Hello"], [constrained(json={"type": "nonsense"}),
                                                  SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    assert outputs[0].finish_reason == "error" and "json" in outputs[0].error
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 4
    engine.check_drained()


def test_a_matcher_that_fails_mid_reply_fails_its_request_alone(engine):
    broken = engine.add_request(chat(engine, "A number."), constrained(regex="[0-9]{4}"))
    plain = engine.add_request(chat(engine, "A word."), SamplingParams(temperature=0, max_tokens=3))
    grammar = engine.requests[broken].grammar
    grammar.matcher.consume_token(engine.tokenizer.encode("x", add_special_tokens=False)[0])  # outside it
    assert grammar.matcher.is_error()
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs[broken].finish_reason == "error" and "structured output" in outputs[broken].error
    assert outputs[plain].finish_reason == "length"
    engine.check_drained()


def test_stats_count_constrained_requests_and_mask_time(engine):
    before = engine.stats()
    engine.generate([chat(engine, "Yes or no?")], constrained(choice=["yes", "no"]), use_tqdm=False)
    after = engine.stats()
    assert after.structured_requests == before.structured_requests + 1
    assert after.mask_steps > before.mask_steps and after.mask_seconds > before.mask_seconds


def test_structured_outputs_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])


def test_masks_leave_unconstrained_rows_bit_for_bit():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5  # token 37 only
    masked = apply_token_masks(logits, TokenMasks([1], bitmask))
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert masked[1].argmax() == 37 and torch.isinf(masked[1]).sum() == 69


def test_a_compiled_engine_decodes_constrained_rows_as_eager_does_without_recompiling(tmp_path):
    from conftest import tiny_text_engine

    options = dict(max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4, max_model_len=128)
    compiled = tiny_text_engine(tmp_path, compile=True, row_buckets=(4,), width_buckets=(64, 128), **options)
    eager = tiny_text_engine(tmp_path, **options)
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["k"], "additionalProperties": False}
    params = [constrained(json=schema, max_tokens=30), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              constrained(1.0, seed=9, regex="[ab]{3,12}", max_tokens=30)]
    prompts = ["hello there", "a plain row", "and a third"]
    got = compiled.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch("[ab]{3,12}", got[2].text) and json.loads(got[0].text)["k"] <= 999
    assert compiled.stats().recompiles_after_warmup == 0 and compiled.stats().mask_steps > 0
