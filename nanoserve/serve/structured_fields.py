"""A request's structured-output fields (response_format, guided_*) -> StructuredOutputs, its
grammar compiled off the event loop and the engine loop, under a time limit; a 400 naming the
field when it cannot be."""

from __future__ import annotations

import asyncio
import json

from nanoserve.serve.errors import ApiError
from nanoserve.serve.protocol import _SamplingFields
from nanoserve.serve.serving import COMPILE_TIMEOUT
from nanoserve.structured import StructuredOutputError, StructuredOutputs
from nanoserve.structured.params import KINDS

GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested_structure(body: _SamplingFields) -> tuple[StructuredOutputs, str] | None:
    """The request's constraint and the field it came from, or None. More than one is a 400."""
    given = [name for name in GUIDED if getattr(body, name) is not None]
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise ApiError(400, f"{given[1]}: only one structured-output field may be given, got "
                            f"{' and '.join(given)}", param=given[1], code="invalid_value")
    if not given:
        return None
    field = given[0]
    try:
        return _spec(body, field), _param(body, field)
    except ValueError as exc:
        raise ApiError(400, f"{_param(body, field)}: {str(exc).split(': ', 1)[-1]}", param=_param(body, field),
                       code="invalid_value") from exc


def _param(body: _SamplingFields, field: str) -> str:
    if field != "response_format":
        return field
    return "response_format.json_schema.schema" if body.response_format.type == "json_schema" else field


def _spec(body: _SamplingFields, field: str) -> StructuredOutputs:
    if field == "response_format":
        fmt = body.response_format
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("a json_schema response_format needs json_schema.schema")
        return StructuredOutputs(json=fmt.json_schema.schema_)
    if field == "structured_outputs":
        fields = body.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        if "json" in fields:
            fields["json"] = _schema(fields["json"])
        return StructuredOutputs(**{k: v for k, v in fields.items() if k in KINDS})
    if field == "guided_json":
        return StructuredOutputs(json=_schema(body.guided_json))
    if field == "guided_regex":
        return StructuredOutputs(regex=body.guided_regex)
    if field == "guided_choice":
        return StructuredOutputs(choice=body.guided_choice)
    return StructuredOutputs(grammar=body.guided_grammar)


def _schema(schema: dict | str) -> dict:
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from exc
    return schema


async def structure_for(state, body: _SamplingFields) -> StructuredOutputs | None:
    """The request's constraint, compiled and cached (None without one); a 400 naming the field."""
    requested = requested_structure(body)
    if requested is None:
        return None
    spec, param = requested
    await compile_structure(state.engine_loop.engine, spec, param, state.compile_timeout)
    return spec


async def compile_structure(engine, spec: StructuredOutputs, param: str, timeout: float = COMPILE_TIMEOUT) -> None:
    """Compile `spec` for `engine`'s vocabulary in a worker thread (the engine's compiler caches
    it, so admitting the request costs the engine loop a copy). A grammar that is invalid, too
    complex for the parser's limits or slower than `timeout` to compile is a 400 naming `param`."""
    compiler = engine.structured.compiler
    if compiler is None:
        raise ApiError(400, f"{param}: structured output needs the model's tokenizer; this server's has none",
                       param=param, code="invalid_value")
    try:
        await asyncio.wait_for(asyncio.to_thread(compiler.compile, spec), timeout)
    except StructuredOutputError as exc:
        raise ApiError(400, f"{param}: {str(exc).split(': ', 1)[-1]}", param=param, code="invalid_value") from exc
    except asyncio.TimeoutError as exc:  # builtin TimeoutError from 3.11 on
        raise ApiError(400, f"{param}: the grammar did not compile within {timeout:g} s; simplify it",
                       param=param, code="invalid_value") from exc
