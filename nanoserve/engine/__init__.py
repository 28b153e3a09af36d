"""The engine layer, the host side: configuration, requests, the scheduler, sampling and Engine itself."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562), so that the torch-free modules here (config, options, sampling_params)
# import without torch: the command line parses its arguments before torch is loaded.
_EXPORTS = {
    "Engine": "nanoserve.engine.engine", "EngineConfig": "nanoserve.engine.config",
    "EngineStats": "nanoserve.engine.stats", "RequestError": "nanoserve.engine.inputs",
    "RequestOutput": "nanoserve.engine.request",
    "SamplingParams": "nanoserve.engine.sampling_params", "build_engine": "nanoserve.engine.build",
}
__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestError", "RequestOutput", "SamplingParams", "build_engine"]

if TYPE_CHECKING:
    from nanoserve.engine.build import build_engine
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from nanoserve.engine.inputs import RequestError
    from nanoserve.engine.request import RequestOutput
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.engine.stats import EngineStats


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
