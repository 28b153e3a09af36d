"""Hugging Face model directories: `config.json` plus `*.safetensors` (one file or sharded)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.network.architectures import HF_CLASSES, HF_MODEL_TYPES, Architecture, architecture
from nanoserve.model.network.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
# transformers' Gemma3TextConfig defaults: the 4B-27B checkpoints' text_config names only what
# differs from them (the 4B's lists neither its heads nor its vocabulary).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
# Tensor-name prefixes of a multimodal checkpoint's language model (transformers 5 and 4.x
# layouts) -> the text model's, and the prefixes of parts we do not run.
TEXT_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                       "language_model.lm_head.": "lm_head."}
OTHER_MODEL_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                        "model.multi_modal_projector.")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(path, f"not valid JSON ({e})") from e


def read_hf_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from `model_dir/config.json`; raises ModelLoadError for an unsupported model,
    naming what the model code cannot run."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    arch = _architecture(path, raw)
    if "text_config" in raw:  # a multimodal checkpoint: its language model
        raw = {**raw, **raw["text_config"]}
    if arch == "gemma3":
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
    try:
        return ModelConfig(**_config_fields(arch, raw))
    except KeyError as e:
        raise ModelLoadError(path, f"missing required key {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from e


def _config_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    record = architecture(arch)
    gemma = arch == "gemma3"
    _refuse_unsupported(raw)
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    bias = bool(raw.get("attention_bias", False))
    fields = dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        # Qwen2 always has q/k/v biases and no o_proj bias; the others' flag covers all four.
        attention_bias=record.qkv_bias or bias,
        attention_out_bias=not record.qkv_bias and bias,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids[0] if eos_ids else None,
        pad_token_id=raw.get("pad_token_id"),
        architecture=arch,
        extra_eos_token_ids=tuple(eos_ids[1:]),
        hidden_act=raw.get("hidden_activation" if gemma else "hidden_act") or "silu",
        qk_norm=record.qk_norm,
        sandwich_norms=gemma,
        scale_embeddings=gemma,
        query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if gemma else None,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )
    if record.sinks:
        fields.update(attention_sinks=True)
    if record.expert_bias:
        fields.update(expert_bias=True)
    if raw.get("swiglu_limit") is not None:
        fields.update(swiglu_limit=float(raw["swiglu_limit"]), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))
    fields.update(_rope_fields(arch, raw))
    fields.update(_window_fields(record, raw))
    if record.experts:
        fields.update(_expert_fields(record, raw))
    return fields


def _expert_fields(record: Architecture, raw: dict[str, Any]) -> dict[str, Any]:
    """The experts as the reference reads them: Qwen's sparse layers are those past
    mlp_only_layers every decoder_sparse_step-th; Mixtral's experts are intermediate_size wide
    and always renormalised."""
    layers = raw["num_hidden_layers"]
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(
        num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", record.norm_topk_prob)) if record.name != "mixtral" else True,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if record.shared_expert else 0,
        sparse_layers=() if all(sparse) else sparse,
    )


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """ValueError naming a setting the model code does not implement."""
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attention logit soft-capping (attn_logit_softcapping="
                         f"{raw['attn_logit_softcapping']}) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (causal attention only)")


def _rope_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 nests rope settings in rope_parameters (Gemma 3: one entry per layer type);
    # 4.x keeps rope_theta + rope_scaling (+ Gemma's rope_local_base_freq).
    params = raw.get("rope_parameters") or {}
    if arch == "gemma3":
        full = dict(params.get("full_attention") or raw.get("rope_scaling") or {})
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local = dict(params.get("sliding_attention") or {})
        local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"sliding layers' rope type {local['rope_type']!r} is not supported (only default)")
        theta, scaling = _rope_entry(full)
        return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=float(local["rope_theta"]))
    rope = dict(params or raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    theta, scaling = _rope_entry(rope)
    return dict(rope_theta=theta, rope_scaling=scaling)


def _rope_entry(rope: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    rope = dict(rope)
    theta = float(rope.pop("rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return theta, (rope if kind != "default" else None)


def _window_fields(record: Architecture, raw: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as the reference reads them (Architecture.windows): Mistral
    windows every layer; Qwen only with use_sliding_window, from layer max_window_layers on;
    Gemma 3 every layer but each sliding_window_pattern-th (or as its layer_types say)."""
    window = raw.get("sliding_window") or None  # transformers writes 0 for none
    if record.windows == "qwen" and not raw.get("use_sliding_window", False):
        window = None
    if window is None or record.windows == "none":
        return dict(sliding_window=None, layer_types=())
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None and record.windows == "qwen":
        first = raw.get("max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif types is None and record.windows == "alternate":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif types is None and record.windows == "gemma3":
        pattern = raw.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return dict(sliding_window=int(window), layer_types=tuple(types or ()))


def _architecture(path: Path, raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in HF_CLASSES:
            return HF_CLASSES[name]
    model_type = raw.get("model_type")
    if not names and model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    raise ModelLoadError(
        path, f"unsupported architecture {names or model_type!r} "
              f"(supported: {', '.join(HF_CLASSES)})"
    )


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model's HF naming, or None for a part we do not run
    (a multimodal checkpoint's vision tower and projector)."""
    if name.startswith(OTHER_MODEL_PREFIXES):
        return None
    for prefix, text_prefix in TEXT_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return text_prefix + name[len(prefix):]
    return name


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
    """Every tensor of the directory's safetensors files, in HF naming (experts stacked),
    converted to `dtype`."""
    has_config = (Path(model_dir) / "config.json").is_file()
    arch = architecture(read_hf_config(model_dir).architecture) if has_config else None
    weights = SafetensorsWeights(model_dir, arch)
    return {name: weights.read(name, dtype) for name in weights.names()}


def _stack_experts(names: list[str], arch: Architecture) -> tuple[dict[str, list[str]], dict[str, str]]:
    """A checkpoint's per-expert tensors (Architecture.hf_expert_names) grouped under this
    model's stacked names, experts in order, and the renamed single tensors (Mixtral's router:
    this model's name -> the checkpoint's). Experts missing from a run (0..E-1) leave the group
    short, which the shape check then names."""
    groups: dict[str, dict[int, str]] = {}
    single: dict[str, str] = {}
    patterns = []
    for source, target in arch.hf_expert_names.items():
        regex = re.escape(source).replace(re.escape("{e}"), r"(\d+)")
        patterns.append((re.compile(r"^model\.layers\.(\d+)\." + regex + "$"), target, "{e}" in source))
    for name in names:
        for regex, target, per_expert in patterns:
            m = regex.match(name)
            if m is None:
                continue
            stacked = f"model.layers.{m.group(1)}.{target}"
            if per_expert:
                groups.setdefault(stacked, {})[int(m.group(2))] = name
            else:
                single[stacked] = name
    return {stacked: [experts[e] for e in sorted(experts)] for stacked, experts in groups.items()}, single


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


def _fused_expert_parts(part: str) -> dict[str, tuple]:
    """gpt-oss's fused expert tensor ``part`` -> this model's stacked names (under the same
    prefix), each with its transform and its shape from the fused one's. gate_up_proj
    [E, H, 2 I] is x @ W with gate and up interleaved column by column ([..., ::2] gate,
    [..., 1::2] up, as the reference splits them): gate and up are its even and odd columns,
    transposed to [E, I, H]; down_proj [E, I, H] transposed to [E, H, I]."""
    if part == "gate_up_proj":
        return {"gate_proj": (lambda t: t[..., ::2].transpose(-1, -2).contiguous(), lambda s: (s[0], s[2] // 2, s[1])),
                "up_proj": (lambda t: t[..., 1::2].transpose(-1, -2).contiguous(), lambda s: (s[0], s[2] // 2, s[1]))}
    if part == "gate_up_proj_bias":
        return {"gate_bias": (lambda t: t[..., ::2].contiguous(), lambda s: (s[0], s[1] // 2)),
                "up_bias": (lambda t: t[..., 1::2].contiguous(), lambda s: (s[0], s[1] // 2))}
    if part == "down_proj":
        return {"down_proj": (lambda t: t.transpose(-1, -2).contiguous(), lambda s: (s[0], s[2], s[1]))}
    return {"down_bias": (lambda t: t, lambda s: tuple(s))}


class SafetensorsWeights:
    """A directory's safetensors files opened (memory-mapped), read one tensor at a time by its
    text model's HF name (loader.WeightFile: float tensors only, so no blocks)."""

    def __init__(self, model_dir: str | Path, arch: Architecture | None = None) -> None:
        self._files: dict[str, tuple[Path, Any, str]] = {}  # HF name -> (file, handle, name in file)
        for path in safetensors_files(model_dir):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
                for name in handle.keys():
                    text_name = text_model_name(name)
                    if text_name is not None:
                        self._files[text_name] = (path, handle, name)
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ModelLoadError(path, f"cannot read safetensors file ({e})") from e
        # A stacked expert tensor's name -> its experts' entries in _files, in expert order; and
        # this model's name of a tensor the checkpoint names otherwise (Mixtral's router).
        self._stacked, renamed = _stack_experts(list(self._files), arch) if arch else ({}, {})
        for ours, theirs in renamed.items():
            self._files[ours] = self._files.pop(theirs)
        # gpt-oss's fused expert tensors: this model's name -> (the file's entry, transform, shape).
        self._derived: dict[str, tuple[tuple[Path, Any, str], Any, Any]] = {}
        if arch is not None and arch.hf_fused_experts:
            for name in [n for n in self._files if _FUSED_EXPERTS.match(n)]:
                prefix, part = _FUSED_EXPERTS.match(name).groups()
                entry = self._files.pop(name)
                for ours, (transform, shape) in _fused_expert_parts(part).items():
                    self._derived[prefix + ours] = (entry, transform, shape)

    def _entries(self, name: str) -> list[str]:
        return self._stacked.get(name, [name])

    def names(self) -> list[str]:
        """Every tensor's name in this model's HF naming (experts stacked)."""
        stacked = {part for parts in self._stacked.values() for part in parts}
        return [n for n in self._files if n not in stacked] + list(self._stacked) + list(self._derived)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for name in self.names():
            if name in self._derived:
                (_, handle, key), _, shape = self._derived[name]
                out[name] = shape(tuple(handle.get_slice(key).get_shape()))
                continue
            entries = self._entries(name)
            path, handle, key = self._files[entries[0]]
            shape = tuple(handle.get_slice(key).get_shape())
            out[name] = (len(entries), *shape) if name in self._stacked else shape
        return out

    def types(self) -> dict[str, str]:
        """Each tensor's dtype as safetensors names it ("F32", "BF16", "F16")."""
        out = {}
        for name in self.names():
            _, handle, key = self._derived[name][0] if name in self._derived else self._files[self._entries(name)[0]]
            out[name] = handle.get_slice(key).get_dtype()
        return out

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if name in self._stacked:
            return torch.stack([self.read(part, dtype) for part in self._stacked[name]])
        transform = None
        if name in self._derived:
            (path, handle, key), transform, _ = self._derived[name]
        else:
            path, handle, key = self._files[name]
        try:
            tensor = handle.get_tensor(key).to(dtype)
            return tensor if transform is None else transform(tensor)
        except Exception as e:
            raise ModelLoadError(path, f"cannot read tensor {key} ({e})") from e

    def blocks(self) -> dict:
        return {}  # float tensors only

    def release(self) -> None:
        pass  # a tensor read in the file's dtype is a view of its map: it is the model
