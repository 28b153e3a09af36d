"""What addressing a decode step costs next to the step itself (part of `compilebench.py slots`).

For each row count n, rows 0..n-1 of the engine's cache hold a `context`-token prompt.
Then planning steps and whole eager decode steps alternate: a planning step is what it takes
to address a step (the block manager's `advance` over the prefix, then the worker cache's
`plan_decode`); a decode step is the worker's `execute` of a decode plan. Each
is timed alone, synchronising a GPU around it; the table quotes medians and the share
planning / step. A second planning step right after the first ("hot") shows what the
forward costs the host code that follows it: its weights push that code's data out of cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile.common import time_once
from nanoserve.engine.engine import Engine
from nanoserve.engine.request import Request
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.worker.kv_cache import DecodePlan
from nanoserve.worker.plan import DecodeBatch, StepPlan

COLUMNS = ["rows", "context", "plan_us", "plan_hot_us", "step_ms", "plan_share_pct"]


@dataclass(frozen=True)
class PlanningRun:
    row_counts: tuple[int, ...] = (1, 8, 32, 64)
    context: int = 128  # tokens each row holds before the first timed step
    steps: int = 20  # timed planning steps, and as many timed decode steps, per row count
    warmup: int = 2  # untimed decode steps per row count

    @property
    def max_model_len(self) -> int:
        return self.context + self.warmup + 3 * self.steps


def decode_batch(engine: Engine, requests: list[Request]) -> DecodeBatch:
    """The block manager advances rows 0..len(requests)-1: their decode rows, as the scheduler plans them."""
    n = len(requests)
    positions, write_slots = engine.scheduler.blocks.advance(range(n))
    return DecodeBatch(tuple(r.request_id for r in requests), tuple(range(n)), tuple(r.last_token_id for r in requests),
                       tuple(positions), tuple(write_slots), n, max(positions) + 1)


def plan_step(engine: Engine, requests: list[Request]) -> tuple[int, int]:
    """The addressing of one decode step over the requests' rows, and nothing else: the widest
    and total context the step is bucketed by."""
    plan: DecodePlan = engine.worker.cache.plan_decode(decode_batch(engine, requests))
    return plan.width, plan.total_context


def decode_once(engine: Engine, requests: list[Request]) -> torch.Tensor:
    """One eager decode step over rows 0..len(requests)-1, planned and run as the engine does."""
    return engine.worker.forward(StepPlan((), decode_batch(engine, requests), ())).logits


def measure_rows(engine: Engine, run: PlanningRun, rows: int) -> dict:
    """Median planning and eager-step time over `rows` rows, alternating one of each."""
    blocks, cache = engine.scheduler.blocks, engine.worker.cache
    for row in blocks.live_rows:
        blocks.free(row)
        cache.free(row)
    requests = [Request(f"plan-{row}", [0] * run.context, SamplingParams()) for row in range(rows)]
    for row in range(rows):
        blocks.grow(row, run.context)
        cache.adopt(row, torch.tensor(blocks.slots_of(row, run.context), device=cache.device))
    for _ in range(run.warmup):
        decode_once(engine, requests)
    planning, hot, stepping = [], [], []
    for _ in range(run.steps):
        planning.append(time_once(lambda: plan_step(engine, requests), cache.device))
        hot.append(time_once(lambda: plan_step(engine, requests), cache.device))
        stepping.append(time_once(lambda: decode_once(engine, requests), cache.device))
    plan_s, step_s = statistics.median(planning), statistics.median(stepping)
    return dict(rows=rows, context=run.context, plan_us=plan_s * 1e6, plan_hot_us=statistics.median(hot) * 1e6,
                step_ms=step_s * 1e3, plan_share_pct=100 * plan_s / step_s)


def measure_planning(engine: Engine, run: PlanningRun) -> list[dict]:
    """One result per row count; the engine must be eager with room for max(row_counts) rows
    of `run.max_model_len` tokens."""
    if engine.worker.decode_step.compiled:
        raise ValueError("the planning share is measured against the eager step: build the engine without compile")
    with torch.inference_mode():
        return [measure_rows(engine, run, rows) for rows in run.row_counts]


def format_planning(results: Sequence[dict]) -> str:
    lines = [f"{'rows':>5} {'context':>8} {'planning':>10} {'hot':>10} {'eager step':>11} {'share':>7}"]
    for r in results:
        lines.append(f"{r['rows']:>5} {r['context']:>8} {r['plan_us']:>8.1f}us {r['plan_hot_us']:>8.1f}us "
                     f"{r['step_ms']:>9.2f}ms {r['plan_share_pct']:>6.2f}%")
    return "\n".join(lines)


def planning_verdict(results: Sequence[dict], rows: int = 32, bar_pct: float = 2.0) -> list[str]:
    """Where planning at `rows` rows stands against the bar (at most `bar_pct`% of the eager step)."""
    return [f"planning at {r['rows']} rows: {r['plan_share_pct']:.2f}% of the eager step "
            f"({'within' if r['plan_share_pct'] <= bar_pct else 'over'} the {bar_pct:g}% bar)"
            for r in results if r["rows"] == rows]
