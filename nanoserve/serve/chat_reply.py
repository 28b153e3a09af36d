"""How a chat reply is shaped: its tool plan and reasoning read back into OpenAI's message, and
what the reply is constrained to (response_format / guided_* / the tools' grammar, from the end
of a thinking model's reasoning on)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanoserve.serve.errors import ApiError
from nanoserve.serve.protocol import ChatCompletionRequest
from nanoserve.serve.serving import ServeState
from nanoserve.serve.structured_fields import compile_structure, structure_for
from nanoserve.serve.tool_calling import ToolPlan, reply_message
from nanoserve.structured import StructuredOutputs
from nanoserve.structured.harmony import parse_harmony
from nanoserve.structured.reasoning import (
    THINK_END,
    closed_in_prompt,
    opened_in_prompt,
    split_reasoning,
    template_thinks,
)


@dataclass
class ReplyShape:
    """How a reply is read back: its tool plan, and whether it opens with reasoning
    (reasoning_mode: None, "may" think, or "opened" in the prompt)."""

    plan: ToolPlan | None
    reasoning: str | None
    harmony: bool = False  # a harmony reply (gpt-oss): channels and calls read by structured.harmony

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole reply as OpenAI's message (reasoning_content apart) and its finish reason."""
        if self.harmony:
            return self._harmony_message(text, finish_reason)
        thought, answer = None, text
        if self.reasoning is not None:
            thought, answer = split_reasoning(text, opened=self.reasoning == "opened")
        if answer is None:  # cut inside its reasoning
            message = {"role": "assistant", "content": None}
        else:
            message, finish_reason = reply_message(self.plan, answer, finish_reason)
        if thought is not None:
            message["reasoning_content"] = thought
        return message, finish_reason

    def _harmony_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        thought, content, calls = parse_harmony(text)
        if self.plan is None or self.plan.choice == "none":
            calls = []
        elif not self.plan.parallel:
            calls = calls[:1]
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if thought is not None:
            message["reasoning_content"] = thought
        return message, finish_reason


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
