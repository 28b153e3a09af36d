"""Soak the HTTP server: many short requests from many concurrent clients, with random
hang-ups (a stream closed after its first chunk), aborts (a request given up on mid-flight)
and preemption (a KV pool too small for every row), on a tiny random model.

Checks: every completed request's greedy tokens equal that prompt's tokens computed alone,
no 5xx, the pool and the rows all back at the end (`Engine.check_drained`), the resident
memory at start, after warm-up and at the end, and the count of live Python objects. Prints one JSON summary; exits 1 on any failure.

    python scripts/soak.py                      # 10,000 requests, 64 clients
    python scripts/soak.py --requests 500 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from collections import Counter

import httpx

from nanoserve.engine import SamplingParams, build_engine
from nanoserve.model.synthetic import random_model, tiny_config
from nanoserve.serve.app import create_app
from nanoserve.serve.engine_loop import EngineLoop
from nanoserve.serve.server import BackgroundServer

MAX_TOKENS = 24
BLOCK_SIZE = 4


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def token_ids(logprobs: dict | None) -> list[int]:
    """Token ids back from the legacy logprobs of a model without a tokenizer ("token_id:N")."""
    return [int(token.split(":", 1)[1]) for token in (logprobs or {}).get("tokens", [])]


class Soak:
    def __init__(self, url: str, prompts: list[list[int]], expected: list[list[int]], seed: int) -> None:
        self.url, self.prompts, self.expected = url, prompts, expected
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []

    async def client(self, count: int) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            for _ in range(count):
                await self.one(http)

    async def one(self, http: httpx.AsyncClient) -> None:
        index = self.rng.randrange(len(self.prompts))
        max_tokens = self.rng.randint(1, MAX_TOKENS)
        body = {"model": "tiny", "prompt": self.prompts[index], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        want = self.expected[index][:max_tokens]
        kind = self.rng.choices(["whole", "stream", "hangup", "abort"], weights=[45, 35, 10, 10])[0]
        try:
            if kind == "whole":
                response = await http.post("/v1/completions", json=body)
                self.check_status(response.status_code, response.text)
                if response.status_code == 200:
                    self.check_tokens(token_ids(response.json()["choices"][0]["logprobs"]), want, "whole")
            elif kind == "stream":
                got = []
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    self.check_status(response.status_code, "")
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            if "error" in event:
                                self.failures.append(f"in-band error: {event}")
                            else:
                                got += token_ids(event["choices"][0]["logprobs"])
                self.check_tokens(got, want, "stream")
            elif kind == "hangup":
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    self.check_status(response.status_code, "")
                    async for _ in response.aiter_lines():
                        break  # hang up after the first line
                self.outcomes["hangup"] += 1
            else:
                try:
                    await asyncio.wait_for(http.post("/v1/completions", json=body),
                                           self.rng.uniform(0.005, 0.2))
                    self.outcomes["abort-too-late"] += 1
                except asyncio.TimeoutError:
                    self.outcomes["abort"] += 1
        except httpx.HTTPError as exc:
            self.failures.append(f"{kind}: transport error {exc!r}")

    def check_status(self, status: int, text: str) -> None:
        if status >= 500:
            self.outcomes["5xx"] += 1
            self.failures.append(f"{status}: {text[:200]}")
        elif status != 200:
            self.outcomes[f"status-{status}"] += 1
            self.failures.append(f"{status}: {text[:200]}")

    def check_tokens(self, got: list[int], want: list[int], kind: str) -> None:
        if got == want:
            self.outcomes[f"{kind}-correct"] += 1
        else:
            self.outcomes[f"{kind}-wrong"] += 1
            self.failures.append(f"{kind}: {got} != {want}")


async def run_clients(soak: Soak, requests: int, clients: int) -> None:
    share = [requests // clients + (i < requests % clients) for i in range(clients)]
    await asyncio.gather(*(soak.client(n) for n in share))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=32, help="KV blocks of 4 tokens (small: preemption)")
    parser.add_argument("--rows", type=int, default=16, help="max_batch_size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = tiny_config()
    model = random_model(config, seed=0)
    bytes_per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * BLOCK_SIZE * 4
    options = dict(max_batch_size=args.rows, kv_cache_bytes=args.blocks * bytes_per_block,
                   block_size=BLOCK_SIZE, max_model_len=64)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(4, 24))] for _ in range(64)]
    reference = build_engine(model, **options)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [reference.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]

    engine = build_engine(model, **options)
    loop = EngineLoop(engine)
    server = BackgroundServer(create_app(loop, "tiny"), log_level="error").start()
    baseline = loop.stats.blocks_free
    soak = Soak(server.url, prompts, expected, args.seed)
    rss_start = rss_mib()
    started = time.monotonic()
    warmup = min(1000, args.requests // 10)
    asyncio.run(run_clients(soak, warmup, min(args.clients, warmup)))
    rss_warm, objects_warm = rss_mib(), len(gc.get_objects())
    asyncio.run(run_clients(soak, args.requests - warmup, args.clients))
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 30
    while (loop.stats.running or loop.stats.waiting or loop.stats.blocks_free != baseline) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = loop.stats
    leak = None
    try:
        engine.check_drained()  # the loop is idle: nothing else touches the engine now
    except AssertionError as exc:
        leak = str(exc)
    rss_end, objects_end = rss_mib(), len(gc.get_objects())  # with the server still up, as at warm-up
    server.stop()
    summary = {
        "requests": args.requests, "clients": args.clients, "seconds": round(elapsed, 1),
        "outcomes": dict(sorted(soak.outcomes.items())), "failures": len(soak.failures),
        "preemptions": stats.preemptions, "aborted_in_engine": stats.aborted,
        "blocks_free_end": stats.blocks_free, "blocks_free_baseline": baseline, "leak": leak,
        "rss_mib": {"start": round(rss_start, 1), "after_warmup": round(rss_warm, 1), "end": round(rss_end, 1)},
        # Python objects alive after warm-up and at the end: a per-request leak would show here.
        "python_objects": {"after_warmup": objects_warm, "end": objects_end},
    }
    print(json.dumps(summary, indent=2))
    for failure in soak.failures[:10]:
        print("FAILURE:", failure, file=sys.stderr)
    return 1 if soak.failures or leak or stats.preemptions == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
