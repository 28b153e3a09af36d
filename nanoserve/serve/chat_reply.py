"""How a chat reply is shaped: its tool plan and reasoning read back apart from its answer, and
what the reply is constrained to (response_format / guided_* / the tools' grammar, from the end
of a thinking model's reasoning on)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanoserve.serve.errors import ApiError
from nanoserve.serve.protocol import ChatCompletionRequest
from nanoserve.serve.serving import ServeState
from nanoserve.serve.structured_fields import compile_structure, structure_for
from nanoserve.serve.tool_calling import ToolPlan, read_reply
from nanoserve.structured import StructuredOutputs
from nanoserve.structured.harmony import parse_harmony
from nanoserve.structured.reasoning import (
    THINK_END,
    closed_in_prompt,
    opened_in_prompt,
    split_reasoning,
    template_thinks,
)
from nanoserve.structured.tools import ToolCall


@dataclass
class ReplyShape:
    """How a reply is read back: its tool plan, and whether it opens with reasoning
    (reasoning_mode: None, "may" think, or "opened" in the prompt)."""

    plan: ToolPlan | None
    reasoning: str | None
    harmony: bool = False  # a harmony reply (gpt-oss): channels and calls read by structured.harmony

    def read(self, text: str, finish_reason: str | None
             ) -> tuple[str | None, str | None, list[ToolCall], str | None]:
        """The whole reply's (reasoning, answer, tool calls, finish reason): reasoning None
        when it had none, answer None when it ended inside its reasoning."""
        if self.harmony:
            return self._read_harmony(text, finish_reason)
        thought, answer = None, text
        if self.reasoning is not None:
            thought, answer = split_reasoning(text, opened=self.reasoning == "opened")
        if answer is None:  # cut inside its reasoning
            return thought, None, [], finish_reason
        answer, calls, finish_reason = read_reply(self.plan, answer, finish_reason)
        return thought, answer, calls, finish_reason

    def _read_harmony(self, text: str, finish_reason: str | None
                      ) -> tuple[str | None, str | None, list[ToolCall], str | None]:
        thought, content, calls = parse_harmony(text)
        calls = self.allowed_calls(calls)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return thought, content, calls, finish_reason

    def allowed_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls the request lets a harmony reply make: none without tools (or with
        tool_choice none), one unless parallel calls are allowed."""
        if self.plan is None or self.plan.choice == "none":
            return []
        return calls if self.plan.parallel else calls[:1]


def reasoning_mode(template: str, prompt: str) -> str | None:
    """None for a model that does not think (or whose prompt closed the block: thinking off),
    "opened" when the prompt opened the block, else "may"."""
    if not template_thinks(template) or closed_in_prompt(prompt):
        return None
    return "opened" if opened_in_prompt(prompt) else "may"


async def reply_structure(state: ServeState, body: ChatCompletionRequest, shape: ReplyShape
                           ) -> StructuredOutputs | None:
    """What the reply is constrained to: response_format / guided_*, or the tools' grammar; for
    a thinking model, from the end of its reasoning on."""
    structure = await _answer_structure(state, body, shape.plan)
    if structure is None or shape.reasoning is None:
        return structure
    structure = replace(structure, after=THINK_END)
    await compile_structure(state.engine_loop.engine, structure, "messages", state.compile_timeout)
    return structure


async def _answer_structure(state: ServeState, body: ChatCompletionRequest, plan: ToolPlan | None
                            ) -> StructuredOutputs | None:
    requested = await structure_for(state, body)
    if plan is not None and plan.choice != "none":  # every parameters schema must be one we can enforce
        for index, function in enumerate(plan.functions):
            await compile_structure(state.engine_loop.engine, StructuredOutputs(json=function.parameters),
                                    f"tools[{index}].function.parameters", state.compile_timeout)
    tools = plan.structure() if plan is not None else None
    if tools is None:
        return requested
    if requested is not None:
        raise ApiError(400, "response_format: cannot be combined with tools whose tool_choice constrains the "
                            "reply; send one of them", param="response_format", code="invalid_value")
    await compile_structure(state.engine_loop.engine, tools, "tools", state.compile_timeout)
    return tools


def template_source(state: ServeState) -> str:
    return getattr(getattr(state.tokenizer, "chat_template", None), "source", "")


def marker_token_id(state: ServeState):
    """A tool format's marker (Mistral's [TOOL_CALLS]) -> its token id in this model's vocabulary."""
    backend = getattr(state.tokenizer, "backend", None)
    return (lambda token: None) if backend is None else backend.token_to_id
