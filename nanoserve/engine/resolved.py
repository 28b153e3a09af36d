"""What an engine resolved its configuration to: the record ``Engine.resolved`` reports, kept
apart from ``Engine.config`` (what was asked, which builds the same engine again)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.model.quant.weight_plan import WeightPlan
from nanoserve.worker.bucketing import Buckets


@dataclass(frozen=True)
class ResolvedConfig:
    weights: str  # the weight format's display name ("fp32", "int4+int8head+bf16>=24"): a report, not an option
    weight_plan: WeightPlan | None  # None: dense weights in `dtype`
    dtype: torch.dtype  # activations
    kv_cache_types: tuple[str, str]  # K's and V's storage ("bf16", "fp32", "q8_0")
    cpu_kernels: str | None  # the kernel tier running packed weights or decode attention, if any
    max_model_len: int  # clamped to what the pool holds
    kv_cache_bytes: int  # the pool's K/V bytes over every rank (the sliding-window layers' rings included)
    num_blocks: int  # including the scratch block
    max_num_batched_tokens: int
    prefill_only_budget: int | None  # None: the same budget as any step
    buckets: Buckets | None  # the decode grid (None: exact shapes)
    compile: bool = False  # whether the decode step runs compiled graphs
    window_ring: int | None = None  # sliding-window layers' ring cells a row (None: they keep the pool's cells)
