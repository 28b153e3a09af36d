"""Grammar compilation: a request's StructuredOutputs -> an llguidance grammar checked against
the model's vocabulary, then a fresh matcher per request.

One compiler per engine. It is thread-safe (a lock around its cache and the vocabulary), so a
server can compile a request's grammar in a worker thread, under a time limit, before the engine
loop sees the request; the loop then only copies the cached matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from nanoserve.structured.params import StructuredOutputError, StructuredOutputs

# JSON is emitted compact: no optional whitespace, so a model cannot pad a reply with blanks
# until max_tokens runs out, and a field's value is the next thing after its key.
JSON_OPTIONS = {"whitespace_flexible": False}
GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.M)  # `root ::= ...`: GBNF (llama.cpp), else Lark
CACHE_SIZE = 64  # compiled grammars kept (agents resend the same schema with every turn)
# Keywords whose value is a count: JSON Schema takes any number with a zero fraction (2.0),
# llguidance only an integer.
_COUNTS = frozenset(("maxItems", "minItems", "maxLength", "minLength", "maxProperties", "minProperties",
                     "maxContains", "minContains"))
# Keywords whose values are data, not schemas: left exactly as written.
_DATA = frozenset(("enum", "const", "default", "examples", "description", "title", "$comment"))


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (JSON text) for `spec`. Raises StructuredOutputError for input
    that is not even well formed (the rest is found by compile)."""
    kind = spec.kind
    if kind == "json":
        try:
            schema = json.dumps(normalise_schema(json.loads(spec.json)), ensure_ascii=False)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise StructuredOutputError("json", str(exc)) from exc
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    lark = gbnf_to_lark(spec.grammar) if GBNF_RULE.search(spec.grammar) else spec.grammar
    return llguidance.LLMatcher.grammar_from_lark(lark)


def normalise_schema(schema: Any) -> Any:
    """`schema` with what llguidance refuses only for its form written the way it takes it, so
    that a schema valid under JSON Schema 2020-12 is not refused: the boolean schema ``true`` as
    ``{}`` (anything; ``false`` stays: nothing matches it), a count written as an integral float
    (``"maxItems": 2.0``) as an integer, and a ``format`` llguidance does not know dropped (in
    2020-12 a format is an annotation unless a validator opts in: the string is unconstrained).
    Data (enum, const, default, examples) is left as written."""
    if schema is True:
        return {}
    if isinstance(schema, list):
        return [normalise_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key in _COUNTS and isinstance(value, float) and value.is_integer():
            out[key] = int(value)
        elif key == "format" and isinstance(value, str) and not _known_format(value):
            continue
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                and isinstance(value, dict):
            out[key] = {name: normalise_schema(sub) for name, sub in value.items()}
        else:
            out[key] = normalise_schema(value)
    return out


@lru_cache(maxsize=64)
def _known_format(name: str) -> bool:
    """Whether llguidance enforces this string format (asked of llguidance itself)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    return not llguidance.LLMatcher.validate_grammar(grammar)


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary; ``matcher(spec)`` is a new request's matcher.

    ``backend`` is the model's `tokenizers.Tokenizer`, ``vocab_size`` the width of the
    model's logits (the bitmask covers it), ``eos_token_ids`` the tokens that end a reply: the
    grammar allows them only where it accepts."""

    def __init__(self, backend, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._backend = backend
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (a fraction of a second)."""
        with self._lock:
            if self._vocabulary is None:
                try:
                    self._vocabulary = llguidance.LLTokenizer(self._backend.to_str(), n_vocab=self.vocab_size,
                                                              eos_token=self._eos)
                except ValueError as exc:  # e.g. a tokenizer.json without a decoder
                    raise StructuredOutputError("structured", "this model's tokenizer cannot be read by the "
                                                f"grammar engine ({exc})") from exc
            return self._vocabulary

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The matcher in its initial state for `spec`, compiled once and cached. Raises
        StructuredOutputError naming the field when the grammar is invalid or too complex."""
        with self._lock:
            if (cached := self._compiled.get(spec)) is not None:
                self._compiled.move_to_end(spec)
                return cached
        vocabulary = self.vocabulary
        matcher = llguidance.LLMatcher(vocabulary, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(spec.kind, _one_line(matcher.get_error()))
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher of its own for one request (a copy of the compiled one)."""
        template = self.compile(spec)
        with self._lock:
            return template.deep_copy()

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocabulary.decode_bytes([token_id])


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip()) or "invalid grammar"
