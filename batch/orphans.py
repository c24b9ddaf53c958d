"""The placement groups of engine actors that died, released.

An engine actor of the batch pool reserves its engine's placement group itself, and Ray ties a group's lifetime to
its creator's job, not to the creating actor: when Ray Data lets the pool go (or an actor is killed mid-job), the
actor's process may exit before its engine is shut down, and its group would hold the engine's CPUs and GPUs until
the driver exits. That starves the next dataset of a notebook or test session, and the replacement of a killed actor
of this one. So each engine's group is named after its actor (``engine_group_name``) and a thread of the driver
removes the groups whose actor is dead (``watch``).
"""

from __future__ import annotations

import threading
import time

import ray
from ray.util import get_placement_group, placement_group_table
from ray.util.placement_group import remove_placement_group

PREFIX = "raylm-batch-engine-"
SWEEP_INTERVAL_S = 2.0

_watcher: threading.Thread | None = None
_lock = threading.Lock()


def engine_group_name() -> str:
    """The placement-group name for the engine of the actor this runs in, free: a group of that name still
    reserved is a previous incarnation's (an actor restarted after a crash keeps its id, so it is never dead to
    ``sweep``), and is removed first, or the new engine would wait behind the old one's resources."""
    name = PREFIX + ray.get_runtime_context().get_actor_id()
    for group in placement_group_table().values():
        if group["name"] == name and group["state"] != "REMOVED":
            remove_placement_group(get_placement_group(name))
    return name


def sweep() -> list[str]:
    """Remove every engine group whose actor is dead; their names."""
    removed = []
    for group in placement_group_table().values():
        name = group["name"]
        if group["state"] == "REMOVED" or not name.startswith(PREFIX):
            continue
        # Ray's public state API needs the dashboard, which a cluster may run without; the GCS's actor table does not.
        actor = ray._private.state.actors(name.removeprefix(PREFIX))
        if actor and actor["State"] == "DEAD":
            remove_placement_group(get_placement_group(name))
            removed.append(name)
    return removed


def _sweep_while_connected() -> None:
    while ray.is_initialized():
        sweep()
        time.sleep(SWEEP_INTERVAL_S)


def watch() -> None:
    """Start the driver's sweeping thread, once per process (again after a Ray restart)."""
    global _watcher
    with _lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_sweep_while_connected, name="raylm-batch-orphans", daemon=True)
            _watcher.start()
