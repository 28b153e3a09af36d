"""nanoserve: an LLM inference engine on PyTorch (paged KV cache, continuous batching)."""

from nanoserve.engine import Engine, SamplingParams, build_engine

__all__ = ["Engine", "SamplingParams", "build_engine"]
