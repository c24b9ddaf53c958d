"""Faults under Serve, each while streams run: SIGKILL of a rank, of the scheduler actor and of the replica
process, and a rank stopped with SIGSTOP (a hang, caught by the step timeout). Every in-flight stream must end
with an error within ERROR_BOUND_S (never a hang; for the engine's faults, a 503 error event a client can retry
on), /health must go red, and Serve must serve again within SERVING_BOUND_S from an engine that holds no
block once the new request finishes. Plus a request that runs past request_timeout_s (a 504).

The model is a tiny random Llama with a long context, so a stream generates until it is stopped; it borrows the
default model's tokenizer (whose vocabulary covers its 256 ids) so Serve can detokenize."""

import asyncio
import os
import signal
import time

import httpx2 as httpx
import pytest

from bench.soak import descendant_pids, engine_gauges
from engine.config import EngineConfig
from engine.network import free_port
from serve import AppArgs
from tests.serve.test_server import serving

pytestmark = pytest.mark.usefixtures("ray_session")

STREAMS = 3
# Generous waits, not targets (each test prints the times it saw): a stream runs for minutes unless a fault ends it.
ERROR_BOUND_S = 60.0  # the fault to the last in-flight stream's end
SERVING_BOUND_S = 180.0  # the fault to a completion answered by the engine Serve builds in its place
STEP_TIMEOUT_S = 3.0
# Serve replaces a replica after three failed health checks: 3 x 10 s by default, the bulk of each fault's recovery.
HEALTH_CHECK_PERIOD_S = 3.0
REQUEST_TIMEOUT_S = 25.0  # well past a stream's start and its fault on a loaded machine, so only the 504 test meets it
MAX_MODEL_LEN = 16384
LONG = MAX_MODEL_LEN - 8  # output tokens: minutes of generation, so nothing in flight ends by itself


@pytest.fixture(scope="module")
def url(servable_tiny_model):
    path = servable_tiny_model(max_position_embeddings=MAX_MODEL_LEN)
    args = AppArgs(
        engine=EngineConfig(
            model=path,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=64 << 20,
            num_threads=1,
            step_timeout_s=STEP_TIMEOUT_S,
        ),
        request_timeout_s=REQUEST_TIMEOUT_S,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    with serving(args, host="127.0.0.1", port=free_port(), grpc_port=free_port()) as url:
        yield url


def only_pid(title: str) -> int:
    """The one live process titled so; a replaced engine's processes must be gone within SERVING_BOUND_S (Serve
    drains a replaced replica for up to its graceful_shutdown_timeout_s, 20 s, before it stops)."""
    deadline = time.monotonic() + SERVING_BOUND_S
    while len(pids := descendant_pids(title)) != 1:
        assert time.monotonic() < deadline, f"{len(pids)} processes titled {title!r}: a replaced engine's linger"
        time.sleep(0.5)
    return pids[0]


async def stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> tuple[float, str]:
    """A long stream; ``started`` is set at its first chunk. Returns when it ended and its last event (or how
    its connection broke)."""
    body = {"prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    last = ""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                last = f"{r.status_code} {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    last = line
                    started.set()
    except httpx.TransportError as e:  # the replica's process is gone with its connections
        last = f"connection broken: {type(e).__name__}"
    started.set()  # a stream that ended before its first chunk must not be waited for
    return time.monotonic(), last


async def streaming(client: httpx.AsyncClient, url: str) -> asyncio.Task:
    """A stream that has sent its first chunk. Right after a replacement the ingress may still refuse one (HAProxy
    brings the new replica's port up after its own checks): such a stream is started again, within
    SERVING_BOUND_S."""
    deadline = time.monotonic() + SERVING_BOUND_S
    while True:
        started = asyncio.Event()
        task = asyncio.create_task(stream(client, url, started))
        await asyncio.wait_for(started.wait(), max(0.1, deadline - time.monotonic()))
        if not task.done():
            return task
        assert time.monotonic() < deadline, f"no stream would start within {SERVING_BOUND_S} s: {task.result()}"
        await asyncio.sleep(0.5)


async def fault_mid_generation(url: str, fault) -> tuple[float, list[tuple[float, str]]]:
    """Start STREAMS streams, apply ``fault`` once all have their first chunk, return its time and how each
    stream ended; a stream still open ERROR_BOUND_S after the fault fails the test."""
    async with httpx.AsyncClient(timeout=ERROR_BOUND_S + 30) as client:
        tasks = await asyncio.gather(*(streaming(client, url) for _ in range(STREAMS)))
        fault()
        at = time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=ERROR_BOUND_S)
        for t in pending:
            t.cancel()
        assert not pending, f"{len(pending)} of {STREAMS} streams still open {ERROR_BOUND_S} s after the fault"
        return at, [t.result() for t in tasks]


def wait_drained(url: str) -> None:
    """Until the engine runs and queues nothing and holds no block (a replaced replica may still answer a scrape
    while Serve stops it: its answer is not the new engine's)."""
    deadline = time.monotonic() + 30
    while (gauges := engine_gauges(url, {})) != (0, 0, 0):
        assert time.monotonic() < deadline, f"the engine still holds requests or blocks: {gauges}"
        time.sleep(0.2)


def recover(url: str, at: float) -> tuple[int, float]:
    """/health's status after the fault, and the time from the fault to a completion served again; then the new
    engine, drained, must hold no block."""
    try:
        health = httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.TransportError:
        health = 0
    while True:
        try:
            if (
                httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30).status_code
                == 200
            ):
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() - at < SERVING_BOUND_S, f"not serving again {SERVING_BOUND_S} s after the fault"
        time.sleep(0.5)
    serving_after = time.monotonic() - at
    wait_drained(url)
    return health, serving_after


def test_a_request_past_request_timeout_s_is_aborted_with_504(url):
    """Streaming or not, past request_timeout_s the request ends with a 504 naming the setting, and the engine
    frees it."""
    body = {"prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True}

    async def both() -> tuple[httpx.Response, str]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + ERROR_BOUND_S) as client:
            whole = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
            _, last = await stream(client, url, asyncio.Event())
            return await whole, last

    whole, last = asyncio.run(both())
    assert whole.status_code == 504, whole.text
    error = whole.json()["error"]
    assert error["code"] == "request_timeout" and "request_timeout_s" in error["message"]
    assert '"code":"request_timeout"' in last, last
    wait_drained(url)


FAULTS = {  # process title (Ray names its processes after the actor class) and signal
    "rank-killed": ("ray::WorkerActor", signal.SIGKILL),
    "scheduler-killed": ("ray::SchedulerActor", signal.SIGKILL),
    "replica-killed": ("ray::ServeReplica:raylm:LLMServer", signal.SIGKILL),
    "rank-stopped": ("ray::WorkerActor", signal.SIGSTOP),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_mid_generation_errors_every_stream_and_serve_recovers(url, fault):
    title, sig = FAULTS[fault]
    for other, _ in FAULTS.values():  # the engine an earlier test replaced is gone, so its replica gets no stream
        only_pid(other)
    pid = only_pid(title)
    try:
        at, ends = asyncio.run(fault_mid_generation(url, lambda: os.kill(pid, sig)))
        health, serving_after = recover(url, at)
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGCONT)  # should Ray not have killed it yet, let it go
            except ProcessLookupError:
                pass
    print(
        f"\n{fault}: streams ended {', '.join(f'{t - at:.2f}' for t, _ in ends)} s after the fault; /health "
        f"{health}; serving again after {serving_after:.1f} s"
    )
    if fault == "replica-killed":
        # Its HTTP connections die with it. /health has no replica to answer it: HAProxy hands it to Serve's
        # fallback proxy, which holds it until the new replica answers.
        assert all(last.startswith("connection broken") or '"error"' in last for _, last in ends), ends
    else:  # the engine's faults: a 503 error event (retryable), and the replica reports itself unhealthy
        assert all('"code":"engine_unavailable"' in last for _, last in ends), ends
        assert health == 503
    if fault == "rank-stopped":  # the stream's error says what happened, not what the replica tripped over next
        assert all("step_timeout_s" in last for _, last in ends), ends
