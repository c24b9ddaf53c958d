"""The RL rollout controls over HTTP (issue #71; docs/rl.md "HTTP control routes"): every replica of the
deployment reached from whichever replica a request lands on.

Why a fan-out. Serve's router (HAProxy, and the prefix-cache router behind it) sends each HTTP request to ONE
replica, but a trainer means the deployment: a /sleep that put one replica of four to sleep, or a weight update
that reached one, would leave the others generating with the old weights. So the replica that gets a control
request calls it on every replica's engine at once and answers per replica. It finds them as the LoRA adapters
do (lora_registry.py): each replica joins a deployment-scoped actor, the ControlRegistry, with its replica id and
its engine's scheduler actor (the handle in its EngineAdapters; that actor runs engine/controls.py, the very calls
RayEngine's control methods forward), and the handling replica calls its own engine through its EngineClient and
the others' through those handles. Calls that must meet (joining the weight-update group, one bucket's broadcast)
are sent to every engine before any is awaited. A replica whose actor died leaves the registry; each replica joins
again every REJOIN_S, so a registry that Serve's controller recreated knows them all again within that time.

What it does not cover: a replica that autoscaling starts later serves the checkpoint's weights, awake and
unpaused, and was not in the weight-update group: a trainer fixes the replica count (min_replicas =
max_replicas). With pd the prefill deployment's engines would keep the old weights, so the routes are refused
there (options.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import ray
from fastapi.responses import Response
from ray import serve
from ray.serve.config import DeploymentActorConfig

from engine.client import EngineClient
from serve.protocol.parsing import APIError, bad_request

logger = logging.getLogger("ray.serve")
NAME = "control_registry"
REJOIN_S = 10.0
SLEEP_LEVELS = ("1", "2")
WAKE_TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "wait", "keep")
# What an engine raises for a control it refuses (a ValueError naming what; a checkpoint path that is not one).
REFUSALS = (ValueError, FileNotFoundError, NotADirectoryError)


def registry_config() -> DeploymentActorConfig:
    """The deployment option that gives a deployment its ControlRegistry (with enable_control_routes)."""
    return DeploymentActorConfig(name=NAME, actor_class=ControlRegistry, actor_options={"num_cpus": 0})


@ray.remote
class ControlRegistry:
    """Each live replica's engine: replica id -> its scheduler actor's handle."""

    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}

    def join(self, replica: str, engine: Any) -> None:
        self.engines[replica] = engine

    def leave(self, replica: str) -> None:
        self.engines.pop(replica, None)

    def listed(self) -> dict[str, Any]:
        return dict(self.engines)


class Answer(NamedTuple):
    """One replica's answer to a control, and the arguments it was called with."""

    replica: str
    value: Any
    args: tuple


def _registry() -> Any:
    return serve.get_deployment_actor(NAME)


def _message(e: BaseException) -> str:
    """The engine's own message (a ValueError naming what it refuses) inside Ray's error."""
    cause = getattr(e, "cause", None) or e
    return str(cause).strip().splitlines()[-1].removeprefix("ValueError: ")


class Controls:
    """One replica's side of the fan-out: its own engine (``engine``, this replica's EngineClient) under
    ``replica``, the others' from the registry. ``each`` runs one control on every replica's engine, in the
    replicas' id order, and returns (replica, answer) pairs."""

    def __init__(self, replica: str, engine: EngineClient) -> None:
        self.replica = replica
        self.engine = engine
        self._rejoin: asyncio.Task | None = None

    async def join(self) -> None:
        """Before the replica serves (the controller may still be starting the registry)."""
        if self.engine.adapters is None:  # an engine no other process can reach: this replica alone
            return
        for attempt in range(100):
            try:
                await _registry().join.remote(self.replica, self.engine.adapters.actor)
                break
            except ValueError:  # not started yet
                if attempt == 99:
                    raise
                await asyncio.sleep(0.1)
        self._rejoin = asyncio.get_running_loop().create_task(self._keep_joined())

    async def _keep_joined(self) -> None:
        while True:
            await asyncio.sleep(REJOIN_S)
            try:
                await _registry().join.remote(self.replica, self.engine.adapters.actor)
            except Exception as e:  # the registry is being recreated: the next round joins the new one
                logger.info("raylm: control registry not reached (%s); joining again in %g s", e, REJOIN_S)

    async def engines(self) -> list[tuple[str, Callable[..., Awaitable[Any]]]]:
        """(replica, call) for every replica in id order: ``call(method, *args)`` runs the control there."""
        others: dict[str, Any] = {}
        if self.engine.adapters is not None:
            others = await _registry().listed.remote()
        others.pop(self.replica, None)
        local = (self.replica, lambda method, *args: getattr(self.engine, method)(*args))
        remote = [(r, _actor_call(actor)) for r, actor in others.items()]
        return sorted([local, *remote], key=lambda e: e[0])

    async def each(
        self,
        method: str,
        args: Callable[[int, int], Sequence[Any]] | Sequence[Any] = (),
        param: str | None = None,
    ) -> list[Answer]:
        """``method`` on every replica's engine at once (``args``, or ``args(i, n)`` for replica i of n); the
        replicas whose engine is gone are dropped from the registry and from the answer. A refusal (REFUSALS)
        on any replica is a 400 naming ``param``, any other failure a 500, each naming the replicas and what
        they said."""
        engines = await self.engines()
        n = len(engines)
        arguments = [tuple(args(i, n)) if callable(args) else tuple(args) for i in range(n)]
        results = await asyncio.gather(
            *(call(method, *a) for (_, call), a in zip(engines, arguments)), return_exceptions=True
        )
        answers, refused, failed = [], [], []
        for (replica, _), result, a in zip(engines, results, arguments):
            if isinstance(result, ray.exceptions.RayActorError) and replica != self.replica:
                await _registry().leave.remote(replica)
            elif isinstance(result, REFUSALS):
                refused.append(f"replica {replica}: {_message(result)}")
            elif isinstance(result, BaseException):
                failed.append(f"replica {replica}: {type(result).__name__}: {_message(result)}")
            else:
                answers.append(Answer(replica, result, a))
        if refused or failed:
            done = f"; it succeeded on {', '.join(a.replica for a in answers)}" if answers else ""
            message = f"{method} failed on {len(refused) + len(failed)} of {n} replicas: {'; '.join(failed + refused)}"
            if failed:
                raise APIError(500, message + done)
            raise bad_request(message + done, param)
        return answers


def _actor_call(actor: Any) -> Callable[..., Awaitable[Any]]:
    async def call(method: str, *args: Any) -> Any:
        return await getattr(actor, method).remote(*args)

    return call


def per_replica(answers: list[Answer], field: str | None = None) -> list[dict[str, Any]]:
    """Each replica's answer: its id, and its value as ``field``."""
    return [{"replica": a.replica, **({field: a.value} if field else {})} for a in answers]


def json_reply(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body), media_type="application/json")


def sleep_level(query: Any) -> int:
    level = query.get("level", "1")
    if level not in SLEEP_LEVELS:
        raise bad_request(
            f"level={level!r}: 1 (free the KV cache, keep the weights) or 2 (free the weights too)", "level"
        )
    return int(level)


def wake_tags(query: Any) -> list[str] | None:
    """``tags`` repeated or comma-separated; None (everything) when absent."""
    tags = [t.strip() for value in query.getlist("tags") for t in value.split(",") if t.strip()]
    for tag in tags:
        if tag not in WAKE_TAGS:
            raise bad_request(f"tags: {tag!r} is not a tag: choose from {', '.join(WAKE_TAGS)}", "tags")
    return tags or None


def pause_mode(query: Any) -> str:
    mode = query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise bad_request(
            f"mode={mode!r}: abort (end every request now), wait (let them finish) or keep (freeze them until /resume)",
            "mode",
        )
    return mode


def common(answers: list[Answer]) -> Any:
    """The one value every replica answered, else None."""
    values = {a.value for a in answers}
    return values.pop() if len(values) == 1 else None
