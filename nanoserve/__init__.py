"""nanoserve: an LLM inference engine on PyTorch (paged KV cache, continuous batching)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562): `nanoserve --help` must answer before torch is imported.
__all__ = ["Engine", "SamplingParams", "build_engine"]

if TYPE_CHECKING:
    from nanoserve.engine import Engine, SamplingParams, build_engine


def __getattr__(name: str) -> Any:
    if name in __all__:
        import nanoserve.engine

        value = getattr(nanoserve.engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
