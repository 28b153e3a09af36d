"""The engine layer: scheduling, sampling, bucketing, the decode step and Engine itself."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562), so that the torch-free modules here (options, sampling_params)
# import without torch: the command line parses its arguments before torch is loaded.
_EXPORTS = {
    "Engine": "nanoserve.engine.engine", "EngineConfig": "nanoserve.engine.engine",
    "RequestError": "nanoserve.engine.engine", "RequestOutput": "nanoserve.engine.request",
    "SamplingParams": "nanoserve.engine.sampling_params", "build_engine": "nanoserve.engine.build",
}
__all__ = ["Engine", "EngineConfig", "RequestError", "RequestOutput", "SamplingParams", "build_engine"]

if TYPE_CHECKING:
    from nanoserve.engine.build import build_engine
    from nanoserve.engine.engine import Engine, EngineConfig, RequestError
    from nanoserve.engine.request import RequestOutput
    from nanoserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
