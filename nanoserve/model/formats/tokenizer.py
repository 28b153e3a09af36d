"""Tokenizers from GGUF metadata or `tokenizer.json`, chat templates, and incremental detokenising."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from nanoserve.model.formats.errors import ModelLoadError

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
# tokenizer.ggml.model values we build: byte-level BPE, and SentencePiece's BPE with byte fallback.
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
SPACE = "\u2581"  # SentencePiece's visible space

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, digits one by one). These are the splits llama.cpp uses;
# "smollm" and friends split every digit apart before the GPT-2 regex, as their tokenizer.json does.
_PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT, False),
    "gpt-2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),
    "starcoder": (_GPT2_SPLIT, True),
    "refact": (_GPT2_SPLIT, True),
    "codeshell": (_GPT2_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split, single_digits = _PRE_TOKENIZERS.get(pre, _PRE_TOKENIZERS["default"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if single_digits else []
    steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _token_string(metadata: Mapping[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][int(token_id)]


def backend_from_gguf(metadata: Mapping[str, Any], source: str = "<gguf>") -> Backend:
    """A `tokenizers.Tokenizer` from llama.cpp's tokenizer.ggml.* metadata: byte-level BPE
    ("gpt2": Llama 3, Qwen, SmolLM) or SentencePiece BPE ("llama": Gemma, Mistral, Llama 2)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(source, f"tokenizer model {model!r} is not supported "
                                     f"(supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)})")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", ()))
    if model == "gpt2":
        backend, vocab, spelled = _byte_level_backend(metadata, tokens)
    else:  # every SentencePiece token is spelled as it is
        backend, vocab, spelled = _sentencepiece_backend(metadata, tokens, types), dict(zip(tokens, range(len(tokens)))), None
    # Control tokens (<|im_start|>...) must match whole in text, never be cut into bytes.
    backend.add_special_tokens([
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, types) if kind == TOKEN_CONTROL and (spelled is None or set(tok) <= spelled)
    ])
    backend.add_tokens([
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED and tok in vocab
    ])
    bos = _token_string(metadata, "bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", model == "llama") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return backend


def _byte_level_backend(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[Backend, dict[str, int], set[str]]:
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # Some files store a token in plain UTF-8 instead of the byte alphabet; respell those.
    vocab = {
        (tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    return backend, vocab, spelled


def _sentencepiece_backend(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    """SentencePiece BPE as llama.cpp runs it: spaces are written as U+2581 (and one is put
    before the text unless tokenizer.ggml.add_space_prefix is false, as Gemma's files say),
    adjacent pieces merge best score first, and what no piece covers falls back to <0xNN> byte
    tokens. The file keeps scores, not merges: a merge of two pieces into a third is ranked by
    the third's score."""
    scores = list(metadata.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    mergeable = {vocab[tok] for tok, kind in zip(tokens, types or [TOKEN_NORMAL] * len(tokens))
                 if kind in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    # Every (piece, cut) whose halves are pieces, ranked by the piece's score, then id, then cut;
    # sorted as arrays (Gemma's 262k pieces make half a million merges).
    ids, cuts = [], []
    for i in mergeable:
        token = tokens[i]
        for cut in range(1, len(token)):
            if token[:cut] in vocab and token[cut:] in vocab:
                ids.append(i)
                cuts.append(cut)
    piece, at = np.asarray(ids, dtype=np.int64), np.asarray(cuts, dtype=np.int64)
    order = np.lexsort((at, piece, -np.asarray(scores, dtype=np.float64)[piece]))
    merges = [(tokens[i][:cut], tokens[i][cut:]) for i, cut in zip(piece[order].tolist(), at[order].tolist())]
    unk = _token_string(metadata, "unknown_token_id")
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    if prefix:  # before the first piece of text only, never after a special token
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


# A chat template may repeat a string or list, or raise to a power, only up to this size: a
# hostile `{{ 'x' * 10**12 }}` is refused instead of taking the machine's memory.
MAX_TEMPLATE_PRODUCT = 1 << 20


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with `*` and `**` bounded (MAX_TEMPLATE_PRODUCT)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sized = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
        counts = [abs(x) for x in (left, right) if isinstance(x, int)]
        if operator == "*" and sized and sized[0] * max(counts, default=1) > MAX_TEMPLATE_PRODUCT:
            raise jinja2.exceptions.SecurityError("the template repeats a value past the sandbox's size limit")
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise jinja2.exceptions.SecurityError("the template raises to a power past the sandbox's limit")
        return super().call_binop(context, operator, left, right)


class ChatTemplate:
    """A model's jinja2 chat template, rendered the way transformers' `apply_chat_template` does."""

    def __init__(self, source: str) -> None:
        env = _TemplateSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                    **variables)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and special token ids."""

    def __init__(self, backend: Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, extra_stop_tokens: Sequence[str] = ()) -> None:
        self.backend = backend
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token,
                               "pad_token": pad_token, "unk_token": unk_token}
        self.chat_template = ChatTemplate(chat_template) if chat_template else None
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        stops = [self.eos_token_id, *(self._id(t) for t in extra_stop_tokens)]
        self.stop_token_ids = tuple(dict.fromkeys(i for i in stops if i is not None))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        eot = _token_string(metadata, "eot_token_id")
        return cls(
            backend_from_gguf(metadata, source),
            bos_token=_token_string(metadata, "bos_token_id"),
            eos_token=_token_string(metadata, "eos_token_id"),
            pad_token=_token_string(metadata, "padding_token_id"),
            unk_token=_token_string(metadata, "unknown_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_stop_tokens=[eot] if eot else [],
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> Tokenizer:
        """From `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja` when present)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer file not found")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(path, f"cannot read tokenizer ({e})") from e
        config = _hf_tokenizer_config(model_dir)
        return cls(backend, chat_template=hf_chat_template(model_dir, config),
                   **{k: _content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS where the model wants it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **variables: Any) -> str | list[int]:
        """Render `messages` with the model's template; token ids (no extra BOS) when `tokenize`."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        text = self.chat_template.render(messages, add_generation_prompt, **{**specials, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _hf_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    config_path = model_dir / "tokenizer_config.json"
    return json.loads(config_path.read_text()) if config_path.is_file() else {}


def hf_chat_template(model_dir: Path, config: Mapping[str, Any] | None = None) -> str | None:
    """A Hugging Face directory's chat template: `chat_template.jinja`, else tokenizer_config.json's
    (``config``: that file, already read)."""
    template_path = model_dir / "chat_template.jinja"
    if template_path.is_file():
        return template_path.read_text()
    template = (_hf_tokenizer_config(model_dir) if config is None else config).get("chat_template")
    if isinstance(template, list):  # named templates; take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never ending a delta inside a character.

    Byte-level tokens can hold part of a UTF-8 character; decoding such a prefix yields U+FFFD.
    Text is held back until the window decodes cleanly, then emitted. The window starts one
    step back so decoders that depend on the previous token (leading spaces) stay correct.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this are already emitted
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text ("" while a character is unfinished)."""
        self.ids.append(int(token_id))
        seen = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        if len(full) <= len(seen) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(full[len(seen):])

    def flush(self) -> str:
        """Everything still held back (an unfinished character comes out as U+FFFD)."""
        seen = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._emit(full[len(seen):])

    def _emit(self, delta: str) -> str:
        self.text += delta
        return delta
