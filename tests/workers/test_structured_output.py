"""Constraints compiled with llguidance and the bitmasks the sampling rank fills from them."""

import copy
import dataclasses
from enum import Enum

import pytest
import torch
from pydantic import BaseModel
from transformers import AutoTokenizer

from scheduler import StructuredOutputsParams
from workers.grammars import close_objects, compile_grammar
from workers.structured_output import GrammarBitmasks


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
            "json: Invalid type",
        ),
        (StructuredOutputsParams(json="{nope"), "json: the schema is not valid JSON"),
        (StructuredOutputsParams(regex="a(b"), "regex:"),
        (StructuredOutputsParams(grammar="start: missing"), "grammar:"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it(constraint, says):
    with pytest.raises(ValueError, match=says):
        compile_grammar(constraint)


def test_each_kind_compiles():
    for c in (
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(json='{"type": "integer"}'),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(grammar='root ::= "x" | "y"'),
    ):  # GBNF as well as Lark
        assert compile_grammar(c)


def compiled(c: StructuredOutputsParams) -> StructuredOutputsParams:
    """``c`` as the engine's request check hands it on: with its grammar compiled."""
    return dataclasses.replace(c, compiled=compile_grammar(c))


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[1])


def test_masks_follow_the_consumed_tokens_and_end_at_eos(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    eos = tok.eos_token_id
    masks = GrammarBitmasks(default_model_dir, len(tok), [eos], torch.device("cpu"))
    c = StructuredOutputsParams(choice=["yes please", "no"])
    with pytest.raises(ValueError, match="uncompiled"):  # the engine's request check compiles it, once
        masks.matcher(c)
    m = masks.matcher(compiled(c))
    ids = tok.encode("yes please", add_special_tokens=False)

    def allowed() -> list[int]:
        banned = masks.fill([m], [1], 2)  # the matcher's row is 1 of 2: row 0 bans nothing
        assert not banned[0].any()
        return (~banned[1]).nonzero().flatten().tolist()

    first = allowed()
    assert ids[0] in first and eos not in first
    assert all(
        tok.decode([t]) and ("yes please".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])))
        for t in first
    )
    m.consume_tokens(ids)
    assert allowed() == [eos]  # complete: only EOS, so the scheduler stops the request
    m.consume_tokens([tok.encode("x", add_special_tokens=False)[0]])  # a token outside the grammar
    assert allowed() == [eos]  # error state: still only EOS, never a hang


class Unit(str, Enum):
    c = "c"
    f = "f"


class City(BaseModel):
    name: str
    population: int | None = None


class Trip(BaseModel):
    cities: list[City]
    unit: Unit
    note: str | None = None


def test_closed_objects_refuse_unlisted_properties_as_vllm_compiles_pydantic_schemas(default_model_dir):
    schema = Trip.model_json_schema()  # what instructor and LangChain send: no additionalProperties anywhere
    original = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == original  # a copy: the request's own schema is not changed
    assert closed["additionalProperties"] is False and closed["$defs"]["City"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["$defs"]["Unit"]  # not an object with properties
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    masks = GrammarBitmasks(default_model_dir, len(tok), [tok.eos_token_id], torch.device("cpu"))

    def accepted(s: dict, text: str) -> bool:
        ids = tok.encode(text, add_special_tokens=False)
        return masks.matcher(compiled(StructuredOutputsParams(json=s))).validate_tokens(ids) == len(ids)

    good, extra = '{"cities": [{"name": "Oslo"}], "unit": "c"}', '{"cities": [{"name": "Oslo", "x": 1}], "unit": "c"}'
    assert accepted(closed, good) and accepted(schema, good)
    assert accepted(schema, extra) and not accepted(closed, extra)


def test_closing_follows_only_subschemas_and_keeps_what_a_schema_says():
    named_properties = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}}}
    closed = close_objects(named_properties)
    assert closed["properties"]["properties"]["additionalProperties"] is False  # the property named "properties"
    assert set(closed["properties"]) == {"properties"}  # not taken for a schema and given additionalProperties
    open_one = {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(open_one) == open_one
    assert close_objects({"properties": {}, "unevaluatedProperties": True})["unevaluatedProperties"] is True
    nested = {"anyOf": [{"properties": {"a": {}}}, {"items": [{"properties": {}}]}], "not": {"properties": {}}}
    closed = close_objects(nested)
    assert closed["anyOf"][0]["additionalProperties"] is False and closed["not"]["additionalProperties"] is False
    assert closed["anyOf"][1]["items"][0]["additionalProperties"] is False
    assert close_objects({"type": "object"}) == {"type": "object"}  # json_object's schema: any object
