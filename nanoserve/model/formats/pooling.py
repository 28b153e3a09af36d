"""A model's own pooling, as its files declare it: what /v1/embeddings and /v1/rerank read.

A GGUF says it in ``{arch}.pooling_type`` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last,
4 rank); a Hugging Face directory in its Sentence-Transformers config (``modules.json`` naming a
Pooling module, whose ``config.json`` sets one of ``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``). None: the files declare none (a
generation model), or one this server does not run (max pooling, weighted mean).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's LLAMA_POOLING_TYPE_*
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_cls_token", "cls"))
_ST_POOLING = "sentence_transformers.models.Pooling"


def gguf_pooling(metadata: Mapping[str, Any]) -> str | None:
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.pooling_type")
    try:
        return GGUF_POOLING.get(int(value)) if value is not None else None
    except (TypeError, ValueError):
        return None


def hf_pooling(model_dir: str | Path) -> str | None:
    model_dir = Path(model_dir)
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    for module in modules if isinstance(modules, list) else ():
        if isinstance(module, dict) and module.get("type") == _ST_POOLING:
            try:
                config = json.loads((model_dir / str(module.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                return None
            chosen = [kind for key, kind in _ST_MODES if config.get(key)]
            others = [key for key, on in config.items() if key.startswith("pooling_mode_") and on
                      and key not in dict(_ST_MODES)]
            return chosen[0] if len(chosen) == 1 and not others else None
    return None


def model_pooling(path: str | Path, metadata: Mapping[str, Any] | None = None) -> str | None:
    """The pooling a model file or directory declares (``metadata``: a GGUF's, already read)."""
    if metadata is not None:
        return gguf_pooling(metadata)
    return hf_pooling(path) if Path(path).is_dir() else None
