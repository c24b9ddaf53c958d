"""Graceful drain: a replica Serve stops (here the app is deleted, as `raylm serve`'s Ctrl-C does; a scale-down or a
redeploy stops a replica the same way) refuses new requests, lets the ones it holds finish for up to
drain_timeout_s, then ends the rest with a 503 error event naming the setting, before Serve kills it: no client is
cut off without an answer.

The model is a tiny random Llama with a long context, so a long stream generates until it is stopped."""

import asyncio
import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from ray import serve

from engine.config import EngineConfig
from engine.network import free_port
from scheduler import EngineRequest
from serve import AppArgs, serve_until_interrupted
from serve.admission import Admission
from serve.app import APP_NAME
from serve.drain import CODE, MARGIN_S, Drain
from serve.protocol.parsing import APIError
from tests.serve.test_server import serving, stop_serve

DRAIN_TIMEOUT_S = 4.0
MAX_MODEL_LEN = 16384
LONG = MAX_MODEL_LEN - 8  # minutes of generation: only the drain's deadline ends it


def app_args(servable_tiny_model) -> AppArgs:
    path = servable_tiny_model(max_position_embeddings=MAX_MODEL_LEN)
    return AppArgs(
        engine=EngineConfig(model=path, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20, num_threads=1),
        drain_timeout_s=DRAIN_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def url(ray_session, servable_tiny_model):
    with serving(app_args(servable_tiny_model), host="127.0.0.1", port=free_port(), grpc_port=free_port()) as url:
        yield url


async def stream(
    client: httpx.AsyncClient, url: str, max_tokens: int, events: list[tuple[float, str]], started: asyncio.Event
) -> None:
    """Collects the stream's `data:` events with their arrival times; a broken connection is an event too."""
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[6:]))
                    started.set()
    except httpx.TransportError as e:
        events.append((time.monotonic(), f"connection broken: {type(e).__name__}"))
    started.set()


async def started_stream(
    client: httpx.AsyncClient, url: str, max_tokens: int, events: list[tuple[float, str]] | None = None
) -> tuple[asyncio.Task, list[tuple[float, str]]]:
    events, started = [] if events is None else events, asyncio.Event()
    task = asyncio.create_task(stream(client, url, max_tokens, events, started))
    await asyncio.wait_for(started.wait(), 60)
    assert not task.done(), events
    return task, events


def test_ctrl_c_on_raylm_serve_drains_before_serve_stops(ray_session, servable_tiny_model, monkeypatch):
    """`raylm serve`'s Ctrl-C (run first: it needs Serve not yet started): a long stream ends with the drain's
    503 event at the deadline, not with a connection cut by Serve's shutdown."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    events: list[tuple[float, str]] = []
    main, interrupted, serving = threading.main_thread().ident, threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:
        if seconds >= 3600:  # serve_until_interrupted's wait for Ctrl-C: it is serving now
            serving.set()
        time.sleep(seconds)

    monkeypatch.setattr("serve.app.time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))

    def interrupt() -> None:
        interrupted.set()
        signal.pthread_kill(main, signal.SIGINT)

    def client() -> None:
        async def run() -> None:
            async with httpx.AsyncClient(timeout=DRAIN_TIMEOUT_S + 60) as client:
                task, _ = await started_stream(client, url, LONG, events)
                interrupt()
                await asyncio.wait_for(task, DRAIN_TIMEOUT_S + 30)

        try:
            assert serving.wait(600), "raylm serve never came up"
            asyncio.run(run())
        finally:
            if not interrupted.is_set():  # a failed client must not leave the main thread serving forever
                interrupt()

    stop_serve()  # a Serve still up would keep its own HTTP port, which this test would wait on in vain
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=client)
    thread.start()
    try:
        serve_until_interrupted(
            app_args(servable_tiny_model), address=None, host="127.0.0.1", port=port, grpc_port=free_port()
        )
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        thread.join(DRAIN_TIMEOUT_S + 60)
        stop_serve()
    *_, (_, error), (_, done) = events
    assert done == "[DONE]" and json.loads(error)["error"]["code"] == CODE, events[-2:]


def test_ctrl_c_while_raylm_serve_starts_deletes_the_app_it_deployed(ray_session, servable_tiny_model, monkeypatch):
    """On a cluster joined (an address given), an app left behind by a Ctrl-C during start-up would serve on,
    unseen, after raylm exited."""

    def interrupted(url: str, timeout_s: float) -> None:
        assert APP_NAME in serve.status().applications  # deployed, not yet announced
        raise KeyboardInterrupt

    monkeypatch.setattr("serve.app.wait_healthy", interrupted)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop_serve()
    try:
        serve_until_interrupted(
            app_args(servable_tiny_model), address="auto", host="127.0.0.1", port=free_port(), grpc_port=free_port()
        )
        assert APP_NAME not in serve.status().applications
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        stop_serve()


def test_a_stopped_replica_finishes_what_it_can_and_ends_the_rest_with_a_503_event(url):
    async def run() -> tuple[float, float, list, list]:
        async with httpx.AsyncClient(timeout=DRAIN_TIMEOUT_S + 60) as client:
            longs = [await started_stream(client, url, LONG) for _ in range(2)]
            # Size a request that ends well inside the drain window at this machine's decode rate.
            n0 = len(longs[0][1])
            await asyncio.sleep(1.0)
            short_tokens = max(8, int((len(longs[0][1]) - n0) * DRAIN_TIMEOUT_S / 3))
            short = await started_stream(client, url, short_tokens)
            stopped_at = time.monotonic()
            deleting = asyncio.create_task(asyncio.to_thread(serve.delete, APP_NAME))
            await asyncio.wait_for(asyncio.gather(*(t for t, _ in [*longs, short])), DRAIN_TIMEOUT_S + 30)
            await asyncio.wait_for(deleting, DRAIN_TIMEOUT_S + MARGIN_S + 60)
            return stopped_at, short_tokens, short[1], [events for _, events in longs]

    stopped_at, short_tokens, short, longs = asyncio.run(run())
    # The short request ran on through the drain and finished as asked.
    *_, (finished_at, last), (_, usage), (_, done) = short
    assert done == "[DONE]" and json.loads(last)["choices"][0]["finish_reason"] == "length", short[-3:]
    assert json.loads(usage)["usage"]["completion_tokens"] == short_tokens
    assert finished_at > stopped_at, "the short request finished before the drain began: nothing was shown"
    for events in longs:
        *_, (error_at, error), (_, done) = events
        assert done == "[DONE]", events[-3:]
        body = json.loads(error)["error"]
        assert body["code"] == CODE and "drain_timeout_s=4" in body["message"], body
        ended = error_at - stopped_at
        print(f"a long stream ended {ended:.2f} s after the stop (drain_timeout_s={DRAIN_TIMEOUT_S:g})")
        assert DRAIN_TIMEOUT_S - 0.5 < ended < DRAIN_TIMEOUT_S + MARGIN_S, ended


class _Engine:
    """An engine whose streams run until ended, counting what ``end_callers`` ended."""

    def __init__(self) -> None:
        self.queues: list[asyncio.Queue] = []

    async def generate(self, request):
        queue = asyncio.Queue()
        self.queues.append(queue)
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def end_callers(self, error: BaseException) -> int:
        for queue in self.queues:
            queue.put_nowait(error)
        return len(self.queues)


def test_drain_refuses_new_requests_and_ends_held_ones_only_at_the_deadline():
    async def run() -> None:
        engine = _Engine()
        admission = Admission(engine, 8, lambda: None)
        held = admission.generate(EngineRequest(request_id="a", prompt_token_ids=[1]))
        consumer = asyncio.create_task(anext(held))
        drain = Drain(admission, 0.5, is_stopping=lambda: True)
        watching = asyncio.create_task(drain.watch())
        await asyncio.sleep(0.1)
        with pytest.raises(APIError) as refused:
            admission.generate(EngineRequest(request_id="b", prompt_token_ids=[1]))
        assert (refused.value.status, refused.value.code) == (503, CODE)
        assert not consumer.done(), "a held request was ended before the deadline"
        assert await asyncio.wait_for(watching, 5) == 1
        with pytest.raises(RuntimeError, match="drain_timeout_s=0.5"):
            await consumer
        assert admission.held == 0
        # Nothing held: the drain ends at once, ending nobody.
        idle = Admission(_Engine(), 8, lambda: None)
        assert await asyncio.wait_for(Drain(idle, 30.0, is_stopping=lambda: True).run(), 1) == 0

    asyncio.run(run())
