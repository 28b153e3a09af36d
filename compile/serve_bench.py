"""serve: what prefix caching and chunked prefill buy under serving traffic (`python compilebench.py serve`).

Four workloads, each comparing two engines built in the same run on the same weights:

- shared: ``--requests`` chat requests rendered by the chat template (the default model's
  inserts its system prompt when the caller sends none), sent one after another, each to its
  first token; the two engines (prefix caching on, off) take turns request by request.
  Time to first token (median) and prompt tokens actually computed.
- burst: the same ``--requests`` chat requests arriving together at a server that has not
  seen the system prompt yet (fresh engines, ``--bursts`` times, arms alternating); TTFT
  (median over the bursts of each burst's median) and prompt tokens computed.
- turns: one ``--turns``-turn conversation, each turn resending everything so far (the
  previous answers included); TTFT and tokens computed per turn, caching on vs off.
- long: ``--streams`` greedy streams decode, then a ``--long-tokens``-token prompt arrives;
  the inter-token latency of the streams while it is prefilled (p50, p99) with chunked
  prefill on (``--chunk-tokens`` per step) vs off, next to their undisturbed p50; ``--long-repeats``
  times, arms alternating. The streams step together, so their p99 is the slowest step or two
  of the prefill: one stall on a shared machine moves it, and the target reads the median
  over the repeats.

Targets (pass/fail in the table): shared-prefix TTFT at least 2x better with caching (one
row for requests one after another, one for a burst); p99
inter-token latency during the long prefill at most 3x the undisturbed p50 with chunking
(the median of the repeats' ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compile.common import (
    FIDELITY_TEXT,
    add_output_options,
    format_table,
    name_list,
    pyplot,
    result_stem,
    save_figure,
    write_results,
)
from nanoserve.engine import build_engine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.formats.loader import DEFAULT_MODEL

TOPICS = ("rivers", "trains", "caches", "bridges", "glaciers", "compilers", "tides", "forests", "volcanoes",
          "libraries", "harbours", "orchards", "deserts", "comets", "lighthouses", "canals", "bees", "clocks",
          "coral reefs", "windmills", "maps", "salt", "owls", "kites", "mushrooms", "bicycles", "thunder",
          "ink", "lenses", "sourdough", "moss", "bells")
FOLLOW_UPS = ("Tell me about the history of paper.", "How was it made before machines?",
              "Which countries still make it by hand?", "Summarise what we discussed in two sentences.")
TARGET_TTFT_SPEEDUP = 2.0
TARGET_ITL_RATIO = 3.0

EngineFactory = Callable[..., object]  # build flags -> Engine, all on the same weights


@dataclass(frozen=True)
class ServeWorkload:
    model: str = DEFAULT_MODEL
    weights: str | None = None
    device: str = "cpu"
    compile: bool = False
    requests: int = 32
    bursts: int = 3
    turns: int = 4
    answer_tokens: int = 32
    streams: int = 32
    long_tokens: int = 2000
    chunk_tokens: int | None = None  # None: the engine's default token budget
    warm_steps: int = 16
    long_repeats: int = 3
    kv_cache_bytes: int = 256 << 20
    workloads: tuple[str, ...] = ("shared", "burst", "turns", "long")


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def _hits(engine) -> int:
    return engine.stats().prefix_cache_hits


def _served(outs: list) -> list:
    """The outputs, or RuntimeError: a benchmark request that fails is a broken run, not a data point."""
    failed = next((out.error for out in outs if out.error), None)
    if failed:
        raise RuntimeError(f"benchmark request failed: {failed}")
    return outs


def _ttft_rows(workload: str, work: ServeWorkload, prompt_tokens: int, computed: dict, ttfts: dict) -> list[dict]:
    """One row per caching arm: TTFT median and mean (ms) of ``ttfts[arm]`` (seconds), tokens computed."""
    return [dict(workload=workload, caching=arm, requests=work.requests, prompt_tokens=prompt_tokens,
                 prefill_tokens=computed[arm], ttft_p50_ms=1e3 * statistics.median(ttfts[arm]),
                 ttft_mean_ms=1e3 * statistics.fmean(ttfts[arm])) for arm in ttfts]


def _chat_turn(engine, messages: list[dict], max_tokens: int) -> tuple[object, int]:
    """One chat request through the engine's chat path: its output and the prompt tokens computed."""
    hits = _hits(engine)
    out = _served([engine.chat(messages, greedy(max_tokens))])[0]
    return out, len(out.prompt_token_ids) - (_hits(engine) - hits)


def _warm(engine) -> None:
    """One request that shares no block with the workloads (no chat template), so first-call
    costs are not charged to the first measured request."""
    engine.generate([FIDELITY_TEXT.read_text()[:200]], greedy(2), use_tqdm=False)


def shared_prefix(make: EngineFactory, work: ServeWorkload) -> list[dict]:
    """TTFT and prompt tokens computed for chat requests sharing the template's system prompt."""
    engines = {"on": make(enable_prefix_caching=True), "off": make(enable_prefix_caching=False)}
    for engine in engines.values():
        _warm(engine)
    ttft = {arm: [] for arm in engines}
    computed = dict.fromkeys(engines, 0)
    prompt_tokens = 0
    for i in range(work.requests):
        messages = _question(i)
        order = list(engines) if i % 2 == 0 else list(reversed(engines))  # neither arm always goes first
        for arm in order:
            out, done = _chat_turn(engines[arm], messages, 1)
            ttft[arm].append(out.metrics.time_to_first_token)
            computed[arm] += done
        prompt_tokens += len(out.prompt_token_ids)
    return _ttft_rows("shared", work, prompt_tokens, computed, ttft)


def _question(i: int) -> list[dict]:
    """The i-th chat request of the shared-prefix workloads: one user message, no system prompt."""
    return [{"role": "user", "content": f"In one sentence, what is interesting about {TOPICS[i % len(TOPICS)]}?"}]


def shared_burst(make: EngineFactory, work: ServeWorkload) -> list[dict]:
    """TTFT and prompt tokens computed for chat requests arriving together on a cold cache."""
    p50s, computed = {"on": [], "off": []}, {}
    prompt_tokens = 0
    for burst in range(work.bursts):
        arms = ["on", "off"] if burst % 2 == 0 else ["off", "on"]
        for arm in arms:
            engine = make(enable_prefix_caching=arm == "on")
            _warm(engine)
            prompts = [engine.tokenizer.apply_chat_template(_question(i), add_generation_prompt=True)
                       for i in range(work.requests)]
            hits = _hits(engine)
            outs = _served(engine.generate(prompts, greedy(1), use_tqdm=False))
            p50s[arm].append(statistics.median(out.metrics.time_to_first_token for out in outs))
            prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
            computed[arm] = prompt_tokens - (_hits(engine) - hits)
    return _ttft_rows("burst", work, prompt_tokens, computed, p50s)


def conversation(make: EngineFactory, work: ServeWorkload) -> list[dict]:
    """A multi-turn chat, each turn resending the whole conversation: TTFT and tokens per turn."""
    rows = []
    for arm, enabled in (("on", True), ("off", False)):
        engine = make(enable_prefix_caching=enabled)
        _warm(engine)
        messages: list[dict] = []
        for turn in range(work.turns):
            messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
            out, done = _chat_turn(engine, messages, work.answer_tokens)
            messages.append({"role": "assistant", "content": out.text})
            rows.append(dict(workload="turns", caching=arm, turn=turn + 1, prompt_tokens=len(out.prompt_token_ids),
                             prefill_tokens=done, ttft_ms=1e3 * out.metrics.time_to_first_token))
    return rows


@dataclass
class StreamGaps:
    """Inter-token gaps of the running streams: undisturbed, and while the long prompt is prefilled."""

    before: list[float]
    during: list[float]
    long_ttft: float


def long_prefill_gaps(engine, streams: int, long_ids: list[int], warm_steps: int) -> StreamGaps:
    """Start `streams` streams; once all are decoding, time `warm_steps` steps, add the long prompt,
    and time every stream token from then until each stream has one from on or after the step
    that gave the long prompt its first token (without chunking, the step after the stall)."""
    vocab = engine.vocab_size
    stream_ids = {engine.add_request([(7 * s + t) % (vocab - 3) + 3 for t in range(16)],
                                     greedy(100_000, ignore_eos=True)) for s in range(streams)}
    last: dict[str, float] = {}
    gaps = StreamGaps([], [], 0.0)
    long_id, long_first, warm_left = None, None, warm_steps
    while long_first is None or min(last.values()) < long_first:
        all_decoding = len(last) == streams  # gaps before that include the streams' own prefills
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in stream_ids and out.new_token_ids:
                if all_decoding:
                    (gaps.during if long_id is not None else gaps.before).append(now - last[out.request_id])
                last[out.request_id] = now
            elif out.request_id == long_id and out.token_ids and long_first is None:
                long_first, gaps.long_ttft = now, out.metrics.time_to_first_token
        if long_id is None and all_decoding:
            warm_left -= 1
            if warm_left <= 0:
                long_id = engine.add_request(long_ids, greedy(1))
    for request_id in stream_ids:
        engine.abort(request_id)
    return gaps


def long_prompt(make: EngineFactory, work: ServeWorkload) -> list[dict]:
    rows = []
    arms = (("off", dict(enable_chunked_prefill=False)),
            ("on", dict(enable_chunked_prefill=True, max_num_batched_tokens=work.chunk_tokens)))
    for repeat in range(work.long_repeats):
        for arm, flags in arms if repeat % 2 == 0 else arms[::-1]:
            engine = make(enable_prefix_caching=False, **flags)
            _warm(engine)
            long_ids = engine.tokenizer.encode(FIDELITY_TEXT.read_text())[:work.long_tokens]
            gaps = long_prefill_gaps(engine, work.streams, long_ids, work.warm_steps)
            undisturbed = statistics.median(gaps.before)
            p99 = _quantile(gaps.during, 0.99)
            rows.append(dict(workload="long", chunking=arm, repeat=repeat + 1, streams=work.streams,
                             long_tokens=len(long_ids),
                             chunk_tokens=engine.resolved.max_num_batched_tokens if arm == "on" else "",
                             undisturbed_p50_ms=1e3 * undisturbed, itl_p50_ms=1e3 * statistics.median(gaps.during),
                             itl_p99_ms=1e3 * p99, p99_x_undisturbed=p99 / undisturbed,
                             long_ttft_ms=1e3 * gaps.long_ttft, steps_during=len(gaps.during) // work.streams))
    return rows


def median_long_rows(rows: list[dict]) -> dict[str, dict]:
    """Per chunking arm, the long workload's timings as medians over the repeats."""
    timed = ("undisturbed_p50_ms", "itl_p50_ms", "itl_p99_ms", "p99_x_undisturbed", "long_ttft_ms")
    out = {}
    for arm in ("off", "on"):
        mine = [r for r in rows if r["workload"] == "long" and r["chunking"] == arm]
        if mine:
            out[arm] = {**mine[0], **{k: statistics.median(r[k] for r in mine) for k in timed}, "repeat": "median"}
    return out


def _quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile (no interpolation: a p99 is a gap that happened)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def targets(rows: list[dict]) -> list[dict]:
    """The suite's targets (the module's docstring), measured against this run's rows."""
    out = []
    for workload, arrival in (("shared", "one after another"), ("burst", "together")):
        shared = {r["caching"]: r for r in rows if r["workload"] == workload}
        if shared:
            speedup = shared["off"]["ttft_p50_ms"] / shared["on"]["ttft_p50_ms"]
            out.append(dict(target=f"shared-prefix TTFT caching off/on >= {TARGET_TTFT_SPEEDUP:g}x ({arrival})",
                            measured=speedup, passed=speedup >= TARGET_TTFT_SPEEDUP))
    chunked = median_long_rows(rows).get("on")
    if chunked:
        ratio = chunked["p99_x_undisturbed"]
        out.append(dict(target=f"chunked p99 ITL during long prefill <= {TARGET_ITL_RATIO:g}x undisturbed p50 "
                               "(median of repeats)",
                        measured=ratio, passed=ratio <= TARGET_ITL_RATIO))
    return out


WORKLOADS = {"shared": shared_prefix, "burst": shared_burst, "turns": conversation, "long": long_prompt}
COLUMNS = {
    "shared": ["caching", "requests", "prompt_tokens", "prefill_tokens", "ttft_p50_ms", "ttft_mean_ms"],
    "burst": ["caching", "requests", "prompt_tokens", "prefill_tokens", "ttft_p50_ms", "ttft_mean_ms"],
    "turns": ["caching", "turn", "prompt_tokens", "prefill_tokens", "ttft_ms"],
    "long": ["chunking", "repeat", "streams", "long_tokens", "chunk_tokens", "undisturbed_p50_ms", "itl_p50_ms", "itl_p99_ms",
             "p99_x_undisturbed", "long_ttft_ms", "steps_during"],
}


def run(make: EngineFactory, work: ServeWorkload) -> list[dict]:
    rows = []
    for name in work.workloads:
        rows += WORKLOADS[name](make, work)
    return rows


def engine_factory(work: ServeWorkload) -> EngineFactory:
    """Engines that differ only in their flags, all on one copy of the weights (loaded on first use)."""
    loaded = {}
    max_model_len = work.long_tokens + 2 * work.answer_tokens * work.turns + 512

    def make(**flags):
        common = dict(max_batch_size=max(work.streams + 1, 2), max_model_len=max_model_len,
                      kv_cache_bytes=work.kv_cache_bytes, device=work.device, compile=work.compile, warmup="eager",
                      **flags)
        if not loaded:
            engine = build_engine(work.model, weights=work.weights, **common)
            loaded.update(model=engine.model, tokenizer=engine.tokenizer, dtype=engine.resolved.dtype)
            return engine
        return build_engine(loaded["model"], tokenizer=loaded["tokenizer"], dtype=loaded["dtype"], **common)

    return make


def write_plot(rows: Sequence[dict], path: Path) -> None:
    """One panel per workload (target rows left out): TTFT on vs off, TTFT per turn, inter-token latency off vs on."""
    plt = pyplot()
    names = [name for name in WORKLOADS if any(r["workload"] == name for r in rows)]
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["workload"] == name]
        if name in ("shared", "burst"):
            bars = ax.bar([f"caching {r['caching']}" for r in mine], [r["ttft_p50_ms"] for r in mine])
            ax.bar_label(bars, fmt="%.0f")
            arrival = "one after another" if name == "shared" else "arriving together"
            ax.set(ylabel="TTFT p50 (ms)", title=f"{mine[0]['requests']} chat requests {arrival}, shared system prompt")
        elif name == "turns":
            for arm in ("on", "off"):
                turns = [r for r in mine if r["caching"] == arm]
                ax.plot([r["turn"] for r in turns], [r["ttft_ms"] for r in turns], marker="o", label=f"caching {arm}")
            ax.set(xlabel="turn", ylabel="TTFT (ms)", title="multi-turn chat, whole conversation resent")
            ax.legend(fontsize="small")
        else:
            mine = list(median_long_rows(mine).values())
            xs = range(len(mine))
            ax.bar([x - 0.2 for x in xs], [r["itl_p50_ms"] for r in mine], 0.4, label="p50 during")
            ax.bar([x + 0.2 for x in xs], [r["itl_p99_ms"] for r in mine], 0.4, label="p99 during")
            ax.axhline(mine[0]["undisturbed_p50_ms"], color="k", ls="--", lw=1, label="undisturbed p50")
            ax.set_xticks(list(xs), [f"chunking {r['chunking']}" for r in mine])
            ax.set(ylabel="inter-token latency (ms), median of repeats", yscale="log",
                   title=f"{mine[0]['streams']} streams, {mine[0]['long_tokens']}-token prompt arrives")
            ax.legend(fontsize="small")
        ax.title.set_fontsize("small")
    save_figure(fig, path)


def report(rows: list[dict]) -> str:
    """Print-ready tables: one per workload, then the targets."""
    sections = []
    for name, columns in COLUMNS.items():
        mine = [r for r in rows if r["workload"] == name]
        if name == "long":
            mine += median_long_rows(mine).values()
        if mine:
            sections.append(f"{name}:\n" + format_table(mine, columns))
    checks = targets(rows)
    if checks:
        sections.append("targets:\n" + format_table(checks, ["target", "measured", "passed"]))
    return "\n\n".join(sections)


def with_targets(rows: list[dict]) -> list[dict]:
    """The CSV's rows: every workload's, then one per target."""
    return rows + [dict(workload="target", **c) for c in targets(rows)]


def main(argv: Sequence[str] | None = None) -> int:
    defaults = ServeWorkload()
    parser = argparse.ArgumentParser(prog="compilebench.py serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--weights", default=defaults.weights, help="weight format (default: auto)")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--workloads", type=name_list(WORKLOADS), default=defaults.workloads, help="shared,burst,turns,long or some")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="shared, burst: chat requests")
    parser.add_argument("--bursts", type=int, default=defaults.bursts, help="burst: bursts per arm")
    parser.add_argument("--turns", type=int, default=defaults.turns, help="turns: conversation turns")
    parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens, help="turns: tokens per answer")
    parser.add_argument("--streams", type=int, default=defaults.streams, help="long: decoding streams")
    parser.add_argument("--long-tokens", type=int, default=defaults.long_tokens, help="long: the prompt's tokens")
    parser.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens,
                        help="long: max_num_batched_tokens with chunking on (unset: the engine's default)")
    parser.add_argument("--warm-steps", type=int, default=defaults.warm_steps, help="long: undisturbed steps timed")
    parser.add_argument("--long-repeats", type=int, default=defaults.long_repeats,
                        help="long: repeats per arm (the target reads their median)")
    parser.add_argument("--kv-cache-bytes", type=int, default=defaults.kv_cache_bytes)
    add_output_options(parser)
    args = parser.parse_args(argv)
    work = ServeWorkload(**{k: v for k, v in vars(args).items() if k not in ("out", "tag", "no_plot")})
    torch.set_grad_enabled(False)
    rows = run(engine_factory(work), work)
    print("\n" + report(rows))
    write_results(with_targets(rows), args.out, result_stem("serve", args.model, args.tag),
                  None if args.no_plot else write_plot)
    return 0
