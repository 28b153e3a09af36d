"""The tp suite's harness on the tiny check model (its timings are the bench's, never a test's)."""

from __future__ import annotations

import csv

import compilebench


def test_compilebench_tp_writes_one_row_per_size_with_collectives_only_when_sharded(tmp_path):
    argv = ["tp", "--model", "tiny", "--sizes", "1,2", "--rows", "2", "--steps", "2", "--profile-steps", "1",
            "--warmup-steps", "1", "--prompt-len", "4", "--out", str(tmp_path)]
    assert compilebench.main(argv) == 0
    with (tmp_path / "tp-tiny.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["tp"]) for r in rows] == [1, 2]
    assert all(float(r["tokens_per_s"]) > 0 and r["weights"] == "fp32" for r in rows)
    one, two = rows
    assert float(one["collectives_ms"]) == 0 and float(one["plan_broadcast_ms"]) == 0
    assert float(two["collectives_ms"]) > 0 and float(two["plan_broadcast_ms"]) > 0
