"""What a request asks its output to match: vLLM's ``StructuredOutputs`` names, one kind each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ValueError):
    """A schema, pattern or grammar that cannot be enforced; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``regex``,
    ``choice`` (the reply is one of these strings), ``grammar`` (Lark, as llguidance reads it,
    or GBNF: a grammar with ``::=`` rules), ``json_object`` (any JSON object).

    ``after`` holds text after which the constraint starts (a thinking model's ``</think>``):
    until the reply contains it, decoding is free. ``distinct_calls`` (with ``json``, the generic
    tool-call envelope) guards the envelope's list of calls: a call repeating an earlier one
    closes it (``nanoserve.structured.tools.RepeatGuard``). Raises ValueError naming the field."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    after: str | None = None
    distinct_calls: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            # Stored as JSON text: the dataclass stays frozen and hashable, and the compiler caches by it.
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured.choice: must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("structured.choice: must hold at least one string")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured: give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        for name in ("regex", "grammar", "after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured.{name}: must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _schema_text(schema: Any) -> str:
    if not isinstance(schema, dict | bool):
        raise ValueError(f"structured.json: a JSON schema is an object, got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)  # property order is kept: it is the output order
