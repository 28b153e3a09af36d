"""A thinking model's reply split into its reasoning (``<think>...</think>``) and its answer,
whole or as it streams. A template that opens the block in the prompt (its generation prompt
ends with ``<think>``) makes the reply start inside the reasoning."""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def template_thinks(template_source: str) -> bool:
    """Whether a chat template is a thinking model's (it writes or strips ``</think>``)."""
    return THINK_END in template_source


def opened_in_prompt(prompt: str) -> bool:
    """The prompt ends inside an open think block: the reply starts with reasoning."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_START)


def closed_in_prompt(prompt: str) -> bool:
    """The prompt already holds an empty, closed block (thinking turned off): no reasoning follows."""
    return prompt.rstrip().endswith(THINK_END)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole reply; reasoning None when the reply has none, answer None
    when the reply ended (or was cut) inside its reasoning."""
    stream = ReasoningStream(opened)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    if not stream.saw_reasoning:
        return None, text
    return reasoning, (content if stream.answering else None)


class ReasoningStream:
    """Text deltas in, (reasoning delta, answer delta) out. Holds back only a tail that could
    still be the start of a marker."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "undecided"
        self.saw_reasoning = opened
        self._held = ""
        self._answer_begun = False  # the blank lines between the block and the answer are dropped

    @property
    def answering(self) -> bool:
        return self.state == "answer"

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, content = "", ""
        if self.state == "undecided":
            head = self._held.lstrip()
            if head.startswith(THINK_START):
                self._held, self.state, self.saw_reasoning = head[len(THINK_START):], "reasoning", True
            elif THINK_START.startswith(head):
                return "", ""  # could still open a block
            else:
                self.state = "answer"
        if self.state == "reasoning":
            before, end, after = self._held.partition(THINK_END)
            if end:
                reasoning, self._held, self.state = before, after, "answer"
            else:
                keep = marker_prefix_length(self._held, THINK_END)
                reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        if self.state == "answer":
            content, self._held = self._answer(self._held), ""
        return reasoning, content

    def _answer(self, text: str) -> str:
        if not self._answer_begun and self.saw_reasoning:
            text = text.lstrip()
        self._answer_begun = self._answer_begun or bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """What is still held back, when the reply ends."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "undecided":
            self.state = "answer"
        return "", self._answer(held)


def marker_prefix_length(text: str, marker: str) -> int:
    """The longest tail of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
