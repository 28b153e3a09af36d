"""Output an agent can parse: grammars enforced token by token (llguidance), tool calls and
reasoning parsed back out of the reply.

``params`` (what a request asks for) imports nothing heavy, so SamplingParams stays torch-free;
``compiler`` and ``decoding`` load llguidance and torch when the engine first needs them.
"""

from nanoserve.structured.params import StructuredOutputError, StructuredOutputs

__all__ = ["StructuredOutputError", "StructuredOutputs"]
