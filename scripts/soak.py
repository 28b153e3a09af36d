"""Soak the HTTP server: concurrent clients for minutes, with streams, hang-ups (a stream closed
after its first chunk), aborts (a request given up on mid-flight), preemption (a K/V pool too
small for every row) and shedding (a waiting queue smaller than the clients), on the default
model (SmolLM2-135M-Instruct) or a tiny random one.

Checks, exit 1 on any failure: every completed reply has its max_tokens tokens and, on the tiny
fp32 model, equals what the same engine generated for that prompt alone before the soak (the
default model's "auto" weight plan multiplies through other kernels as the batch grows, so
there a greedy reply may differ from the one generated alone: the share that matches is
reported, not required; --strict-tokens requires it); no 5xx but the shed 503s (each with Retry-After);
every block and row back at the end (`Engine.check_drained`); resident memory flat after
warm-up (growth under 5% between the middle and the end); preemptions and sheds happened.
Reports the clients' time to first token and inter-token latency (p50, p99), prints one JSON
summary and writes it as a CSV row.

    python scripts/soak.py                                  # SmolLM2, 32 clients, 180 s
    python scripts/soak.py --model tiny --seconds 20        # the tiny random model
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.network.synthetic import random_model, tiny_config
from nanoserve.serve.app import create_app
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.serve.server import BackgroundServer

MAX_TOKENS = 24
RSS_GROWTH_LIMIT = 0.05  # middle -> end, after warm-up
KINDS = {"whole": 40, "stream": 35, "hangup": 10, "abort": 15}  # request mix, by weight


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Soak:
    """The clients, their outcomes and their latencies."""

    def __init__(self, url: str, model: str, prompts: list[list[int]], expected: list[list[str]], seed: int,
                 strict_tokens: bool) -> None:
        self.url, self.model, self.prompts, self.expected = url, model, prompts, expected
        self.strict_tokens = strict_tokens
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []

    async def client(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as http:
            while time.monotonic() < deadline:
                await self.one(http)

    async def one(self, http: httpx.AsyncClient) -> None:
        index = self.rng.randrange(len(self.prompts))
        max_tokens = self.rng.randint(1, MAX_TOKENS)
        body = {"model": self.model, "prompt": self.prompts[index], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        want = self.expected[index][max_tokens - 1]
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        try:
            if kind == "whole":
                response = await http.post("/v1/completions", json=body)
                if await self.check_status(response, response.text):
                    self.check_reply(response.json()["choices"][0]["logprobs"]["tokens"], want, max_tokens, kind)
            elif kind == "stream":
                await self.stream(http, body, want, max_tokens)
            elif kind == "hangup":
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    if await self.check_status(response, ""):
                        async for _ in response.aiter_lines():
                            break  # hang up after the first line
                        self.outcomes["hangup"] += 1
            else:
                try:
                    await asyncio.wait_for(http.post("/v1/completions", json=body), self.rng.uniform(0.005, 0.5))
                    self.outcomes["abort-too-late"] += 1
                except asyncio.TimeoutError:
                    self.outcomes["abort"] += 1
        except httpx.HTTPError as exc:
            self.failures.append(f"{kind}: transport error {exc!r}")

    async def stream(self, http: httpx.AsyncClient, body: dict, want: str, max_tokens: int) -> None:
        started = time.perf_counter()
        last, pieces = None, []
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            if not await self.check_status(response, ""):
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.failures.append(f"in-band error: {event}")
                    return
                choice = event["choices"][0]
                new = (choice.get("logprobs") or {}).get("tokens", [])
                tokens = len(new)
                pieces += new
                now = time.perf_counter()
                if tokens and last is None:
                    self.ttft.append(now - started)
                elif tokens:
                    self.itl += [(now - last) / tokens] * tokens
                last = now if tokens else last
        self.check_reply(pieces, want, max_tokens, "stream")

    async def check_status(self, response: httpx.Response, text: str) -> bool:
        """True for a 200; a shed 503 waits its Retry-After; anything else is a failure."""
        if response.status_code == 200:
            return True
        if response.status_code == 503 and "retry-after" in response.headers:
            self.outcomes["shed"] += 1
            await asyncio.sleep(float(response.headers["retry-after"]) * self.rng.uniform(0.5, 1.0))
            return False
        await response.aread()
        self.outcomes[f"status-{response.status_code}"] += 1
        self.failures.append(f"{response.status_code}: {(text or response.text)[:200]}")
        return False

    def check_reply(self, pieces: list[str], want: str, max_tokens: int, kind: str) -> None:
        """The reply's tokens (each as its own text): all max_tokens of them, and the same as
        the prompt's reply alone (required with strict_tokens, else counted)."""
        if len(pieces) != max_tokens:
            self.outcomes[f"{kind}-short"] += 1
            self.failures.append(f"{kind}: {len(pieces)} tokens, asked for {max_tokens}")
        elif "".join(pieces) == want:
            self.outcomes[f"{kind}-same-as-alone"] += 1
        else:
            self.outcomes[f"{kind}-differs-from-alone"] += 1
            if self.strict_tokens:
                self.failures.append(f"{kind}: {''.join(pieces)!r} != {want!r}")


def build(model_name: str, rows: int, blocks: int, block_size: int, weights: str):
    """The engine under test and its vocabulary size: the default model (or a path) with its
    tokenizer, or a tiny random model without one."""
    options = dict(max_batch_size=rows, block_size=block_size, max_model_len=128)
    if model_name == "tiny":
        config = tiny_config()
        model = random_model(config, seed=0)
        per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size * 4
        return build_engine(model, kv_cache_bytes=blocks * per_block, **options), config.vocab_size
    probe = build_engine(model_name, max_batch_size=1, max_model_len=32, kv_cache_bytes=4 << 20,
                         block_size=block_size, weights=weights)
    per_block = probe.config.kv_cache_bytes // probe.stats().blocks_total  # the pool's block size in bytes
    probe.close()
    del probe
    engine = build_engine(model_name, kv_cache_bytes=blocks * per_block, weights=weights, **options)
    return engine, engine.tokenizer.vocab_size


def reference_texts(engine, prompts: list[list[int]]) -> list[list[str]]:
    """For each prompt, its first 1..MAX_TOKENS greedy tokens as the server's logprobs name them
    (each token's own text, "token_id:N" without a tokenizer), joined; each prompt run alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    texts = []
    for prompt in prompts:
        output = engine.generate([prompt], greedy, use_tqdm=False)[0]
        ids = output.token_ids
        names = [f"token_id:{t}" if engine.tokenizer is None else engine.tokenizer.decode([t]) for t in ids]
        texts.append(["".join(names[:k]) for k in range(1, MAX_TOKENS + 1)])
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf or HF path, or 'tiny'")
    parser.add_argument("--seconds", type=float, default=180.0, help="how long the clients run")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16, help="max_batch_size")
    parser.add_argument("--block-size", type=int, default=4,
                        help="tokens per K/V block (small: a growing row needs blocks often)")
    parser.add_argument("--blocks", type=int, default=96,
                        help="K/V blocks (fewer than the rows need: preemption)")
    parser.add_argument("--max-waiting", type=int, default=8,
                        help="the waiting queue (smaller than clients - rows: some requests are shed)")
    parser.add_argument("--weights", default="auto", help="the weight format of a named model (default auto)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--strict-tokens", action="store_true",
                        help="fail on a greedy reply that differs from the prompt's reply alone (always on "
                             "for the tiny fp32 model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="default compile/results/runs/soak-MODEL.csv (git ignores it)")
    args = parser.parse_args(argv)

    engine, vocab = build(args.model, args.rows, args.blocks, args.block_size, args.weights)
    rng = random.Random(args.seed)
    low = 4 if args.model == "tiny" else 100  # the default model: skip its control tokens
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(4, 64))] for _ in range(args.prompts)]
    expected = reference_texts(engine, prompts)
    loop = EngineLoop(engine, max_waiting=args.max_waiting)
    server = BackgroundServer(create_app(loop, "soak"), log_level="error").start()
    baseline = loop.stats.blocks_free
    soak = Soak(server.url, "soak", prompts, expected, args.seed, args.strict_tokens or args.model == "tiny")
    samples: dict[str, float] = {"start": rss_mib()}

    async def run() -> None:
        started = time.monotonic()
        deadline = started + args.seconds

        async def sample(name: str, at: float) -> None:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            samples[name] = rss_mib()

        await asyncio.gather(sample("warm", args.seconds * 0.2), sample("middle", args.seconds * 0.5),
                             *(soak.client(deadline) for _ in range(args.clients)))

    started = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 60
    while (loop.stats.running or loop.stats.waiting or loop.stats.blocks_free != baseline) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = loop.stats
    same = sum(v for k, v in soak.outcomes.items() if k.endswith("-same-as-alone"))
    replies = same + sum(v for k, v in soak.outcomes.items() if k.endswith("-differs-from-alone"))
    leak = None
    try:
        engine.check_drained()  # the loop is idle: nothing else touches the engine now
    except AssertionError as exc:
        leak = str(exc)
    samples["end"] = rss_mib()  # with the server still up, as in the middle
    server.stop()
    growth = samples["end"] / samples["middle"] - 1
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    summary = {
        "model": args.model, "weights": args.weights, "clients": args.clients, "rows": args.rows, "blocks": args.blocks,
        "block_size": args.block_size,
        "max_waiting": args.max_waiting, "seconds": round(elapsed, 1),
        "requests": sum(soak.outcomes.values()), "failures": len(soak.failures),
        "shed_503": soak.outcomes["shed"],
        "same_as_alone": round(same / max(replies, 1), 3), "preemptions": stats.preemptions, "aborted_in_engine": stats.aborted,
        "ttft_p50_ms": ms(percentile(soak.ttft, 0.5)), "ttft_p99_ms": ms(percentile(soak.ttft, 0.99)),
        "itl_p50_ms": ms(percentile(soak.itl, 0.5)), "itl_p99_ms": ms(percentile(soak.itl, 0.99)),
        "rss_start_mib": round(samples["start"], 1), "rss_warm_mib": round(samples["warm"], 1),
        "rss_middle_mib": round(samples["middle"], 1), "rss_end_mib": round(samples["end"], 1),
        "rss_growth_middle_to_end": round(growth, 4), "drained": leak is None,
        "outcomes": dict(sorted(soak.outcomes.items())),
    }
    print(json.dumps(summary, indent=2))
    for failure in soak.failures[:10]:
        print("FAILURE:", failure, file=sys.stderr)
    if leak:
        print("LEAK:", leak, file=sys.stderr)
    out = Path(args.csv or f"compile/results/runs/soak-{Path(args.model).stem}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    row = {k: v for k, v in summary.items() if k != "outcomes"}
    row["outcomes"] = json.dumps(summary["outcomes"], sort_keys=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    problems = [soak.failures, leak, growth >= RSS_GROWTH_LIMIT, stats.preemptions == 0, soak.outcomes["shed"] == 0]
    return 1 if any(problems) else 0


if __name__ == "__main__":
    sys.exit(main())
