"""The `ray up` cluster YAMLs (cluster/ray_up/): each passes the checks `ray up` itself runs, and the
on-premises one brings up a real head over SSH on this machine: `ray up`, `ray exec` of `raylm generate`,
`ray down`.

The SSH server runs in its own PID namespace, with its own HOME and Ray temp dir: `ray down` runs a bare
`ray stop` on the head, which stops every Ray process it can see, and on this machine that would include the
test session's Ray and anyone else's. In the namespace it sees only the head's, and killing the namespace
ends whatever the head left behind."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from shlex import quote

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((ROOT / "cluster" / "ray_up").glob("*.yaml"))
ONPREM_YAML = ROOT / "cluster" / "ray_up" / "onprem.yaml"
VENV_BIN = Path(sys.executable).parent
PROMPT = "The capital of France is"
MAX_TOKENS = 8
# The tools the test needs, as `shutil.which` finds them, and the Debian package of each.
TOOLS = {"/usr/sbin/sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
         "rsync": "rsync", "nc": "netcat-openbsd"}
APT_TIMEOUT_S = 600
RAY_CLI_TIMEOUT_S = 300  # a `ray up` / `ray exec` that takes longer has hung: fail instead of stalling CI


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ---- the checks `ray up` runs ---------------------------------------------------------------------


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_passes_ray_ups_own_checks(path):
    config = prepare_config(load(path))
    validate_config(config)
    # The node types' min/max bounds only mean something if the head runs the autoscaler.
    assert any("--autoscaling-config=~/ray_bootstrap_config.yaml" in c for c in config["head_start_ray_commands"])


def test_the_cluster_yamls_are_the_aws_and_on_premises_ones():
    providers = {load(p)["provider"]["type"] for p in CLUSTER_YAMLS}
    assert providers == {"aws", "local"}
    # EC2's g and p families are its GPU instances; the autoscaler may grow them between their bounds.
    gpu_types = [t for t in load(ROOT / "cluster" / "ray_up" / "aws-gpu.yaml")["available_node_types"].values()
                 if t["node_config"]["InstanceType"].startswith(("g", "p"))]
    assert gpu_types and all(t["max_workers"] > t["min_workers"] for t in gpu_types)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_a_misspelled_key_fails_ray_ups_checks(path):
    config = load(path)
    config["setup_command"] = config.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError, match="'setup_command' was unexpected"):
        validate_config(prepare_config(config))


# ---- `ray up` for real, on this machine -------------------------------------------------------------


@dataclass(slots=True)
class SSHHead:
    """An SSH server on 127.0.0.1 that logs in as root with ``key``; its sessions see ``home`` as HOME and
    ``ray_tmp`` as RAY_TMPDIR, and only the processes of its own PID namespace."""

    dir: Path
    port: int
    key: Path
    home: Path
    ray_tmp: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def install_ssh_tools() -> None:
    """Install what is missing of the SSH server, client, rsync and nc from Debian's packages, or skip saying
    why that cannot be done here."""
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"needs {missing}, and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-qq", "-o", "DPkg::Lock::Timeout=120"]
    for cmd in (apt + ["update"], apt + ["install", "-y", "--no-install-recommends", *missing]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`{' '.join(cmd)}` took over {APT_TIMEOUT_S} s")
        if done.returncode:
            pytest.skip(f"`{' '.join(cmd)}` failed: {(done.stdout + done.stderr)[-2000:]}")


def check_pid_namespaces() -> None:
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True,
                          timeout=30)
    if done.returncode:
        pytest.skip(f"cannot start a PID namespace ({done.stderr.strip()}), and outside one the `ray stop` that "
                    f"`ray down` runs would stop every Ray on this machine")


def wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"sshd is not listening on port {port}: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def ssh_head() -> Iterator[SSHHead]:
    if os.geteuid() != 0:
        pytest.skip("the head is reached as root over SSH, which needs an sshd running as root")
    install_ssh_tools()
    check_pid_namespaces()
    # Short: Ray's Unix socket paths live under RAY_TMPDIR and must stay under 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="rlm-", dir="/tmp"))
    head = SSHHead(d, free_port(), d / "key", d / "home", d / "h")
    head.home.mkdir()
    head.ray_tmp.mkdir()
    for key in (d / "host_key", head.key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    shutil.copy(f"{head.key}.pub", d / "authorized_keys")
    # HOME: what `ray up` writes to the head's home (bootstrap config and key, ~/.bashrc, the synced packages)
    # lands here, not in root's. RAY_TMPDIR: the head's Ray sessions and address file are its own.
    (d / "sshd_config").write_text(f"""\
ListenAddress 127.0.0.1:{head.port}
HostKey {d}/host_key
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
SetEnv HOME={head.home} RAY_TMPDIR={head.ray_tmp}
""")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    log = d / "sshd.log"
    with log.open("w") as out:
        # --kill-child: when unshare dies, so does sshd, the namespace's first process, and with it every
        # process in the namespace.
        sshd = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "/usr/sbin/sshd",
                                 "-D", "-e", "-f", str(d / "sshd_config")], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_listening(head.port, sshd, log)
        yield head
    finally:
        sshd.kill()  # SIGKILL: unshare blocks SIGTERM while it waits for its child
        sshd.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


def head_config(head: SSHHead, path: Path) -> None:
    """The on-premises YAML pointed at ``head``: its address and key, and this checkout's venv instead of an
    install, started on ports of its own so it never meets another Ray on this machine."""
    config = load(ONPREM_YAML)
    config["cluster_name"] = f"raylm-test-{os.getpid()}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    # Ray's SSH settings have no port: reach sshd's through nc.
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(head.key),
                      "ssh_proxy_command": f"nc %h {head.port}"}
    config["setup_commands"] = [f"echo 'export PATH=\"{VENV_BIN}:$PATH\"' >> ~/.bashrc"]
    ports = ["port", "node-manager-port", "object-manager-port", "ray-client-server-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port"]
    flags = " ".join(f"--{name}={free_port()}" for name in ports)
    config["head_start_ray_commands"] = [
        "ray stop",
        f"ray start --head {flags} --include-dashboard=false --num-cpus=2 --disable-usage-stats "
        f"--autoscaling-config=~/ray_bootstrap_config.yaml",
    ]
    path.write_text(yaml.safe_dump(config))


def ray_cli(head: SSHHead, *args: str) -> str:
    """Run the `ray` CLI from the repository root (file_mounts are relative to it) with its local state (the
    local provider's cluster state, the config cache) in the test's dir; return its output, or fail with it."""
    local = head.dir / "local"
    local.mkdir(exist_ok=True)
    env = {**os.environ, "RAY_TMPDIR": str(local), "TMPDIR": str(local)}
    try:
        done = subprocess.run([str(VENV_BIN / "ray"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=RAY_CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`ray {args[0]}` took over {RAY_CLI_TIMEOUT_S} s: {e.stdout!r} {e.stderr!r}") from None
    out = (done.stdout + done.stderr).replace("\r\n", "\n")
    assert done.returncode == 0, f"`ray {' '.join(args)}` failed:\n{out[-4000:]}"
    return out


def gcs_accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def greedy_reference(model: str) -> str:
    """What `raylm generate` prints for PROMPT with its defaults (greedy), run in this process without Ray."""
    llm = LLM(model=model, executor="inprocess")
    try:
        (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    return out.outputs[0].text


def test_ray_up_exec_down_on_this_machine(ssh_head, default_model_dir, ray_session):
    expected = greedy_reference(default_model_dir)
    assert expected.strip()
    config = ssh_head.dir / "cluster.yaml"
    head_config(ssh_head, config)

    ray_cli(ssh_head, "up", "-y", "--no-config-cache", str(config))
    synced = ssh_head.home / "raylm"
    assert (synced / "cluster" / "serve.py").is_file() and (synced / "pyproject.toml").is_file()
    assert not list(synced.rglob("__pycache__"))  # rsync_exclude held
    gcs = (ssh_head.ray_tmp / "ray" / "ray_current_cluster").read_text().strip()
    assert gcs_accepts(gcs)

    out = ray_cli(ssh_head, "exec", str(config), f"raylm generate --address auto --model {quote(default_model_dir)} "
                                                 f"--prompt {quote(PROMPT)} --max-tokens {MAX_TOKENS}")
    assert expected in out

    ray_cli(ssh_head, "down", "-y", str(config))
    deadline = time.monotonic() + 30
    while gcs_accepts(gcs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not gcs_accepts(gcs), "the head's GCS still answers after `ray down`"
    # The session's Ray, outside the namespace, lives on.
    assert ray.get(ray.put("alive"), timeout=30) == "alive"
    assert all(n["Alive"] for n in ray.nodes())
