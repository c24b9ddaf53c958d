"""The Ray Data processor: rows through a pool of two raylm engines give LLM.generate's tokens, and a row that
cannot run gets its error while the others are answered."""

import json
import time

import pytest
import ray

from batch import BatchConfig, build_processor
from batch.orphans import PREFIX, SWEEP_INTERVAL_S
from engine.config import EngineConfig
from engine.llm import LLM
from scheduler import SamplingParams

MAX_TOKENS = 8


def _row(i: int) -> dict:
    if i % 2:
        return {"id": i, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}
    return {"id": i, "prompt": f"The number {i} is"}


@pytest.fixture(scope="module")
def model(servable_tiny_model):
    return servable_tiny_model()


@pytest.fixture(scope="module")
def expected(ray_session, model):
    """LLM.generate's greedy tokens for each row's prompt (its chat template applied for messages)."""
    llm = LLM(model=model)
    try:
        prompts = [
            llm.apply_chat_template(r["messages"]) if "messages" in r else r["prompt"] for r in map(_row, range(24))
        ]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    return {i: o.outputs[0] for i, o in enumerate(outs)}


BAD_ROWS = {
    100: ({"prompt": "word " * 300}, "prompt", "max_model_len=256"),
    101: ({"prompt": "hi", "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature", "temprature"),
    102: ({"prompt": "hi", "sampling_params": {"temperature": -1.0}}, "temperature", "temperature=-1.0"),
    103: ({"prompt": "hi", "sampling_params": {"max_tokens": 600}}, "max_tokens", "max_tokens=600"),
    104: ({}, "prompt", "needs messages, a prompt or prompt_token_ids"),
    # constraints as JSON text (what keeps rows of any constraint's shape in one Arrow column)
    105: (
        {"prompt": "hi", "sampling_params": {"structured_outputs": '{"regex": "(("}'}},
        "structured_outputs.regex",
        "compile",
    ),
    106: (
        {"prompt": "hi", "sampling_params": {"structured_outputs": "{not json"}},
        "sampling_params.structured_outputs",
        "JSON",
    ),
    107: (
        {"prompt": "hi", "sampling_params": {"structured_outputs": '{"regexp": "a"}'}},
        "sampling_params.structured_outputs",
        "one of",
    ),
}


def test_greedy_rows_through_two_engines_match_llm_generate_token_for_token(ray_session, model, expected):
    """Bad rows among them get their error, naming the field, and the good ones are answered all the same."""
    config = BatchConfig(engine=EngineConfig(model=model), concurrency=2, batch_size=4, batches_in_flight=2)
    rows = [_row(i) | {"sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}} for i in range(24)]
    rows[5:5] = [{"id": i} | row for i, (row, _, _) in BAD_ROWS.items()]
    out = build_processor(config)(ray.data.from_items(rows)).take_all()
    assert sorted(r["id"] for r in out) == [*range(24), *BAD_ROWS]
    for r in out:
        if r["id"] in BAD_ROWS:
            _, param, named = BAD_ROWS[r["id"]]
            assert r["error_param"] == param and named in r["error"], r
            assert r["generated_text"] is None
            continue
        want = expected[r["id"]]
        assert r["error"] is None, r["error"]
        assert r["generated_token_ids"] == want.token_ids, r["id"]
        assert r["generated_text"] == want.text
        assert r["finish_reason"] == want.finish_reason
        assert r["num_generated_tokens"] == len(want.token_ids)
        assert r["num_input_tokens"] == len(r["prompt_token_ids"]) > 0
        assert r["total_s"] >= r["first_token_s"] > 0
        assert ("messages" in r and r["messages"] is not None) == bool(r["id"] % 2)  # input columns kept


def test_a_rows_structured_outputs_holds_its_output(ray_session, model):
    """A choice and a JSON schema, each the row's own: a random model samples inside them."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constraints = [{"choice": ["yes", "no"]}] * 4 + [{"json": schema}]
    rows = [
        {"id": i, "prompt": f"Answer {i}:", "sampling_params": {"temperature": 1.0, "seed": i, "max_tokens": 32}}
        for i in range(5)
    ]
    for row, constraint in zip(rows, constraints):
        row["sampling_params"]["structured_outputs"] = json.dumps(constraint)
    config = BatchConfig(engine=EngineConfig(model=model), batch_size=2)
    out = {r["id"]: r for r in build_processor(config)(ray.data.from_items(rows)).take_all()}
    assert all(r["error"] is None for r in out.values()), out
    assert {out[i]["generated_text"] for i in range(4)} <= {"yes", "no"}
    assert all(out[i]["finish_reason"] == "stop" for i in range(4))
    assert out[4]["generated_text"].lstrip().startswith("{")
    if out[4]["finish_reason"] == "stop":
        assert isinstance(json.loads(out[4]["generated_text"])["a"], int)


def _engine_groups() -> list[str]:
    groups = ray.util.placement_group_table().values()
    return [g["name"] for g in groups if g["state"] != "REMOVED" and g["name"].startswith(PREFIX)]


def _settle(cpus: float) -> tuple[list[str], float]:
    """The engine groups left and the CPUs free once no group is left and ``cpus`` are free, or after a while."""
    deadline = time.monotonic() + 10 * SWEEP_INTERVAL_S
    while (_engine_groups() or ray.available_resources().get("CPU", 0) < cpus) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _engine_groups(), ray.available_resources().get("CPU", 0)


def test_the_engines_placement_groups_go_with_the_pool(ray_session, model):
    """Ray ties a placement group to its creator's job, not to the engine actor that made it: without
    batch.orphans, the pool's groups would hold their CPUs after the dataset is done, for the session's life."""
    cpus = ray.cluster_resources()["CPU"]
    assert _settle(cpus) == ([], cpus)  # the earlier test's pool let go as well
    config = BatchConfig(engine=EngineConfig(model=model), concurrency=2, batch_size=2, batches_in_flight=1)
    rows = [{"id": i, "prompt": f"The number {i} is", "sampling_params": {"max_tokens": 2}} for i in range(4)]
    assert len(build_processor(config)(ray.data.from_items(rows)).take_all()) == 4
    assert _settle(cpus) == ([], cpus)
