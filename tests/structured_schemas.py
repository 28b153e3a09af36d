"""Hypothesis strategies for JSON schemas whose every instance is short: bounded numbers, short
strings, few items, shallow nesting. A reply that must match one can always finish."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = ("id", "name", "size", "kind", "tags", "ok", "score", "items")


def leaf_schemas() -> st.SearchStrategy[dict]:
    bounds = st.integers(-1000, 1000).flatmap(lambda low: st.tuples(st.just(low), st.integers(low, low + 1000)))
    return st.one_of(
        bounds.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        st.tuples(bounds, st.sampled_from([0.5, 0.25])).map(
            lambda t: {"type": "number", "minimum": t[0][0], "maximum": t[0][1], "multipleOf": t[1]}),
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "boolean"}),
        st.lists(st.text("abcxyz -", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)
        .map(lambda values: {"enum": values}),
    )


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(properties: dict, required_flags: list[bool]) -> dict:
        required = [name for name, flag in zip(properties, required_flags) if flag]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    properties = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3)
    return properties.flatmap(lambda p: st.lists(st.booleans(), min_size=len(p), max_size=len(p))
                              .map(lambda flags: build(p, flags)))


def _array(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": min(t[1], t[2]), "maxItems": max(t[1], t[2])})


def json_schemas() -> st.SearchStrategy[dict]:
    """Objects (with `required` subsets), arrays, enums, bounded numbers, nested up to 2 deep;
    the top level is always an object."""
    inner = st.one_of(leaf_schemas(), _array(leaf_schemas()), _object(leaf_schemas()))
    return _object(inner)
