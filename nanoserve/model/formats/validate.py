"""What a model file says about itself, checked before anything is built from it.

A GGUF file or a Hugging Face directory is input from strangers: its metadata, vocabulary,
special token ids, chat template and tensor table can each be wrong or hostile, and can
disagree with one another. Each check here raises ModelLoadError naming the file and the
field at fault, so a bad file is refused in one line at load instead of failing later inside
the tokenizer library, the model code or a chat request. Here: a GGUF's checks, the chat
template's probe and the ceilings both kinds share; a Hugging Face directory's own checks are
validate_hf.py's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanoserve.model.formats.errors import ModelLoadError
from nanoserve.model.formats.tokenizer import ChatTemplate, _bytes_to_unicode
from nanoserve.model.network.config import ModelConfig

if TYPE_CHECKING:
    from nanoserve.model.formats.gguf_loader import GGUFCheckpoint

# Sanity ceilings: no real model comes near them, and a value past one is a broken or hostile
# header (a context length of 2^40 would size the rotary tables beyond any memory).
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # hidden size, feed-forward size, head count, head size
MAX_CONTEXT = 1 << 24
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 12
# llama.cpp's token types: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
TOKEN_TYPES = range(0, 7)
# The conversation a chat template is rendered on once at load: one user turn, then the
# assistant's prompt, which every chat template must take.
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"},)

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
    "expert_count": (_INT, 0, MAX_EXPERTS),
    "expert_used_count": (_INT, 0, MAX_EXPERTS),
    "expert_feed_forward_length": (_INT, 1, MAX_WIDTH),
    "expert_shared_feed_forward_length": (_INT, 0, MAX_WIDTH),
    "expert_weights_norm": (_BOOL, None, None),
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
    """Each tensor's shape (outermost first) by GGUF name, within a layer or global; the expert
    tensors' against the expert count and width the metadata gives."""
    hidden, q, kv, ffn = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    rows = {"attn_q": q, "attn_k": kv, "attn_v": kv, "ffn_gate": ffn, "ffn_up": ffn}
    shapes: dict[str, tuple[int, ...]] = {f"{name}.weight": (n, hidden) for name, n in rows.items()}
    shapes.update({f"{name}.bias": (n,) for name, n in rows.items()})
    shapes.update({"attn_output.weight": (hidden, q), "attn_output.bias": (hidden,), "ffn_down.weight": (hidden, ffn),
                   "attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,),
                   "token_embd.weight": (config.vocab_size, hidden), "output.weight": (config.vocab_size, hidden)})
    for norm in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "output_norm"):
        shapes[f"{norm}.weight"] = (hidden,)
    if config.num_experts:
        experts, width, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
        shapes.update({"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_exps.weight": (experts, width, hidden),
                       "ffn_up_exps.weight": (experts, width, hidden), "ffn_down_exps.weight": (experts, hidden, width),
                       "ffn_gate_up_exps.weight": (experts, 2 * width, hidden),
                       "ffn_gate_shexp.weight": (shared, hidden), "ffn_up_shexp.weight": (shared, hidden),
                       "ffn_down_shexp.weight": (hidden, shared), "ffn_gate_inp_shexp.weight": (hidden,)})
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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
