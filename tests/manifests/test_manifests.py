"""The Kubernetes manifests and Serve configs (manifests/): every KubeRay manifest validates against
KubeRay's CRD schemas, where an unknown key fails; every Serve config (serve_config*.yaml and each RayService's
serveConfigV2) parses with Ray Serve's own schema and its import path builds raylm's app; and what the
manifests ask of the cluster fits what the Serve config asks of it, per node type where prefill and decode
engines have their own (PD).

The CRD schemas are vendored in tests/manifests/schemas/kuberay (its README says where they come from)."""

import copy
import importlib
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray import serve
from ray.serve._private.build_app import build_app
from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

from cli import build_parser
from cli.batch import batch_config
from serve import deployment_options
from serve.app import app_args_list

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kuberay"
SCHEMA_FILES = {"RayService": "rayservice_v1.json", "RayCluster": "raycluster_v1.json"}
# RayJob's spec as KubeRay's ray-operator/apis/ray/v1/rayjob_types.go declares it (RayJobSpec); its two nested
# templates are the RayCluster CRD's own (a RayClusterSpec, and a PodTemplateSpec like every group's).
RAYJOB_SPEC = {
    "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
    "backoffLimit": {"type": "integer", "minimum": 0},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    "clusterSelector": {"type": "object", "additionalProperties": {"type": "string"}},
    "submitterConfig": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"backoffLimit": {"type": "integer"}},
    },
    "managedBy": {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
    "deletionStrategy": {"type": "object"},
    "entrypoint": {"type": "string"},
    "runtimeEnvYAML": {"type": "string"},
    "jobId": {"type": "string"},
    "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode"]},
    "entrypointResources": {"type": "string"},
    "entrypointNumCpus": {"type": "number"},
    "entrypointNumGpus": {"type": "number"},
    "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
    "shutdownAfterJobFinishes": {"type": "boolean"},
    "suspend": {"type": "boolean"},
    "schedule": {"type": "string"},
}
GPU = "nvidia.com/gpu"
# The custom resource each PD deployment's ranks ask, one per GPU of the node type that should run them.
PD_NODE_RESOURCES = {"PrefillServer": "prefill_gpu", "LLMServer": "decode_gpu"}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


KUBERAY = [p for p in MANIFESTS if "kind" in load(p)]
SERVE_CONFIGS = {p.name: load(p) for p in MANIFESTS if "kind" not in load(p)} | {
    f"{p.name}:serveConfigV2": yaml.safe_load(load(p)["spec"]["serveConfigV2"])
    for p in KUBERAY
    if load(p)["kind"] == "RayService"
}


def schema(kind: str) -> dict:
    if kind != "RayJob":
        return json.loads((SCHEMAS / SCHEMA_FILES[kind]).read_text())
    cluster = schema("RayCluster")
    spec = cluster["properties"]["spec"]
    pod_template = spec["properties"]["headGroupSpec"]["properties"]["template"]
    job_spec = {"rayClusterSpec": spec, "submitterPodTemplate": pod_template, **RAYJOB_SPEC}
    cluster["properties"]["spec"] = {"type": "object", "additionalProperties": False, "properties": job_spec}
    cluster["properties"].pop("status")  # RayJobStatus: written by the operator, never in a manifest
    cluster["properties"]["kind"] = {"enum": ["RayJob"]}
    return cluster


def validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(schema(kind))


def cluster_spec(manifest: dict) -> dict:
    key = {"RayService": "rayClusterConfig", "RayJob": "rayClusterSpec"}.get(manifest["kind"])
    return manifest["spec"][key] if key else manifest["spec"]


def groups(manifest: dict) -> list[dict]:
    spec = cluster_spec(manifest)
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def gpu_group(manifest: dict) -> dict:
    """The first worker group with GPUs (PD's manifest has one per node type)."""
    return next(
        g
        for g in cluster_spec(manifest)["workerGroupSpecs"]
        if GPU in g["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


def limits(group: dict) -> dict[str, float]:
    """One pod's resources in Ray's terms."""
    lim = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return {"CPU": float(lim["cpu"]), "GPU": float(lim.get(GPU, 0))}


# ---- KubeRay's schemas ------------------------------------------------------------------------------


def test_the_manifests_are_a_rayservice_a_raycluster_and_a_serve_config():
    # The checks below are parametrized over what these globs find: make sure they find it.
    assert sorted(load(p)["kind"] for p in KUBERAY) == ["RayCluster", "RayJob"] + ["RayService"] * 4
    assert sorted(SERVE_CONFIGS) == [
        "rayservice-pd.yaml:serveConfigV2",
        "rayservice-pipeline.yaml:serveConfigV2",
        "rayservice-two-models.yaml:serveConfigV2",
        "rayservice.yaml:serveConfigV2",
        "serve_config.yaml",
        "serve_config_pd.yaml",
    ]


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_manifest_validates_against_the_kuberay_crd(path):
    manifest = load(path)
    validator(manifest["kind"]).validate(manifest)


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


MISTAKES = {
    "misspelled cluster key": (
        lambda m: _rename(cluster_spec(m), "enableInTreeAutoscaling", "enableInTreeAutoScaling"),
        "'enableInTreeAutoScaling' was unexpected",
    ),
    "misspelled container key": (
        lambda m: _rename(gpu_group(m)["template"]["spec"]["containers"][0], "readinessProbe", "readynessProbe"),
        "'readynessProbe' was unexpected",
    ),
    "misspelled probe key": (
        lambda m: _rename(groups(m)[0]["template"]["spec"]["containers"][0]["livenessProbe"], "exec", "execute"),
        "'execute' was unexpected",
    ),
    "rayStartParams value not a string": (
        lambda m: groups(m)[0]["rayStartParams"].update({"num-cpus": 0}),
        "0 is not of type 'string'",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_a_mistake_in_a_manifest_fails_the_schema(path, mistake):
    manifest = load(path)
    v = validator(manifest["kind"])
    mutate, message = MISTAKES[mistake]
    bad = copy.deepcopy(manifest)
    mutate(bad)
    with pytest.raises(jsonschema.ValidationError, match=message):
        v.validate(bad)


# ---- the Serve configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_parses_with_serves_schema_and_names_no_unknown_key(name):
    raw = SERVE_CONFIGS[name]
    config = ServeDeploySchema.model_validate(raw)
    assert [app.name for app in config.applications] == ["raylm"]
    # Serve's schemas drop keys they do not know, so a misspelled one would vanish without a word.
    assert set(raw) <= set(ServeDeploySchema.model_fields)
    for app in raw["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields)
        for deployment in app.get("deployments", []):
            assert set(deployment) <= set(DeploymentSchema.model_fields)


def built_app(app: ServeApplicationSchema) -> serve.Application:
    module, attr = app.import_path.split(":")
    return getattr(importlib.import_module(module), attr)(app.args)


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_import_path_builds_the_app(name):
    (app,) = ServeDeploySchema.model_validate(SERVE_CONFIGS[name]).applications
    assert isinstance(built_app(app), serve.Application)


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_restates_a_deployments_bundles_adding_only_a_node_types_resource(name):
    """A Serve config that restates a deployment's placement group bundles (to pin its ranks to a node type) names
    a deployment the app has, and its bundles are the app's own, with one node-type resource on each rank's."""
    (app,) = ServeDeploySchema.model_validate(SERVE_CONFIGS[name]).applications
    own = {
        d.name: d._replica_config.placement_group_bundles for d in build_app(built_app(app), name=app.name).deployments
    }
    for deployment in app.deployments:
        resource = PD_NODE_RESOURCES[deployment.name]
        bundles = deployment.placement_group_bundles
        assert [{k: v for k, v in b.items() if k != resource} for b in bundles] == own[deployment.name]
        assert [b.get(resource) for b in bundles] == [1 if "GPU" in b else None for b in bundles]


# ---- what the cluster holds against what Serve asks -------------------------------------------------


def serve_args(manifest: dict) -> dict[str, Any]:
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    return app["args"]


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayservice-pipeline.yaml", "rayservice-two-models.yaml"])
def test_rayservice_gpu_pods_hold_serves_min_and_max_replicas(name):
    manifest = load(ROOT / "manifests" / name)
    apps = app_args_list(serve_args(manifest))  # one per model
    spec = cluster_spec(manifest)
    assert spec["enableInTreeAutoscaling"] is True
    head, workers = limits(spec["headGroupSpec"]), gpu_group(manifest)
    pod = limits(workers)
    for bound, pods in (("min_replicas", workers["minReplicas"]), ("max_replicas", workers["maxReplicas"])):
        gpus = cpus = 0.0
        for args in apps:
            # cuda, not auto: auto would follow the GPUs present when the app is built, before any GPU pod is up.
            assert args.engine.device == "cuda"
            bundles = deployment_options(args)["placement_group_bundles"]  # one replica: its own, the engine's
            assert sum(b.get("GPU", 0) for b in bundles) == args.engine.world_size
            gpus += getattr(args, bound) * args.engine.world_size
            cpus += getattr(args, bound) * sum(b["CPU"] for b in bundles)
        # Exactly the GPUs that many replicas use: fewer and the last replica never starts, more and they idle.
        assert pods * pod["GPU"] == gpus
        cpus += 1 if len(apps) > 1 else 0  # the ModelRouter's replica
        assert cpus <= head["CPU"] + pods * pod["CPU"], f"{bound} replicas need {cpus} CPUs"


def node_resources(group: dict) -> dict[str, float]:
    """A worker group's custom Ray resources: KubeRay takes rayStartParams' value as a JSON string, quoted."""
    return json.loads(json.loads(group["rayStartParams"].get("resources", '"{}"')))


def test_the_pd_rayservice_serves_the_pd_serve_config():
    assert SERVE_CONFIGS["rayservice-pd.yaml:serveConfigV2"] == SERVE_CONFIGS["serve_config_pd.yaml"]


def test_pd_node_groups_hold_each_sides_min_and_max_replicas():
    """Prefill and decode engines on their own node types: each side's worker group offers its resource, one per
    GPU, and its minReplicas / maxReplicas pods hold exactly that side's min_replicas / max_replicas engines."""
    manifest = load(ROOT / "manifests" / "rayservice-pd.yaml")
    (args,) = app_args_list(serve_args(manifest))
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    bundles = {d["name"]: d["placement_group_bundles"] for d in app["deployments"]}
    spec = cluster_spec(manifest)
    cpus_needed, cpus_held = 0.0, limits(spec["headGroupSpec"])["CPU"]
    for name, side in (("LLMServer", args), ("PrefillServer", args.prefill)):
        resource = PD_NODE_RESOURCES[name]
        (group,) = [g for g in spec["workerGroupSpecs"] if resource in node_resources(g)]
        pod = limits(group)
        assert node_resources(group) == {resource: pod["GPU"]}
        assert sum(b.get(resource, 0) for b in bundles[name]) == side.engine.world_size
        for bound, pods in (("min_replicas", group["minReplicas"]), ("max_replicas", group["maxReplicas"])):
            assert pods * pod["GPU"] == getattr(side, bound) * side.engine.world_size, f"{name} {bound}"
        cpus_needed += side.max_replicas * sum(b["CPU"] for b in bundles[name])
        cpus_held += group["maxReplicas"] * pod["CPU"]
    assert cpus_needed <= cpus_held


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_every_ray_container_reads_the_model_from_the_pvc_and_has_probes(path):
    manifest = load(path)
    for group in groups(manifest):
        pod = group["template"]["spec"]
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        (container,) = pod["containers"]
        mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
        assert mounts, f"{group.get('groupName', 'head')} mounts no PVC"
        if manifest["kind"] == "RayService":
            for args in app_args_list(serve_args(manifest)):
                assert any(args.engine.model.startswith(m + "/") for m in mounts)
        if manifest["kind"] == "RayJob":
            assert any(batch_args(manifest)[1].engine.model.startswith(m + "/") for m in mounts)
        assert "exec" in container["readinessProbe"] and "exec" in container["livenessProbe"]


# ---- the batch RayJob -----------------------------------------------------------------------------


def batch_args(manifest: dict):
    """The RayJob's entrypoint as raylm's own parser reads it, and the BatchConfig it makes."""
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv[:2] == ["raylm", "batch"]
    args = build_parser().parse_args(argv[1:])
    return args, batch_config(args)


def test_the_rayjob_reads_and_writes_its_files_on_the_heads_claim_and_ends_with_its_cluster():
    manifest = load(ROOT / "manifests" / "rayjob-batch.yaml")
    args, _ = batch_args(manifest)
    head = cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]
    claims = {
        v["name"]
        for v in head["volumes"]
        if "persistentVolumeClaim" in v and not v["persistentVolumeClaim"].get("readOnly")
    }
    writable = [
        Path(m["mountPath"])
        for m in head["containers"][0]["volumeMounts"]
        if m["name"] in claims and not m.get("readOnly")
    ]
    # The driver (on the head) appends the answers, and a retry (backoffLimit) resumes from the same file.
    for path in (args.input_file, args.output_file):
        assert any(Path(path).is_relative_to(m) for m in writable), path
    assert manifest["spec"]["shutdownAfterJobFinishes"] and manifest["spec"]["backoffLimit"] >= 1


def test_the_rayjobs_gpu_group_holds_every_engine_of_the_pool():
    manifest = load(ROOT / "manifests" / "rayjob-batch.yaml")
    _, config = batch_args(manifest)
    group = gpu_group(manifest)
    assert config.concurrency * config.engine.world_size <= group["maxReplicas"] * limits(group)["GPU"]
    # The GPU pods start from zero while the engines wait to be placed.
    assert group["minReplicas"] == 0 and config.engine.placement_timeout_s >= 600


def test_a_misspelled_rayjob_key_fails_the_schema():
    bad = load(ROOT / "manifests" / "rayjob-batch.yaml")
    _rename(bad["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinish")
    with pytest.raises(jsonschema.ValidationError, match="'shutdownAfterJobFinish' was unexpected"):
        validator("RayJob").validate(bad)


def test_the_rayjobs_cluster_is_the_batch_raycluster_with_the_data_claim_on_its_head():
    """KubeRay cannot point a RayJob at another manifest's spec, so the RayJob restates raycluster.yaml's: this keeps
    the two from drifting apart."""
    job = copy.deepcopy(cluster_spec(load(ROOT / "manifests" / "rayjob-batch.yaml")))
    head = job["headGroupSpec"]["template"]["spec"]
    head["volumes"] = [v for v in head["volumes"] if v["name"] != "batch-data"]
    container = head["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "batch-data"]
    assert job == cluster_spec(load(ROOT / "manifests" / "raycluster.yaml"))
