"""A harmony (gpt-oss) conversation through the server with the official openai client: the
analysis channel as reasoning_content, the final channel as content, a commentary call to
functions.NAME as tool_calls (finish_reason "tool_calls"), and the tool's result carried back
through the harmony template to a final answer; streamed and not.

A tiny random model writes no harmony by itself, so its replies are scripted: the model's
vocabulary has the harmony special tokens and its chat template is in the harmony shape, the
engine runs as ever (prompt, paged forward, detokenizer, stops), and only the token choice is
replaced by a sampler that plays back a planned reply. The sampler records the prompts it saw,
so the rendered conversation can be checked token for token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import served  # noqa: E402
from gguf_files import V, tiny_chat_gguf  # noqa: E402

from nanoserve.engine.sampling_params import SamplingParams  # noqa: E402
from nanoserve.worker.sampler import Sampler, SamplerOutput  # noqa: E402

MODEL = "gpt-oss-tiny"
HARMONY_SPECIALS = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

# gpt-oss's template in miniature: the same headers, channels and tool turns (the real one also
# writes the tools as a TypeScript namespace and dates the system message).
HARMONY_TEMPLATE = """\
{%- set last_tool_call = namespace(name=none) -%}
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{%- for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}<|start|>developer<|message|># Instructions

{{ message.content }}<|end|>
{%- elif message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif %}
<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>
{%- set last_tool_call.name = call.name %}
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'tool' %}
{%- if last_tool_call.name is none %}{{ raise_exception('a tool message must follow a tool call') }}{% endif %}
<|start|>functions.{{ last_tool_call.name }} to=assistant<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
REASONING, ANSWER = "The user asks for the weather; I know it.", "It is sunny in Paris."
REASONING_AND_FINAL = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
                       f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
CALL_THOUGHT = "Need the weather: call get_weather."
TOOL_CALL = (f"<|channel|>analysis<|message|>{CALL_THOUGHT}<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris"}<|call|>')
RESULT = {"city": "Paris", "temperature": 18, "sky": "clear"}
AFTER_RESULT = ("<|channel|>analysis<|message|>The tool says 18 and clear.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is 18 °C and clear in Paris.<|return|>")


def harmony_gguf(path):
    """The tiny GGUF (tests/gguf_files.py) with the harmony special tokens in its vocabulary,
    <|return|> its end of text, and the harmony template; a context long enough for tools."""
    d = tiny_chat_gguf()
    tokens = list(d.fields["tokenizer.ggml.tokens"][0])
    plain = [t for t in tokens if not t.startswith("<|")]
    tokens = plain + ["<|endoftext|>"] + HARMONY_SPECIALS
    vocab = len(tokens)
    d.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    d.set("tokenizer.ggml.token_type", [1] * len(plain) + [3] * (vocab - len(plain)), V.ARRAY, V.INT32)
    d.set("tokenizer.ggml.scores", [0.0] * vocab, V.ARRAY, V.FLOAT32)
    d.set("tokenizer.ggml.bos_token_id", tokens.index("<|endoftext|>"), V.UINT32)
    d.set("tokenizer.ggml.eos_token_id", tokens.index("<|return|>"), V.UINT32)
    d.set("llama.context_length", 2048, V.UINT32)
    d.set("tokenizer.chat_template", HARMONY_TEMPLATE, V.STRING)
    rng = np.random.default_rng(1)
    for name in ("token_embd.weight", "output.weight"):
        hidden = d.tensors[name].shape[1]
        d.tensors[name] = (rng.standard_normal((vocab, hidden)) * hidden ** -0.5).astype(np.float32)
    return d.write(path)


class ScriptedSampler(Sampler):
    """Plays back `reply` (token ids) whatever the logits say: each row's next token is the
    script's token at its reply's length (the end of text past it); with `reply` None, samples
    as ever. Records every prompt."""

    def __init__(self, end_id: int):
        super().__init__()
        self.reply: list[int] | None = []
        self.prompts: list[list[int]] = []
        self.end_id = end_id

    def __call__(self, logits, params, generators, histories=None, masks=None) -> SamplerOutput:
        assert histories is not None, "the scripted engine passes every row's history"
        if self.reply is None:  # unscripted: the model's own greedy choice (within any grammar)
            return super().__call__(logits, params, generators, histories, masks)
        chosen = []
        for prompt, output in histories:
            if not output and list(prompt) not in self.prompts:
                self.prompts.append(list(prompt))
            chosen.append(self.reply[len(output)] if len(output) < len(self.reply) else self.end_id)
        return SamplerOutput(torch.tensor(chosen, dtype=torch.long, device=logits.device), [None] * len(params))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from nanoserve import build_engine
    from nanoserve.model.formats.loader import load_model

    model, tokenizer = load_model(str(harmony_gguf(tmp_path_factory.mktemp("harmony") / "harmony.gguf")))
    engine = build_engine(model, tokenizer=tokenizer, max_batch_size=2, max_model_len=2048, compile=False)
    sampler = ScriptedSampler(tokenizer.backend.token_to_id("<|return|>"))
    engine.worker.sampler = sampler
    with pytest.MonkeyPatch.context() as patch:
        # Every row's (prompt, output) reaches the sampler (the engine passes them for penalties).
        patch.setattr(SamplingParams, "uses_penalties", property(lambda self: True))
        with served(engine, MODEL, None) as server, \
                openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client, sampler, tokenizer


def play(scripted, text: str) -> None:
    _, sampler, tokenizer = scripted
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and len(ids) < len(text)  # the markers are single tokens
    sampler.reply = ids


def ask(scripted, reply: str, stream: bool = False, **request):
    client = scripted[0]
    play(scripted, reply)
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 200, **request}
    if not stream:
        return client.chat.completions.create(**request)
    return [c for c in client.chat.completions.create(**request, stream=True) if c.choices]


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def streamed(chunks) -> tuple[str, str, list[str]]:
    """(reasoning, content, the order of the kinds of delta) of a streamed reply."""
    reasoning, content, order = "", "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        if thought := reasoning_of(delta):
            reasoning += thought
            order.append("reasoning")
        if delta.content:
            content += delta.content
            order.append("content")
        if delta.tool_calls:
            order.append("tool_calls")
    return reasoning, content, [kind for i, kind in enumerate(order) if i == 0 or order[i - 1] != kind]


def test_analysis_and_final_are_reasoning_and_content(scripted):
    reply = ask(scripted, REASONING_AND_FINAL)
    choice = reply.choices[0]
    assert choice.message.content == ANSWER and reasoning_of(choice.message) == REASONING
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert reply.usage.completion_tokens == len(scripted[1].reply)


def test_streamed_reasoning_then_content_without_marker_fragments(scripted):
    chunks = ask(scripted, REASONING_AND_FINAL, stream=True)
    reasoning, content, order = streamed(chunks)
    assert (reasoning, content) == (REASONING, ANSWER) and order == ["reasoning", "content"]
    for chunk in chunks:  # no marker, nor a piece of one, in any delta
        delta = chunk.choices[0].delta
        text = (delta.content or "") + (reasoning_of(delta) or "")
        assert "<|" not in text and "|>" not in text and "channel" not in text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_reasoning_effort_reaches_the_template(scripted):
    ask(scripted, REASONING_AND_FINAL, reasoning_effort="high")
    prompt = scripted[2].decode(scripted[1].prompts[-1])
    assert "Reasoning: high" in prompt and prompt.endswith("<|end|><|start|>assistant")


def check_call(call) -> None:
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_commentary_call_is_a_tool_call(scripted):
    choice = ask(scripted, TOOL_CALL, tools=TOOLS, tool_choice="auto").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert reasoning_of(choice.message) == CALL_THOUGHT
    call, = choice.message.tool_calls
    check_call(call)
    prompt = scripted[2].decode(scripted[1].prompts[-1])
    assert "<|start|>developer<|message|># Tools" in prompt and "type get_weather = (_: {" in prompt


def test_a_commentary_call_streamed(scripted):
    chunks = ask(scripted, TOOL_CALL, stream=True, tools=TOOLS, tool_choice="auto")
    reasoning, content, order = streamed(chunks)
    assert (reasoning, content) == (CALL_THOUGHT, "") and order == ["reasoning", "tool_calls"]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_a_call_is_not_a_tool_call(scripted):
    choice = ask(scripted, TOOL_CALL).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert reasoning_of(choice.message) == CALL_THOUGHT


@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_result_goes_back_and_the_answer_comes(scripted, stream):
    first = ask(scripted, TOOL_CALL, tools=TOOLS).choices[0]
    call, = first.message.tool_calls
    history = QUESTION + [first.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}]
    if stream:
        reasoning, content, order = streamed(ask(scripted, AFTER_RESULT, stream=True, messages=history, tools=TOOLS))
    else:
        message = ask(scripted, AFTER_RESULT, messages=history, tools=TOOLS).choices[0].message
        reasoning, content = reasoning_of(message), message.content
        assert not message.tool_calls
    assert (reasoning, content) == ("The tool says 18 and clear.", "It is 18 °C and clear in Paris.")
    prompt = scripted[2].decode(scripted[1].prompts[-1])
    turns = ('<|start|>user<|message|>What is the weather in Paris?<|end|>'
             # the reply's reasoning, sent back as reasoning_content, is the call turn's analysis
             f'<|start|>assistant<|channel|>analysis<|message|>{CALL_THOUGHT}<|end|>'
             '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
             '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
             f'{json.dumps(json.dumps(RESULT))}<|end|><|start|>assistant')
    assert prompt.endswith(turns), prompt


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
BOUNDED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
                 {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choices_force_a_harmony_call(scripted, stream, tool_choice):
    """Unscripted: the random model's greedy reply under the harmony call grammar is a call,
    with arguments valid by the function's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    _, sampler, _ = scripted
    sampler.reply = None
    try:
        request = dict(model=MODEL, messages=QUESTION, tools=BOUNDED_TOOLS, tool_choice=tool_choice,
                       temperature=0, max_tokens=120)
        if stream:
            chunks = [c for c in scripted[0].chat.completions.create(**request, stream=True) if c.choices]
            calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = scripted[0].chat.completions.create(**request).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
    finally:
        sampler.reply = []
    assert finish == "tool_calls" and len(calls) == 1
    name = calls[0].function.name
    assert name in ("get_weather", "get_time") if tool_choice == "required" else name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), {"get_weather": CITY, "get_time": ZONE}[name])
