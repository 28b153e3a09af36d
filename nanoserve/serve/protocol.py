"""The OpenAI request bodies we accept, and their mapping onto SamplingParams.

Types are strict, as OpenAI's are: ``"8"`` or ``true`` is not an integer, ``"yes"`` is not a
boolean, and a float must be finite (Python's JSON parser lets ``Infinity`` and ``NaN``
through). Every text field must be valid Unicode (no lone UTF-16 surrogates). Integer ranges
are SamplingParams' own (64-bit, the generator's seed range). A generation request's fields are
honoured or refused: an unknown one is a 400 naming it (as OpenAI's API answers), fields we
cannot honour (``n > 1``, ``suffix``, ``logit_bias``, image parts) are refused with a 400 that
says so, and only IGNORED_FIELDS (bookkeeping clients send, with nothing to do here) are
accepted and ignored by design (README). Nested objects (messages, tools) still take fields
beyond their own: clients send an earlier reply's message back as it came (`refusal`,
`annotations`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from nanoserve.engine import SamplingParams
from nanoserve.engine.inputs import unicode_problem
from nanoserve.serve.errors import ApiError

MAX_TOP_LOGPROBS = 20  # OpenAI's own ceiling for chat top_logprobs
MAX_PROMPTS = 64  # prompts in one /v1/completions batch (evaluation harnesses send a few)


def _unicode(text: str) -> str:
    if (problem := unicode_problem(text)) is not None:
        raise ValueError(problem)
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # a str that can be tokenized and sent back as UTF-8


# OpenAI's fields that only matter to OpenAI's own service (an end user's id, storing the reply,
# tags, a billing tier, cache routing hints), accepted on both generation routes and ignored.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")


class StrictModel(BaseModel):
    """Strict JSON types, finite floats; unknown fields allowed (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # true: any JSON
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: "text", "json_object", or "json_schema" with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(StrictModel):
    """vLLM's newer `structured_outputs` body field: one of its kinds, as StructuredOutputs names them."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")  # `json` is a BaseModel method
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class _SamplingFields(StrictModel):
    """Fields both endpoints share. ``None`` means "the OpenAI default". A field not declared
    here or in a route's request is refused (a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 disables
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension: run to max_tokens (benchmarks, tests)
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # IGNORED_FIELDS: accepted, type-checked, and not used.
    user: Text | None = None
    store: bool | None = None
    metadata: dict[str, Text] | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, f"n: only n=1 is supported (one choice per request), got {self.n}; "
                                "send several requests instead", param="n", code="invalid_value")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias", code="invalid_value")


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # the prompt comes back before the completion (with logprobs: scored)
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, unsupported in (("suffix", self.suffix), ("best_of", self.best_of not in (None, 1))):
            if unsupported:
                raise ApiError(400, f"{name} is not supported", param=name, code="invalid_value")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of texts or of token-id lists), one
        choice each. A streamed request takes one prompt."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        if not 1 <= len(batch) <= MAX_PROMPTS:
            raise ApiError(400, f"prompt: a batch holds 1 to {MAX_PROMPTS} prompts, got {len(batch)}",
                           param="prompt", code="invalid_value")
        if self.stream and len(batch) > 1:
            raise ApiError(400, f"prompt: a streamed request takes one prompt, got {len(batch)}; send them "
                                "unstreamed or as several requests", param="prompt", code="invalid_value")
        return batch


class ContentPart(StrictModel):
    type: Text
    text: Text | None = None


class FunctionCall(StrictModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class MessageToolCall(StrictModel):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Text
    content: Text | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a "tool" turn: the call it answers
    name: Text | None = None

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ApiError(400, "messages: only text content parts are supported", param="messages",
                               code="invalid_value")
            content = "".join(part.text or "" for part in content)
        return content or ""

    def as_template_dict(self) -> dict[str, Any]:
        """The {"role", "content"} dict chat templates expect (text parts joined), with the tool
        fields templates read where present (a call's arguments as an object, as they take them)."""
        # "developer" is the newer name for "system"; templates only know the older one.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.role == "assistant" and (thinking := self.reasoning()):
            message["thinking"] = thinking  # gpt-oss's template writes it as the turn's analysis
        return message

    def reasoning(self) -> str | None:
        """An assistant turn's reasoning as a client sends it back: OpenAI-style
        ``reasoning_content`` (what this server replies with), ``reasoning`` or ``thinking``."""
        extra = self.model_extra or {}
        for key in ("reasoning_content", "reasoning", "thinking"):
            if isinstance(extra.get(key), str) and extra[key]:
                return extra[key]
        return None


def _arguments(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


class FunctionDefinition(StrictModel):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # a harmony template's variable

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages: at least one message is needed", param="messages",
                           code="invalid_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs",
                           code="invalid_value")


def sampling_params(body: _SamplingFields, *, max_tokens: int, logprobs: int | None,
                    logprobs_param: str = "logprobs", prompt_logprobs: int | None = None) -> SamplingParams:
    """Build SamplingParams; its ValueError ("field: must be ...") becomes a 400 naming the field."""
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{logprobs_param}: must be at most {MAX_TOP_LOGPROBS}, got {logprobs}",
                       param=logprobs_param, code="invalid_value")
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    fields = dict(
        max_tokens=max_tokens, temperature=_default(body.temperature, 1.0), top_k=top_k,
        top_p=_default(body.top_p, 1.0), min_p=_default(body.min_p, 0.0),
        repetition_penalty=_default(body.repetition_penalty, 1.0),
        presence_penalty=_default(body.presence_penalty, 0.0),
        frequency_penalty=_default(body.frequency_penalty, 0.0), seed=body.seed,
        stop=body.stop or (), stop_token_ids=body.stop_token_ids or (), ignore_eos=body.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        param = logprobs_param if field in ("logprobs", "prompt_logprobs") else field if field in fields else None
        raise ApiError(400, str(exc), param=param, code="invalid_value") from exc


def _default(value, default):
    return default if value is None else value


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered through the template first."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (templated)
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt", code="invalid_value")


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[int]
