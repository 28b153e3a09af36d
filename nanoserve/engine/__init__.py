"""The engine layer: scheduling, sampling, bucketing, the decode step and Engine itself."""

from nanoserve.engine.build import build_engine
from nanoserve.engine.engine import Engine, EngineConfig, RequestError
from nanoserve.engine.request import RequestOutput
from nanoserve.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestError", "RequestOutput", "SamplingParams", "build_engine"]
