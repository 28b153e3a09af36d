"""Server metrics in Prometheus text format, without a client library.

The engine thread records (tokens, latencies, decode batch sizes); the HTTP side renders them
next to a snapshot of ``Engine.stats()`` (an ``EngineStats``, read by attribute). One lock guards both sides, held for microseconds.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

from nanoserve.engine.stats import EngineStats

# Seconds. TTFT on CPU can reach seconds under load; inter-token latency is usually ms.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class ServeMetrics:
    """What the server measures itself; engine counters come from the stats snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds",
                              "Time from a request's arrival at the engine to its first token.", TTFT_BUCKETS)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds",
                             "Time between consecutive tokens of one request.", ITL_BUCKETS)
        self.decode_batch = Histogram("nanoserve_decode_batch_size",
                                      "Requests (rows) in each decode step.", BATCH_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.disconnects = 0
        self.shed = 0

    def record_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def record_decode_step(self, rows: int) -> None:
        with self._lock:
            self.decode_batch.observe(rows)

    def record_tokens(self, count: int, ttft: float | None, gap: float | None) -> None:
        """`count` new tokens of one request; `ttft` on its first, else the gap since its last."""
        with self._lock:
            self.generation_tokens += count
            if ttft is not None:
                self.ttft.observe(ttft)
            elif gap is not None and count:
                for _ in range(count):  # tokens that arrive together share the gap
                    self.itl.observe(gap / count)

    def record_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def record_disconnect(self) -> None:
        """A client hung up before its answer was complete (normal traffic, not an error)."""
        with self._lock:
            self.disconnects += 1

    def record_shed(self) -> None:
        """A request refused because the waiting queue was full (a 503 with Retry-After)."""
        with self._lock:
            self.shed += 1

    def render(self, stats: EngineStats, http_in_flight: int | None = None, max_waiting: int | None = None) -> str:
        """Prometheus text exposition (version 0.0.4) of these metrics and an engine stats snapshot
        (and, from the HTTP side, the requests it is handling and the waiting queue's bound)."""
        gauges = [
            ("nanoserve_requests_running", "Requests holding a row in the engine.", stats.running),
            ("nanoserve_requests_waiting", "Requests queued for admission.", stats.waiting),
            ("nanoserve_kv_blocks_used", "KV cache blocks in use.", stats.blocks_total - stats.blocks_free),
            ("nanoserve_kv_blocks_free", "KV cache blocks free.", stats.blocks_free),
            ("nanoserve_kv_blocks_total", "KV cache blocks in the pool.", stats.blocks_total),
            ("nanoserve_decode_rows_max", "Most rows in one decode step so far.", stats.max_decode_rows),
            ("nanoserve_decode_rows_mean", "Mean rows per decode step so far.", stats.mean_decode_rows),
            ("nanoserve_compiled_graphs", "Decode graphs built.", stats.graphs_built),
            ("nanoserve_graphs_ready", "Decode buckets with a compiled graph in use.", stats.graphs_ready),
            ("nanoserve_graphs_building", "Decode buckets whose graph is being built in the background.",
             stats.graphs_building),
            ("nanoserve_graphs_pending", "Decode buckets waiting for their graph to be built.", stats.graphs_pending),
            ("nanoserve_graphs_loaded", "Decode graphs loaded from the compile cache.", stats.graphs_loaded),
            ("nanoserve_prefix_cache_blocks", "KV cache blocks holding a cached prefix (in use or evictable).",
             stats.prefix_cache_blocks),
        ]
        if stats.spec_method is not None:
            gauges += [
                ("nanoserve_spec_acceptance_rate", "Proposed tokens accepted, of those verified.",
                 stats.spec_acceptance_rate),
                ("nanoserve_spec_mean_accepted_length",
                 "Tokens a verifying row emits per step (accepted proposals and the target's own).",
                 stats.spec_mean_accepted_length),
            ]
        if http_in_flight is not None:
            gauges.append(("nanoserve_http_requests_in_flight",
                           "HTTP requests being handled (body arriving, queued or generating), probes aside.",
                           http_in_flight))
        if max_waiting is not None:
            gauges.append(("nanoserve_requests_waiting_max",
                           "Requests that may wait for a row; past it new requests get a 503.", max_waiting))
        counters = [
            ("nanoserve_engine_steps_total", "Engine steps (prefill and decode).", stats.steps),
            ("nanoserve_decode_steps_total", "Decode steps.", stats.decode_steps),
            ("nanoserve_preemptions_total", "Requests preempted (recomputed later).", stats.preemptions),
            ("nanoserve_eager_steps_total", "Decode steps run eagerly because their bucket had no graph yet.",
             stats.eager_steps),
            ("nanoserve_recompiles_total", "Recompilations of the decode graph after warm-up.",
             stats.recompiles_after_warmup),
            # vLLM's prefix_cache_queries / prefix_cache_hits: tokens asked about, tokens found cached.
            ("nanoserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("nanoserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not recomputed).",
             stats.prefix_cache_hits),
            ("nanoserve_prefix_cache_evictions_total", "Cached prefix blocks evicted to make room.",
             stats.prefix_cache_evictions),
            ("nanoserve_structured_requests_total", "Requests whose output a grammar or schema constrains.",
             stats.structured_requests),
            ("nanoserve_mask_steps_total", "Steps that computed token masks for constrained rows.", stats.mask_steps),
            ("nanoserve_mask_seconds_total", "Time computing token masks (beside the forward).", stats.mask_seconds),
        ]
        if stats.spec_method is not None:  # vLLM's spec_decode counters
            counters += [
                ("nanoserve_spec_verify_steps_total", "Decode steps that verified proposed tokens.",
                 stats.spec_verify_steps),
                ("nanoserve_spec_proposed_tokens_total", "Tokens proposed and verified.", stats.spec_proposed_tokens),
                ("nanoserve_spec_accepted_tokens_total", "Proposed tokens accepted.", stats.spec_accepted_tokens),
                ("nanoserve_spec_draft_seconds_total", "Time proposing tokens (the draft model or the n-gram lookup).",
                 stats.spec_draft_seconds),
                ("nanoserve_spec_verify_seconds_total", "Time in the forwards of verify steps.",
                 stats.spec_verify_seconds),
            ]
        with self._lock:
            counters += [
                ("nanoserve_prompt_tokens_total", "Prompt tokens admitted.", self.prompt_tokens),
                ("nanoserve_generation_tokens_total", "Tokens generated.", self.generation_tokens),
                ("nanoserve_client_disconnects_total",
                 "Requests whose client hung up before the answer was complete (their work is aborted).",
                 self.disconnects),
                ("nanoserve_requests_shed_total",
                 "Requests refused with a 503 because the waiting queue was full.", self.shed),
            ]
            lines = _plain("gauge", gauges) + _plain("counter", counters)
            lines += ["# HELP nanoserve_requests_finished_total Requests finished, by reason.",
                      "# TYPE nanoserve_requests_finished_total counter"]
            lines += [f'nanoserve_requests_finished_total{{reason="{reason}"}} {count}'
                      for reason, count in sorted(self.finished.items())]
            for histogram in (self.ttft, self.itl, self.decode_batch):
                lines += histogram.render()
        return "\n".join(lines) + "\n"


def _plain(kind: str, rows: list[tuple[str, str, float]]) -> list[str]:
    lines = []
    for name, help, value in rows:
        lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return lines

