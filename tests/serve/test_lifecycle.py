"""`raylm serve` stopped and restarted the way process managers do it: a real `python -m cli serve` with a
Ray of its own (a tiny random Llama with a long context, so a stream runs until stopped) killed with SIGKILL
mid-stream and started again on the same port, stopped with SIGTERM mid-stream, and stopped during start-up
(what it leaves behind is read from its session: raylm_serve.py)."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from engine.network import free_port
from serve.drain import CODE
from serve.lifecycle import OWNER_ENV, write_launcher
from tests.serve.raylm_serve import RaylmServe, session

DRAIN_TIMEOUT_S = 4.0
# SIGTERM to exit: a generous wait, not a target (issue 24's is drain_timeout_s + 15 s, printed, not asserted: a
# loaded machine misses it); the stop's events are what the tests assert.
STOP_BOUND_S = 180
MAX_MODEL_LEN = 16384


def long_context_server(model: str, port: int, log: Path) -> RaylmServe:
    """A server whose streams run until stopped, and whose drain is short."""
    return RaylmServe(
        model,
        port,
        log,
        *("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", str(64 << 20), "--num-threads", "1"),
        *("--drain-timeout-s", f"{DRAIN_TIMEOUT_S:g}"),
    )


def tree(pid: int) -> set[int]:
    """``pid`` and its descendants now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            children.setdefault(int(stat.read_text().rpartition(")")[2].split()[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        found.add(p := todo.pop())
        todo += children.get(p, [])
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_stop_signal_whose_exception_ray_start_lost_still_stops_it(monkeypatch):
    """ray.init's SIGTERM handler raises SystemExit; raised inside an at-fork callback or a finalizer, Python
    prints and ignores it, and raylm serve went on starting (seen once in CI)."""
    from serve import app
    from serve.lifecycle import STOP_SIGNALS, StopSignals

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here: its SystemExit is printed and ignored

    def start_ray_losing_a_sigterm(*args):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # ray.init's own handler
        Finalizer()

    monkeypatch.setattr(app, "start_ray", start_ray_losing_a_sigterm)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signals = StopSignals()
    try:
        signals.install()
        with pytest.raises(KeyboardInterrupt):
            app._start_ray([], None, "127.0.0.1", 0, 0, signals)
        assert signals.received == [signal.SIGTERM] and signals.name() == "SIGTERM"
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_stop_watches_only_for_ray_processes_that_exit_during_it(monkeypatch):
    """A daemon already dead when the stop begins is not the stop signal's doing: the stop runs to its end. One
    that exits during it ends the wait at once, named."""
    import ray._private.worker

    from serve.lifecycle import LocalRayLost, while_local_ray_lives

    already_dead = subprocess.Popen(["true"])
    already_dead.wait()
    daemon = subprocess.Popen(["sleep", "60"])

    class Info:
        def __init__(self, process):
            self.process = process

    class Node:  # what the stop reads of ray's Node: its processes by kind
        all_processes = {"dashboard": [Info(already_dead)], "raylet": [Info(daemon)]}

        def dead_processes(self):
            return [(k, i.process) for k, v in self.all_processes.items() for i in v if i.process.poll() is not None]

    monkeypatch.setattr(ray._private.worker, "_global_node", Node())
    stopped = threading.Event()
    while_local_ray_lives(lambda: stopped.wait(0.3) or stopped.set())
    assert stopped.is_set()
    released = threading.Event()  # a stop that ends only when released: LocalRayLost means the watch ended it
    threading.Timer(0.3, daemon.kill).start()
    try:
        with pytest.raises(LocalRayLost, match="Ray's own raylet exited while raylm stopped"):
            while_local_ray_lives(lambda: released.wait(120))
    finally:
        released.set()


def test_while_ray_starts_a_lost_stop_exception_is_not_reported_as_a_traceback(monkeypatch):
    """Python reports an exception raised where it cannot propagate (an at-fork callback, a finalizer) through
    sys.unraisablehook, as "Exception ignored ... Traceback": for a stop signal's, the recording says it instead."""
    import types

    from serve.lifecycle import StopSignals

    reported: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_type))

    def unraisable(exc: BaseException) -> types.SimpleNamespace:
        return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None, err_msg=None, object=None)

    with StopSignals().recording():
        for exc in (SystemExit(signal.SIGTERM), KeyboardInterrupt(), ValueError("not a stop")):
            sys.unraisablehook(unraisable(exc))
    sys.unraisablehook(unraisable(SystemExit(0)))
    assert reported == [ValueError, SystemExit]


def test_the_haproxy_launcher_dies_with_the_process_that_started_it(tmp_path, monkeypatch):
    """As Serve's HAProxyManager actor starts HAProxy, a parent starts the launcher (here for `sleep`), then is
    killed: the kernel kills what the launcher became."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    sleep = shutil.which("sleep")
    launcher = write_launcher(sleep)
    assert write_launcher(sleep) == launcher, "a second server must find the launcher written, not a new one"
    start = f"import subprocess; p = subprocess.Popen([{str(launcher)!r}, '600']); print(p.pid, flush=True); p.wait()"
    parent = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{child}/cmdline").read_bytes().startswith(sleep.encode()):  # exec'd: sleep itself
        assert time.monotonic() < deadline and alive(child), "the launcher did not become its program"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the launched program outlived its parent by 10 s"
        time.sleep(0.05)


def test_the_haproxy_launcher_dies_at_once_with_the_raylm_that_owns_it(tmp_path, monkeypatch):
    """A process manager restarts a killed raylm on its port at once: HAProxy must not wait for its parent actor
    to notice the raylet has gone (~2 s), but end the moment the owning raylm does; and it ends with its parent
    all the same while the owner lives."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    launcher = write_launcher(shutil.which("sleep"))
    owner = subprocess.Popen(["sleep", "600"])
    start = f"import subprocess; p = subprocess.Popen([{str(launcher)!r}, '600']); print(p.pid, flush=True); print(p.wait())"
    env = {**os.environ, OWNER_ENV: str(owner.pid)}
    parent = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while len(tree(child)) < 2:  # the watcher has started
            assert time.monotonic() < deadline and alive(child), "the launcher left no watcher"
            time.sleep(0.05)
        (watcher,) = tree(child) - {child}
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 2
        while alive(child) or alive(watcher):
            assert time.monotonic() < deadline, "the launched program outlived the raylm that owns it by 2 s"
            time.sleep(0.02)
        assert parent.stdout.readline().strip() == str(-signal.SIGKILL), "its parent did not see it killed"
    finally:
        parent.kill()
        parent.wait()


class Stream:
    """A long completion stream in a thread: its `data:` events, or how its connection broke."""

    def __init__(self, url: str) -> None:
        self.events: list[str] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        assert self.started.wait(60), f"no first token within 60 s: {self.events}"

    def _run(self, url: str) -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except httpx.TransportError as e:
            self.events.append(f"connection broken: {type(e).__name__}")
        self.started.set()

    def end(self, timeout_s: float = 60) -> list[str]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the stream still runs {timeout_s} s on"
        return self.events


def assert_clean_output(server: RaylmServe) -> None:
    """No traceback, and none of the lines that ask a user to act on a normal start and stop."""
    output = server.output()
    assert "Traceback" not in output and "SIGTERM received" not in output, output[-3000:]
    assert "Token authentication is enabled" not in output and "will not be applied" not in output, output[-3000:]
    assert "graceful_shutdown failed" not in output, output[-3000:]  # Ray's word on serve.shutdown's own task


@pytest.fixture(scope="module")
def model(servable_tiny_model) -> str:
    return servable_tiny_model(max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def restarted(model, tmp_path_factory):
    """A server killed with SIGKILL mid-stream, and one started at once on its port: (the killed one, how long
    it took to be gone, the new one serving, its cold start)."""
    port = free_port()
    logs = tmp_path_factory.mktemp("raylm-serve")
    killed = long_context_server(model, port, logs / "killed.log")
    servers = [killed]
    try:
        killed.wait_serving()
        Stream(killed.url)
        started = tree(killed.proc.pid)
        assert started <= set(session(killed.sid)), "a process of raylm serve's tree left its session"
        killed.proc.kill()
        killed.wait_exit(10)
        t0 = time.monotonic()
        again = long_context_server(model, port, logs / "again.log")
        servers.append(again)
        again.wait_serving()
        cold_start = time.monotonic() - t0
        print(
            f"SIGKILL mid-stream, then a start on the same port: serving again {cold_start:.1f} s after the kill "
            f"({len(started)} processes in the killed server's tree)"
        )
        yield killed, killed.wait_gone() + cold_start, again
    finally:
        for server in servers:
            server.kill_session()


def test_a_killed_server_leaves_nothing_and_a_restart_on_its_port_serves(restarted):
    _, gone_s, again = restarted
    r = httpx.post(f"{again.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    print(f"everything of the killed server gone {gone_s:.1f} s after the kill")


def test_sigterm_mid_stream_drains_then_exits_0_leaving_nothing(restarted):
    _, _, server = restarted
    stream = Stream(server.url)
    server.proc.send_signal(signal.SIGTERM)
    status, stop_s = server.wait_exit(STOP_BOUND_S)
    *_, error, done = stream.end()
    gone_s = server.wait_gone()
    print(
        f"SIGTERM mid-stream: raylm serve exited {status} after {stop_s:.1f} s (drain_timeout_s="
        f"{DRAIN_TIMEOUT_S:g}), its last process {gone_s:.1f} s later"
    )
    assert done == "[DONE]" and f'"code":"{CODE}"' in error, stream.events[-2:]
    assert status == 0, server.output()[-3000:]
    assert "raylm: SIGTERM: stopping" in server.output() and "raylm: stopped" in server.output()
    assert_clean_output(server)


def test_sigterm_to_its_whole_process_group_stops_at_once_saying_why(model, tmp_path):
    """`kill -- -PGID` (or a supervisor's group stop) reaches Ray's daemons too: the drain cannot happen, and
    raylm must say so and exit, not wait a minute on a Ray that is going down."""
    server = long_context_server(model, free_port(), tmp_path / "serve.log")
    try:
        server.wait_serving()
        stream = Stream(server.url)
        os.killpg(server.proc.pid, signal.SIGTERM)  # a session leader leads its process group: the pgid is its pid
        status, stop_s = server.wait_exit(STOP_BOUND_S)
        events = stream.end()
        gone_s = server.wait_gone()
        print(
            f"SIGTERM to the process group: exit {status} after {stop_s:.1f} s, its last process {gone_s:.1f} s later"
        )
        assert status == 128 + signal.SIGTERM, server.output()[-3000:]
        assert "exited while raylm stopped: the stop signal reached raylm's whole process group" in server.output()
        assert "raylm: stopped" not in server.output()
        assert events[-1] != "[DONE]", "a stream said it ended well though its engine went down"
    finally:
        server.kill_session()


def _has_child(server: RaylmServe) -> bool:
    return len(tree(server.proc.pid)) > 1


def _replica_loading(server: RaylmServe) -> bool:
    return any("ServeReplica" in cmdline for cmdline in session(server.sid).values())


@pytest.mark.parametrize(
    ("when", "signals", "status", "said"),
    [
        (_has_child, [signal.SIGTERM], 0, "raylm: SIGTERM: stopping; it was still starting"),
        # The first starts the stop (deleting an app still deploying), the second ends it at once. (A single signal
        # while the replica loads stops as during Ray's start, with exit status 0: 12.2 s here, not worth a cold start.)
        (_replica_loading, [signal.SIGTERM] * 2, 128 + signal.SIGTERM, "raylm: SIGTERM again: stopping at once"),
    ],
    ids=["ray-starting", "replica-loading-twice"],
)
def test_a_stop_signal_during_start_up_stops_it_leaving_nothing(model, tmp_path, when, signals, status, said):
    server = long_context_server(model, free_port(), tmp_path / "serve.log")
    try:
        server.wait_until(lambda: when(server), when.__name__)
        for sig in signals:
            server.proc.send_signal(sig)
            time.sleep(0.5)
        got, stop_s = server.wait_exit(STOP_BOUND_S)
        gone_s = server.wait_gone()
        print(
            f"{[signal.Signals(s).name for s in signals]} once {when.__name__}: exit {got} after {stop_s:.1f} s, "
            f"its last process {gone_s:.1f} s later"
        )
        assert got == status and said in server.output(), server.output()[-3000:]
        assert "raylm: serving" not in server.output()
        assert_clean_output(server)
    finally:
        server.kill_session()


def test_a_port_already_taken_is_refused_at_start_in_one_line_leaving_nothing(model, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        server = RaylmServe(model, port, tmp_path / "serve.log")
        status, _ = server.wait_exit(STOP_BOUND_S * 10)  # the imports, on a loaded machine
    server.wait_gone()
    said = [line for line in server.output().splitlines() if line.strip()]
    assert status == 2 and said[-1].startswith(f"raylm: error: --port {port}: cannot listen on 127.0.0.1:{port}: "), (
        said
    )
    assert not any(line.startswith("raylm: error") for line in said[:-1]) and "Traceback" not in server.output()
