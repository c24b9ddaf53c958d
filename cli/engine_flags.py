"""The engine's flags as the offline commands (`generate`, the engine benchmarks) take them. A flag not given is
absent from the namespace (its default is the config's, applied there), so read them with getattr."""

from __future__ import annotations

import argparse

from engine.config import EngineConfig, LaunchConfig
from engine.flags import add_flags

EXECUTORS = ("ray", "inprocess")


def add_engine_flags(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    add_flags(p, EngineConfig, exclude, title="engine")
    add_flags(p, LaunchConfig, ("host", "port", "grpc_port"), title="cluster")
    p.add_argument(
        "--executor",
        default="ray",
        choices=EXECUTORS,
        help="ray: scheduler and worker actors (default); inprocess: one process, tp=1, for debugging",
    )


def engine_kwargs(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
    """EngineConfig's fields given as flags; the rest keep the config's defaults (or a benchmark's own)."""
    return {
        name: getattr(args, name) for name in EngineConfig.model_fields if hasattr(args, name) and name not in exclude
    }
