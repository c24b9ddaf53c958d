"""The OpenAI Batch API's file format: one request per JSON line in (``custom_id``, ``method``, ``url``, ``body``),
one answer per line out, shaped as the server answers /v1/chat/completions and /v1/completions. The requests may
also be Parquet rows, and lie in a directory of files or at a URI (batch/inputs.py).

A line that is no request (not JSON, no custom_id, another method or url) is answered with ``error`` (its number
in the input in ``error.line``); a request the server would refuse with a 400 is answered with that 400 and its
OpenAI error body (``param`` names the field); each message leads with where the request is ("line 3", or
"part-2.jsonl line 3" in a directory).

Duplicated from serve/ (which batch may not import): the body fields each endpoint takes, their mapping onto
SamplingParams, and the response shapes (serve/protocol builds them as pydantic models; here they are dicts).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import IO, Any

from batch.config import BatchConfig
from batch.inputs import Record, records
from engine.request_check import CONSTRAINT_KINDS
from scheduler import RequestError, SamplingParams, StructuredOutputsParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
)
# Fields that change no output (OpenAI bookkeeping), taken and left be, as the server takes them.
BOOKKEEPING = ("model", "user", "metadata", "store")
CONSTRAINTS = ("response_format", "structured_outputs")
FIELDS = {
    CHAT: {*SAMPLING_FIELDS, *BOOKKEEPING, *CONSTRAINTS, "messages", "stop", "stream", "max_tokens"}
    | {"max_completion_tokens", "logprobs", "top_logprobs"},
    COMPLETIONS: {*SAMPLING_FIELDS, *BOOKKEEPING, *CONSTRAINTS, "prompt", "stop", "stream", "max_tokens"}
    | {"logprobs", "echo"},
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is the room the context leaves)


class LineError(ValueError):
    """A line that is no request of this file format (answered with ``error``, not a response); ``custom_id`` is
    the line's own where it has one."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


class BodyError(ValueError):
    """A request body the server would refuse with a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def read_request(value: str | dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """The custom_id, url and body of a line's text (or a Parquet row); LineError saying what makes it no
    request."""
    try:
        request = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise LineError(f"not JSON: {e}") from None
    if not isinstance(request, dict):
        raise LineError(f"a request is a JSON object, got {type(request).__name__}")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"custom_id: a non-empty string is required, got {custom_id!r}")
    if request.get("method", "POST") != "POST":
        raise LineError(f"method: only POST is served, got {request.get('method')!r}", custom_id)
    url = request.get("url")
    if url not in FIELDS:
        served = "; /v1/embeddings is not served in batch yet" if url == "/v1/embeddings" else ""
        raise LineError(f"url: {url!r} is not one of {sorted(FIELDS)}{served}", custom_id)
    body = request.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body: a JSON object is required, got {type(body).__name__}", custom_id)
    return custom_id, url, body


def request_row(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The processor's row for a body (its prompt, and its sampling params checked by SamplingParams), or
    BodyError naming the field."""
    unknown = sorted(set(body) - FIELDS[url])
    if unknown:
        raise BodyError(f"{unknown[0]}: batch does not support this field; leave it out", unknown[0])
    if body.get("stream"):
        raise BodyError("stream: a batch request is answered whole; leave stream out", "stream")
    if body.get("echo"):
        raise BodyError("echo: not supported in batch; leave it out", "echo")
    given = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if given.get("top_k") == 0:  # 0 and -1 both mean off, as in vLLM
        given["top_k"] = -1
    if url == CHAT:
        row = {"messages": _messages(body.get("messages")), "prompt_token_ids": None}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise BodyError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    else:
        row = {"messages": None, "prompt_token_ids": _prompt(body.get("prompt"))}
        max_tokens = body.get("max_tokens", COMPLETIONS_MAX_TOKENS)
        logprobs = body.get("logprobs")
    given |= {k: v for k, v in (("max_tokens", max_tokens), ("logprobs", logprobs)) if v is not None}
    try:  # max_tokens checked against the prompt by the engine stage, which knows the context
        checked = SamplingParams(**given)
        given = {name: getattr(checked, name) for name in given}  # reals as floats: one Arrow type per field
    except RequestError as e:
        raise BodyError(str(e), param_for(url, e.field)) from None
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise BodyError(f"stop: a string or a list of strings, got {stop!r}", "stop")
    stops = [stop] if isinstance(stop, str) else stop
    prompt = body.get("prompt")
    constraint, constraint_param = _constraint(body)
    # Every row's params have the same keys (None: unset), so that Arrow gives the column one type; a constraint
    # travels as JSON text, whatever its schema's shape.
    params = dict.fromkeys((*SAMPLING_FIELDS, "max_tokens", "logprobs")) | given
    params |= {"stop": stops, "structured_outputs": constraint}
    return row | {
        "prompt": prompt if isinstance(prompt, str) else None,
        "sampling_params": params,
        "constraint_param": constraint_param,
    }


def _constraint(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """The body's output constraint as the processor takes it (the JSON text of structured_outputs' kinds), and
    the field it came from; BodyError where the server would refuse it. The engine compiles it."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMATS:
            raise BodyError(
                f"response_format: type is one of {list(RESPONSE_FORMATS)}, got {_short(rf)}", "response_format"
            )
        _only(rf, ("type", "json_schema"), "response_format")
        if rf["type"] != "text" and so is not None:
            raise BodyError(
                "response_format and structured_outputs both constrain the output; send one", "structured_outputs"
            )
        if rf["type"] == "json_object":
            return json.dumps({"json_object": True}), "response_format"
        if rf["type"] == "json_schema":
            schema = rf.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
                raise BodyError(
                    "response_format: type json_schema needs json_schema.schema", "response_format.json_schema"
                )
            _only(schema, ("name", "description", "schema", "strict"), "response_format.json_schema")
            return json.dumps({"json": schema["schema"]}), "response_format"
    if so is None:
        return None, None
    if not isinstance(so, dict):
        raise BodyError(f"structured_outputs: an object, got {_short(so)}", "structured_outputs")
    _only(so, CONSTRAINT_KINDS, "structured_outputs")
    kinds = {k: v for k, v in so.items() if v is not None}
    try:
        StructuredOutputsParams(**kinds)
    except RequestError as e:
        raise BodyError(f"structured_outputs: {e}", "structured_outputs") from None
    return json.dumps(kinds), "structured_outputs"


def _only(value: dict[str, Any], keys: tuple[str, ...], name: str) -> None:
    extra = sorted(set(value) - set(keys))
    if extra:
        raise BodyError(f"{name}.{extra[0]}: not a field of {name}; take {list(keys)}", f"{name}.{extra[0]}")


def _messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as the template takes them: a role and text content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise BodyError(f"messages: a non-empty list is required, got {messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BodyError(f"messages[{i}].role: a string is required", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BodyError(f"messages[{i}].content: only text parts are served", f"messages[{i}].content")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BodyError(f"messages[{i}].content: a string or text parts, got {content!r}", f"messages[{i}].content")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise BodyError(
                f"messages[{i}].{extra[0]}: not supported in batch; leave it out", f"messages[{i}].{extra[0]}"
            )
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(prompt: Any) -> list[int] | None:
    """A completion's token-id prompt (None for a text one, which the tokenize stage encodes)."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _prompt(prompt[0])
    raise BodyError(f"prompt: one prompt per request (a string or token ids), got {_short(prompt)}", "prompt")


def param_for(url: str, field: str) -> str:
    """The body's parameter behind a RequestError's field (SamplingParams' names, or the engine check's)."""
    if field == "prompt" or field.startswith("prompt["):
        return "messages" if url == CHAT else "prompt"
    if url == CHAT and field == "logprobs":
        return "top_logprobs"
    return field


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def line_error(record: Record, custom_id: str | None, message: str) -> dict[str, Any]:
    """The answer of a record that is no request: ``error.line`` is its number in the whole input."""
    error = {"code": "invalid_request_line", "message": f"{record.where}: {message}", "line": record.number}
    return {"id": _id(), "custom_id": custom_id, "response": None, "error": error}


def refusal(where: str, custom_id: str, url: str, message: str, param: str | None, status: int = 400) -> dict:
    """The answer the server gives a request it refuses: the status and an OpenAI error body, its message led by
    where the request is in the input."""
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    error = {"message": f"{where}: {message}", "type": kind, "param": param and param_for(url, param)}
    error["code"] = "invalid_value" if status < 500 else "engine_failed"
    return _answer(custom_id, status, {"error": error})


def answer(row: dict[str, Any], model: str) -> dict[str, Any]:
    """The line for a row the processor ran: the server's response to its request, or its refusal."""
    if row["error"] is not None:
        status = 400 if row["error_param"] is not None else 500
        param = row["error_param"]
        if (
            param is not None
            and param.startswith("structured_outputs")
            and row["constraint_param"] == "response_format"
        ):
            # the engine's check names the constraint's kind; the body's field is the response_format it came from
            param = "response_format.json_schema.schema" if param == "structured_outputs.json" else "response_format"
        return refusal(row["where"], row["custom_id"], row["url"], row["error"], param, status)
    chat = row["url"] == CHAT
    completion = row["num_generated_tokens"]
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_chat_choice(c) if chat else _completion_choice(c) for c in row["choices"]],
        "usage": {
            "prompt_tokens": row["num_input_tokens"],
            "completion_tokens": completion,
            "total_tokens": row["num_input_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": row["num_cached_tokens"]},
        },
    }
    return _answer(row["custom_id"], 200, body)


def _chat_choice(c: dict[str, Any]) -> dict[str, Any]:
    def top(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    logprobs = None
    if c["logprobs"] is not None:
        logprobs = {
            "content": [
                top(lp["token"], lp["logprob"])
                | {"top_logprobs": [top(t, v) for t, v in zip(lp["top_tokens"], lp["top_logprobs"])]}
                for lp in c["logprobs"]
            ]
        }
    message = {"role": "assistant", "content": c["text"]}
    return {"index": c["index"], "message": message, "logprobs": logprobs, "finish_reason": c["finish_reason"]}


def _completion_choice(c: dict[str, Any]) -> dict[str, Any]:
    logprobs = None
    if c["logprobs"] is not None:
        offsets, offset = [], 0
        for lp in c["logprobs"]:
            offsets.append(offset)
            offset = min(offset + len(lp["token"]), len(c["text"]))
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": [lp["logprob"] for lp in c["logprobs"]],
            "tokens": [lp["token"] for lp in c["logprobs"]],
            "top_logprobs": [dict(zip(lp["top_tokens"], lp["top_logprobs"])) for lp in c["logprobs"]],
        }
    return {"index": c["index"], "text": c["text"], "logprobs": logprobs, "finish_reason": c["finish_reason"]}


def _answer(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    request_id = _id()
    return {
        "id": request_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def _id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def answered(path: Path) -> tuple[set[str], set[int]]:
    """The custom_ids an output file already answers, and the lines it answers that had none. A last line cut
    short (a job killed while writing it) is removed, so that its request runs again."""
    if not path.exists():
        return set(), set()
    ids, lines, keep, ended = set(), set(), 0, True
    with path.open("rb+") as f:
        for raw in f:
            try:
                out = json.loads(raw)
            except json.JSONDecodeError:
                break
            keep += len(raw)
            ended = raw.endswith(b"\n")
            if out.get("custom_id") is not None:
                ids.add(out["custom_id"])
            elif out.get("error"):
                lines.add(out["error"]["line"])
        f.truncate(keep)
        f.seek(keep)
        if not ended:  # a whole last answer whose newline was not written yet
            f.write(b"\n")
    return ids, lines


def run_file(config: BatchConfig, source: str, output_path: Path, address: str | None = None) -> Counter:
    """Answer every request of ``source`` (batch.inputs: a file, a directory, a URI) not yet answered in
    ``output_path``, appending each answer as it comes (flushed: a job killed part-way keeps them, and its rerun
    resumes); returns the count of each status."""
    done_ids, done_lines = answered(output_path)
    counts: Counter = Counter()
    with output_path.open("a") as out:
        rows = _requests(source, done_ids, done_lines, lambda line: _write(out, line, counts))
        if rows:
            _run(config, rows, address, lambda line: _write(out, line, counts))
    return counts


def _requests(source: str, done_ids: set[str], done_lines: set[int], write) -> list[dict[str, Any]]:
    """The rows of the input's requests still to run; the answers of its bad records are written meanwhile."""
    rows, first_seen = [], {}
    for record in records(source):
        try:
            custom_id, url, body = read_request(record.value)
            if custom_id in first_seen:
                raise LineError(f"custom_id: {custom_id!r} was already given at {first_seen[custom_id]}")
        except LineError as e:
            done = e.custom_id in done_ids if e.custom_id is not None else record.number in done_lines
            if not done:
                write(line_error(record, e.custom_id, str(e)))
            continue
        first_seen[custom_id] = record.where
        if custom_id in done_ids:
            continue
        try:
            rows.append(request_row(url, body) | {"custom_id": custom_id, "where": record.where, "url": url})
        except BodyError as e:
            write(refusal(record.where, custom_id, url, str(e), e.param))
    return rows


def _run(config: BatchConfig, rows: list[dict[str, Any]], address: str | None, write) -> None:
    import ray

    from batch.processor import build_processor
    from engine.connect import connect
    from engine.placement import SCHEDULER_CPUS

    engine = config.engine
    connect(address, config.concurrency * (SCHEDULER_CPUS + engine.world_size * (engine.num_threads or 1)) + 1)
    model = engine.model or engine.resolved_model()
    results = build_processor(config)(ray.data.from_items(rows))
    for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
        for row in batch.to_pylist():
            write(answer(row, model))


def _write(out: IO[str], line: dict[str, Any], counts: Counter) -> None:
    out.write(json.dumps(line) + "\n")
    out.flush()
    counts[line["response"]["status_code"] if line["response"] else "error"] += 1
