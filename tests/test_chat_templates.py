"""Each architecture family's chat template renders through nanoserve's jinja2 path (from the
GGUF file's tokenizer.chat_template) exactly as transformers' own renderer renders it.

The templates are written here in their families' formats (Llama 3's headers, Mistral's [INST]
turns, ChatML, Qwen3's thinking blocks, Gemma 3's turns), with the constructs those templates use
(namespaces, reversed loops, string methods, filters, role checks that raise, the system prompt
folded into Gemma's first user turn)."""

from __future__ import annotations

import jinja2
import pytest
from arch_models import make_hf_model, write_converted_gguf

from nanoserve.model.formats.loader import load_model

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

QWEN3_STYLE = """{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages[::-1] -%}
  {%- set index = messages|length - 1 - loop.index0 -%}
  {%- if message.role == 'user' and ns.last_query < 0 and message.content is string -%}
    {%- set ns.last_query = index -%}
  {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else '' -%}
  {%- if message.role == 'assistant' -%}
    {%- set thought = '' -%}
    {%- if '</think>' in content -%}
      {%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query and thought -%}
{{ '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
    {%- else -%}
{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- endif -%}
  {%- else -%}
{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}
{%- endif -%}"""

GEMMA3_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set first_prefix = messages[0]['content'] | trim + '\\n\\n' -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set first_prefix = '' -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""


LLAMA3_STYLE = """{{ bos_token }}
{%- for message in messages -%}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"""

MISTRAL_STYLE = """{{ bos_token }}
{%- for message in messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- if message['role'] == 'user' -%}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}
  {%- else -%}{{ ' ' + message['content'] | trim + eos_token }}{%- endif -%}
{%- endfor -%}"""

CHATML_STYLE = """{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""


CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there "},
                {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello."},
                {"role": "user", "content": "What is 2 + 2?"}]
# variant -> (template, messages it accepts, extra variables)
FAMILIES = {
    "llama3": (lambda: LLAMA3_STYLE, CONVERSATION, {}),
    "mistral": (lambda: MISTRAL_STYLE, CONVERSATION[1:], {}),
    "qwen2": (lambda: CHATML_STYLE, CONVERSATION, {}),
    "qwen3": (lambda: QWEN3_STYLE, CONVERSATION, {"enable_thinking": False}),
    "gemma3": (lambda: GEMMA3_STYLE, CONVERSATION, {}),
}


@pytest.fixture(scope="module")
def gguf_tokenizers(tmp_path_factory):
    """Per family, the tokenizer of a GGUF file that carries its template."""
    out = {}
    for variant, (template, _, _) in FAMILIES.items():
        hf = make_hf_model(variant, num_hidden_layers=1, layer_types=None) if variant == "gemma3" \
            else make_hf_model(variant, num_hidden_layers=1)
        path = write_converted_gguf(tmp_path_factory.mktemp(variant) / "m.gguf", hf, variant, chat_template=template())
        out[variant] = load_model(str(path))[1]
    return out


@pytest.mark.parametrize("variant", sorted(FAMILIES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_files_chat_template_renders_as_transformers_renders_it(gguf_tokenizers, variant, add_generation_prompt):
    template, messages, variables = FAMILIES[variant]
    tokenizer = gguf_tokenizers[variant]
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    tokenizer.special_tokens.update(specials)
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
    rendered, _ = chat_template_utils.render_jinja_template([messages], chat_template=template(),
                                                            add_generation_prompt=add_generation_prompt,
                                                            **specials, **variables)
    assert ours == rendered[0]
    assert messages[-1]["content"].strip() in ours


def test_a_qwen3_style_template_drops_the_thoughts_of_turns_before_the_last_query(gguf_tokenizers):
    text = gguf_tokenizers["qwen3"].apply_chat_template(CONVERSATION, enable_thinking=False)
    assert "say hello" not in text and "assistant\nHello.<|im_end|>" in text
    assert "say hello" in gguf_tokenizers["qwen3"].apply_chat_template(CONVERSATION[:3], add_generation_prompt=False)


@pytest.mark.parametrize("variant", ["mistral", "gemma3"])
def test_a_conversation_the_template_refuses_raises_its_message(gguf_tokenizers, variant):
    with pytest.raises(jinja2.exceptions.TemplateError, match="alternate"):
        gguf_tokenizers[variant].apply_chat_template([{"role": "user", "content": "a"}] * 2)
