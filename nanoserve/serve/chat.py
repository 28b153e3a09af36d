"""POST /v1/chat/completions: messages through the model's chat template, a reply out."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace

import jinja2
from starlette.requests import Request

from nanoserve.engine.sampler import TokenLogprobs
from nanoserve.serve import serving
from nanoserve.serve.chat_reply import (
    ReplyShape,
    marker_token_id,
    reasoning_mode,
    reply_structure,
    template_source,
)
from nanoserve.serve.errors import ApiError, quoted
from nanoserve.serve.protocol import ChatCompletionRequest, ChatMessage, sampling_params
from nanoserve.serve.serving import ServeState
from nanoserve.serve.tool_calling import ToolPlan, ToolReplyStream, plan_tools, prompt_messages
from nanoserve.structured.harmony import HARMONY_STOPS, HarmonyStream, template_is_harmony
from nanoserve.structured.reasoning import ReasoningStream

CHAT_ROLES = ("system", "developer", "user", "assistant")  # what every chat template takes
# "tool" only where the template names that role itself (a generic template would render it
# as if it were a turn of its own, which the model was never trained on).
_TOOL_ROLE = re.compile(r"""["']tool["']""")


async def create_chat_completion(state: ServeState, body: ChatCompletionRequest, request: Request):
    state.check_model(body.model)
    body.check_supported()
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is not None and requested < 1:
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"{name}: must be at least 1 for a chat reply, got {requested}", param=name,
                       code="invalid_value")
    top = (body.top_logprobs or 0) if body.logprobs else None
    # Validate every field before the template and tokenizer run; the budget is settled after.
    params = sampling_params(body, max_tokens=1 if requested is None else requested, logprobs=top,
                             logprobs_param="top_logprobs")
    plan = plan_tools(body, template_source(state), state.tool_call_parser, marker_token_id(state))
    harmony = template_is_harmony(template_source(state))
    if harmony and plan is not None and plan.choice not in ("none", "auto"):
        raise ApiError(400, "tool_choice: only \"auto\" and \"none\" are supported with this model's harmony "
                            "format", param="tool_choice", code="invalid_value")
    effort = {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort is not None else {}
    prompt = await render_chat(state, body.messages, plan=plan, variables=effort)
    shape = ReplyShape(plan, None if harmony else reasoning_mode(template_source(state), prompt), harmony)
    params = replace(params, structured=await reply_structure(state, body, shape))
    if harmony:  # its channels are special tokens; a reply ends at <|return|> or <|call|>
        stops = tuple(i for i in map(marker_token_id(state), HARMONY_STOPS) if i is not None)
        params = replace(params, skip_special_tokens=False,
                         stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *stops))))
    prompt_ids = await serving.encode(state, prompt, "messages")
    max_tokens = serving.resolve_max_tokens(state, len(prompt_ids), requested, "messages")
    params = replace(params, max_tokens=max_tokens)
    request_id, created = serving.new_id("chatcmpl")
    queue = await serving.submit(state, prompt_ids, params, request_id, "messages")
    head = {"id": request_id, "object": "chat.completion", "created": created, "model": state.model_name}
    if body.stream:
        head["object"] = "chat.completion.chunk"
        chunks = _chunks(state, head, queue, len(prompt_ids), body.include_usage, shape)
        return serving.sse_response(state, chunks, request_id)
    output, = await serving.collect(state, request, [(queue, request_id)])
    message, finish_reason = shape.message(output.text, output.finish_reason)
    choice = {"index": 0, "message": message, "logprobs": chat_logprobs(state, output.logprobs),
              "finish_reason": finish_reason}
    return {**head, "choices": [choice], "usage": serving.usage(len(prompt_ids), len(output.token_ids))}


async def render_chat(state: ServeState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                      plan: ToolPlan | None = None, variables: dict | None = None) -> str:
    """The prompt text: the model's chat template (with the generation prompt appended), rendered
    in a worker thread so that long conversations do not stall the event loop. A role the
    template does not take is a 400 naming `messages[i].role`, as OpenAI's API answers. With a
    tool plan, the tools are in the prompt (the template's own way, or a system message)."""
    template = getattr(state.tokenizer, "chat_template", None)
    if template is None:
        raise ApiError(400, "messages: this server's model has no chat template (a server started with "
                            "--chat-template FILE|NAME has one); use /v1/completions",
                       param="messages", code="invalid_value")
    roles = chat_roles(template.source)
    # Outside a native template, tool results are rewritten as user turns (prompt_messages).
    check_roles(messages, roles if plan is None or plan.native else tuple(dict.fromkeys((*roles, "tool"))))
    messages = prompt_messages(plan, [m.as_template_dict() for m in messages])
    tools = {"tools": plan.template_tools()} if plan is not None and plan.native else {}
    tools.update(variables or {})  # e.g. a harmony template's reasoning_effort
    try:
        return await asyncio.to_thread(state.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt, **tools)
    except jinja2.TemplateError as exc:  # e.g. the template's own raise_exception on bad roles
        raise ApiError(400, f"messages: the chat template refused them: {exc}", param="messages",
                       code="invalid_value") from exc


def chat_roles(template_source: str) -> tuple[str, ...]:
    """The roles a chat template takes: CHAT_ROLES, and "tool" where the template names it."""
    return CHAT_ROLES + (("tool",) if _TOOL_ROLE.search(template_source) else ())


def check_roles(messages: list[ChatMessage], roles: tuple[str, ...]) -> None:
    for index, message in enumerate(messages):
        if message.role not in roles:
            param = f"messages[{index}].role"
            raise ApiError(400, f"{param}: invalid value {quoted(message.role)}; supported values are "
                                f"{', '.join(map(repr, roles))}", param=param, code="invalid_value")


async def _chunks(state: ServeState, head: dict, queue: asyncio.Queue, prompt_len: int,
                  include_usage: bool, shape: ReplyShape) -> AsyncIterator[dict]:
    extra = {"usage": None} if include_usage else {}
    yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], **extra}
    completion_tokens = 0
    thinking = ReasoningStream(shape.reasoning == "opened") if shape.reasoning is not None else None
    tools = ToolReplyStream(shape.plan) if shape.plan is not None and not shape.harmony else None
    harmony = HarmonyStream() if shape.harmony else None
    async for delta in serving.deltas(state, queue, head["id"]):
        if harmony is not None:
            for choice in _harmony_choices(state, harmony, delta, shape):
                yield {**head, "choices": [choice], **extra}
            completion_tokens = len(delta.output.token_ids)
            continue
        completion_tokens = len(delta.output.token_ids)
        text = delta.text
        if thinking is not None:
            thought, text = thinking.feed(text)
            if delta.output.finished:
                more_thought, more_text = thinking.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:
                yield {**head, "choices": [{"index": 0, "delta": {"reasoning_content": thought}, "logprobs": None,
                                            "finish_reason": None}], **extra}
        if tools is not None:  # content while it surely is content; calls once the reply is whole
            for choice in _tool_reply_choices(state, tools, delta, text):
                yield {**head, "choices": [choice], **extra}
            continue
        if not text and not delta.output.finished and not delta.logprobs:
            continue  # tokens whose text is still held back (a partial character, a possible stop)
        choice = {"index": 0, "delta": {"content": text} if text else {},
                  "logprobs": chat_logprobs(state, delta.logprobs),
                  "finish_reason": serving.finish_reason(delta.output)}
        yield {**head, "choices": [choice], **extra}
    if include_usage:
        yield {**head, "choices": [], "usage": serving.usage(prompt_len, completion_tokens)}


def _harmony_choices(state: ServeState, stream: HarmonyStream, delta: serving.Delta, shape: ReplyShape
                     ) -> list[dict]:
    """Stream choices of a harmony reply: reasoning and content deltas as their channels stream,
    and at the end one tool_calls delta per call."""
    thought, text = stream.feed(delta.text)
    finished = delta.output.finished
    if finished:
        more_thought, more_text = stream.finish()
        thought, text = thought + more_thought, text + more_text
    choices = []
    if thought:
        choices.append({"index": 0, "delta": {"reasoning_content": thought}, "logprobs": None, "finish_reason": None})
    logprobs = chat_logprobs(state, delta.logprobs)
    if text or (logprobs and not finished):
        choices.append({"index": 0, "delta": {"content": text} if text else {},
                        "logprobs": None if finished else logprobs, "finish_reason": None})
    if not finished:
        return choices
    calls = stream.calls if shape.plan is not None and shape.plan.choice != "none" else []
    calls = calls if shape.plan is None or shape.plan.parallel else calls[:1]
    for index, call in enumerate(calls):
        choices.append({"index": 0, "delta": {"tool_calls": [call.as_openai(index)]}, "logprobs": None,
                        "finish_reason": None})
    finish_reason = serving.finish_reason(delta.output)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    choices.append({"index": 0, "delta": {}, "logprobs": logprobs, "finish_reason": finish_reason})
    return choices


def _tool_reply_choices(state: ServeState, tools: ToolReplyStream, delta: serving.Delta, text: str) -> list[dict]:
    """Stream choices of a tool-enabled reply: content and logprobs as they come, then at the
    end the rest and one tool_calls delta per call (OpenAI's shape: index, id, name, arguments)."""
    logprobs = chat_logprobs(state, delta.logprobs)
    content = tools.feed(text)
    if not delta.output.finished:
        if not content and not logprobs:
            return []
        return [{"index": 0, "delta": {"content": content} if content else {}, "logprobs": logprobs,
                 "finish_reason": None}]
    rest, calls, finish_reason = tools.finish(delta.output.finish_reason)
    content += rest
    choices = []
    if content:
        choices.append({"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None})
    for index, call in enumerate(calls):
        choices.append({"index": 0, "delta": {"tool_calls": [{"index": index, **call}]}, "logprobs": None,
                        "finish_reason": None})
    choices.append({"index": 0, "delta": {}, "logprobs": logprobs, "finish_reason": finish_reason})
    return choices


def chat_logprobs(state: ServeState, logprobs: list[TokenLogprobs] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        token = state.token_text(token_id)
        return {"token": token, "logprob": serving.logprob_value(logprob),
                "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}
