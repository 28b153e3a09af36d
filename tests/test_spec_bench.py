"""The spec suite's harness on tiny settings: its rows, columns and comparisons (its timings are the
bench's, never a test's)."""

from __future__ import annotations

import csv
import importlib.util

import pytest

import compilebench
from compile import spec_bench
from compile.spec_bench import LLAMA_CPP, NANOSERVE, compare

# The draft method lands in nanoserve/speculative/draft.py; until then its arms report their error.
HAS_DRAFT = importlib.util.find_spec("nanoserve.speculative.draft") is not None


def read_rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_copying_workloads_copy_their_source():
    code = spec_bench.source_text("code")
    assert 2000 <= len(code) <= 3500 and "history" in code  # the name the workload renames
    quote = spec_bench.source_text("quote")
    assert len(quote) <= spec_bench.SUMMARY_CHARS + 1 and quote.endswith(".\n")  # whole paragraphs
    assert spec_bench.source_text("quote", 50) == quote[:50]


def test_arms_pair_every_method_with_its_own_no_speculation_arm():
    arms = spec_bench.plan_arms(spec_bench.PARTS, (8, 32), llama_cpp=True)
    assert [(a.part, a.system, a.weights, a.method) for a in arms] == [
        ("ngram", NANOSERVE, "auto", "none"), ("ngram", NANOSERVE, "auto", "ngram"),
        ("ngram", LLAMA_CPP, "file", "none"), ("ngram", LLAMA_CPP, "file", "ngram"),
        ("draft", NANOSERVE, "fp32", "none"), ("draft", NANOSERVE, "fp32", "draft"),
        ("batch", NANOSERVE, "auto", "none"), ("batch", NANOSERVE, "auto", "ngram"),
        ("batch", NANOSERVE, "fp32", "none"), ("batch", NANOSERVE, "fp32", "draft")]
    assert arms[0].jobs == (("code", 1), ("quote", 1)) and arms[-1].jobs == (("headline", 8), ("headline", 32))
    assert all(a.system == NANOSERVE for a in spec_bench.plan_arms(("ngram",), (8,), llama_cpp=False))
    assert spec_bench.speculative_config("none", 4, {}, {}) is None
    assert spec_bench.speculative_config("draft", 3, {"adaptive": False}, {"draft_weights": "int8"}) == {
        "method": "draft", "num_speculative_tokens": 3, "adaptive": False, "draft_weights": "int8"}


def test_compare_sets_ratios_bars_same_tokens_and_the_peers_figures():
    def row(system, method, tok_s, part="ngram", weights=None):
        return dict(part=part, workload="code", batch=1, system=system, method=method, tok_s=tok_s,
                    weights=weights or ("file" if system == LLAMA_CPP else "auto"))

    rows = [row(NANOSERVE, "none", 100.0), row(NANOSERVE, "ngram", 180.0), row(LLAMA_CPP, "none", 120.0),
            row(LLAMA_CPP, "ngram", 150.0), row(NANOSERVE, "none", 50.0, "batch"),
            row(NANOSERVE, "ngram", 45.0, "batch"), {**row(NANOSERVE, "draft", 0.0, "batch", "fp32"), "error": "x"}]
    tokens = {0: [[1, 2, 3]], 1: [[1, 2, 3]], 2: [[1, 2, 3]], 3: [[1, 9, 3]], 4: [[5], [6]], 5: [[5], [7]], 6: []}
    compare(rows, tokens)
    ours, theirs, batch = rows[1], rows[3], rows[5]
    assert ours["ratio"] == pytest.approx(1.8) and ours["bar"] == 1.5 and ours["meets"] == "yes"
    assert ours["same_tokens"] == "1/1" and ours["first_diff"] == ""
    assert ours["vs_llama"] == pytest.approx(1.2) and ours["llama_ratio"] == pytest.approx(1.25)
    assert theirs["same_tokens"] == "0/1" and theirs["first_diff"] == 1 and "bar" not in theirs
    assert batch["ratio"] == pytest.approx(0.9) and batch["meets"] == "no" and batch["same_tokens"] == "1/2"
    assert "ratio" not in rows[0] and "ratio" not in rows[6]


def test_compilebench_spec_on_a_tiny_model_writes_every_row_with_its_counters(tiny_llama_dir, tmp_path):
    argv = ["spec", "--model", str(tiny_llama_dir), "--rows", "ngram,batch", "--mode", "eager", "--new-tokens", "32",
            "--batch-new-tokens", "32",
            "--batches", "2", "--repeats", "1", "--text-chars", "80", "--skip-llama-cpp", "--out", str(tmp_path),
            "--tag", "t", "--spec-options", '{"prompt_lookup_min": 1, "adaptive": false}']
    # (32 greedy tokens of the random model loop: the lookup finds them from then on)
    assert compilebench.main(argv) == 0
    rows = read_rows(tmp_path / f"spec-{tiny_llama_dir.name}-t.csv")
    assert (tmp_path / f"spec-{tiny_llama_dir.name}-t.png").exists()
    assert [(r["part"], r["workload"], r["batch"], r["weights"], r["method"]) for r in rows] == [
        ("ngram", "code", "1", "auto", "none"), ("ngram", "quote", "1", "auto", "none"),
        ("ngram", "code", "1", "auto", "ngram"), ("ngram", "quote", "1", "auto", "ngram"),
        ("batch", "headline", "2", "auto", "none"), ("batch", "headline", "2", "auto", "ngram"),
        ("batch", "headline", "2", "fp32", "none"), ("batch", "headline", "2", "fp32", "draft")]
    assert all(r["cpu"] and r["kernels"] and r["system"] == NANOSERVE and r["k"] == "4" for r in rows)
    measured = [r for r in rows if r["method"] != "draft" or HAS_DRAFT]
    assert all(not r.get("error") and float(r["tok_s"]) > 0 and r["recompiles_after_warmup"] == "0"
               for r in measured)
    for r in measured:
        if r["method"] == "none":
            assert r["ratio"] == "" and r["acceptance_rate"] == ""
        else:
            assert float(r["ratio"]) > 0 and float(r["verify_steps"]) >= 0 and r["same_tokens"].endswith("/" + r["batch"])
            assert 0 <= float(r["acceptance_rate"]) <= 1 and float(r["draft_s"]) >= 0
    assert [r["bar"] for r in rows if r["method"] == "ngram"] == ["1.5", "1.5", "0.95"]
    assert float(rows[2]["verify_steps"]) > 0 and float(rows[2]["mean_accepted_length"]) >= 1
    if not HAS_DRAFT:
        assert rows[-1]["error"] and rows[-1]["tok_s"] == ""


@pytest.mark.skipif(not HAS_DRAFT, reason="nanoserve.speculative.draft has not landed")
def test_compilebench_spec_draft_rows_say_whether_the_tokens_are_the_targets(tiny_llama_dir, tmp_path):
    # The tiny model's draft costs as much as its target, so an adaptive row would rightly not
    # speculate once that is measured: a fixed k keeps the draft rows drafting.
    argv = ["spec", "--model", str(tiny_llama_dir), "--rows", "draft", "--mode", "eager", "--new-tokens", "8",
            "--repeats", "1", "--text-chars", "80", "--out", str(tmp_path), "--no-plot",
            "--draft-options", '{"adaptive": false}']
    assert compilebench.main(argv) == 0
    rows = read_rows(tmp_path / f"spec-{tiny_llama_dir.name}.csv")
    assert [(r["weights"], r["method"]) for r in rows] == [("fp32", "none")] * 2 + [("fp32", "draft")] * 2
    assert all(not r.get("error") and float(r["tok_s"]) > 0 for r in rows)
    assert all(r["same_tokens"] in ("0/1", "1/1") and float(r["proposed"]) > 0 for r in rows[2:])


@pytest.mark.slow
@pytest.mark.model
def test_compilebench_spec_ngram_part_beside_llama_cpp_prompt_lookup(smollm2_path, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[peers]')")
    argv = ["spec", "--rows", "ngram", "--mode", "eager", "--new-tokens", "8", "--repeats", "1",
            "--text-chars", "100", "--out", str(tmp_path), "--no-plot"]
    assert compilebench.main(argv) == 0
    rows = read_rows(tmp_path / "spec.csv")
    assert [(r["system"], r["method"]) for r in rows] == [(NANOSERVE, "none")] * 2 + [(NANOSERVE, "ngram")] * 2 + [
        (LLAMA_CPP, "none")] * 2 + [(LLAMA_CPP, "ngram")] * 2
    assert all(not r.get("error") and float(r["tok_s"]) > 0 for r in rows)
    for r in rows[2:4]:
        assert float(r["vs_llama"]) > 0 and float(r["llama_ratio"]) > 0
    for r in rows[6:]:
        assert float(r["ratio"]) > 0 and float(r["verify_steps"]) >= 0 and r["same_tokens"] in ("0/1", "1/1")
