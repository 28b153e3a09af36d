"""The sampling suite's harness (its timings are the bench's, never a test's)."""

from __future__ import annotations

import csv

import compilebench
from compile.sampling_bench import LAWS


def test_compilebench_sampling_writes_a_row_per_law_vocab_and_batch(tmp_path):
    argv = ["sampling", "--vocabs", "300,1000", "--batches", "1,3", "--repeats", "1", "--no-e2e", "--out", str(tmp_path)]
    assert compilebench.main(argv) == 0
    with (tmp_path / "sampling.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["law"], int(r["vocab"]), int(r["batch"])) for r in rows) == sorted(
        (law, vocab, batch) for law in LAWS for vocab in (300, 1000) for batch in (1, 3))
    for row in rows:
        for arm in ("op_ms", "race_ms", "law_op_ms", "law_sort_ms"):
            assert float(row[arm]) > 0, (arm, row)
        assert abs(float(row["sort_over_op"]) - float(row["law_sort_ms"]) / float(row["law_op_ms"])) < 1e-6
