"""The engine loop without HTTP: outputs reach asyncio, abort gives blocks back, bad requests
fail alone, an idle loop sleeps, and the metrics it records render as Prometheus text."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import threading
import time

import pytest

from nanoserve.engine import RequestError, SamplingParams, build_engine
from nanoserve.engine.stats import EngineStats
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.serve.engine_loop import EngineLoop, EngineStopped
from nanoserve.serve.metrics import Histogram, ServeMetrics


@pytest.fixture
def loop():
    engine = build_engine(random_model(tiny_config(), seed=0), max_batch_size=4, kv_cache_bytes=1 << 20,
                          block_size=4, max_model_len=64)
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


async def _drain(queue: asyncio.Queue):
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs.append(await queue.get())
    return outputs


def test_outputs_reach_the_event_loop_and_match_generate(loop):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run():
        queues = [await loop.add([1, 2, 3 + i], params, f"r{i}") for i in range(3)]
        return await asyncio.gather(*(_drain(q) for q in queues))

    results = asyncio.run(run())
    reference = build_engine(loop.engine.model, max_batch_size=4, kv_cache_bytes=1 << 20, block_size=4,
                             max_model_len=64)
    for i, outputs in enumerate(results):
        deltas = [t for out in outputs for t in out.new_token_ids]
        expected = reference.generate([[1, 2, 3 + i]], params, use_tqdm=False)[0].token_ids
        assert deltas == outputs[-1].token_ids == expected
    assert loop.metrics.generation_tokens == 18 and loop.metrics.finished["length"] == 3
    assert loop.metrics.ttft.count == 3 and loop.metrics.itl.count == 15


def test_bad_request_raises_in_the_caller_and_the_loop_keeps_going(loop):
    async def run():
        with pytest.raises(RequestError, match="vocabulary"):
            await loop.add([1, 9999], SamplingParams(), "bad")
        return await _drain(await loop.add([1, 2], SamplingParams(max_tokens=2, ignore_eos=True), "good"))

    assert asyncio.run(run())[-1].finish_reason == "length"
    assert loop.alive


def test_abort_gives_blocks_back_without_waiting_for_a_step(loop):
    baseline = loop.stats.blocks_free
    # The engine's steps after its first wait until the abort is posted: on a loaded host the
    # request could otherwise finish its 30 tokens before the abort reaches the loop.
    released, step, calls = threading.Event(), loop.engine.step, itertools.count()

    def held_step():
        if next(calls) >= 1:
            released.wait(10.0)
        return step()

    loop.engine.step = held_step

    async def run():
        queue = await loop.add(list(range(1, 30)), SamplingParams(max_tokens=30, ignore_eos=True), "long")
        await queue.get()  # it is running and holds blocks
        loop.abort("long")
        released.set()

    asyncio.run(run())
    deadline = time.monotonic() + 10.0
    while loop.stats.blocks_free != baseline and time.monotonic() < deadline:
        time.sleep(0.005)
    assert loop.stats.blocks_free == baseline
    assert loop.metrics.finished["abort"] == 1
    loop.engine.check_drained()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads thread CPU time from /proc")
def test_idle_loop_sleeps_instead_of_spinning(loop):
    def cpu_seconds() -> float:
        with open(f"/proc/self/task/{loop._thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    start = cpu_seconds()
    time.sleep(0.5)
    assert cpu_seconds() - start < 0.05


def test_stopped_loop_refuses_new_requests(loop):
    loop.stop()
    with pytest.raises(EngineStopped):
        asyncio.run(loop.add([1], SamplingParams(), "late"))


def test_histogram_counts_are_cumulative_and_end_at_inf():
    histogram = Histogram("x_seconds", "help", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    lines = histogram.render()
    assert lines[2:] == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1.0"} 3',
                         'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 3.65", "x_seconds_count 4"]


def test_metrics_render_as_prometheus_text():
    metrics = ServeMetrics()
    metrics.record_decode_step(3)
    metrics.record_tokens(1, ttft=0.2, gap=None)
    metrics.record_tokens(2, ttft=None, gap=0.02)
    metrics.record_finished("stop")
    metrics.record_disconnect()
    stats = EngineStats(running=2, waiting=1, blocks_free=10, blocks_total=16, prefix_cache_queries=96,
                        prefix_cache_hits=64, prefix_cache_blocks=5, prefix_cache_evictions=2)
    text = metrics.render(stats, http_in_flight=3)
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"\})? -?[0-9.e+-]+$')
    declared = set()
    for line in text.strip().splitlines():
        if line.startswith("# TYPE"):
            declared.add(line.split()[2])
        elif not line.startswith("# HELP"):
            assert sample.match(line), line
            assert re.sub(r"(_bucket|_sum|_count)?(\{.*\})? .*$", "", line) in declared, line
    assert "nanoserve_kv_blocks_used 6" in text
    assert "nanoserve_generation_tokens_total 3" in text
    assert 'nanoserve_requests_finished_total{reason="stop"} 1' in text
    assert "nanoserve_inter_token_latency_seconds_count 2" in text
    for line in ("nanoserve_prefix_cache_queries_total 96", "nanoserve_prefix_cache_hits_total 64",
                 "nanoserve_prefix_cache_blocks 5", "nanoserve_prefix_cache_evictions_total 2",
                 "nanoserve_http_requests_in_flight 3", "nanoserve_client_disconnects_total 1"):
        assert line in text.splitlines(), line
