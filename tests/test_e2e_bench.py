"""The e2e and headline suites' harness on a tiny model (not their figures: a benchmark is
never a timed test)."""

from __future__ import annotations

import csv
import dataclasses

import pytest
import torch

from compile import e2e, headline, llama_peer
from compile.common import DecodeWorkload, make_prompts
from compile.e2e import run
from compile.floor import ReadSampler, read_buffer, step_cache_bytes, step_weight_bytes, x_read_floor
from compile.interleave import TRANSFORMERS, EngineSteps, Rotation, interleaved_run
from nanoserve.engine import build_engine
from nanoserve.model.quant import cpu_kernels
from nanoserve.model.quant.weight_plan import WeightPlan

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def engine_and_reference(tiny_dir):
    reference = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    # A budget for the whole batch's prompts: the batch's prefill is one step, as EngineSteps counts.
    engine = build_engine(str(tiny_dir), max_batch_size=4, max_model_len=64, weights="fp32",
                          max_num_batched_tokens=256)
    return engine, reference


def test_interleaved_pass_pairs_every_transformers_step_with_each_arms_step(engine_and_reference):
    engine, reference = engine_and_reference
    prompts = make_prompts(3, 8, 256)
    result = interleaved_run({"eager": EngineSteps(engine, prompts, 6)}, prompts, 6, reference)
    # 6 positions: one prefill and 5 decode steps each, the i-th of both neighbours in time.
    assert len(result.decode_steps["eager"]) == len(result.decode_steps[TRANSFORMERS]) == 5
    assert all(t > 0 for steps in result.decode_steps.values() for t in steps)
    assert result.tokens["eager"] == result.tokens[TRANSFORMERS]
    assert all(len(t) == 6 for t in result.tokens["eager"])
    assert not engine.has_unfinished()


def test_rotation_steps_every_arm_once_per_call_in_a_rotating_order():
    order = []

    class Arm:
        def __init__(self, name):
            self.name, self.steps = name, 0

        def step(self):
            order.append(self.name)
            self.steps += 1

        @property
        def done(self):
            return self.steps >= 3

    rotation = Rotation({name: Arm(name) for name in "abc"})
    while not rotation.done:
        rotation.step_all()
    assert order == list("abc" "bca" "cab")


def test_a_read_takes_its_turn_among_the_steps_and_each_step_meets_the_read_beside_it(engine_and_reference):
    engine, _ = engine_and_reference
    prompts = make_prompts(2, 5, 256)
    read = read_buffer(1 << 20)
    result = interleaved_run({"eager": EngineSteps(engine, prompts, 4), "read": ReadSampler(read)}, prompts, 4)
    # one read per round, the prefill's round left out as the engine's is: never holds the pass back
    assert len(result.decode_steps["read"]) == len(result.decode_steps["eager"]) == 3
    # a step twice its floor while memory was slow, and twice while fast: twice, not a blend of phases
    steps, reads = [0.2, 0.2, 0.1, 0.1], [0.1, 0.1, 0.05, 0.05]
    assert x_read_floor(steps, reads, read_bytes=1000, weight_bytes=1000) == pytest.approx(2.0)
    # twice the weights' bytes read in 0.1 s: a floor of 0.05 s, which a 0.3 s step is 6 times
    assert x_read_floor([0.3], [0.1], read_bytes=2000, weight_bytes=1000) == pytest.approx(6.0)


def test_engine_alone_times_its_decode_steps(engine_and_reference):
    engine, _ = engine_and_reference
    steps = EngineSteps(engine, make_prompts(2, 5, 256), 4)
    while not steps.done:
        steps.step()
    assert len(steps.decode_steps) == 3 and [len(t) for t in steps.tokens] == [4, 4]
    assert 0.0 <= steps.outside_forward < 1.0


def test_a_sampled_run_samples_every_arm_and_refuses_the_greedy_reference(tiny_dir, monkeypatch):
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    work = DecodeWorkload(model=str(tiny_dir), weights=("int4",), modes=("eager",), batches=(2,), prompt_len=6,
                          new_tokens=4, transformers=False, sampling="llama.cpp")
    rows = run(work)
    assert [(r["sampling"], r["batch"]) for r in rows] == [("llama.cpp", 2)] and rows[0]["tok_s"] > 0
    with pytest.raises(ValueError, match="--no-transformers"):
        run(DecodeWorkload(model=str(tiny_dir), weights=("int4",), modes=("eager",), sampling="llama.cpp"))


def test_e2e_rows_per_format_mode_and_batch_with_floors_and_ratios(tiny_dir, monkeypatch, capsys):
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    work = DecodeWorkload(model=str(tiny_dir), weights=("fp32", "int4"), modes=("eager",), batches=(1, 2),
                          prompt_len=6, new_tokens=4)
    rows = run(work)
    assert llama_peer.ABSENT in capsys.readouterr().out  # said once, and every other arm still ran
    assert [(r["weights"], r["batch"]) for r in rows] == [("fp32", 1), ("fp32", 2), ("int4", 1), ("int4", 2)]
    for r in rows:
        assert r["tok_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3))
        assert r["x_bw_floor"] > 0 and r["read_gb_s"] > 0 and r["bw_floor_ms"] > 0
        assert r["vs_hf_p10"] <= r["vs_hf"] <= r["vs_hf_p90"]
        assert "llama_tok_s" not in r
    fp32, int4 = rows[0], rows[2]
    assert fp32["same_as_hf"] == "1/1"  # fp32 is the reference's own arithmetic
    # int4 linears (an eighth of fp32) beside a dense head in the compute dtype (the tiny model's
    # largest tensor, a third of its fp32 bytes): well under half of fp32 on any CPU
    assert int4["weight_mb"] < fp32["weight_mb"] / 2.5


def test_step_weight_bytes_reads_the_packed_codes_or_the_bf16_copy_by_rows(tiny_dir):
    engine = build_engine(str(tiny_dir), max_batch_size=4, max_model_len=64,
                          weights=WeightPlan("int8", dense_from_rows=4))
    model = engine.model
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    linears.append(model.lm_head)
    packed = sum(m.codes.nbytes + m.scales.nbytes for m in linears)
    dense = sum(m.dense.nbytes for m in linears)
    assert step_weight_bytes(model, 3) == packed
    assert step_weight_bytes(model, 4) == dense


def test_headline_writes_its_table_and_plot(tiny_dir, tmp_path, capsys):
    status = headline.main(["--model", str(tiny_dir), "--modes", "eager", "--batches", "1,2", "--prompt-len", "6",
                            "--new-tokens", "3", "--no-llama-cpp", "--out", str(tmp_path)])
    assert status == 0
    with (tmp_path / f"headline-{tiny_dir.name}.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["batch"] for r in rows] == ["1", "2"] and all(r["weights"] == "auto" for r in rows)
    assert rows[0]["kernels"] == cpu_kernels.resolve_tier() and rows[0]["cpu"]  # what ran, and where
    assert {"eager_tok_s", "hf_tok_s", "eager_vs_hf"} <= set(rows[0])
    assert (tmp_path / f"headline-{tiny_dir.name}.png").stat().st_size > 0
    assert "llama-cpp-python" not in capsys.readouterr().out  # asked not to run it: no absence note


def test_e2e_of_another_model_names_its_files_after_it(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    status = e2e.main(["--model", str(tiny_dir), "--weights", "fp32", "--modes", "eager", "--batches", "1",
                       "--prompt-len", "6", "--new-tokens", "4", "--no-transformers", "--tag", "t",
                       "--out", str(tmp_path)])
    assert status == 0
    stem = f"e2e-{tiny_dir.name}-t"
    with (tmp_path / f"{stem}.csv").open() as f:
        (row,) = csv.DictReader(f)
    assert row["weights"] == "fp32" and row["batch"] == "1" and "hf_tok_s" not in row
    assert (tmp_path / f"{stem}.png").stat().st_size > 0


def test_e2e_runs_an_engine_arm_per_kv_cache_type(tiny_dir, monkeypatch):
    monkeypatch.setattr(llama_peer, "available", lambda: False)
    work = DecodeWorkload(model=str(tiny_dir), weights=("fp32",), modes=("eager",), batches=(2,), prompt_len=6,
                          new_tokens=4, transformers=False, kv_cache_types=("auto", "bf16"))
    rows = run(work)
    assert [(r["mode"], r["kv_cache"]) for r in rows] == [("eager", "auto"), ("eager", "bf16")]
    assert all(r["tok_s"] > 0 for r in rows)


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16"])
def test_step_cache_bytes_counts_each_layers_cells_in_the_pools_format_up_to_its_window(tiny_dir, kv_cache_dtype):
    engine = build_engine(str(tiny_dir), max_batch_size=4, max_model_len=64, weights="fp32",
                          kv_cache_dtype=kv_cache_dtype)
    config = engine.model.config
    per_head = config.head_dim * (4 if kv_cache_dtype == "fp32" else 2)
    per_cell = 2 * config.num_kv_heads * per_head  # K and V
    assert step_cache_bytes(engine, 3, 40) == 3 * 40 * config.num_layers * per_cell
    # A sliding layer reads its window's cells at most: every other layer sliding over 16.
    windowed = dataclasses.replace(config, sliding_window=16,
                                   layer_types=["sliding_attention", "full_attention"] * (config.num_layers // 2)
                                   + ["full_attention"] * (config.num_layers % 2))
    engine.model.config = windowed
    try:
        sliding = config.num_layers // 2
        assert step_cache_bytes(engine, 3, 40) == 3 * (sliding * 16 + (config.num_layers - sliding) * 40) * per_cell
        assert step_cache_bytes(engine, 3, 10) == 3 * 10 * config.num_layers * per_cell
    finally:
        engine.model.config = config
