"""What a row's K/V costs at a long context with sliding-window layers keeping every position
(swa_full) and keeping only their window (rings: prefix caching off, and on with its saved
rings), and whether they give the same greedy tokens, for a prompt of that length and for a
second turn that extends it (which the prefix-caching arms adopt from the cache).

    PYTHONPATH=. python scripts/window_kv_bytes.py MODEL [--context 4096] [--new-tokens 16]

Prints a table and writes window-kv-bytes-<model>.csv under --out (default compile/results/runs). Each engine holds one
row of ``--context`` tokens; K/V bytes per row are its pool's and rings' bytes (``Engine.resolved``: with
prefix caching the rings' saved copies too, two per row). ``turn2_adopted`` is the prompt tokens the
second turn took from the cache, ``turn2_s`` that turn's time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from compile.common import RUNS, format_table, write_results
from nanoserve.engine import SamplingParams, build_engine

COLUMNS = ["cache", "kv_bytes_per_row_mb", "ring", "saved_rings", "sliding_layers", "tokens", "same_tokens",
           "seconds", "turn2_adopted", "turn2_s"]
ARMS = (("every position (swa_full), prefix caching", dict(swa_full=True)),
        ("window rings, no prefix caching", dict(enable_prefix_caching=False)),
        ("window rings + saved rings, prefix caching", {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RUNS)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows, tokens = [], {}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for name, options in ARMS:
        engine = build_engine(args.model, max_batch_size=1, max_model_len=args.context, compile=False, **options)
        resolved, config = engine.resolved, engine.model.config
        windows = [config.layer_window(i) for i in range(config.num_layers)]
        vocab = engine.vocab_size
        # The second turn: the first's prompt and reply, a few more tokens, and its own reply.
        prompt = [(31 * i + 7) % (vocab - 300) + 100 for i in range(args.context - 3 * args.new_tokens - 1)]
        started = time.perf_counter()
        out = engine.generate([prompt], greedy, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        turn = prompt + out.token_ids + [(13 * i + 5) % (vocab - 300) + 100 for i in range(args.new_tokens)]
        hits = engine.stats().prefix_cache_hits
        started = time.perf_counter()
        second = engine.generate([turn], greedy, use_tqdm=False)[0]
        tokens[name] = (out.token_ids, second.token_ids)
        cache = engine.worker.cache
        rows.append(dict(cache=name, kv_bytes_per_row_mb=resolved.kv_cache_bytes / 1e6, ring=resolved.window_ring or "",
                         saved_rings=cache.ring.snapshots if cache.ring is not None else "",
                         sliding_layers=f"{sum(w is not None for w in windows)} of {len(windows)}",
                         tokens=len(turn) + args.new_tokens, seconds=seconds,
                         turn2_adopted=engine.stats().prefix_cache_hits - hits, turn2_s=time.perf_counter() - started,
                         model=Path(args.model).name, context=args.context))
        engine.close()
    first = next(iter(tokens.values()))
    for row in rows:
        row["same_tokens"] = "yes" if tokens[row["cache"]] == first else "no"
    print(format_table(rows, COLUMNS))
    write_results(rows, args.out, f"window-kv-bytes-{Path(args.model).stem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
