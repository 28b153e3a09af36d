"""A Hugging Face directory checked before anything is built from it: `config.json` (and its
text_config), `tokenizer.json`, `tokenizer_config.json`, the chat template and every safetensors
header. Each check raises ModelLoadError naming the file and the field at fault; the GGUF
checks and the ceilings they share are validate.py's."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.validate import (
    _BOOL,
    _FLOAT,
    _INT,
    _STR,
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    _shown,
    check_chat_template,
)
from nanoserve.model.network.config import ModelConfig

# A safetensors header is JSON of at most this many bytes (the format's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100_000_000
SAFETENSORS_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                          "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_INT_LIST, _STR_LIST = "a list of integers", "a list of strings"
# config.json settings the model code reads: the kinds of value each may hold, and its range.
_HF_KEYS: dict[str, tuple[tuple[str, ...], float | None, float | None]] = {
    "vocab_size": ((_INT,), 1, MAX_VOCAB),
    "hidden_size": ((_INT,), 1, MAX_WIDTH),
    "intermediate_size": ((_INT,), 1, MAX_WIDTH),
    "num_hidden_layers": ((_INT,), 1, MAX_LAYERS),
    "num_attention_heads": ((_INT,), 1, MAX_WIDTH),
    "num_key_value_heads": ((_INT,), 1, MAX_WIDTH),
    "head_dim": ((_INT,), 2, MAX_WIDTH),
    "max_position_embeddings": ((_INT,), 1, MAX_CONTEXT),
    "max_window_layers": ((_INT,), 0, MAX_LAYERS),
    "sliding_window": ((_INT,), 0, MAX_CONTEXT),  # 0: none (transformers saves it so)
    "sliding_window_pattern": ((_INT,), 1, MAX_LAYERS),
    "rms_norm_eps": ((_FLOAT,), 0, 1),
    "rope_theta": ((_FLOAT,), 1e-9, None),
    "rope_local_base_freq": ((_FLOAT,), 1e-9, None),
    "query_pre_attn_scalar": ((_FLOAT,), 1e-9, None),
    "final_logit_softcapping": ((_FLOAT,), 1e-9, None),
    "tie_word_embeddings": ((_BOOL,), None, None),
    "attention_bias": ((_BOOL,), None, None),
    "use_sliding_window": ((_BOOL,), None, None),
    "hidden_act": ((_STR,), None, None),
    "hidden_activation": ((_STR,), None, None),
    "model_type": ((_STR,), None, None),
    "architectures": ((_STR_LIST,), None, None),
    "layer_types": ((_STR_LIST,), None, None),
    "bos_token_id": ((_INT,), 0, MAX_VOCAB),
    "pad_token_id": ((_INT,), 0, MAX_VOCAB),
    "eos_token_id": ((_INT, _INT_LIST), 0, MAX_VOCAB),
    "num_experts": ((_INT,), 0, MAX_EXPERTS),
    "num_local_experts": ((_INT,), 0, MAX_EXPERTS),
    "num_experts_per_tok": ((_INT,), 1, MAX_EXPERTS),
    "moe_intermediate_size": ((_INT,), 1, MAX_WIDTH),
    "shared_expert_intermediate_size": ((_INT,), 0, MAX_WIDTH),
    "decoder_sparse_step": ((_INT,), 1, MAX_LAYERS),
    "mlp_only_layers": ((_INT_LIST,), 0, MAX_LAYERS),
    "norm_topk_prob": ((_BOOL,), None, None),
}
# Settings that may be absent (a default applies) but not null.
_HF_NOT_NULL = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_local_base_freq",
                "query_pre_attn_scalar", "sliding_window_pattern")
# Numbers inside rope_scaling / rope_parameters.
_ROPE_NUMBERS = ("factor", "rope_theta", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "beta_fast", "beta_slow")
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def checked_hf_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory, once its files pass check_hf_dir."""
    from nanoserve.model.formats.hf_loader import read_hf_config

    check_hf_config_values(model_dir / "config.json")
    config = read_hf_config(model_dir)
    check_hf_dir(model_dir, config)
    return config


def check_hf_config_values(path: Path) -> None:
    """config.json (and its text_config): each setting the model code reads holds a value of
    the right type and in range."""
    raw = _json_object(path)
    text = raw.get("text_config")
    if "text_config" in raw and not isinstance(text, dict):
        raise ModelLoadError(path, f"text_config must be an object, got {_shown(text)}")
    for where, values in (("", raw), ("text_config.", text or {})):
        for key, (kinds, low, high) in _HF_KEYS.items():
            value = values.get(key)
            if value is None:
                continue
            if not any(_is_kind(value, kind) for kind in kinds):
                raise ModelLoadError(path, f"{where}{key} must be {' or '.join(kinds)}, got {_shown(value)}")
            numbers = value if isinstance(value, list) else [value]
            for number in numbers:
                if isinstance(number, (int, float)) and not isinstance(number, bool):
                    if not math.isfinite(number) or (low is not None and number < low) or (
                            high is not None and number > high):
                        raise ModelLoadError(path, f"{where}{key} must be in [{low}, {high}], got {_shown(value)}")
        for key in ("rope_scaling", "rope_parameters"):
            _check_rope(path, f"{where}{key}", values.get(key))
    merged = {**raw, **(text or {})}  # as read_hf_config reads a multimodal checkpoint's text model
    for key in _HF_NOT_NULL:
        if key in merged and merged[key] is None:
            raise ModelLoadError(path, f"{key} must be {' or '.join(_HF_KEYS[key][0])}, got None")


def _check_rope(path: Path, field: str, rope: Any) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ModelLoadError(path, f"{field} must be an object, got {_shown(rope)}")
    entries = [rope] + [v for v in rope.values() if isinstance(v, dict)]  # per layer type (Gemma 3)
    for entry in entries:
        for key, value in entry.items():
            if key in ("rope_type", "type"):
                if not isinstance(value, str):
                    raise ModelLoadError(path, f"{field}.{key} must be a string, got {_shown(value)}")
            elif key in _ROPE_NUMBERS and not (_is_kind(value, _FLOAT) and math.isfinite(value) and value > 0):
                raise ModelLoadError(path, f"{field}.{key} must be a positive number, got {_shown(value)}")


def _is_kind(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _INT_LIST:
        return isinstance(value, list) and all(_is_kind(v, _INT) for v in value)
    if kind == _STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return {_STR: str, _BOOL: bool}[kind] is type(value)


def check_hf_dir(model_dir: Path, config: ModelConfig) -> None:
    """Refuse a directory whose tokenizer files are unreadable or disagree with config.json
    (special tokens outside the vocabulary, token ids past the embedding rows), whose chat
    template fails its probe, or whose safetensors headers are malformed or name layers
    config.json does not have."""
    from tokenizers import Tokenizer as Backend

    path = model_dir / "tokenizer.json"
    if path.is_file():
        _check_bpe_model(path, _json_object(path).get("model"))
        try:
            backend = Backend.from_file(str(path))
        except BaseException as e:  # the tokenizers library raises a bare Exception for a bad file
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise  # a Rust panic in the library is a BaseException; anything else is not ours
            raise ModelLoadError(path, f"cannot read tokenizer ({str(e).splitlines()[0][:300]})") from e
        vocab = backend.get_vocab(with_added_tokens=True)
        top = max(vocab.values(), default=-1)
        if top >= config.vocab_size:
            raise ModelLoadError(path, f"the tokenizer has token id {top} but config.json's vocab_size is "
                                       f"{config.vocab_size} (embedding rows)")
        specials = _check_tokenizer_config(model_dir, vocab)
        _check_config_ids(model_dir / "config.json", config)
        template, field = _hf_template(model_dir)
        if template:
            check_chat_template(field, "chat_template", template, specials)
    layers: set[int] = set()
    for weights in sorted(model_dir.glob("*.safetensors")):
        names = check_safetensors_header(weights)
        layers |= {int(m.group(1)) for name in names if (m := _HF_LAYER.search(name))}
    beyond = sorted(i for i in layers if i >= config.num_layers)
    if beyond:
        raise ModelLoadError(model_dir / "config.json", f"num_hidden_layers is {config.num_layers} but the "
                                                        f"safetensors files hold layer {beyond[0]}")


def _check_bpe_model(path: Path, model: Any) -> None:
    """A BPE model's vocabulary (unique non-negative ids) and merges (each side and their join a
    token of the vocabulary): the tokenizers library panics on a merge whose join is missing."""
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" or "merges" not in model:
        return
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in vocab.values()):
        raise ModelLoadError(path, "model.vocab must map tokens to non-negative integer ids")
    if len(set(vocab.values())) != len(vocab):
        raise ModelLoadError(path, "model.vocab gives two tokens the same id")
    if not isinstance(merges, list):
        raise ModelLoadError(path, "model.merges must be a list")
    prefix = model.get("continuing_subword_prefix") or ""
    for index, merge in enumerate(merges):
        parts = merge.split(" ", 1) if isinstance(merge, str) else merge
        if not (isinstance(parts, list) and len(parts) == 2 and all(isinstance(p, str) for p in parts)):
            raise ModelLoadError(path, f"model.merges[{index}] is {_shown(merge)}, not a pair of tokens")
        left, right = parts
        joined = left + (right[len(prefix):] if prefix and right.startswith(prefix) else right)
        missing = next((t for t in (left, right, joined) if t not in vocab), None)
        if missing is not None:
            raise ModelLoadError(path, f"model.merges[{index}] ({_shown(merge)}) needs the token {_shown(missing)}, "
                                       "which is not in model.vocab")


def _check_tokenizer_config(model_dir: Path, vocab: Mapping[str, int]) -> dict[str, str | None]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    raw = _json_object(path)
    specials: dict[str, str | None] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        token = value.get("content") if isinstance(value, dict) else value
        if token is not None and not isinstance(token, str):
            raise ModelLoadError(path, f"{key} must be a string, got {_shown(value)}")
        if token is not None and token not in vocab:
            raise ModelLoadError(path, f"{key} {_shown(token)} is not in the tokenizer's vocabulary")
        specials[key] = token
    template = raw.get("chat_template")
    if template is not None and not isinstance(template, str) and not (
            isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                               for t in template)):
        raise ModelLoadError(path, "chat_template must be a string or a list of {name, template} entries")
    return specials


def _check_config_ids(path: Path, config: ModelConfig) -> None:
    ids = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "pad_token_id": config.pad_token_id}
    ids.update({f"eos_token_id[{i + 1}]": v for i, v in enumerate(config.extra_eos_token_ids)})
    for key, value in ids.items():
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < config.vocab_size:
            raise ModelLoadError(path, f"{key} is {_shown(value)}, outside the vocabulary "
                                       f"(vocab_size {config.vocab_size})")


def _hf_template(model_dir: Path) -> tuple[str | None, Path]:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(), jinja
        except UnicodeDecodeError as e:
            raise ModelLoadError(jinja, f"not UTF-8 text ({e})") from e
    path = model_dir / "tokenizer_config.json"
    template = _json_object(path).get("chat_template") if path.is_file() else None
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, path


def check_safetensors_header(path: Path) -> list[str]:
    """The header of a safetensors file: its length within the file, a JSON object whose
    every tensor has a known dtype, a shape of non-negative integers, and a byte range inside
    the data that holds exactly that shape. Returns the tensor names."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(path, f"truncated safetensors file ({size} bytes, no header)")
        length, = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ModelLoadError(path, f"safetensors header claims {length} bytes but the file has {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelLoadError(path, "safetensors header is not a JSON object")
    data_size = size - 8 - length
    names = [name for name in header if name != "__metadata__"]
    for name in names:
        _check_tensor_entry(path, name, header[name], data_size)
    return names


def _check_tensor_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    if not isinstance(entry, dict):
        raise ModelLoadError(path, f"safetensors tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEM_BYTES:
        raise ModelLoadError(path, f"safetensors tensor {name!r}: unknown dtype {_shown(dtype)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ModelLoadError(path, f"safetensors tensor {name!r}: shape {_shown(shape)} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size):
        raise ModelLoadError(path, f"safetensors tensor {name!r}: data_offsets {_shown(offsets)} are not a "
                                   f"byte range inside the {data_size} data bytes")
    need = math.prod(shape) * SAFETENSORS_ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise ModelLoadError(path, f"safetensors tensor {name!r}: shape {shape} of {dtype} needs {need} bytes, "
                                   f"data_offsets give {offsets[1] - offsets[0]}")


def _json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "not a JSON object")
    return raw
