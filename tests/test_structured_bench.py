"""The structured suite's harness on a tiny model (its timings are the bench's, never a test's)."""

from __future__ import annotations

import csv

import pytest

import compilebench


@pytest.mark.model
def test_compilebench_structured_writes_a_row_per_batch(smollm2_path, tmp_path):
    argv = ["structured", "--batches", "2", "--new-tokens", "6", "--prompt-len", "8", "--eager", "--out", str(tmp_path)]
    assert compilebench.main(argv) == 0
    with (tmp_path / "structured.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["batch"]) for r in rows] == [2]
    row = rows[0]
    assert float(row["plain_tok_s"]) > 0 and float(row["constrained_tok_s"]) > 0
    assert abs(float(row["ratio"]) - float(row["constrained_tok_s"]) / float(row["plain_tok_s"])) < 1e-6
    assert float(row["mask_ms_per_step"]) > 0
