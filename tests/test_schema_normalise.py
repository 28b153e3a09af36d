"""JSON schemas llguidance refuses only for their form are normalised before it sees them
(structured/compiler.py normalise_schema): the boolean schema true, counts written as integral
floats (2.0), formats it does not know (annotations in JSON Schema 2020-12). Data keywords
(enum, const, default) are left as written, and a schema that is really wrong is still refused."""

from __future__ import annotations

import pytest

llguidance = pytest.importorskip("llguidance")

from nanoserve.structured import StructuredOutputs  # noqa: E402
from nanoserve.structured.compiler import grammar_text, normalise_schema  # noqa: E402


def accepted(schema) -> bool:
    return llguidance.LLMatcher.validate_grammar(grammar_text(StructuredOutputs(json=schema))) == ""


@pytest.mark.parametrize("schema", [
    True,
    {"type": "object", "properties": {"a": True}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1.0, "maxItems": 2.0},
    {"type": "string", "minLength": 0.0, "maxLength": 3.0},
    {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"], "maxProperties": 1.0},
    {"type": "string", "format": "uri-reference"},
    {"type": "object", "properties": {"link": {"type": "string", "format": "iri"}},
     "$defs": {"p": {"type": "string", "format": "json-pointer"}}},
])
def test_schemas_refused_only_for_their_form_are_accepted(schema):
    assert accepted(schema)


def test_what_normalising_changes_and_what_it_keeps():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "maxItems": 2.0, "items": True},
        "when": {"type": "string", "format": "date-time"},  # known: kept, still enforced
        "ref": {"type": "string", "format": "uri-template"},  # unknown: dropped
        "format": {"type": "string"},  # a property named like a keyword is a property
        "enum": {"enum": [2.0, {"maxItems": 2.0}], "default": {"format": "x"}}}}
    assert normalise_schema(schema) == {"type": "object", "properties": {
        "tags": {"type": "array", "maxItems": 2, "items": {}},
        "when": {"type": "string", "format": "date-time"},
        "ref": {"type": "string"},
        "format": {"type": "string"},
        "enum": {"enum": [2.0, {"maxItems": 2.0}], "default": {"format": "x"}}}}
    assert normalise_schema(False) is False


@pytest.mark.parametrize("schema", [
    {"type": "array", "maxItems": 2.5},  # not an integer at all
    {"type": "string", "minLength": -1},
    {"type": "nonsense"},
])
def test_schemas_that_are_wrong_are_still_refused(schema):
    assert not accepted(schema)
