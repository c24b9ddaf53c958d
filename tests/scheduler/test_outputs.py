import pickle
from dataclasses import fields

import pytest

from scheduler import (
    CachedRequestData,
    KVPart,
    KVTransfer,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SampledLogprobs,
    SchedulerOutput,
    merge_deltas,
    pack_outputs,
    unpack_outputs,
)

PLAIN = ("request_id", "index", "new_token_ids")
OTHER_FIELDS = [f.name for f in fields(RequestOutput) if f.name not in PLAIN]

# A value other than the default for every field past the three a plain delta carries.
SET = {
    "finished": True,
    "finish_reason": "stop",
    "new_logprobs": [SampledLogprobs(logprob=-0.5, top_token_ids=[7, 9], top_logprobs=[-0.5, -1.5], rank=1)],
    "num_prompt_tokens": 12,
    "num_cached_tokens": 8,
    "error": "boom",
    "queued_s": 0.25,
    "prompt_logprobs": [SampledLogprobs(logprob=-2.0, top_token_ids=[3], top_logprobs=[-2.0], rank=4)],
    "embedding": [0.5, -0.5],
    "kv_transfer": KVTransfer(
        first_block=1, num_prompt_tokens=40, block_size=16, parts=[KVPart(head_start=0, num_heads=2, data=b"kv")]
    ),
}


def delta(request_id="cmpl", index=0, new_token_ids=(1,), **kw) -> RequestOutput:
    return RequestOutput(request_id=request_id, index=index, new_token_ids=list(new_token_ids), **kw)


def set_value(name: str):
    assert name in SET, f"RequestOutput.{name} has no test value: add one to SET"
    return SET[name]


@pytest.mark.parametrize(
    "cls", [NewRequestData, CachedRequestData, SchedulerOutput, SampledLogprobs, ModelRunnerOutput, RequestOutput]
)
def test_what_crosses_processes_is_built_by_keyword_only(cls):
    assert [f.name for f in fields(cls) if not f.kw_only] == []


def test_a_delta_of_tokens_only_travels_as_three_values():
    out = delta("cmpl-1", 1, [42, 43])
    packed = pack_outputs([out])
    assert packed == [("cmpl-1", 1, [42, 43])]
    assert unpack_outputs(pickle.loads(pickle.dumps(packed))) == [out]


@pytest.mark.parametrize("name", OTHER_FIELDS)
def test_a_delta_with_any_other_field_set_comes_back_equal(name):
    out = delta("cmpl-2", 0, [5], **{name: set_value(name)})
    packed = pack_outputs([delta("cmpl-3"), out])
    assert len(packed[1]) == len(fields(RequestOutput))
    assert unpack_outputs(pickle.loads(pickle.dumps(packed))) == [delta("cmpl-3"), out]


def test_merge_deltas_folds_each_sample_in_order():
    lp = [SampledLogprobs(logprob=-float(i), top_token_ids=[i], top_logprobs=[-float(i)]) for i in range(4)]
    deltas = [
        delta("r", 0, [1], new_logprobs=[lp[0]]),
        delta("r", 1, [7]),
        delta("r", 0, [2, 3], new_logprobs=lp[1:3]),
        delta("r", 0, [4], finished=True, finish_reason="length", new_logprobs=[lp[3]]),
    ]
    first, second = merge_deltas(deltas)
    assert (first.index, first.new_token_ids, first.finished, first.finish_reason) == (0, [1, 2, 3, 4], True, "length")
    assert first.new_logprobs == lp
    assert second == deltas[1]
    assert merge_deltas(deltas[:1]) == deltas[:1]


def test_merged_deltas_keep_the_prompt_logprobs_of_the_first():
    prompt = SET["prompt_logprobs"]
    deltas = [delta(new_token_ids=[1], prompt_logprobs=prompt), delta(new_token_ids=[2]), delta(new_token_ids=[3])]
    (merged,) = merge_deltas(deltas)
    assert merged.new_token_ids == [1, 2, 3]
    assert merged.prompt_logprobs == prompt


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("name", OTHER_FIELDS)
def test_merged_deltas_keep_every_field_whichever_delta_set_it(name, position):
    """Every field, a field added later included, survives a fold whether it rode on the first, a middle or the
    last delta."""
    deltas = [delta(new_token_ids=[i]) for i in range(3)]
    deltas[position] = delta(new_token_ids=[position], **{name: set_value(name)})
    (merged,) = merge_deltas(deltas)
    assert getattr(merged, name) == SET[name]
    assert merged.new_token_ids == [0, 1, 2]
