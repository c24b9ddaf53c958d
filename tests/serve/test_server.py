"""The Serve app against one live server (the default model under the README's name, an API key, small
max_tokens): the README's quick start, the OpenAI client, SSE framing, metrics, autoscaling config, bad
input, the API key, gRPC, and aborts that free the engine's blocks (a stop string, a client that
disconnects)."""

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import httpx2 as httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.serve._private.constants import SERVE_NAMESPACE  # no public name for it
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.network import free_port
from serve import AppArgs, raylm_pb2, raylm_pb2_grpc, start
from serve.app import check_ports_free, shutdown_serve
from serve.ingress import side_ports

pytestmark = pytest.mark.usefixtures("ray_session")

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"  # the name the README's quick start sends
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 8
LONG = 1000  # output tokens that take minutes here: a request still running after a few seconds was not stopped
STALE_S = 3  # how old /metrics' engine gauges may be: the replica's stats period plus Ray's report period, and margin
WAIT_S = 30  # bound on anything asynchronous the tests wait for (a hang fails instead of stalling)
QUEUE_LEN = 2  # requests the replica queues beyond the MAX_NUM_SEQS it runs


def stop_serve(timeout_s: float = 90.0) -> None:
    """Serve's shutdown (shutdown_serve), killing each replica as it stops, then wait until every Serve actor (controller, proxies,
    replicas) is gone. A test has asserted what it wanted of a graceful stop already: in a teardown, a replica
    still starting (the replacement of one a test killed) or draining would hold the shutdown until Serve's
    force-kill, graceful_shutdown_timeout_s (the drain timeout and a margin, 35 s) later. On a loaded machine the
    actors outlive shutdown's own 30 s wait: the next module's serve.start would join the dying controller
    (ActorDiedError), and its replicas get the ports a new controller hands out first, which a lingering replica
    of this module still listens on, so some requests would reach the old app. A dead actor's process may still
    hold its sockets a moment longer: the next Serve of this Ray reuses its side ports (HAProxy's, the fallback
    proxy's), and HAProxy's bind without SO_REUSEPORT, so wait until they are free too."""
    shutdown = threading.Thread(target=shutdown_serve)
    shutdown.start()
    deadline = time.monotonic() + timeout_s
    while (left := serve_actors()) or shutdown.is_alive():
        assert time.monotonic() < deadline, f"Serve actors still alive {timeout_s} s after the shutdown began: {left}"
        if shutdown.is_alive():  # the controller has begun deleting the apps: it starts no replica in their place
            for name in left:
                if name.startswith("SERVE_REPLICA::"):
                    with contextlib.suppress(ValueError):  # gone already
                        ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE), no_restart=True)
        time.sleep(0.5)
    while True:
        try:
            check_ports_free("0.0.0.0", side_ports())
            return
        except ValueError as e:
            assert time.monotonic() < deadline, f"{timeout_s} s after the shutdown began: {e}"
            time.sleep(0.5)


def serve_actors() -> list[str]:
    """The names of the Serve actors alive in this Ray."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == SERVE_NAMESPACE]


@contextlib.contextmanager
def serving(args: AppArgs, **kwargs) -> Iterator[str]:
    """``start(args, **kwargs)``'s URL; stop_serve after, a start that failed included: a Serve left running keeps
    its ports, and the next module's start would be refused (serve/app.py check_serve_ports)."""
    try:
        yield start(args, **kwargs)
    finally:
        stop_serve()


@pytest.fixture(scope="module")
def server(default_model_dir):
    """One server for the module: HTTP URL and gRPC port."""
    args = AppArgs(
        engine=EngineConfig(
            model=default_model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, kv_cache_bytes=96 << 20
        ),
        served_model_name=MODEL,
        api_key=KEY,
        min_replicas=1,
        max_replicas=2,
        # Above the most requests any test here holds (the 429 test's MAX_NUM_SEQS + QUEUE_LEN): load never
        # starts a second replica, which would take some of the requests a test means for one.
        target_ongoing_requests=MAX_NUM_SEQS + QUEUE_LEN + 1,
        max_body_bytes=1 << 20,
        max_queue_len=QUEUE_LEN,
    )
    grpc_port = free_port()
    with serving(args, host="127.0.0.1", port=free_port(), grpc_port=grpc_port) as url:
        yield url, grpc_port


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120, **kw)
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=120, **kw)


def metrics(url: str, by_replica: bool = False) -> dict[str, float]:
    """Every sample of /metrics, keyed 'name{label=value,...}' (labels sorted), parsed by prometheus_client;
    summed over replicas unless by_replica."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("replica"), f"{s.name} has no replica label"
            labels = sorted((k, v) for k, v in s.labels.items() if by_replica or k != "replica")
            key = f"{s.name}{{{','.join(f'{k}={v}' for k, v in labels)}}}"
            samples[key] = samples.get(key, 0) + s.value
    return samples


def wait_metrics(url: str, done: Callable[[dict[str, float]], bool], by_replica: bool = False) -> dict[str, float]:
    """/metrics (``metrics(url, by_replica)``) once done(it) holds: replicas' series reach Ray's export once per
    report period."""
    deadline = time.monotonic() + WAIT_S
    while not done(m := metrics(url, by_replica)):
        if time.monotonic() > deadline:
            pytest.fail(f"/metrics did not reach the expected values within {WAIT_S} s: {m}")
        time.sleep(0.2)
    return m


def wait_drained(url: str) -> None:
    """Until the engine runs and queues nothing and holds no KV block; fails after WAIT_S. The gauges reach
    /metrics within one stats period plus one Ray report period (1 s each here): only values read after that
    are the engine's state since the call."""
    time.sleep(STALE_S)
    wait_metrics(
        url,
        lambda m: (
            tuple(
                m[f"{name}{{model_name={MODEL}}}"]
                for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            )
            == (0, 0, 0)
        ),
    )


def sse_events(response: httpx.Response) -> list[str]:
    """The payloads of a raw SSE body, checking the framing: 'data: ...' lines, each followed by a blank line."""
    lines = response.text.split("\n")
    assert lines[-2:] == ["", ""], "the stream must end with a blank line"
    events = []
    for i, line in enumerate(lines[:-2]):
        if i % 2:
            assert line == "", f"line {i} should separate events: {line!r}"
        else:
            assert line.startswith("data: "), line
            events.append(line[len("data: ") :])
    return events


# ---- the OpenAI client ---------------------------------------------------------------------


def test_a_generative_model_asked_for_embeddings_is_a_400_saying_why(client):
    """runner=auto on a chat model (no sentence-transformers export): generate only."""
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    error = e.value.body
    assert (
        error["param"] == "model" and "runner=generate" in error["message"] and "--runner pooling" in error["message"]
    )


def test_models_lists_the_served_model(client, default_model_dir):
    (card,) = client.models.list().data
    assert card.id == MODEL == AppArgs().model_name  # what `raylm serve` with no --model serves
    assert card.model_dump()["root"] == default_model_dir
    assert card.model_dump()["max_model_len"] == MAX_MODEL_LEN


def test_lora_adapter_endpoints_need_the_api_key(url):
    for path in ("load_lora_adapter", "unload_lora_adapter"):
        r = post(url, f"/v1/{path}", {"lora_name": "x", "lora_path": "/x"}, headers={})
        assert r.status_code == 401, r.text


def test_the_readme_quick_start(url, client):
    """The README's three calls as written, but for the API key (and fewer tokens)."""
    r = httpx.post(
        f"{url}/v1/completions",
        headers=AUTH | {"Content-Type": "application/json"},
        timeout=120,
        content=b'{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", '
        b'"max_tokens": 16, "temperature": 0}',
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "SmolLM2-135M-Instruct" and r.json()["choices"][0]["text"]
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="def fibonacci(n):", max_tokens=8, temperature=0
    )
    assert out.choices[0].text
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        stream=True,
        max_tokens=8,
        messages=[{"role": "user", "content": "Write a haiku about Ray."}],
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream)


def test_completion(client, url):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    (choice,) = out.choices
    assert choice.text and choice.finish_reason == "length"
    prompt_len = post(url, "/tokenize", {"prompt": "The capital of France is"}).json()["count"]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 5)
    assert out.usage.total_tokens == prompt_len + 5


def test_token_id_prompt_is_the_same_as_its_text(client, url):
    ids = post(url, "/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_uses_the_chat_template(client, url, default_model_dir):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(expected)
    assert post(url, "/tokenize", {"messages": messages}).json()["tokens"] == expected


def test_streaming_gives_the_same_text_as_not_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_streaming_sends_the_role_first(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_samples(client):
    out = client.completions.create(
        model=MODEL,
        prompt="My favourite colour is",
        max_tokens=4,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 8


def test_a_seed_makes_sampling_reproducible(client):
    kw = dict(
        model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}
    )
    first, again, *others = [client.completions.create(seed=s, **kw).choices[0].text for s in (11, 11, 12, 13, 14)]
    assert again == first
    assert any(t != first for t in others), "three other seeds all sampled the same 8 tokens: the seed is unused"


def test_streaming_n_samples_gives_each_its_text(client):
    kw = dict(
        model=MODEL,
        prompt="My favourite colour is",
        max_tokens=6,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    whole = {c.index: c.text for c in client.completions.create(**kw).choices}
    streamed, finished = {0: "", 1: ""}, {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert c.index not in finished, "a choice went on after its finish_reason"
            streamed[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert streamed == whole


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2
        assert top[token] == pytest.approx(logprob)  # greedy: the sampled token is the most likely one
        assert max(top.values()) == pytest.approx(logprob)


def test_logprob_offsets_index_the_text_when_tokens_split_characters(client):
    """Japanese takes several byte-level tokens per character: each decoded alone is U+FFFD, yet every offset
    must point into the text returned (advancing one per token would run past its end)."""
    kw = dict(model=MODEL, prompt="日本語のテキスト。日本語の", max_tokens=8, temperature=0, logprobs=0)
    out = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    streamed = (
        "".join(c.text for c in chunks),
        [t for c in chunks if c.logprobs for t in c.logprobs.tokens],
        [o for c in chunks if c.logprobs for o in c.logprobs.text_offset],
    )
    for text, tokens, offsets in ((out.text, out.logprobs.tokens, out.logprobs.text_offset), streamed):
        assert any("\ufffd" in t for t in tokens), f"no token split a character in {text!r}: nothing is exercised"
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert offsets[-1] <= len(text), (offsets, text)
        for token, offset in zip(tokens, offsets):
            assert "\ufffd" in token or text[offset : offset + len(token)] == token


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_stop_string_cuts_the_text_and_frees_the_request(client, url):
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, extra_body={"ignore_eos": True})
    free_text = client.completions.create(max_tokens=12, **kw).choices[0].text
    stop = free_text[3:7]  # a few characters into the text: it usually straddles tokens
    assert stop.strip(), free_text
    out = client.completions.create(max_tokens=LONG, stop=[stop], **kw)
    assert out.choices[0].text == free_text[: free_text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    wait_drained(url)  # aborted in the engine, not left to run LONG tokens
    streamed = client.completions.create(max_tokens=LONG, stop=[stop], stream=True, **kw)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == free_text[: free_text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_drained(url)


def test_stop_token_ids(client, url):
    comma = post(url, "/tokenize", {"prompt": ","}).json()["tokens"][0]
    out = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        temperature=0,
        max_tokens=20,
        extra_body={"ignore_eos": True, "stop_token_ids": [comma]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 20  # greedy continues " 5, 6, ...": the first comma stops it


# ---- raw HTTP: framing, errors, the API key ---------------------------------------------------


def test_sse_framing_and_usage_chunk(url):
    r = post(
        url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hello",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and "usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_vllm_bench_serve_request_shape(url, default_model_dir):
    """`vllm bench serve` works unchanged: its exact body (which `raylm bench serve` sends too), streamed with
    usage, ends with a chunk of no choices holding the usage, and /v1/models names the model's root."""
    from bench.serve import completion_payload

    prompt = AutoTokenizer.from_pretrained(default_model_dir).encode("The capital of France is")
    r = post(url, "/v1/completions", completion_payload(MODEL, prompt, 6))
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks, last = chunks[:-1], chunks[-1]
    assert text_chunks and all(len(c["choices"]) == 1 and isinstance(c["choices"][0]["text"], str) for c in text_chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks)
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"  # ignore_eos: all 6 tokens
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 6 and last["usage"]["prompt_tokens"] == len(prompt)
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["root"] == default_model_dir


def test_chat_sse_framing(url):
    r = post(
        url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True},
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_sse_with_usage_has_usage_on_every_chunk(url):
    r = post(
        url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # the role chunk too, as OpenAI sends
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


NOT_JSON = [b'{"prompt": "hi", "max_tokens": ', b"\xff\xfe not json", b"[" * 100_000]  # the last: too deep

BAD_INPUT = [
    # (path, body, status, param)
    *[("/v1/completions", body, 400, None) for body in NOT_JSON],
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": Infinity}', 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * MAX_MODEL_LEN, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, 400, "priority"),  # the server schedules fcfs
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-17"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": -2}, 400, "priority"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    # Lone surrogates: valid JSON, not Unicode text (the tokenizer raises on them); a pair is one character.
    ("/v1/completions", b'{"prompt": "caf\\udcff"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "\\ud83d\\ude00 ok", "stop": ["\\ud800"]}', 400, "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udcff"}]}', 400, "messages[0].content"),
    ("/tokenize", b'{"prompt": "\\uDFFF"}', 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUT)
def test_bad_input_is_an_openai_error_naming_the_parameter(url, path, body, status, param):
    r = post(url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "code" in error


@pytest.mark.parametrize("body", NOT_JSON, ids=["truncated", "not-utf8", "nested-too-deep"])
def test_a_body_that_does_not_decode_is_invalid_json(url, body):
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400, r.text  # never a 500
    assert r.json()["error"]["code"] == "invalid_json" and "body" in r.json()["error"]["message"]


def test_an_oversized_body_is_refused_before_parsing(url):
    r = post(url, "/v1/completions", b"{" + b" " * (1 << 20) + b"}")
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_the_server_still_serves_after_bad_input(client):
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}], ids=["none", "wrong", "no-bearer"]
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
    ],
)
def test_a_wrong_api_key_is_401(url, headers, method, path):
    r = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_docs_need_the_key(url, path):
    assert httpx.get(f"{url}{path}", timeout=30).status_code == 401
    r = httpx.get(f"{url}{path}", headers=AUTH, timeout=30)
    assert r.status_code == 200
    if path == "/openapi.json":
        assert "/v1/completions" in r.json()["paths"]


def test_health_needs_no_key(url):
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("method, path", [("POST", "/sleep"), ("GET", "/is_sleeping"), ("POST", "/pause?mode=abort")])
def test_the_control_routes_are_404_without_their_flag(url, method, path):
    r = httpx.request(method, f"{url}{path}", headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_tokenize_round_trip(url):
    tokens = post(url, "/tokenize", {"prompt": "Hello 😀 world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert post(url, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello 😀 world"}


# ---- metrics and autoscaling ---------------------------------------------------------------------

ENGINE_GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_swapped",
    "vllm:cpu_cache_usage_perc",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
]


def test_metrics_have_vllm_names_and_move_with_requests(client, url):
    # Ray exports a counter from its first increment on: the gauges are there from the start. Earlier tests'
    # requests reach the export within STALE_S.
    time.sleep(STALE_S)
    before = wait_metrics(url, lambda m: all(f"{name}{{model_name={MODEL}}}" in m for name in ENGINE_GAUGES))
    client.completions.create(
        model=MODEL, prompt="Counting: 1, 2,", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    key = f"vllm:request_success_total{{finished_reason=length,model_name={MODEL}}}"
    after = wait_metrics(
        url,
        lambda m: (
            m.get(key, 0) > before.get(key, 0)
            and m.get(f"vllm:prefix_cache_queries_total{{model_name={MODEL}}}", 0)
            > before.get(f"vllm:prefix_cache_queries_total{{model_name={MODEL}}}", 0)
        ),
    )

    def moved(name: str, labels: str = "") -> float:
        key = f"{name}{{{labels}model_name={MODEL}}}"
        return after[key] - before.get(key, 0)

    assert moved("vllm:generation_tokens_total") == 3
    assert moved("vllm:prompt_tokens_total") > 0
    assert moved("vllm:prefix_cache_queries_total") > 0
    assert moved("vllm:request_success_total", "finished_reason=length,") == 1
    for h in HISTOGRAMS:
        assert moved(f"{h}_count") == 1, h
        assert after[f"{h}_bucket{{le=+Inf,model_name={MODEL}}}"] == after[f"{h}_count{{model_name={MODEL}}}"]
    assert moved("vllm:inter_token_latency_seconds_count") == 2  # 3 tokens, one delta each
    assert moved("vllm:request_generation_tokens_bucket", "le=2.0,") == 0
    assert moved("vllm:request_generation_tokens_bucket", "le=5.0,") == 1
    (info,) = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert "enable_prefix_caching=True" in info and after[info] == 1


def test_autoscaling_config_reaches_serve(server):
    from ray.serve.context import _get_global_client  # the controller's view; no public getter in Serve

    details = _get_global_client().get_serve_details()
    config = details["applications"]["raylm"]["deployments"]["LLMServer"]["deployment_config"]
    auto = config["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 2)
    assert auto["target_ongoing_requests"] == MAX_NUM_SEQS + QUEUE_LEN + 1
    assert config["max_ongoing_requests"] == 2 * MAX_NUM_SEQS + QUEUE_LEN  # Admission refuses past its queue


def test_the_replica_reserves_its_engine_bundles(server):
    """One placement group per replica: its own bundle, the scheduler's and one per rank, each held by its
    actor (the engine makes no group of its own, and nothing of the group is left unused)."""
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert [list(g["bundles"].values()) for g in groups] == [[{"CPU": 1.0}] * 3]
    group_cpus = f"CPU_group_{groups[0]['placement_group_id']}"
    assert ray.cluster_resources()[group_cpus] == 3
    assert ray.available_resources().get(group_cpus, 0) == 0


# ---- gRPC -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as channel:
        yield raylm_pb2_grpc.RayLMStub(channel)


GRPC_AUTH = [("authorization", f"Bearer {KEY}")]


def test_grpc_streaming_round_trip(stub, client):
    request = raylm_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=5, temperature=0, ignore_eos=True)
    replies = list(stub.GenerateStream(request, metadata=GRPC_AUTH))
    assert [r.finish_reason for r in replies][-1] == "length" and not any(r.finish_reason for r in replies[:-1])
    assert sum(len(r.token_ids) for r in replies) == replies[-1].num_generated_tokens == 5
    text = "".join(r.text for r in replies)
    unary = stub.Generate(request, metadata=GRPC_AUTH)
    assert unary.text == text and unary.num_generated_tokens == 5 and unary.finish_reason == "length"
    http = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert http.choices[0].text == text


@pytest.mark.parametrize(
    ("request_kw", "metadata", "code"),
    [
        (dict(prompt="hi", max_tokens=0), GRPC_AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", temperature=-1), GRPC_AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", model="gpt-17"), GRPC_AUTH, grpc.StatusCode.NOT_FOUND),
        (dict(prompt="hi"), [], grpc.StatusCode.UNAUTHENTICATED),
    ],
    ids=["max_tokens", "temperature", "model", "no-key"],
)
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_grpc_errors_have_status_codes(stub, request_kw, metadata, code, method):
    with pytest.raises(grpc.RpcError) as e:
        reply = getattr(stub, method)(raylm_pb2.GenerateRequest(**request_kw), metadata=metadata)
        if method == "GenerateStream":
            list(reply)
    assert e.value.code() == code


# ---- aborts ------------------------------------------------------------------------------------------


def test_a_client_disconnect_mid_stream_frees_the_request(url):
    aborted = f"vllm:request_success_total{{finished_reason=abort,model_name={MODEL}}}"
    time.sleep(STALE_S)  # earlier tests' requests have reached the export
    before = metrics(url).get(aborted, 0)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        running = f"vllm:num_requests_running{{model_name={MODEL}}}"
        m = wait_metrics(url, lambda m: m.get(running) == 1)
        assert m[f"vllm:kv_cache_usage_perc{{model_name={MODEL}}}"] > 0
    wait_drained(url)
    wait_metrics(url, lambda m: m.get(aborted, 0) == before + 1)


# ---- back-pressure -------------------------------------------------------------------------------------


async def _hold_streams(url: str, count: int) -> list[asyncio.Task]:
    """``count`` long streams, left running (or waiting in the engine's queue) until their tasks are cancelled."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "stream": True}

    async def hold() -> None:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r,
        ):
            async for _ in r.aiter_lines():
                pass

    return [asyncio.create_task(hold()) for _ in range(count)]


def test_past_the_queue_a_request_is_refused_with_429_and_counted(url):
    """MAX_NUM_SEQS run and QUEUE_LEN wait in the engine; one more is a 429 with Retry-After at once, counted in
    raylm:requests_rejected_total; the held requests, once their clients go, leave no block, request or held
    slot behind (a second round is refused at the same point)."""
    rejected = f"raylm:requests_rejected_total{{model_name={MODEL}}}"

    async def round_trip() -> httpx.Response:
        tasks = await _hold_streams(url, MAX_NUM_SEQS + QUEUE_LEN)
        try:
            deadline = time.monotonic() + WAIT_S
            # Both gauges from one scrape: two scrapes may each see a different report of the replica's. The
            # server keeps one replica (its target_ongoing_requests is above what this test holds).
            held = [f"{g}{{model_name={MODEL}}}" for g in ("vllm:num_requests_running", "vllm:num_requests_waiting")]
            while [(m := metrics(url)).get(held[0]), m.get(held[1])] != [MAX_NUM_SEQS, QUEUE_LEN]:
                engine = {k: v for k, v in m.items() if k.startswith(("vllm:num_requests_", "vllm:kv_cache_usage"))}
                assert time.monotonic() < deadline, f"the held requests did not reach the engine: {engine}"
                await asyncio.sleep(0.2)
            async with httpx.AsyncClient(timeout=WAIT_S) as client:
                return await client.post(
                    f"{url}/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                )
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    for round_number in range(2):
        before = metrics(url).get(rejected, 0)
        r = asyncio.run(round_trip())
        assert r.status_code == 429, (round_number, r.text)
        assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
        wait_metrics(url, lambda m: m.get(rejected, 0) == before + 1)  # noqa: B023 (waited on here)
        wait_drained(url)


@pytest.mark.parametrize(("stopping", "status"), [(False, 200), (True, 503)])
def test_health_is_503_while_the_replica_drains(stopping, status):
    # A load balancer trusting /health stops sending to a replica that refuses new requests (drain.py).
    from types import SimpleNamespace

    from serve.drain import CODE
    from serve.server import LLMServer

    replica = SimpleNamespace(
        drain=SimpleNamespace(is_stopping=lambda: stopping), engine=SimpleNamespace(check_health=dict), pd=None
    )
    response = asyncio.run(LLMServer.func_or_class.health(replica))
    assert response.status_code == status and (CODE in response.body.decode()) == stopping
