"""Chat templates given in place of a model's own (`--chat-template FILE|NAME`): a jinja file, or
one of the built-in templates of the common formats, for a model file that carries none (Gemma
3's GGUF files, for one). They render in the model's own template's sandbox (tokenizer.ChatTemplate)
and are checked when the engine's options are, before any weights load: a template that cannot
render a short conversation is refused in one line."""

from __future__ import annotations

import copy
from pathlib import Path

import jinja2

from nanoserve.model.formats.tokenizer import ChatTemplate, Tokenizer

# The system message, where a format has no system turn, leads the first user turn (as the
# models' own templates fold it). Roles must alternate where the format's turns assume it.
CHATML = """{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"""

LLAMA3 = """{{ bos_token }}
{%- for message in messages -%}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"""

# Formats with no system role fold a system message into the first user turn, and take turns
# that alternate user/assistant: the loop's head, shared by the templates below.
_SYSTEM_FOLDED_TURNS = """{%- if messages[0]['role'] == 'system' -%}
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
"""

GEMMA = """{{ bos_token }}
""" + _SYSTEM_FOLDED_TURNS + """  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

MISTRAL = """{{ bos_token }}
""" + _SYSTEM_FOLDED_TURNS + """  {%- if message['role'] == 'user' -%}
{{ '[INST] ' + (first_prefix if loop.first else '') + message['content'] | trim + ' [/INST]' }}
  {%- else -%}
{{ ' ' + message['content'] | trim + eos_token }}
  {%- endif -%}
{%- endfor -%}"""

BUILTIN = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "mistral": MISTRAL}

# What a template must render at load: a system message, a finished exchange and a new question.
SAMPLE_CONVERSATION = ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2 + 2?"})
# Stand-ins for the model's special tokens while checking (the tokenizer is not read yet).
SAMPLE_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def chat_template_source(spec: str) -> str:
    """The jinja source `spec` names: a built-in template's name, or a file's path. ValueError,
    in one line, for anything else."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {spec!r}: neither a file nor a built-in template "
                         f"({', '.join(sorted(BUILTIN))})")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template {spec!r}: cannot read it ({exc})") from None


def checked_chat_template(spec: str, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
    """The template `spec` names, compiled and shown to render SAMPLE_CONVERSATION with the
    generation prompt (``special_tokens``: the model's, else stand-ins); ValueError, in one line,
    naming what failed."""
    source = chat_template_source(spec)
    try:
        template = ChatTemplate(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template {spec!r}: line {exc.lineno}: {exc.message}") from None
    try:
        text = template.render(SAMPLE_CONVERSATION, True, **(special_tokens or SAMPLE_SPECIALS))
    except Exception as exc:  # whatever the template's code raises (its raise_exception, a TypeError)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"chat_template {spec!r} cannot render a sample conversation: {reason}") from None
    if SAMPLE_CONVERSATION[-1]["content"] not in text:
        raise ValueError(f"chat_template {spec!r} leaves the messages out of the prompt it renders")
    return template


def with_chat_template(tokenizer: Tokenizer | None, spec: str) -> Tokenizer:
    """A copy of `tokenizer` whose chat template is the one `spec` names (the caller's tokenizer
    is left as it was)."""
    if tokenizer is None:
        raise ValueError(f"chat_template {spec!r}: the model has no tokenizer to render chats with")
    specials = {name: token for name, token in tokenizer.special_tokens.items() if token is not None}
    chosen = copy.copy(tokenizer)
    chosen.chat_template = checked_chat_template(spec, {**SAMPLE_SPECIALS, **specials})
    return chosen
