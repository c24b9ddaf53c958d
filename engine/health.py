"""Why an engine on Ray cannot serve: its scheduler's failure, and which ranks are lost and where."""

from __future__ import annotations

import ray

from engine.startup import NodeInfo


def diagnose(actor, workers: list, ranks: list[NodeInfo], tp: int = 1) -> None:
    """Raise RuntimeError saying why when the engine cannot serve, naming the ranks lost (and, pipelined, their
    stages: rank r is in stage r // tp) and their nodes."""
    try:
        ray.get(actor.check_health.remote())
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(f"the scheduler actor is gone: {brief(str(e))}{lost_ranks(workers, ranks, tp)}") from None
    except ray.exceptions.RayTaskError as e:
        raise RuntimeError(f"{brief(str(e.cause))}{lost_ranks(workers, ranks, tp)}") from None


def lost_ranks(workers: list, ranks: list[NodeInfo], tp: int = 1, timeout_s: float = 5.0) -> str:
    """'; rank r on node IP (node id ...) is lost: why' for each rank whose actor is gone or does not answer
    within ``timeout_s``, else ''. Asked of the actors themselves: Ray marks a lost node dead only after its
    own health checks, seconds later, while a dead actor's call fails at once."""
    refs = [w.check_health.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    notes = []
    for r, (ref, info) in enumerate(zip(refs, ranks)):
        stage = f"stage {r // tp}, " if len(workers) > tp else ""
        where = f"; {stage}rank {r} on node {info.ip} (node id {info.node_id}"
        if info.node_id not in alive:
            notes.append(f"{where}) is lost: Ray reports the node dead")
        elif ref not in ready:
            notes.append(f"{where}) does not answer within {timeout_s:g} s")
        else:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                notes.append(f"{where}) is lost: {type(e).__name__}")
    return "".join(notes)


def brief(reason: str) -> str:
    """A failure's first and last lines: a rank's error arrives with its whole traceback in between."""
    lines = [line for line in reason.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1].strip()}"
