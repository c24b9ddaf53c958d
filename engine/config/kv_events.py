"""``kv_events_config``: vLLM's JSON spelling of KV-cache events, checked and completed."""

from __future__ import annotations

import re
from typing import Any

from engine.config.json_object import json_object

# vLLM's KVEventsConfig keys and defaults; raylm honours each of them (engine/kv_events.py).
DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,  # None: "zmq" when events are enabled, else "null" (vLLM's rule)
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
PUBLISHERS = ("zmq", "null")
# The least each count may be: a replay buffer and a queue hold at least one batch; a high-water mark of 0 is ZMQ's
# "no limit".
MINIMA = {"buffer_steps": 1, "hwm": 0, "max_queue_size": 1}
_TCP = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def check_endpoint(key: str, endpoint: Any) -> None:
    """A ZMQ endpoint raylm can bind or connect: tcp://HOST:PORT (HOST ``*``, a name, an IPv4 address or a
    bracketed IPv6 one; PORT in [1, 65535]), ipc://PATH or inproc://NAME; a ValueError names the key and value."""
    if isinstance(endpoint, str):
        tcp = _TCP.fullmatch(endpoint)
        if tcp is not None and 1 <= int(tcp.group(2)) <= 65535:
            return
        for scheme in ("ipc://", "inproc://"):
            if endpoint.startswith(scheme) and len(endpoint) > len(scheme):
                return
    raise ValueError(
        f"kv_events_config {key}={endpoint!r} is not a ZMQ endpoint: expected tcp://HOST:PORT (HOST * to listen on "
        "every interface, PORT in [1, 65535]), ipc://PATH or inproc://NAME"
    )


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (a wildcard host, ipc or inproc) or connects to it (a named host, a
    subscriber that binds), vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """``kv_events_config``'s JSON checked and completed with vLLM's defaults: every key vLLM's KVEventsConfig
    has, each of its type; ``publisher`` "zmq" or "null"; endpoints ZMQ's (``check_endpoint``). A ValueError names
    the key and the value."""
    spec = json_object("kv_events_config", text)
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"kv_events_config has unknown keys {unknown}: its keys are {list(DEFAULTS)}")
    config = {**DEFAULTS, **spec}
    if type(config["enable_kv_cache_events"]) is not bool:
        raise ValueError(
            f"kv_events_config enable_kv_cache_events={config['enable_kv_cache_events']!r} must be true or false"
        )
    if config["publisher"] is None:
        config["publisher"] = "zmq" if config["enable_kv_cache_events"] else "null"
    if config["publisher"] not in PUBLISHERS:
        raise ValueError(f"kv_events_config publisher={config['publisher']!r} is not one of {list(PUBLISHERS)}")
    check_endpoint("endpoint", config["endpoint"])
    if config["replay_endpoint"] is not None:
        check_endpoint("replay_endpoint", config["replay_endpoint"])
    for key, least in MINIMA.items():
        if type(config[key]) is not int or config[key] < least:
            raise ValueError(f"kv_events_config {key}={config[key]!r} must be an integer >= {least}")
    if not isinstance(config["topic"], str):
        raise ValueError(f"kv_events_config topic={config['topic']!r} must be a string")
    return config
