"""Constraints compiled to llguidance grammars: what every entry point checks a request's ``structured_outputs``
with before scheduling. No torch here: the API server and the CLI import it, and the per-step bitmasks that need
torch live on the sampling rank (workers/structured_output.py).

Why llguidance (measured on SmolLM2's 49152-token vocabulary, a nested JSON schema with an array
of enums and a pattern, 54 tokens; see the issue 12 note): about 10 us per token mask (xgrammar
about 2.4 us, outlines-core has no grammars), one abi3 wheel with no dependencies (xgrammar needs
torch, triton, transformers and tvm-ffi), and it compiles JSON schemas, regexes, choices, Lark and
GBNF, so vLLM's ``structured_outputs`` fields all map onto it.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from scheduler.sampling_params import StructuredOutputsParams

# JSON Schema keywords (draft 7 and 2020-12) whose value is a schema or a list of schemas, and those whose value maps
# names to schemas: the only places a schema nests, so a property *named* "properties" is never taken for one.
SUBSCHEMAS = frozenset(
    ("additionalProperties", "items", "additionalItems", "prefixItems", "contains", "not", "if", "then", "else")
    + ("propertyNames", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf")
)
SUBSCHEMA_MAPS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
)


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that lists ``properties`` and says nothing of
    ``additionalProperties`` (or ``unevaluatedProperties``) admits no other property, as vLLM's default backend
    compiles schemas. Libraries send pydantic's schemas as they are, without ``additionalProperties``; read
    literally, those let a model add properties until ``max_tokens``. Anything else is returned unchanged."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: close_objects(s) for name, s in value.items()}
        elif key in SUBSCHEMAS:
            value = close_objects(value)
        out[key] = value
    if "properties" in schema and not {"additionalProperties", "unevaluatedProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out


def closed_schema(schema: dict | str | None, close: bool) -> dict | str | None:
    """``schema`` (a JSON schema, or its text) with its objects closed (``close_objects``) when ``close``; text that
    is not JSON is left for the engine's check to name."""
    if not close or schema is None:
        return schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return schema
    return close_objects(schema)


def compile_grammar(c: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint, or ValueError naming the field and what is wrong with it.

    Every entry point calls this before scheduling, so a worker never meets a grammar that fails to build.
    """
    if c.json_object:
        field, grammar = "json_object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    elif c.json is not None:
        field = "json"
        schema = c.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json: the schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json: a JSON schema is an object or a boolean, got {type(schema).__name__}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    elif c.regex is not None:
        field, grammar = "regex", llguidance.grammar_from("regex", c.regex)
    elif c.choice is not None:
        field, grammar = "choice", llguidance.grammar_from("choice", json.dumps(list(c.choice)))
    else:
        field, grammar = "grammar", llguidance.grammar_from("grammar", c.grammar)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field}: {error.strip()}")
    return grammar
