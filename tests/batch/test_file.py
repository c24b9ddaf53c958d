"""`raylm batch`: an OpenAI batch file through the processor, each line answered once as the server would, a bad
line's answer naming its line and field, a rerun with the same output answering only what is missing, and a crash
of an engine actor or of a rank mid-job costing no answer and doubling none."""

import json
import os
import signal
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from cli import main

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _line(custom_id, url, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(content: str, **body) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0.0} | body


LINES = [
    _line("chat-1", CHAT, _chat("Hello there")),
    _line("text-1", COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}),
    '{"custom_id": "broken", "url": ',
    _line("bad-temperature", CHAT, _chat("Hi", temperature=-2)),
    _line("bad-field", CHAT, _chat("Hi", foo=1)),
    _line("emb-1", "/v1/embeddings", {"input": "Hi"}),
    _line("too-long", COMPLETIONS, {"prompt": "word " * 300}),
    _line("chat-1", CHAT, _chat("Again")),
    _line("ids-1", COMPLETIONS, {"prompt": [1, 2, 3, 4], "max_tokens": 4, "logprobs": 2, "temperature": 0}),
    _line("chat-2", CHAT, _chat("Pick a number", n=2, logprobs=True, top_logprobs=2, temperature=1.0, seed=7)),
    _line("chat-choice", CHAT, _chat("Yes or no?", structured_outputs={"choice": ["yes", "no"]}, max_tokens=8)),
    _line("text-json", COMPLETIONS, {"prompt": "JSON:", "max_tokens": 8, "response_format": {"type": "json_object"}}),
    _line(
        "bad-schema", CHAT, _chat("Hi", response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}})
    ),
    _line("bad-regex", COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(("}}),
    _line(
        "two-constraints", CHAT, _chat("Hi", response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    ),
]
# custom_id (None: a line without a usable one) -> (its line, the status, or "error" for a line that is no
# request, and the field its error names)
EXPECTED = {
    "chat-1": (1, 200, None),
    "text-1": (2, 200, None),
    "bad-temperature": (4, 400, "temperature"),
    "bad-field": (5, 400, "foo"),
    "emb-1": (6, "error", "url"),
    "too-long": (7, 400, "prompt"),
    "ids-1": (9, 200, None),
    "chat-2": (10, 200, None),
    "chat-choice": (11, 200, None),
    "text-json": (12, 200, None),
    "bad-schema": (13, 400, "response_format.json_schema.schema"),
    "bad-regex": (14, 400, "structured_outputs.regex"),
    "two-constraints": (15, 400, "structured_outputs"),
}


@pytest.fixture(scope="module")
def model(servable_tiny_model):
    return servable_tiny_model()


def _run(model: str, tmp_path, output) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(LINES) + "\n")
    main(["batch", "-i", str(source), "-o", str(output), "--model", model, "--batch-size", "3"])


def _answers(output) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def _check_answer(a: dict) -> None:
    line, status, field = EXPECTED[a["custom_id"]]
    if status == "error":
        assert a["response"] is None and a["error"]["line"] == line
        assert a["error"]["message"].startswith(f"line {line}: {field}:"), a
        return
    assert a["error"] is None and a["response"]["status_code"] == status, a
    body = a["response"]["body"]
    if status == 400:
        assert body["error"]["param"] == field and body["error"]["message"].startswith(f"line {line}: "), a
        return
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"] > 0
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
    if a["custom_id"].startswith("chat"):
        assert body["object"] == "chat.completion"
        assert all(c["message"]["role"] == "assistant" for c in body["choices"])
    else:
        assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)


def test_a_batch_file_round_trip_answers_every_line_once(ray_session, model, tmp_path):
    output = tmp_path / "out.jsonl"
    _run(model, tmp_path, output)
    answers = _answers(output)
    assert len(answers) == len(LINES)
    by_id = {a["custom_id"]: a for a in answers}
    assert set(by_id) == {*EXPECTED, None}
    for a in answers:
        if a["custom_id"] is not None:
            _check_answer(a)
    line_errors = sorted((a["error"]["line"], a["error"]["message"]) for a in answers if a["custom_id"] is None)
    assert [n for n, _ in line_errors] == [3, 8]
    assert line_errors[0][1].startswith("line 3: not JSON")
    assert "custom_id: 'chat-1' was already given at line 1" in line_errors[1][1]
    chat2 = by_id["chat-2"]["response"]["body"]
    assert [c["index"] for c in chat2["choices"]] == [0, 1]
    for c in chat2["choices"]:
        tokens = c["logprobs"]["content"]
        assert tokens and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in tokens)
    assert by_id["chat-choice"]["response"]["body"]["choices"][0]["message"]["content"] in ("yes", "no")
    assert by_id["text-json"]["response"]["body"]["choices"][0]["text"].lstrip().startswith("{")
    ids1 = by_id["ids-1"]["response"]["body"]
    assert ids1["usage"]["prompt_tokens"] == 4
    logprobs = ids1["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == ids1["usage"]["completion_tokens"]


def test_a_rerun_with_the_same_output_answers_only_what_is_missing(ray_session, model, tmp_path):
    """The output cut after its fourth answer, half-way through the fifth (a job killed while writing): the rerun
    keeps the four answers as they were and adds one answer for each line they lack; a third run adds nothing."""
    output = tmp_path / "out.jsonl"
    _run(model, tmp_path, output)
    lines = output.read_text().splitlines(keepends=True)
    kept = "".join(lines[:4])
    output.write_text(kept + lines[4][: len(lines[4]) // 2])
    _run(model, tmp_path, output)
    text = output.read_text()
    assert text.startswith(kept)
    answers = _answers(output)
    assert len(answers) == len(LINES)
    assert sorted(filter(None, (a["custom_id"] for a in answers))) == sorted(EXPECTED)
    assert sorted(a["error"]["line"] for a in answers if a["custom_id"] is None) == [3, 8]
    for a in answers[4:]:
        if a["custom_id"] is not None:
            _check_answer(a)
    _run(model, tmp_path, output)
    assert output.read_text() == text


def _alive(class_name: str) -> list[dict]:
    """The live actors whose class name holds ``class_name`` (the GCS's table: the session's Ray runs no dashboard)."""
    actors = ray._private.state.actors().values()
    return [a for a in actors if class_name in a["ActorClassName"] and a["State"] == "ALIVE"]


@pytest.mark.parametrize("victim", ["EngineStage", "WorkerActor"], ids=["engine actor", "one engine's rank"])
def test_a_crash_mid_job_is_replaced_and_every_request_answered_once(ray_session, model, tmp_path, victim):
    """SIGKILL mid-job, once some answers are written: an engine actor of the pool (Ray Data starts it again), or a
    rank of one engine (its actor sees the engine fail and exits to be started again). Either way the killed actor's
    unfinished batches run again on a new engine, and every request is answered once, with a 200."""
    ids = [f"req-{i}" for i in range(48)]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"max_tokens": 48, "ignore_eos": True}
    source.write_text("".join(_line(i, CHAT, _chat(f"Tell story {i}", **body)) + "\n" for i in ids))
    args = ["batch", "-i", str(source), "-o", str(output), "--model", model, "--batch-size", "2"]
    job = threading.Thread(target=main, args=(args + ["--concurrency", "2", "--batches-in-flight", "2"],))
    job.start()
    deadline = time.monotonic() + 120
    while not (output.exists() and len(output.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and job.is_alive(), "no answer came"
        time.sleep(0.05)
    killed = _alive(victim)[0]
    os.kill(killed["Pid"], signal.SIGKILL)
    written = len(output.read_text().splitlines())
    job.join(300)
    assert not job.is_alive()
    assert written < len(ids)  # killed mid-job
    answers = _answers(output)
    assert sorted(a["custom_id"] for a in answers) == sorted(ids)
    assert all(a["error"] is None and a["response"]["status_code"] == 200 for a in answers), answers
    if victim == "EngineStage":
        assert ray._private.state.actors(killed["ActorID"])["NumRestarts"] >= 1


def test_a_directory_of_jsonl_and_parquet_parts_is_answered_once_each(ray_session, model, tmp_path):
    """The parts in name order, each request's answer, and each error naming its file and line or row."""
    parts, output = tmp_path / "in", tmp_path / "out.jsonl"
    parts.mkdir()
    (parts / "1.jsonl").write_text(_line("j1", CHAT, _chat("Hello")) + '\n{"custom_id": "broken"\n')
    rows = [
        {"custom_id": "p1", "url": COMPLETIONS, "body": {"prompt": "Once", "max_tokens": 3, "temperature": 0}},
        {"custom_id": "p2", "url": COMPLETIONS, "body": {"prompt": "Once", "temperature": -1}},
    ]
    table = pa.Table.from_pylist([r | {"method": "POST", "body": json.dumps(r["body"])} for r in rows])
    pq.write_table(table, parts / "2.parquet")
    main(["batch", "-i", str(parts), "-o", str(output), "--model", model])
    by_id = {a["custom_id"]: a for a in _answers(output)}
    assert set(by_id) == {"j1", "p1", "p2", None}
    assert by_id["j1"]["response"]["status_code"] == by_id["p1"]["response"]["status_code"] == 200
    assert by_id["p1"]["response"]["body"]["usage"]["completion_tokens"] == 3
    refused = by_id["p2"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert refused["body"]["error"]["message"].startswith("2.parquet row 2: ")
    assert by_id[None]["error"]["message"].startswith("1.jsonl line 2: not JSON") and by_id[None]["error"]["line"] == 2
