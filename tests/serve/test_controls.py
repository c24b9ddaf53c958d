"""The RL control routes (serve/controls.py) on a live server with --enable-control-routes: two replicas of the
default model behind an API key, so every answer must cover both. Sleep holds a completion until the wake-up,
pause keep freezes a stream that then finishes to full length, pause abort counts what it ended, bad input is a
400 naming the parameter, and an update from disk sets the weight version. (Off, the routes are 404:
test_server.py.)"""

import json
import threading
import time

import httpx2 as httpx
import pytest
from ray import serve

from engine.config import EngineConfig
from engine.network import free_port
from serve import APP_NAME, AppArgs
from tests.serve.test_server import WAIT_S, serving

pytestmark = pytest.mark.usefixtures("ray_session")

KEY = "control-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
REPLICAS = 2
LONG = 400  # output tokens that take minutes here (within max_model_len)


@pytest.fixture(scope="module")
def url(default_model_dir):
    args = AppArgs(
        engine=EngineConfig(model=default_model_dir, max_model_len=512, max_num_seqs=4, kv_cache_bytes=32 << 20),
        served_model_name=MODEL,
        api_key=KEY,
        min_replicas=REPLICAS,
        max_replicas=REPLICAS,
        request_router="serve",
        enable_control_routes=True,
    )
    with serving(args, port=free_port(), grpc_port=free_port()) as url:
        deadline = time.monotonic() + 300
        deployment = serve.status().applications[APP_NAME].deployments["LLMServer"]
        while deployment.replica_states.get("RUNNING", 0) < REPLICAS:
            assert time.monotonic() < deadline, "the second replica did not start"
            time.sleep(0.5)
            deployment = serve.status().applications[APP_NAME].deployments["LLMServer"]
        yield url


def control(url: str, method: str, path: str, **kw) -> dict:
    r = httpx.request(method, f"{url}{path}", headers=AUTH, timeout=120, **kw)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["replicas"]) == REPLICAS, body  # every replica answered
    return body


def complete(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)


class Stream(threading.Thread):
    """A streamed completion read in a thread: the time of each token event, and its finish reason."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.times: list[float] = []
        self.finish_reason = self.usage = None
        self.started = threading.Event()
        self.status = 0
        self.start()

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    self.usage = event["usage"]
                for choice in event["choices"]:
                    self.times.append(time.monotonic())
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
                self.started.set()


def test_the_routes_need_the_api_key(url):
    r = httpx.get(f"{url}/is_sleeping", timeout=30)
    assert r.status_code == 401, r.text


@pytest.mark.parametrize(
    "method, path, body, param",
    [
        ("POST", "/sleep?level=3", None, "level"),
        ("POST", "/pause?mode=later", None, "mode"),
        ("POST", "/wake_up?tags=weights,gpu", None, "tags"),
        ("POST", "/update_weights_from_disk", {"flush_cache": True}, "model_path"),
        (
            "POST",
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 2,  # the trainer and one rank: too few for two replicas
                "group_name": "g",
            },
            "world_size",
        ),
    ],
)
def test_bad_input_is_a_400_naming_it(url, method, path, body, param):
    r = httpx.request(method, f"{url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_completion_sent_while_asleep_is_answered_after_the_wake_up(url):
    assert control(url, "POST", "/sleep?level=1")["level"] == 1
    assert control(url, "GET", "/is_sleeping")["is_sleeping"] is True
    answer: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: answer.append(complete(url)), daemon=True)
    waiting.start()
    waiting.join(2)
    assert not answer, "a completion was answered while every replica slept"
    control(url, "POST", "/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")])
    waiting.join(WAIT_S)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert answer[0].json()["choices"][0]["text"]
    body = control(url, "GET", "/is_sleeping")
    assert body["is_sleeping"] is False and not any(r["is_sleeping"] for r in body["replicas"])


def test_pause_keep_freezes_a_stream_which_after_resume_finishes_to_full_length(url):
    stream = Stream(url, 16)
    assert stream.started.wait(WAIT_S)
    control(url, "POST", "/pause?mode=keep")
    assert control(url, "GET", "/is_paused")["is_paused"] is True
    time.sleep(0.5)  # events already on their way arrive
    frozen = len(stream.times)
    time.sleep(1)
    assert len(stream.times) == frozen and stream.is_alive(), "the stream went on while paused"
    control(url, "POST", "/resume")
    stream.join(WAIT_S)
    assert not stream.is_alive()
    assert stream.finish_reason == "length" and stream.usage["completion_tokens"] == 16, stream.usage
    assert control(url, "GET", "/is_paused")["is_paused"] is False


def test_pause_abort_ends_the_live_requests_and_counts_them(url):
    streams = [Stream(url, LONG) for _ in range(2)]
    for s in streams:
        assert s.started.wait(WAIT_S)
    body = control(url, "POST", "/pause?mode=abort")
    try:
        assert body["aborted"] == 2 == sum(r["aborted"] for r in body["replicas"]), body
        for s in streams:
            s.join(WAIT_S)
            assert not s.is_alive() and s.finish_reason == "abort"
    finally:
        control(url, "POST", "/resume")
    assert complete(url).status_code == 200


def test_update_weights_from_disk_sets_the_weight_version(url, default_model_dir):
    assert control(url, "GET", "/get_weight_version")["weight_version"] == "default"
    before = complete(url).json()["choices"][0]["text"]
    control(url, "POST", "/update_weights_from_disk", json={"model_path": default_model_dir, "weight_version": "v1"})
    body = control(url, "GET", "/get_weight_version")
    assert body["weight_version"] == "v1" and {r["weight_version"] for r in body["replicas"]} == {"v1"}
    assert complete(url).json()["choices"][0]["text"] == before  # the same checkpoint: the same greedy text
