"""A thinking model's reply kept apart: reasoning_content vs content, whole and streamed (cut at
every point), and a grammar that starts only where the reasoning ends."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.structured.reasoning import ReasoningStream, split_reasoning

REPLY = "<think>\nThe user wants a number. 4 fits.\n</think>\n\n{\"n\": 4}"


def test_a_reply_splits_into_reasoning_and_answer():
    assert split_reasoning(REPLY) == ("\nThe user wants a number. 4 fits.\n", '{"n": 4}')
    assert split_reasoning("Plain answer.") == (None, "Plain answer.")
    assert split_reasoning("<think>still thinking") == ("still thinking", None)
    assert split_reasoning("opened in the prompt</think>answer", opened=True) == ("opened in the prompt", "answer")


@given(cuts=st.lists(st.integers(0, len(REPLY)), max_size=8))
def test_a_streamed_reply_splits_the_same_wherever_its_deltas_are_cut(cuts):
    bounds = [0, *sorted(cuts), len(REPLY)]
    stream, reasoning, answer = ReasoningStream(), "", ""
    for start, end in zip(bounds, bounds[1:]):
        thought, text = stream.feed(REPLY[start:end])
        reasoning, answer = reasoning + thought, answer + text
    thought, text = stream.finish()
    assert (reasoning + thought, answer + text) == split_reasoning(REPLY)


@pytest.mark.model
def test_a_grammar_applies_only_after_its_start_marker(smollm2_path):
    from nanoserve import SamplingParams, build_engine
    from nanoserve.structured import StructuredOutputs

    engine = build_engine(str(smollm2_path), max_batch_size=2, max_model_len=256)
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].text
    assert " 9," in free  # the model counts on by itself: the marker comes unconstrained
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured=StructuredOutputs(regex="[a-z]{5}", after=" 9,"))
    output = engine.generate([prompt], params, use_tqdm=False)[0]
    before, marker, after = output.text.partition(" 9,")
    assert free.startswith(before + marker)
    assert re.fullmatch("[a-z]{5}", after) and output.finish_reason == "stop"


# A ChatML template of a thinking model whose generation prompt opens the block (as some do).
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
                     "{# replies end their reasoning with </think> #}")


@pytest.fixture(scope="module")
def thinking_client(smollm2_path):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from conftest import served

    from nanoserve import build_engine
    from nanoserve.model.formats.tokenizer import ChatTemplate

    engine = build_engine(str(smollm2_path), max_batch_size=4, max_model_len=512)
    engine.tokenizer.chat_template = ChatTemplate(THINKING_TEMPLATE)
    with served(engine, "thinker", None) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.mark.model
def test_reasoning_is_kept_out_of_the_content_streamed_and_not(thinking_client):
    ask = dict(model="thinker", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12,
               temperature=0, response_format={"type": "json_object"})
    reply = thinking_client.chat.completions.create(**ask)
    message = reply.choices[0].message
    # Ended inside its reasoning: all of it is reasoning, free text (the JSON grammar never started).
    assert message.content is None and message.model_extra["reasoning_content"].strip()
    chunks = [c.choices[0] for c in thinking_client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert streamed == message.model_extra["reasoning_content"]
    assert not "".join(c.delta.content or "" for c in chunks)
