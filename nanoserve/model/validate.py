"""What a model file says about itself, checked before anything is built from it.

A GGUF file or a Hugging Face directory is input from strangers: its metadata, vocabulary,
special token ids, chat template and tensor table can each be wrong or hostile, and can
disagree with one another. Each check here raises ModelLoadError naming the file and the
field at fault, so a bad file is refused in one line at load instead of failing later inside
the tokenizer library, the model code or a chat request.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanoserve.model.config import ModelConfig
from nanoserve.model.errors import ModelLoadError
from nanoserve.model.tokenizer import ChatTemplate, _bytes_to_unicode

if TYPE_CHECKING:
    from nanoserve.model.gguf_loader import GGUFCheckpoint

# Sanity ceilings: no real model comes near them, and a value past one is a broken or hostile
# header (a context length of 2^40 would size the rotary tables beyond any memory).
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # hidden size, feed-forward size, head count, head size
MAX_CONTEXT = 1 << 24
MAX_VOCAB = 1 << 24
# llama.cpp's token types: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
TOKEN_TYPES = range(0, 7)
# The conversation a chat template is rendered on once at load: one user turn, then the
# assistant's prompt, which every chat template must take.
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"},)
# A safetensors header is JSON of at most this many bytes (the format's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100_000_000
SAFETENSORS_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                          "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

_INT, _FLOAT, _STR, _BOOL = "an integer", "a number", "a string", "a boolean"
# GGUF metadata keys under "{architecture}." and the kind of value each must hold, with the
# range an integer or number must fall in (inclusive; None: no bound that side).
_ARCH_KEYS: dict[str, tuple[str, float | None, float | None]] = {
    "block_count": (_INT, 1, MAX_LAYERS),
    "context_length": (_INT, 1, MAX_CONTEXT),
    "embedding_length": (_INT, 1, MAX_WIDTH),
    "feed_forward_length": (_INT, 1, MAX_WIDTH),
    "attention.head_count": (_INT, 1, MAX_WIDTH),
    "attention.head_count_kv": (_INT, 1, MAX_WIDTH),
    "attention.key_length": (_INT, 2, MAX_WIDTH),
    "attention.value_length": (_INT, 2, MAX_WIDTH),
    "rope.dimension_count": (_INT, 2, MAX_WIDTH),
    "vocab_size": (_INT, 1, MAX_VOCAB),
    "attention.sliding_window": (_INT, 1, MAX_CONTEXT),
    "rope.freq_base": (_FLOAT, 0.0, None),
    "rope.freq_base_swa": (_FLOAT, 0.0, None),
    "rope.scaling.factor": (_FLOAT, 0.0, None),
    "attention.layer_norm_rms_epsilon": (_FLOAT, 0.0, 1.0),
    "attention.scale": (_FLOAT, 0.0, None),
    "final_logit_softcapping": (_FLOAT, 0.0, None),
    "rope.scaling.type": (_STR, None, None),
}
_GLOBAL_KEYS: dict[str, tuple[str, float | None, float | None]] = {
    "general.architecture": (_STR, None, None),
    "tokenizer.ggml.model": (_STR, None, None),
    "tokenizer.ggml.pre": (_STR, None, None),
    "tokenizer.chat_template": (_STR, None, None),
    "tokenizer.ggml.add_bos_token": (_BOOL, None, None),
    "tokenizer.ggml.add_eos_token": (_BOOL, None, None),
    "tokenizer.ggml.add_space_prefix": (_BOOL, None, None),
}
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
    "sliding_window": ((_INT,), 1, MAX_CONTEXT),
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
}
# Settings that may be absent (a default applies) but not null.
_HF_NOT_NULL = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_local_base_freq",
                "query_pre_attn_scalar", "sliding_window_pattern")
# Numbers inside rope_scaling / rope_parameters.
_ROPE_NUMBERS = ("factor", "rope_theta", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "beta_fast", "beta_slow")
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Keys whose value is a token id: each must name a token of the vocabulary.
_TOKEN_ID_KEY = re.compile(r"^tokenizer\.ggml\.\w+_token_id$")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def check_gguf(path: Path, metadata: Mapping[str, Any], tensors: Sequence[Any]) -> None:
    """Refuse a GGUF file whose metadata has values of the wrong type or out of range, whose
    vocabulary disagrees with its token types, scores, merges or special token ids, or whose
    chat template fails (or reaches past the sandbox) on a probe conversation."""
    arch = metadata.get("general.architecture")
    for key, rule in _GLOBAL_KEYS.items():
        _check_value(path, key, metadata.get(key), rule)
    if isinstance(arch, str):
        for key, rule in _ARCH_KEYS.items():
            _check_value(path, f"{arch}.{key}", metadata.get(f"{arch}.{key}"), rule)
        _check_heads(path, metadata, arch)
    tokens = _check_vocabulary(path, metadata)
    template = metadata.get("tokenizer.chat_template")
    if template:
        specials = {name: _token_at(metadata, tokens, f"tokenizer.ggml.{key}_token_id")
                    for name, key in (("bos_token", "bos"), ("eos_token", "eos"))}
        check_chat_template(path, "tokenizer.chat_template", template, specials)


def checked_gguf_config(ckpt: GGUFCheckpoint) -> ModelConfig:
    """The ModelConfig of an opened GGUFCheckpoint, once its file passes check_gguf."""
    check_gguf(ckpt.path, ckpt.metadata, ckpt.reader.tensors)
    config = ckpt.config()  # names a missing key; the tensors are checked against what is there
    check_gguf_tensors(ckpt.path, ckpt.metadata, ckpt.reader.tensors, config)
    return config


def check_gguf_tensors(path: Path, metadata: Mapping[str, Any], tensors: Sequence[Any], config: ModelConfig) -> None:
    """Refuse a GGUF file whose layer tensors disagree with its block count, whose tensors'
    shapes disagree with the config its metadata gives, whose vocabulary disagrees with its
    embedding and output rows, or whose merges name tokens it does not have. `tensors` are
    GGUFReader's."""
    arch = metadata.get("general.architecture")
    _check_layers(path, metadata, tensors, arch)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(path, "missing metadata key 'tokenizer.ggml.tokens' (the vocabulary)")
    _check_rows(path, metadata, tensors, arch, len(tokens))
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        _check_merges(path, metadata.get("tokenizer.ggml.merges", []), tokens)
    expected = _gguf_shapes(config)
    for t in tensors:
        m = _LAYER.match(t.name)
        kind = t.name[m.end():] if m else t.name
        shape = tuple(int(d) for d in reversed(t.shape))
        if kind in expected and shape != expected[kind]:
            raise ModelLoadError(path, f"tensor {t.name} has shape {list(shape)} but the metadata makes it "
                                       f"{list(expected[kind])}")


def _gguf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape (outermost first) by GGUF name, within a layer or global."""
    hidden, q, kv, ffn = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    rows = {"attn_q": q, "attn_k": kv, "attn_v": kv, "ffn_gate": ffn, "ffn_up": ffn}
    shapes: dict[str, tuple[int, ...]] = {f"{name}.weight": (n, hidden) for name, n in rows.items()}
    shapes.update({f"{name}.bias": (n,) for name, n in rows.items()})
    shapes.update({"attn_output.weight": (hidden, q), "attn_output.bias": (hidden,), "ffn_down.weight": (hidden, ffn),
                   "attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,),
                   "token_embd.weight": (config.vocab_size, hidden), "output.weight": (config.vocab_size, hidden)})
    for norm in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "output_norm"):
        shapes[f"{norm}.weight"] = (hidden,)
    return shapes


def check_chat_template(path: Path | str, field: str, source: str, specials: Mapping[str, str | None]) -> None:
    """Parse the template and render it once on PROBE_CONVERSATION in the sandbox; a template
    that does not parse, raises, or touches what the sandbox forbids is refused, with why."""
    try:
        ChatTemplate(source).render(list(PROBE_CONVERSATION), add_generation_prompt=True,
                                    **{k: v for k, v in specials.items() if v is not None})
    except Exception as e:  # jinja's errors, and whatever Python raises inside the template
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        raise ModelLoadError(path, f"{field}: the chat template fails on a plain user message ({reason})") from e


def _check_value(path: Path, key: str, value: Any, rule: tuple[str, float | None, float | None]) -> None:
    if value is None:
        return
    kind, low, high = rule
    ok = {_INT: isinstance(value, int) and not isinstance(value, bool),
          _FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
          _STR: isinstance(value, str), _BOOL: isinstance(value, bool)}[kind]
    if not ok:
        raise ModelLoadError(path, f"metadata {key} must be {kind}, got {_shown(value)}")
    if kind == _FLOAT and not math.isfinite(value):
        raise ModelLoadError(path, f"metadata {key} must be finite, got {value}")
    if kind == _FLOAT and low is not None and value <= low:
        raise ModelLoadError(path, f"metadata {key} must be above {low}, got {value}")
    if kind == _FLOAT and high is not None and value >= high:
        raise ModelLoadError(path, f"metadata {key} must be below {high}, got {value}")
    if kind == _INT and not (low is None or value >= low) or kind == _INT and not (high is None or value <= high):
        raise ModelLoadError(path, f"metadata {key} must be in [{low}, {high}], got {value}")


def _check_heads(path: Path, metadata: Mapping[str, Any], arch: str) -> None:
    heads = metadata.get(f"{arch}.attention.head_count")
    kv = metadata.get(f"{arch}.attention.head_count_kv")
    hidden = metadata.get(f"{arch}.embedding_length")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelLoadError(path, f"metadata {arch}.attention.head_count ({heads}) is not a multiple of "
                                   f"{arch}.attention.head_count_kv ({kv})")
    if isinstance(heads, int) and isinstance(hidden, int) and heads > hidden:
        raise ModelLoadError(path, f"metadata {arch}.attention.head_count ({heads}) exceeds "
                                   f"{arch}.embedding_length ({hidden})")


def _check_layers(path: Path, metadata: Mapping[str, Any], tensors: Sequence[Any], arch: str) -> None:
    """Every layer index the tensors name is below block_count, and every layer has tensors."""
    count = metadata.get(f"{arch}.block_count")
    if not isinstance(count, int):
        return
    layers = {int(m.group(1)) for t in tensors if (m := _LAYER.match(t.name))}
    beyond = sorted(i for i in layers if i >= count)
    if beyond:
        raise ModelLoadError(path, f"metadata {arch}.block_count is {count} but the file has tensors for "
                                   f"layer {beyond[0]}")
    missing = sorted(set(range(count)) - layers)
    if missing:
        raise ModelLoadError(path, f"metadata {arch}.block_count is {count} but the file has no tensors for "
                                   f"layer {missing[0]}")


def _check_vocabulary(path: Path, metadata: Mapping[str, Any]) -> list[str] | None:
    """The token list, checked with its types, scores and special ids; None when absent."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ModelLoadError(path, "tokenizer.ggml.tokens must be a non-empty list of non-empty strings")
    if len(tokens) > MAX_VOCAB:
        raise ModelLoadError(path, f"tokenizer.ggml.tokens has {len(tokens)} tokens (at most {MAX_VOCAB})")
    for key, kind in (("tokenizer.ggml.token_type", int), ("tokenizer.ggml.scores", (int, float))):
        values = metadata.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise ModelLoadError(path, f"{key} must be a list of numbers, got {_shown(values)}")
        if len(values) != len(tokens):
            raise ModelLoadError(path, f"{key} has {len(values)} entries for {len(tokens)} tokens "
                                       "(tokenizer.ggml.tokens)")
    bad = next((v for v in metadata.get("tokenizer.ggml.token_type", []) if v not in TOKEN_TYPES), None)
    if bad is not None:
        raise ModelLoadError(path, f"tokenizer.ggml.token_type holds {bad}, not a token type (0-6)")
    for key, value in metadata.items():
        if _TOKEN_ID_KEY.match(key):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tokens):
                raise ModelLoadError(path, f"{key} is {_shown(value)}, outside the vocabulary "
                                           f"(tokenizer.ggml.tokens has {len(tokens)} tokens)")
    return tokens


def _check_rows(path: Path, metadata: Mapping[str, Any], tensors: Sequence[Any], arch: Any, count: int) -> None:
    """The vocabulary, the declared vocab_size, and the embedding and output rows agree: a
    GGUF converter pads the vocabulary to the rows, so a difference is a broken file."""
    declared = metadata.get(f"{arch}.vocab_size")
    if isinstance(declared, int) and declared != count:
        raise ModelLoadError(path, f"metadata {arch}.vocab_size is {declared} but tokenizer.ggml.tokens has "
                                   f"{count} tokens")
    for t in tensors:
        if t.name in ("token_embd.weight", "output.weight") and len(t.shape) == 2 and int(t.shape[1]) != count:
            raise ModelLoadError(path, f"tokenizer.ggml.tokens has {count} tokens but tensor {t.name} has "
                                       f"{int(t.shape[1])} rows")


def _check_merges(path: Path, merges: Any, tokens: list[str]) -> None:
    """Byte-level BPE merges: "left right", each side and their join a token of the vocabulary
    (spelled in the byte alphabet, as the tokenizer respells plain UTF-8 tokens)."""
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelLoadError(path, "tokenizer.ggml.merges must be a list of strings")
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens}
    for index, merge in enumerate(merges):
        parts = merge.split(" ", 1)
        if len(parts) != 2 or not all(parts):
            raise ModelLoadError(path, f"tokenizer.ggml.merges[{index}] is {_shown(merge)}, not 'left right'")
        missing = next((p for p in (*parts, "".join(parts)) if p not in vocab), None)
        if missing is not None:
            raise ModelLoadError(path, f"tokenizer.ggml.merges[{index}] ({_shown(merge)}) needs the token "
                                       f"{_shown(missing)}, which is not in tokenizer.ggml.tokens")


def _token_at(metadata: Mapping[str, Any], tokens: list[str] | None, key: str) -> str | None:
    token_id = metadata.get(key)
    return None if tokens is None or token_id is None else tokens[token_id]


# -- Hugging Face directories ------------------------------------------------------------------

def checked_hf_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory, once its files pass check_hf_dir."""
    from nanoserve.model.hf_loader import read_hf_config

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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
