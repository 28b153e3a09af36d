"""Shared test set-up: devices, the gpu marker, hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI keeps the property suite quick; NANOSERVE_HYPOTHESIS=long explores much further.
settings.register_profile(
    "ci", max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", max_examples=1000, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("NANOSERVE_HYPOTHESIS", "ci"))

HAS_CUDA = torch.cuda.is_available()
# Parametrise device-generic tests over these: cpu always, cuda where present.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
