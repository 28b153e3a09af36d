"""The decode suite's harness on a tiny model (its timings are the bench's, never a test's)."""

from __future__ import annotations

import csv

import compilebench


def test_compilebench_decode_writes_one_row_per_arm_and_bucket(tiny_llama_dir, tmp_path):
    argv = ["decode", "--model", str(tiny_llama_dir), "--device", "cpu", "--rows", "1,2", "--widths", "16,32",
            "--steps", "1", "--arms", "eager", "--out", str(tmp_path), "--tag", "t"]
    assert compilebench.main(argv) == 0
    stem = f"decode-{tiny_llama_dir.name}-t"
    with (tmp_path / f"{stem}.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["arm"], int(r["rows"]), int(r["width"])) for r in rows] == [
        ("eager", 1, 16), ("eager", 1, 32), ("eager", 2, 16), ("eager", 2, 32)]
    assert all(float(r["step_ms"]) > 0 and int(r["recompiles"]) == 0 for r in rows)
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
