"""How `raylm serve` lives and dies under a process manager: stop signals, and HAProxy's lifetime.

Every process a local `raylm serve` starts must end when it does, however it dies (a drained stop, a second
signal, SIGKILL, the OOM killer), or a restart on the same port fails on the HAProxy still holding it. Ray
already ties its own processes to the driver: it starts GCS, the raylet and its monitors with
PR_SET_PDEATHSIG (the kernel kills them when raylm dies), and the raylet's workers and agents exit once the
raylet is gone. The one process outside that chain is Serve's HAProxy, a child of the HAProxyManager actor:
when that actor dies with the raylet, HAProxy is re-parented to init and keeps the port. So HAProxy is started
through a launcher that asks the kernel for the same parent-death signal, then becomes HAProxy (exec): nothing
polls, nothing has to run after raylm is killed, and nothing is left for the next start to clean.
That chain takes ~2 s (the actor's core worker notices its raylet is gone, then exits), and a process manager's
restart on the same port can be quicker: so the launcher also leaves a watcher, blocked on a pidfd of the raylm
process that started this Ray, which kills HAProxy the moment raylm dies. docs/operations.md weighs this against
a process group or a pid file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAUNCHER_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Serve starts this file as HAProxy (read at import, in the actor)
OWNER_ENV = "RAYLM_HAPROXY_OWNER_PID"  # the raylm process whose death ends HAProxy at once

# -I: no environment or user site; -S: no site-packages (only the standard library is needed). A parent may die
# between fork and prctl, so each process checks its parent is still the one it had. The watcher is HAProxy's
# child, ended by the kernel with it; it closes its standard streams so that it holds none of HAProxy's. Without
# pidfds (Linux < 5.3) it exits and the parent-death chain alone ends HAProxy.
LAUNCHER = """#!{python} -IS
# raylm: HAProxy, killed by the kernel (PR_SET_PDEATHSIG) when the process that started it dies, and by its
# watcher the moment the raylm process that started this Ray dies.
import ctypes, os, select, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
parent = os.getppid()
if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit(f"raylm haproxy launcher: prctl(PR_SET_PDEATHSIG) failed: {{os.strerror(ctypes.get_errno())}}")
if os.getppid() != parent:
    sys.exit("raylm haproxy launcher: the process that started HAProxy is gone")
owner = os.environ.get({owner_env!r})
if owner and os.fork() == 0:
    haproxy_pid = os.getppid()
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == haproxy_pid:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            select.select([os.pidfd_open(int(owner))], [], [])
        except ProcessLookupError:
            pass
        except OSError:
            os._exit(0)
        os.kill(haproxy_pid, signal.SIGKILL)
    os._exit(0)
os.execv({haproxy!r}, [{haproxy!r}, *sys.argv[1:]])
"""


class StopSignals:
    """SIGINT and SIGTERM both stop `raylm serve` the way Ctrl-C always did: as a KeyboardInterrupt in the main
    thread, so a stop during start-up or while serving runs the same drain.

    ``received`` lists the signals in the order they came (the exit status names the last). ``install`` must run
    again after ray.init, which replaces the SIGTERM handler twice: with a Python one that exits at once, then with
    its core worker's C++ one, which prints a stack trace before calling that.
    """

    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        raise KeyboardInterrupt

    def name(self) -> str:
        return signal.Signals(self.received[-1]).name if self.received else "SIGINT"

    def exit_status(self) -> int:
        """The shell's status for a process the last signal ended: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + (self.received[-1] if self.received else signal.SIGINT)

    @contextlib.contextmanager
    def recording(self):
        """Yields a list that, once the block has run, holds the stop signals that came during it. A handler's
        exception can be lost on its way: raised inside an at-fork callback or a finalizer, where Python prints
        and ignores it (ray.init forks its daemons, and its own SIGTERM handler raises SystemExit). Python's C
        handler also writes each signal's number to the wakeup fd, whatever becomes of the exception."""
        seen: list[int] = []
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        previous_hook = sys.unraisablehook

        def quiet_when_a_stop(unraisable) -> None:
            # A handler's lost exception would print as a traceback; the wakeup fd has its signal.
            if not isinstance(unraisable.exc_value, (KeyboardInterrupt, SystemExit)):
                previous_hook(unraisable)

        sys.unraisablehook = quiet_when_a_stop
        try:
            yield seen
        finally:
            sys.unraisablehook = previous_hook
            signal.set_wakeup_fd(previous)
            with contextlib.suppress(BlockingIOError):
                seen += [s for s in os.read(read_end, 4096) if s in STOP_SIGNALS]
            os.close(read_end)
            os.close(write_end)

    @staticmethod
    def restore_defaults() -> None:
        """One more signal ends the process at once (Ray's own processes end with it)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


class LocalRayLost(RuntimeError):
    """The Ray this process started lost processes of its own while raylm stopped."""


def while_local_ray_lives(stop: Callable[[], None], poll_s: float = 0.1) -> None:
    """Run ``stop`` (Ray calls) to its end, unless a process of the local Ray exits meanwhile: then raise
    LocalRayLost naming them, at once. A stop signal sent to raylm's whole process group (`kill -- -PGID`, a
    supervisor's group stop) reaches Ray's daemons too, which share the group: the dashboard and the log monitor
    exit within 50 ms, the raylet (and every worker with it, the replicas included) within ~10 s, and a drain's
    Ray calls would wait 60 s for them before Ray ends the process. ``stop`` runs in a thread so that the main
    thread watches, and still takes a second stop signal."""
    import ray._private.worker

    node = ray._private.worker._global_node
    if node is None:  # not a Ray this process started: nothing of it to watch
        stop()
        return
    dead_before = {id(process) for _, process in node.dead_processes()}
    failed: list[BaseException] = []

    def run() -> None:
        try:
            stop()
        except BaseException as e:  # handed to the main thread
            failed.append(e)

    thread = threading.Thread(target=run, name="raylm-stop", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        dead = sorted({kind for kind, p in node.dead_processes() if id(p) not in dead_before})
        if dead and thread.is_alive():
            raise LocalRayLost(
                f"Ray's own {', '.join(dead)} exited while raylm stopped: the stop signal reached raylm's whole "
                f"process group, which Ray's daemons share, and Ray goes down with them, so requests in flight "
                f"are cut, not drained; to drain, signal raylm serve's process alone (systemd: KillMode=mixed, "
                f"docs/operations.md)"
            )
    if failed:
        raise failed[0]


def haproxy_dies_with_its_parent() -> None:
    """Have the Ray about to start here run Serve's HAProxy (the operator's RAY_SERVE_HAPROXY_BINARY_PATH, else
    Serve's own) through a launcher that ties it to its parent and to this process. Call before Ray starts: its
    processes inherit the environment."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY
    from ray.serve._private.haproxy import _resolve_haproxy_binary  # Serve's own choice, and its error if none

    if not (RAY_SERVE_ENABLE_HA_PROXY and sys.platform.startswith("linux")):  # no HAProxy, or no prctl
        return
    os.environ[OWNER_ENV] = str(os.getpid())  # this process's own, not one inherited from whoever started it
    haproxy = _resolve_haproxy_binary()
    if Path(haproxy).parent == _launcher_dir():  # a second start in this process: already ours
        return
    os.environ[LAUNCHER_ENV] = str(write_launcher(haproxy))


def _launcher_dir() -> Path:
    """Beside the converted default model (workers/default_model.py): the user's own, so nobody else can swap
    the file that Ray executes."""
    return Path(os.environ.get("RAYLM_CACHE_DIR") or Path.home() / ".cache" / "raylm") / "bin"


def write_launcher(haproxy: str) -> Path:
    """The launcher for this interpreter and HAProxy binary, written once (named by its content) and atomically,
    so that servers starting at once never execute a half-written file."""
    text = LAUNCHER.format(python=sys.executable, haproxy=haproxy, owner_env=OWNER_ENV)
    path = _launcher_dir() / f"haproxy-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(text)
        partial.chmod(0o755)
        partial.replace(path)
    return path
