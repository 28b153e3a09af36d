"""Bad model input: every failure names the file and what is wrong with it (faults are planted)."""

from __future__ import annotations

import json

import gguf
import pytest

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.loader import load_config, load_model, resolve_model_path
from nanoserve.model.network.llama import unfuse_hf_weights
from nanoserve.model.network.synthetic import random_model, tiny_config

Q = gguf.GGMLQuantizationType


def hf_weights(config):
    """Random HF-named weights in `config`'s shape."""
    return unfuse_hf_weights(random_model(config, seed=0))


CONFIG = tiny_config(vocab_size=260)


@pytest.fixture
def good_gguf(tmp_path, gguf_writer):
    return gguf_writer(tmp_path / "good.gguf", CONFIG, hf_weights(CONFIG))


def test_planted_file_loads_when_nothing_is_wrong(good_gguf):
    model, tokenizer = load_model(str(good_gguf))
    assert model.config.num_layers == 2 and tokenizer.vocab_size == 260


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere.gguf"
    with pytest.raises(FileNotFoundError, match="nowhere.gguf.*not found"):
        load_model(str(path))


def test_unknown_model_name_says_what_is_accepted():
    with pytest.raises(FileNotFoundError, match="smollm2"):
        resolve_model_path("no-such-model")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelLoadError, match="weights.gguf: not a GGUF file"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.98], ids=["in-header", "in-tensors", "last-bytes"])
def test_truncated_gguf_names_file_and_problem(tmp_path, good_gguf, keep):
    data = good_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="cut.gguf: .*truncated") as err:
        load_model(str(cut))
    assert str(cut) in str(err.value)


def test_unsupported_architecture_in_gguf(tmp_path, gguf_writer):
    path = gguf_writer(tmp_path / "mamba.gguf", CONFIG, hf_weights(CONFIG), arch="mamba")
    with pytest.raises(ModelLoadError, match="mamba.gguf: unsupported architecture 'mamba'"):
        load_model(str(path))


def test_unsupported_quantisation_type_names_tensor_and_type(tmp_path, gguf_writer):
    path = gguf_writer(tmp_path / "q81.gguf", CONFIG, hf_weights(CONFIG),
                       tensor_types={"blk.1.ffn_up.weight": Q.Q8_1})
    with pytest.raises(ModelLoadError, match="q81.gguf: tensor blk.1.ffn_up.weight has unsupported "
                                             "quantisation type Q8_1"):
        load_model(str(path))


def test_weights_that_contradict_the_metadata(tmp_path, gguf_writer):
    other = tiny_config(vocab_size=260, intermediate_size=96)
    path = gguf_writer(tmp_path / "mismatch.gguf", CONFIG, hf_weights(other))
    with pytest.raises(ModelLoadError, match="mismatch.gguf: tensor blk.0.ffn_gate.weight has shape \\[96, 64\\] "
                                             "but the metadata makes it \\[128, 64\\]"):
        load_model(str(path))


def test_gguf_missing_a_tensor(tmp_path, gguf_writer):
    weights = hf_weights(CONFIG)
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = gguf_writer(tmp_path / "holes.gguf", CONFIG, weights)
    with pytest.raises(ModelLoadError, match="holes.gguf: .*model.layers.1.mlp.up_proj.weight"):
        load_model(str(path))


def test_gguf_missing_metadata_key(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="bare.gguf: missing metadata key 'llama.attention.head_count'"):
        load_config(str(tmp_path / "bare.gguf"))


def test_hf_directory_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="config.json: unsupported architecture"):
        load_config(str(tmp_path))


def test_hf_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_hf_directory_without_weights(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises((FileNotFoundError, ModelLoadError), match=str(tmp_path)):
        load_model(str(tmp_path))


def test_corrupt_safetensors_names_the_file(tmp_path):
    from nanoserve.model.formats.hf_loader import load_hf_state_dict

    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read safetensors"):
        load_hf_state_dict(tmp_path)
