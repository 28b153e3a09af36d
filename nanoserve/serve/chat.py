"""POST /v1/chat/completions: messages through the model's chat template, a reply out."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import jinja2
from starlette.requests import Request

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
from nanoserve.serve.reply import Reply, ReplyDelta, reply_deltas, whole_reply
from nanoserve.serve.serving import ServeState
from nanoserve.serve.tool_calling import ToolPlan, plan_tools, prompt_messages
from nanoserve.structured.harmony import HARMONY_STOPS, template_is_harmony
from nanoserve.worker.scoring import TokenLogprobs

CHAT_ROLES = ("system", "developer", "user", "assistant")  # what every chat template takes
# "tool" only where the template names that role itself (a generic template would render it
# as if it were a turn of its own, which the model was never trained on).
_TOOL_ROLE = re.compile(r"""["']tool["']""")


@dataclass
class ChatJob:
    """A chat request in the engine, and how its reply is read back (protocol-free: reply.py)."""

    request_id: str
    created: int
    queue: asyncio.Queue
    prompt_tokens: int
    shape: ReplyShape

    async def reply(self, state: ServeState, request: Request) -> Reply:
        output, = await serving.collect(state, request, [(self.queue, self.request_id)])
        return whole_reply(self.shape, output, self.prompt_tokens)

    def deltas(self, state: ServeState) -> AsyncIterator[ReplyDelta]:
        return reply_deltas(state, self.queue, self.request_id, self.shape)


async def chat_prompt(state: ServeState, body: ChatCompletionRequest,
                      variables: dict | None = None) -> tuple[ToolPlan | None, str]:
    """The request's tool plan and prompt text (the template given `variables` besides)."""
    plan = plan_tools(body, template_source(state), state.tool_call_parser, marker_token_id(state))
    return plan, await render_chat(state, body.messages, plan=plan, variables=variables)


async def start_chat(state: ServeState, body: ChatCompletionRequest, id_prefix: str = "chatcmpl",
                     variables: dict | None = None, id_sep: str = "-") -> ChatJob:
    """Check the request, render its prompt, and submit it: what every chat route shares."""
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
    harmony = template_is_harmony(template_source(state))
    if body.reasoning_effort is not None:  # a template that reads it (harmony's) gets it
        variables = {**(variables or {}), "reasoning_effort": body.reasoning_effort}
    plan, prompt = await chat_prompt(state, body, variables)
    shape = ReplyShape(plan, None if harmony else reasoning_mode(template_source(state), prompt), harmony)
    params = replace(params, structured=await reply_structure(state, body, shape))
    if harmony:  # its channels are special tokens; a reply ends at <|return|> or <|call|>
        stops = tuple(i for i in map(marker_token_id(state), HARMONY_STOPS) if i is not None)
        params = replace(params, skip_special_tokens=False,
                         stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *stops))))
    prompt_ids = await serving.encode(state, prompt, "messages")
    max_tokens = serving.resolve_max_tokens(state, len(prompt_ids), requested, "messages")
    params = replace(params, max_tokens=max_tokens)
    request_id, created = serving.new_id(id_prefix, id_sep)
    queue = await serving.submit(state, prompt_ids, params, request_id, "messages")
    return ChatJob(request_id, created, queue, len(prompt_ids), shape)


async def create_chat_completion(state: ServeState, body: ChatCompletionRequest, request: Request):
    state.check_model(body.model)
    job = await start_chat(state, body)
    head = {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": state.model_name}
    if body.stream:
        head["object"] = "chat.completion.chunk"
        chunks = _chunks(state, head, job, body.include_usage)
        return serving.sse_response(state, chunks, job.request_id)
    reply = await job.reply(state, request)
    choice = {"index": 0, "message": openai_message(reply), "logprobs": chat_logprobs(state, reply.logprobs),
              "finish_reason": reply.finish_reason}
    return {**head, "choices": [choice], "usage": serving.usage(reply.usage.prompt_tokens,
                                                                reply.usage.completion_tokens)}


def openai_message(reply: Reply) -> dict:
    """The reply as OpenAI's assistant message (reasoning_content apart)."""
    message = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [call.as_openai() for call in reply.tool_calls]
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return message


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
    extra = {"tools": plan.template_tools()} if plan is not None and plan.native else {}
    extra.update(variables or {})  # e.g. a harmony template's reasoning_effort
    try:
        return await asyncio.to_thread(state.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt, **extra)
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


async def _chunks(state: ServeState, head: dict, job: ChatJob, include_usage: bool) -> AsyncIterator[dict]:
    """The reply's deltas as OpenAI chat chunks: one chunk per delta."""
    extra = {"usage": None} if include_usage else {}
    yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], **extra}
    completion_tokens = 0
    async for delta in job.deltas(state):
        completion_tokens = delta.completion_tokens
        if delta.reasoning:
            message, logprobs = {"reasoning_content": delta.reasoning}, None
        elif delta.tool_call is not None:
            message, logprobs = {"tool_calls": [delta.tool_call.as_openai(delta.tool_index)]}, None
        else:
            message, logprobs = {"content": delta.text} if delta.text else {}, chat_logprobs(state, delta.logprobs)
        choice = {"index": 0, "delta": message, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        yield {**head, "choices": [choice], **extra}
    if include_usage:
        yield {**head, "choices": [], "usage": serving.usage(job.prompt_tokens, completion_tokens)}


def chat_logprobs(state: ServeState, logprobs: list[TokenLogprobs] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        token = state.token_text(token_id)
        return {"token": token, "logprob": serving.logprob_value(logprob),
                "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}
