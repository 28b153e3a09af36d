"""Where several tool calls are allowed (parallel_tool_calls), a reply's calls still end: every
call grammar closes after ``call_limit`` calls, the generic envelope's repeat guard closes the
list once a call repeats an earlier one, and a reply is read back without repeated calls. On a
tiny random model (the generic form: its template takes no tools), with no max_tokens, the reply
ends by itself in calls."""

from __future__ import annotations

import json

import pytest

from nanoserve.structured.tool_parsers import FORMATS
from nanoserve.structured.tools import (
    MAX_PARALLEL_CALLS,
    Function,
    RepeatGuard,
    ToolCall,
    call_limit,
    distinct_calls,
    envelope_schema,
)

PING = Function("ping", "Check the service.", {"type": "object", "properties": {}, "additionalProperties": False})
POKE = Function("poke", "Poke a host.", {"type": "object", "properties": {"host": {"enum": ["a", "b"]}},
                                         "required": ["host"], "additionalProperties": False})


def fed(text: str, chunk: int) -> RepeatGuard:
    guard = RepeatGuard()
    data = text.encode()
    for at in range(0, len(data), chunk):
        guard.feed(data[at:at + chunk])
    return guard


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_the_repeat_guard_closes_only_once_a_call_repeats_an_earlier_one(chunk):
    first = '{"name":"poke","arguments":{"host":"a","note":"} ] {\\"x"}}'  # brackets inside strings
    other = '{"name":"poke","arguments":{"host":"b","note":"} ] {\\"x"}}'
    same = '{"name":"poke","arguments":{"note":"} ] {\\"x","host":"a"}}'  # the first, keys reordered
    assert not fed('{"tool_calls":[' + first + "," + other, chunk).closing
    guard = fed('{"tool_calls":[' + first + "," + other + "," + same[:-1], chunk)
    assert not guard.closing and guard.calls == 2  # not complete yet
    guard.feed(b"}")
    assert guard.closing and guard.calls == 3
    assert not fed('{"content":"{\\"tool_calls\\":[{},{}]}"}', chunk).closing  # an answer holds no calls


def test_a_reply_is_read_back_without_repeated_calls():
    calls = [ToolCall("poke", '{"host": "a"}'), ToolCall("poke", '{"host":"b"}'), ToolCall("poke", '{"host":"a"}'),
             ToolCall("ping", "{}"), ToolCall("ping", " {} ")]
    assert [(c.name, json.loads(c.arguments)) for c in distinct_calls(calls)] == \
        [("poke", {"host": "a"}), ("poke", {"host": "b"}), ("ping", {})]
    text = json.dumps({"tool_calls": [{"name": "ping", "arguments": {}}] * 3})
    assert len(FORMATS["generic"].parse(text).tool_calls) == 3  # the parser reads what is written
    from nanoserve.serve.tool_calling import ToolPlan

    plan = ToolPlan(FORMATS["generic"], [PING], [PING], "required", parallel=True)
    assert len(plan.parse(text).tool_calls) == 1  # the plan drops the repeats


def test_every_call_grammar_is_bounded_where_several_calls_are_allowed():
    assert call_limit([PING]) == MAX_PARALLEL_CALLS and call_limit([PING] * 20) == 20
    array = envelope_schema([PING, POKE], calls_required=True)["properties"]["tool_calls"]
    assert array["maxItems"] == MAX_PARALLEL_CALLS
    assert envelope_schema([PING], True, parallel=False)["properties"]["tool_calls"]["maxItems"] == 1
    for name in ("hermes", "llama3_json", "gemma"):
        assert f"{{0,{MAX_PARALLEL_CALLS - 1}}}" in FORMATS[name].call_grammar([PING, POKE], parallel=True)
    assert f'"maxItems": {MAX_PARALLEL_CALLS}' in FORMATS["mistral"].call_grammar([PING, POKE], parallel=True)


# -- on a tiny random model, through the server ----------------------------------------------------

httpx = pytest.importorskip("httpx")

TOOLS = [f.as_tool() for f in (PING, POKE)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("fastapi")
    from conftest import served, tiny_text_engine

    engine = tiny_text_engine(tmp_path_factory.mktemp("tool-guard"), max_batch_size=4, max_model_len=1024,
                              kv_cache_bytes=8 << 20)
    with served(engine, "tiny", None) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield engine, client


def test_the_envelope_grammar_refuses_a_call_past_the_bound(tiny):
    from nanoserve.structured import StructuredOutputs

    engine, _ = tiny
    spec = StructuredOutputs(json=envelope_schema([PING], calls_required=True))
    matcher = engine.structured.compiler.matcher(spec)
    vocabulary = engine.structured.compiler.vocabulary
    call = '{"name":"ping","arguments":{}}'
    head = '{"tool_calls":[' + ",".join([call] * MAX_PARALLEL_CALLS)
    assert matcher.consume_tokens(vocabulary.tokenize_str(head))
    assert not matcher.try_consume_tokens(vocabulary.tokenize_str(","))  # no ninth call
    assert matcher.consume_tokens(vocabulary.tokenize_str("]}")) and matcher.is_stopped()


def test_the_repeat_guard_narrows_the_mask_to_the_lists_close(tiny):
    from nanoserve.structured import StructuredOutputs

    engine, _ = tiny
    structured = engine.structured
    grammar = structured.grammar_for(StructuredOutputs(json=envelope_schema([PING, POKE], True), distinct_calls=True))
    vocabulary = structured.compiler.vocabulary
    text = '{"tool_calls":[{"name":"ping","arguments":{}},{"name":"ping","arguments":{}}'
    for token_id in vocabulary.tokenize_str(text):
        assert not grammar.accept(token_id, ends_reply=False)
    assert grammar.closing
    masks, failed = structured.finish_masks(structured.start_masks([grammar]), [grammar])
    words = masks.bitmask[0].tolist()
    allowed = [t for t in range(structured.compiler.vocab_size) if (words[t // 32] >> (t % 32)) & 1]
    assert not failed and [vocabulary.decode_str([t]) for t in allowed] == ["]"]  # not "," (another call)


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_parallel_calls_without_max_tokens_end_in_distinct_calls(tiny, tool_choice, sampling):
    # The tiny model calls ping, then ping again: the repeat closes the list (78 tokens); without
    # the guard it would call ping to the bound (8 calls, 264 tokens), without the bound to the limit.
    _, client = tiny
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Check every host."}], "tools": TOOLS,
            "tool_choice": tool_choice, "parallel_tool_calls": True, **sampling}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["finish_reason"] == "tool_calls" and usage["completion_tokens"] <= 256, (choice, usage)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls and len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls), calls
    for name, arguments in calls:
        assert name in ("ping", "poke") and (arguments == {} if name == "ping" else arguments["host"] in "ab")
