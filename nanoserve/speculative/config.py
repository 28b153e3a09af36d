"""What speculation was asked for, in vLLM's words: ``{"method": "ngram", "num_speculative_tokens":
4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method": "draft", "model": path,
"num_speculative_tokens": 4}``. Validated once, here; imports nothing heavy (the command line
reads it before torch is loaded).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` is the most a row proposes a step (its k adapts below that
    from its recent acceptance unless ``adaptive`` is off). ``ngram`` matches the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens against the row's history. ``draft``
    runs ``model`` (a GGUF or Hugging Face path; None: the target's own file) with weights
    ``draft_weights`` (default "auto": for an fp32 target, its own int4 blocks). Steps with at
    least ``disable_by_batch_size`` decoding rows do not speculate: with many rows a step is
    compute-bound and verifying costs more than it saves."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    draft_weights: str = "auto"
    disable_by_batch_size: int = 8
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be an int >= 1, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative num_speculative_tokens must be <= 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative method 'ngram' takes no model (it looks tokens up in the prompt)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative adaptive must be true or false, got {self.adaptive!r}")

    def most_rows(self, max_batch_size: int) -> int:
        """The most decode rows a speculating step has (fewer than ``disable_by_batch_size``)."""
        return max(1, min(max_batch_size, self.disable_by_batch_size - 1))

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a config, a dict of its fields, or that dict as JSON (the command line's);
        None stays None. Unknown keys raise ValueError naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
