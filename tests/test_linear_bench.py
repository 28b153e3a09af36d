"""The linear suite's harness at its smallest (its timings are the bench's, never a test's)."""

from __future__ import annotations

import csv

import compilebench
from nanoserve.model.quant import cpu_kernels


def test_compilebench_linear_writes_one_row_per_shape_and_row_count(tmp_path, capsys):
    argv = ["linear", "--shapes", "o", "qkv", "--rows", "1", "3", "--repeats", "1", "--layers", "1",
            "--out", str(tmp_path)]
    assert compilebench.main(argv) == 0
    tier = cpu_kernels.resolve_tier()
    with (tmp_path / f"linear_crossover-{tier}.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["shape"], int(r["rows"])) for r in rows] == [("o", 1), ("o", 3), ("qkv", 1), ("qkv", 3)]
    assert {r["tier"] for r in rows} == {tier}
    assert all(float(r[f"{arm}_us"]) > 0 for r in rows for arm in ("fp32", "bf16", "int4", "int4_torch", "int8g"))
    assert "linear_crossover" in capsys.readouterr().out
