"""Constraints compiled with llguidance and the bitmasks the sampling rank fills from them."""

import pytest
import torch
from transformers import AutoTokenizer

from scheduler import StructuredOutputsParams
from workers.structured_output import GrammarBitmasks, compile_grammar


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


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[1])


def test_masks_follow_the_consumed_tokens_and_end_at_eos(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    eos = tok.eos_token_id
    masks = GrammarBitmasks(default_model_dir, len(tok), [eos], torch.device("cpu"))
    m = masks.matcher(StructuredOutputsParams(choice=["yes please", "no"]))
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
