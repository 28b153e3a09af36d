"""The e2e benchmark's lockstep harness (not its figures: a benchmark is never a timed test)."""

from __future__ import annotations

import pytest
import torch

from compile.e2e import engine_run, make_prompts, paired_run
from nanoserve.engine import build_engine
from nanoserve.model.hf_loader import load_hf_state_dict, read_hf_config
from nanoserve.model.loader import build_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine_and_reference(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("tiny-llama")
    reference.save_pretrained(path, safe_serialization=True)
    model = build_model(read_hf_config(path), load_hf_state_dict(path))
    engine = build_engine(model, max_batch_size=4, max_model_len=64, dtype="float32", device="cpu")
    return engine, reference


def test_lockstep_pairs_every_transformers_step_with_an_engine_step(engine_and_reference):
    engine, reference = engine_and_reference
    prompts = make_prompts(3, 8, 256)
    engine_steps, hf_steps, outside, engine_tokens, hf_tokens = paired_run(engine, reference, prompts, 6)
    # 6 positions: one prefill and 5 decode steps each, the i-th of both neighbours in time.
    assert len(engine_steps) == len(hf_steps) == 5
    assert all(t > 0 for t in engine_steps + hf_steps)
    assert engine_tokens == hf_tokens and all(len(t) == 6 for t in engine_tokens)
    assert 0.0 <= outside < 1.0
    assert not engine.has_unfinished()


def test_engine_alone_times_its_decode_steps(engine_and_reference):
    engine, _ = engine_and_reference
    steps, _, tokens = engine_run(engine, make_prompts(2, 5, 256), 4)
    assert len(steps) == 3 and [len(t) for t in tokens] == [4, 4]
