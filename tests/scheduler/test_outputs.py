import pickle
from dataclasses import fields

import pytest

from scheduler import RequestOutput, SampledLogprobs, pack_outputs, unpack_outputs

# A value other than the default for every field past the three a plain delta carries.
SET = {
    "finished": True,
    "finish_reason": "stop",
    "new_logprobs": [SampledLogprobs(-0.5, [7, 9], [-0.5, -1.5], 1)],
    "num_prompt_tokens": 12,
    "num_cached_tokens": 8,
    "error": "boom",
    "queued_s": 0.25,
    "prompt_logprobs": [SampledLogprobs(-2.0, [3], [-2.0], 4)],
    "embedding": [0.5, -0.5],
}


def test_every_field_a_delta_can_set_has_a_case():
    assert set(SET) == {f.name for f in fields(RequestOutput)[3:]}


def test_a_delta_of_tokens_only_travels_as_three_values():
    out = RequestOutput("cmpl-1", 1, [42, 43])
    packed = pack_outputs([out])
    assert packed == [("cmpl-1", 1, [42, 43])]
    assert unpack_outputs(pickle.loads(pickle.dumps(packed))) == [out]


@pytest.mark.parametrize("name", SET)
def test_a_delta_with_any_other_field_set_comes_back_equal(name):
    out = RequestOutput("cmpl-2", 0, [5], **{name: SET[name]})
    packed = pack_outputs([RequestOutput("cmpl-3", 0, [1]), out])
    assert len(packed[1]) == len(fields(RequestOutput))
    assert unpack_outputs(pickle.loads(pickle.dumps(packed))) == [RequestOutput("cmpl-3", 0, [1]), out]
