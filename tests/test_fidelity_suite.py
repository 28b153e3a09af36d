"""The fidelity suite's harness on a tiny model (its figures for the real model are the bench's)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from compile import fidelity_suite, llama_peer
from compile.common import formats_for, result_stem

SHORT_TEXT = Path(__file__).parent / "data" / "fidelity_short.txt"


def test_fidelity_suite_writes_one_row_per_format_against_fp32(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    status = fidelity_suite.main(["--model", str(tiny_llama_dir), "--text", str(SHORT_TEXT),
                                  "--weights", "fp32,int4", "--out", str(tmp_path)])
    assert status == 0
    assert llama_peer.ABSENT in capsys.readouterr().out
    # Another model's CSV carries its name, so it never overwrites the default model's figures.
    with (tmp_path / f"fidelity-{Path(tiny_llama_dir).name}.csv").open() as f:
        rows = {r["system"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"fp32", "int4"}
    fp32 = rows["fp32"]  # the reference against itself: the metrics' own zero
    assert float(fp32["top1"]) == 1.0 and float(fp32["mean_kl"]) == 0.0 and float(fp32["ppl_ratio"]) == 1.0
    assert int(rows["int4"]["tokens"]) == int(fp32["tokens"]) > 100
    assert 0.0 < float(rows["int4"]["mean_kl"]) and 0.0 <= float(rows["int4"]["top1"]) <= 1.0


def test_fidelity_suite_reads_only_the_first_max_tokens_in_chunks(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    status = fidelity_suite.main(["--model", str(tiny_llama_dir), "--text", str(SHORT_TEXT), "--weights", "int4",
                                  "--max-tokens", "40", "--chunk-rows", "8", "--tag", "rows8", "--out", str(tmp_path)])
    assert status == 0
    with (tmp_path / f"fidelity-{Path(tiny_llama_dir).name}-rows8.csv").open() as f:
        (row,) = csv.DictReader(f)
    assert row["system"] == "int4" and int(row["tokens"]) == 39


def test_result_files_of_the_default_model_keep_the_suite_name():
    assert result_stem("fidelity") == "fidelity" and result_stem("e2e", tag="avx2") == "e2e-avx2"
    assert result_stem("e2e", "/models/Qwen3-0.6B-Q4_K_M.gguf", "x") == "e2e-Qwen3-0.6B-Q4_K_M-x"


def test_another_model_runs_in_auto_unless_formats_are_chosen():
    assert formats_for("smollm2", None, ("bf16", "int4")) == ("bf16", "int4")
    assert formats_for("/models/x.gguf", None, ("bf16", "int4")) == ("auto",)
    assert formats_for("/models/x.gguf", ("int4",), ("bf16",)) == ("int4",)


def test_at_least_as_faithful_needs_no_worse_on_all_three_figures():
    bar = dict(top1=0.97, mean_kl=0.003, ppl_ratio=1.002)
    assert fidelity_suite.at_least_as_faithful(dict(top1=0.98, mean_kl=0.002, ppl_ratio=0.999), bar)
    assert fidelity_suite.at_least_as_faithful(dict(bar), bar)
    assert not fidelity_suite.at_least_as_faithful(dict(top1=0.96, mean_kl=0.002, ppl_ratio=1.0), bar)
    assert not fidelity_suite.at_least_as_faithful(dict(top1=0.98, mean_kl=0.004, ppl_ratio=1.0), bar)
    assert not fidelity_suite.at_least_as_faithful(dict(top1=0.98, mean_kl=0.002, ppl_ratio=0.997), bar)


def test_reference_measures_every_row_against_another_models_logits(tiny_llama_dir, tmp_path, monkeypatch):
    """A copy of the model with its weights nudged, against the original: even its fp32 row
    moves off the metrics' zero, and the CSV names the reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    nudged = tmp_path / "nudged"
    shutil.copytree(tiny_llama_dir, nudged)
    weights = load_file(nudged / "model.safetensors")
    save_file({name: w + 0.01 * torch.randn_like(w) for name, w in weights.items()}, nudged / "model.safetensors",
              metadata={"format": "pt"})
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    status = fidelity_suite.main(["--model", str(nudged), "--reference", str(tiny_llama_dir), "--text", str(SHORT_TEXT),
                                  "--weights", "fp32", "--max-tokens", "40", "--out", str(tmp_path)])
    assert status == 0
    with (tmp_path / "fidelity-nudged.csv").open() as f:
        (row,) = csv.DictReader(f)
    assert row["reference"] == Path(tiny_llama_dir).name and float(row["mean_kl"]) > 0.0


def test_a_reference_over_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        fidelity_suite.same_vocabulary(torch.zeros(5, 320), torch.zeros(5, 49152), "a.gguf", "b.gguf")


def test_fidelity_suite_measures_each_kv_cache_type_against_fp32(gguf_writer, tmp_path, monkeypatch):
    # A head of 32 (q8_0's run): fp32 cells hold the activations as they are, q8_0 rounds them.
    from nanoserve.model.network.llama import unfuse_hf_weights
    from nanoserve.model.network.synthetic import random_model, tiny_config

    config = tiny_config(vocab_size=300, hidden_size=128, head_dim=32)
    path = gguf_writer(tmp_path / "tiny32.gguf", config, unfuse_hf_weights(random_model(config, seed=2)))
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    status = fidelity_suite.main(["--model", str(path), "--text", str(SHORT_TEXT), "--weights", "fp32",
                                  "--kv-cache-dtype", "auto,fp32,q8_0", "--max-tokens", "60", "--chunk-rows", "8",
                                  "--out", str(tmp_path)])
    assert status == 0
    with (tmp_path / "fidelity-tiny32.csv").open() as f:
        rows = {r["kv_cache"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"auto", "fp32", "q8_0"} and {r["system"] for r in rows.values()} == {"fp32"}
    assert float(rows["auto"]["mean_kl"]) < 1e-9 and float(rows["fp32"]["mean_kl"]) < 1e-9
    assert 1e-7 < float(rows["q8_0"]["mean_kl"]) < 0.05
