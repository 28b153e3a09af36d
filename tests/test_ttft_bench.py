"""The ttft suite's harness on a tiny model (its timings are the bench's, never a test's)."""

from __future__ import annotations

import csv

import compilebench
from nanoserve.model.quant import cpu_kernels


def test_compilebench_ttft_writes_one_row_per_prompt_length(tiny_llama_dir, tmp_path, capsys):
    argv = ["ttft", "--model", str(tiny_llama_dir), "--lengths", "8,24", "--repeats", "1", "--no-llama-cpp",
            "--out", str(tmp_path)]
    assert compilebench.main(argv) == 0
    with (tmp_path / f"ttft-{tiny_llama_dir.name}.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["prompt_tokens"]) for r in rows] == [8, 24]
    assert all(float(r["nanoserve_s"]) > 0 and "vs_llama" not in r for r in rows)
    assert rows[0]["kernels"] == cpu_kernels.resolve_tier()
    assert "llama-cpp-python" not in capsys.readouterr().out  # asked not to run it: no absence note
