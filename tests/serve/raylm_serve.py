"""A real `raylm serve` of this checkout, as a user starts it, for the tests that need the whole process: its
start-up, its ports, how it stops and what it leaves behind.

What a server leaves behind is read from its session: each is started as a session leader, and every process
it starts (Ray's daemons and workers, HAProxy) inherits the session whatever its parent becomes once
re-parented, so an orphan is found without knowing its name."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.network import free_port

START_BOUND_S = 600  # a cold start: Ray, Serve, the replica and its engine, on a loaded 2-core machine
# How long a killed server's processes may take to end. HAProxy and Ray's workers end within seconds; Ray's two
# agents first try to tell a GCS that has gone that their raylet died, and give up ~50 s later.
GONE_BOUND_S = 120
REPO = Path(__file__).resolve().parents[2]


def session(sid: int) -> dict[int, str]:
    """The live processes of session ``sid`` (zombies hold nothing), with their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, _pgrp, session_id = stat.read_text().rpartition(")")[2].split()[:4]
            if int(session_id) == sid and state != "Z":
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # it has gone
            pass
    return found


def listening_ports(sid: int) -> set[int]:
    """The TCP ports the processes of session ``sid`` listen on (any address, IPv4 or IPv6)."""
    listening = {}  # socket inode: port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A":  # LISTEN
                listening[fields[9]] = int(fields[1].rpartition(":")[2], 16)
    ports = set()
    for pid in session(sid):
        with contextlib.suppress(OSError):  # it has gone
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if (link := os.readlink(fd)).startswith("socket:["):
                        ports.add(listening.get(link[8:-1]))
    return ports - {None}


class RaylmServe:
    """`python -m cli serve --model MODEL --port PORT --grpc-port (a free one) FLAGS...` in a session of
    its own, its output kept in a file. It inherits this test session's environment as a user's shell would, the
    ports this session's Serve picked included (serve/ingress.py: it must pick its own)."""

    def __init__(self, model: str, port: int, log: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [sys.executable, "-m", "cli", "serve", "--model", model, "--port", str(port)]
        cmd += ["--grpc-port", str(free_port()), *flags]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO,
                env={**os.environ, **(env or {})},
            )
        self.sid = self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def serving(self) -> bool:
        return "raylm: serving" in self.output()

    def wait_until(self, ready, what: str, timeout_s: float = START_BOUND_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.proc.poll() is None, (
                f"raylm serve exited ({self.proc.returncode}) before {what}:\n{self.output()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"raylm serve: not {what} after {timeout_s} s:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def wait_serving(self) -> None:
        self.wait_until(self.serving, "serving")

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        """Its exit status and how long it took from now."""
        t0 = time.monotonic()
        try:
            return self.proc.wait(timeout_s), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            pytest.fail(f"raylm serve still running {timeout_s} s on:\n{self.output()[-3000:]}")

    def wait_gone(self, timeout_s: float = GONE_BOUND_S) -> float:
        """Once raylm serve itself has exited: how long until nothing of its session is left."""
        t0 = time.monotonic()
        while left := session(self.sid):
            assert time.monotonic() - t0 < timeout_s, f"left {timeout_s} s after raylm serve ended: {left}"
            time.sleep(0.5)
        return time.monotonic() - t0

    def kill_session(self) -> None:
        """Teardown: whatever is left (only after a failure)."""
        for pid in session(self.sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
