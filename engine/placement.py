"""Where an engine's actors go: its bundles, reserving them, and saying what is missing when they do not fit."""

from __future__ import annotations

from collections import Counter

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from engine.config import EngineConfig

SCHEDULER_CPUS = 1.0  # the scheduler's bundle; the actor mostly awaits, but Ray needs a non-empty bundle
ACCELERATOR_SHARE = 0.001  # of a node's accelerator_type:NAME resource, per rank: a marker, not a count


def engine_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    """Bundle 0 for the scheduler actor, bundle 1 + r for rank r, stage by stage (rank r is in stage r // tp), so
    that PACK fills a node with one stage's ranks before it starts the next stage's. With an accelerator type each
    rank asks a sliver of that node resource (Ray gives a node one unit of its own type), which only such nodes
    have, as Ray Serve LLM asks it."""
    rank = {"CPU": float(config.num_threads or 1)} | ({"GPU": 1.0} if use_gpu else {})
    if config.accelerator_type is not None:
        rank[f"accelerator_type:{config.accelerator_type}"] = ACCELERATOR_SHARE
    return [{"CPU": SCHEDULER_CPUS}] + [dict(rank) for _ in range(config.world_size)]


def place(
    bundles: list[dict[str, float]], strategy: str, timeout_s: float, stage_size: int, name: str = ""
) -> PlacementGroup:
    """Reserve the bundles (a group called ``name``), or remove the request and raise RuntimeError naming what is
    missing; ranks come in stages of ``stage_size`` (engine_bundles' order)."""
    pg = placement_group(bundles, strategy=strategy, name=name)
    if pg.wait(timeout_s):
        return pg
    remove_placement_group(pg)
    raise RuntimeError(placement_error(bundles, strategy, timeout_s) + stages_error(bundles[1:], stage_size))


def stages_error(rank_bundles: list[dict[str, float]], stage_size: int) -> str:
    """With pipeline stages, what each stage needs on one node and whether any node is that large: a stage split
    over nodes sends its every tensor-parallel all-reduce between them."""
    if len(rank_bundles) <= stage_size:
        return ""
    largest: Counter[str] = Counter()
    for n in ray.nodes():
        if n["Alive"]:
            for k, v in n["Resources"].items():
                largest[k] = max(largest[k], v)
    parts = []
    for s in range(0, len(rank_bundles), stage_size):
        need: Counter[str] = Counter()
        for b in rank_bundles[s : s + stage_size]:
            need.update(b)
        fits = all(largest[k] >= v for k, v in need.items())
        parts.append(
            f"stage {s // stage_size} (ranks {s}-{s + stage_size - 1}) needs {_show(need, need)} on one node"
            + ("" if fits else f": no node is that large (the largest has {_show(largest, need)})")
        )
    return "; per stage: " + "; ".join(parts)


def placement_error(bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> str:
    need: Counter[str] = Counter()
    for b in bundles:
        need.update(b)
    have, free = ray.cluster_resources(), ray.available_resources()
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    missing = {k: v - have.get(k, 0) for k, v in need.items() if v > have.get(k, 0)}
    msg = (
        f"cannot place the engine within placement_timeout_s={timeout_s:g}: its {len(bundles)} bundles "
        f"{bundles} ({strategy}) need {_show(need, need)} in all; the cluster has {_show(have, need)} "
        f"({_show(free, need)} free) on {nodes} node(s)"
    )
    if missing:
        return msg + f"; missing: {_show(missing, missing)}"
    if strategy == "STRICT_SPREAD" and nodes < len(bundles):
        return msg + (
            f"; STRICT_SPREAD puts each bundle (the scheduler and every rank) on its own node: "
            f"it needs {len(bundles)} nodes"
        )
    return msg + "; the resources exist but not free, or not on one node as the strategy requires"


def _show(resources: dict[str, float], keys) -> str:
    return ", ".join(f"{k}: {resources.get(k, 0):g}" for k in sorted(keys))


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    return device


def bundle_device(pg: PlacementGroup, bundle: int) -> str:
    """The device a reserved rank bundle was sized for. Deciding again from the cluster could disagree with it
    (GPUs joining after the reservation) and leave a rank waiting for a GPU its bundle lacks."""
    return "cuda" if pg.bundle_specs[bundle].get("GPU") else "cpu"
