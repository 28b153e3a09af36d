"""Hugging Face model directories: `config.json` plus `*.safetensors` (one file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nanoserve.model.config import ModelConfig
from nanoserve.model.errors import ModelLoadError

# HF `architectures` entry -> our architecture name.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(path, f"not valid JSON ({e})") from e


def read_hf_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from `model_dir/config.json`; raises ModelLoadError for an unsupported model."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    arch = _architecture(path, raw)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(path, f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("mlp_bias"):
        raise ModelLoadError(path, "mlp_bias=true is not supported")
    heads = raw["num_attention_heads"]
    # transformers 5 nests rope settings in rope_parameters; 4.x keeps rope_theta + rope_scaling.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    eos = raw.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    llama_bias = bool(raw.get("attention_bias", False))
    try:
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's flag covers all four.
            attention_bias=arch == "qwen2" or llama_bias,
            attention_out_bias=arch != "qwen2" and llama_bias,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            pad_token_id=raw.get("pad_token_id"),
            architecture=arch,
            extra_eos_token_ids=tuple(eos_ids[1:]),
        )
    except KeyError as e:
        raise ModelLoadError(path, f"missing required key {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from e


def _architecture(path: Path, raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_HF_ARCHITECTURES:
            return SUPPORTED_HF_ARCHITECTURES[name]
    model_type = raw.get("model_type")
    if not names and model_type in SUPPORTED_HF_ARCHITECTURES.values():
        return model_type
    raise ModelLoadError(
        path, f"unsupported architecture {names or model_type!r} "
              f"(supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)})"
    )


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a directory: the shards its index names, or every `*.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [model_dir / name for name in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index} not found")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files in this directory")
    return files


def load_hf_state_dict(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, in HF naming, converted to `dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name).to(dtype)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(path, f"cannot read safetensors file ({e})") from e
    return tensors
