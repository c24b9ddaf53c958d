"""Test hosts as Linux network namespaces: each has its own network stack, address and interfaces, joined to
the others by a veth link to a bridge the test creates, so traffic between hosts crosses a real (virtual)
link and a host can be cut off or killed alone. A Ray node runs in each (`ray start` inside the namespace).

Everything a run creates is named ``rlmh<pid>-...``, so the leftovers of a run that died without cleaning up
(its pid gone) are removed by the next one. The root namespace gets no address on the bridge: the hosts reach
nothing but each other, and drivers run inside the head's namespace."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "rlmh"
VENV_BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
RAY_START_TIMEOUT_S = 90
HOSTNAME = os.uname().nodename


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def why_hosts_cannot_be_made() -> str | None:
    """None when this machine can build namespace hosts, else the reason (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces and veth links need root"
    if shutil.which("ip") is None:
        return "needs `ip` (Debian's iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def remove_leftovers() -> None:
    """Remove the namespaces and links of earlier runs whose process is gone."""

    def dead(name: str) -> bool:
        pid = name[len(PREFIX) :].split("-", 1)[0]
        return pid.isdigit() and not Path(f"/proc/{pid}").exists()

    for ns in ip("netns", "list").stdout.split():
        if ns.startswith(PREFIX) and dead(ns):
            kill_namespace(ns)
    for line in ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX) and dead(name):
            ip("link", "del", name, check=False)


def kill_processes(ns: str) -> None:
    """SIGKILL every process in namespace ``ns``, at once (nothing in it gets to say goodbye)."""
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def kill_namespace(ns: str) -> None:
    kill_processes(ns)
    ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@dataclass(slots=True)
class Host:
    """One test host: namespace ``ns`` whose ``eth0`` holds ``ip`` on the test's bridge; ``veth`` is the link's
    root-side end (down, the host is cut off), ``tmp`` its own Ray temp dir (Ray's sockets and session files
    live on the filesystem every namespace shares)."""

    name: str
    ns: str
    ip: str
    veth: str
    tmp: Path

    def cmd(self, *args: str, env: dict[str, str] | None = None) -> list[str]:
        """``args`` run inside this host, with ``env`` added to the environment."""
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        # Token auth off: Ray 2.60 turns it on for a head whenever ~/.ray/auth_token exists, which a local
        # ray.init creates, and then nodes joining without the token are refused. The hosts reach only each other.
        return [
            "ip",
            "netns",
            "exec",
            self.ns,
            "env",
            f"RAY_TMPDIR={self.tmp}",
            "RAY_AUTH_MODE=disabled",
            *pairs,
            *args,
        ]

    def process_names(self) -> list[str]:
        names = []
        for pid in ip("netns", "pids", self.ns, check=False).stdout.split():
            try:
                names.append(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:  # gone meanwhile
                pass
        return names

    def kill(self) -> None:
        """The host dies: its Ray node and every actor on it."""
        kill_processes(self.ns)


@dataclass(slots=True)
class Network:
    """A bridge and the hosts on it; ``close()`` removes everything it made, whatever state it is in."""

    tag: str
    subnet: str  # the first three octets of the hosts' /24
    dir: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)
    servers: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def create(cls) -> Network:
        remove_leftovers()
        tag = f"{PREFIX}{os.getpid()}"
        # Short: Ray's Unix socket paths live under each host's temp dir and must stay under 108 bytes.
        net = cls(tag, f"10.250.{os.getpid() % 250}", Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp")))
        net._add_link(f"{tag}-br", "type", "bridge")
        ip("link", "set", f"{tag}-br", "up")
        return net

    def _add_link(self, name: str, *spec: str) -> None:
        self.links.append(name)  # first: close() removes it even if the add half-failed
        ip("link", "add", name, *spec)

    def add_host(self, name: str) -> Host:
        n = len(self.hosts) + 1
        host = Host(name, f"{self.tag}-{name}", f"{self.subnet}.{n}", f"{self.tag}-v{n}", self.dir / name)
        host.tmp.mkdir()
        ip("netns", "add", host.ns)
        self.hosts[name] = host
        self._add_link(host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        ip("link", "set", host.veth, "master", f"{self.tag}-br", "up")
        ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        ip("-n", host.ns, "link", "set", "eth0", "up")
        ip("-n", host.ns, "link", "set", "lo", "up")
        # As on a real machine, a default route: Ray finds a node's own IP by the route out. Nothing is behind
        # it: the bridge has no uplink and the root namespace no address on it.
        ip("-n", host.ns, "route", "add", "default", "dev", "eth0")
        return host

    def add_dead_end(self, host: Host, subnet: str) -> str:
        """Give ``host`` a second interface, ``eth1``, on a link that reaches no other host, and make its host
        name resolve to eth1's address: what gloo binds to by default. Returns that address."""
        addr = f"{subnet}.{list(self.hosts).index(host.name) + 1}"
        veth = f"{self.tag}-d{len(self.links)}"
        self._add_link(veth, "type", "veth", "peer", "name", "eth1", "netns", host.ns)
        ip("link", "set", veth, "up")
        ip("-n", host.ns, "addr", "add", f"{addr}/24", "dev", "eth1")
        ip("-n", host.ns, "link", "set", "eth1", "up")
        # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc: this host alone resolves its name to eth1.
        etc = Path("/etc/netns") / host.ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {HOSTNAME}\n")
        return addr

    def start_sshd(self, host: Host, authorized_keys: Path, home: Path, env: dict[str, str]) -> None:
        """An SSH server on ``host``'s port 22 that logs in as root with the keys in ``authorized_keys``; its
        sessions get ``env``. It runs in PID and mount namespaces of its own: there the bare `ray stop` that
        `ray up` and `ray down` run stops only this host's Ray, not every Ray on the machine, and ``home`` is
        mounted on /root, root's home as ssh reads it from the password database (it expands ``~`` in key
        paths there, not from $HOME). close() ends it with the host."""
        d = self.dir / f"{host.name}-sshd"
        d.mkdir()
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True, timeout=30
        )
        (d / "sshd_config").write_text(f"""\
ListenAddress {host.ip}:22
HostKey {d}/host_key
PidFile {d}/sshd.pid
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
SetEnv {" ".join(f"{k}={v}" for k, v in env.items())}
""")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        with (d / "sshd.log").open("w") as log:
            self.servers.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        host.ns,
                        "unshare",
                        "--pid",
                        "--fork",
                        "--mount-proc",
                        "--kill-child",
                        "sh",
                        "-c",
                        'mount --bind "$0" /root && exec /usr/sbin/sshd -D -e -f "$1"',
                        str(home),
                        str(d / "sshd_config"),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_for(lambda: self.reaches(host, host.ip, 22), f"sshd listening on {host.name}", 15)

    def reaches(self, host: Host, ip: str, port: int) -> bool:
        """Whether a TCP connection from ``host`` to ``ip``:``port`` succeeds."""
        return subprocess.run(host.cmd("nc", "-z", "-w", "2", ip, str(port)), timeout=30).returncode == 0

    def start_ray(self, host: Host, num_cpus: int, head: Host | None = None, env: dict[str, str] | None = None) -> None:
        """`ray start` in ``host``: a head when ``head`` is None, else a node joining ``head``."""
        join = ["--head", "--port=6379", "--include-dashboard=false"] if head is None else [f"--address={head.ip}:6379"]
        done = subprocess.run(
            host.cmd(
                str(VENV_BIN / "ray"),
                "start",
                *join,
                f"--node-ip-address={host.ip}",
                f"--num-cpus={num_cpus}",
                "--num-gpus=0",
                "--object-store-memory=100000000",
                "--disable-usage-stats",
                env=env,
            ),
            capture_output=True,
            text=True,
            timeout=RAY_START_TIMEOUT_S,
        )
        if done.returncode:
            raise RuntimeError(f"`ray start` in {host.name} failed:\n{(done.stdout + done.stderr)[-3000:]}")

    def driver(self, host: Host, func: str, *args: str, timeout_s: float, env: dict[str, str] | None = None) -> dict:
        """Run ``tests.hosts_driver.<func>(head_ip, *args)`` in a Python process inside ``host`` (the
        first host is the head) and return the JSON it prints last; fail with its output if it fails or
        overruns ``timeout_s``."""
        head = next(iter(self.hosts.values()))
        cmd = host.cmd(sys.executable, "-m", "tests.hosts_driver", func, head.ip, *args, env=env)
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"driver {func} ran over {timeout_s:g} s:\n{(e.stderr or b'')[-4000:]!r}") from None
        assert done.returncode == 0, f"driver {func} failed:\n{done.stderr[-6000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        for host in self.hosts.values():
            kill_namespace(host.ns)
        for server in self.servers:
            server.wait(timeout=30)
        for name in self.links:
            ip("link", "del", name, check=False)  # most went with their namespace
        # In the background: the hosts' homes hold whole installs (torch, Ray), whose removal on this disk takes
        # a minute that the tests after this one need not wait for.
        subprocess.Popen(["rm", "-rf", str(self.dir)], start_new_session=True)
        try:
            os.rmdir("/etc/netns")  # only when no one else keeps a host's files there
        except OSError:
            pass


def report_of(reports: dict[str, dict], func: str) -> dict:
    """``func``'s report from the reports of a ``several`` driver, failing with its traceback if it raised."""
    report = reports[func]
    assert "failed" not in report, report.get("failed")
    return report


def wait_for(predicate, what: str, timeout_s: float, every_s: float = 0.2) -> float:
    """Poll until ``predicate()`` holds; return the seconds it took, or raise naming ``what``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(every_s)
    return time.monotonic() - start
