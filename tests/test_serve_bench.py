"""The serve suite's output on a tiny model: every workload's rows, the targets, the CSV. Untimed:
only what the numbers must say whatever the machine (tokens computed, steps counted)."""

from __future__ import annotations

import csv

from conftest import tiny_text_engine

from compile import serve_bench
from compile.common import write_results
from compile.serve_bench import ServeWorkload
from nanoserve.engine import build_engine


def test_serve_suite_reports_caching_and_chunking_on_a_tiny_model(tmp_path):
    base = tiny_text_engine(tmp_path)

    def make(**flags):
        return build_engine(base.model, tokenizer=base.tokenizer, max_batch_size=4, max_model_len=512,
                            block_size=8, **flags)

    work = ServeWorkload(requests=3, bursts=2, turns=2, answer_tokens=4, streams=3, long_tokens=120, chunk_tokens=24,
                         warm_steps=2, long_repeats=2)
    rows = serve_bench.run(make, work)
    text = serve_bench.report(rows)

    shared = {r["caching"]: r for r in rows if r["workload"] == "shared"}
    assert shared["off"]["prefill_tokens"] == shared["off"]["prompt_tokens"]
    assert shared["on"]["prefill_tokens"] < shared["off"]["prefill_tokens"]  # the template's head is shared
    burst = {r["caching"]: r for r in rows if r["workload"] == "burst"}
    assert burst["off"]["prefill_tokens"] == burst["off"]["prompt_tokens"] == shared["off"]["prompt_tokens"]
    # A cold cache: the first request computes the template's head, the other two adopt it.
    assert burst["on"]["prefill_tokens"] < burst["off"]["prefill_tokens"]
    turns = {(r["caching"], r["turn"]): r for r in rows if r["workload"] == "turns"}
    assert turns["on", 2]["prefill_tokens"] < turns["on", 2]["prompt_tokens"] == turns["off", 2]["prefill_tokens"]
    long = {(r["chunking"], r["repeat"]): r for r in rows if r["workload"] == "long"}
    assert sorted(long) == [("off", 1), ("off", 2), ("on", 1), ("on", 2)]
    for repeat in (1, 2):
        assert long["on", repeat]["long_tokens"] == 120 and long["on", repeat]["chunk_tokens"] == 24
        # The prompt went in chunks, decoding between.
        assert long["on", repeat]["steps_during"] > long["off", repeat]["steps_during"]
    for row in long.values():
        assert row["itl_p99_ms"] >= row["itl_p50_ms"] > 0 and row["undisturbed_p50_ms"] > 0
    medians = serve_bench.median_long_rows(rows)
    ratios = sorted(long["on", repeat]["p99_x_undisturbed"] for repeat in (1, 2))
    assert medians["on"]["p99_x_undisturbed"] == (ratios[0] + ratios[1]) / 2  # the target reads this median
    assert serve_bench.targets(rows)[-1]["measured"] == medians["on"]["p99_x_undisturbed"]
    assert [t["target"].split()[0] for t in serve_bench.targets(rows)] == ["shared-prefix", "shared-prefix", "chunked"]
    assert "targets:" in text and "shared:" in text and "burst:" in text and "turns:" in text and "long:" in text
    write_results(serve_bench.with_targets(rows), tmp_path, "serve", serve_bench.write_plot)
    assert (tmp_path / "serve.png").stat().st_size > 0
    with (tmp_path / "serve.csv").open() as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) + 3
