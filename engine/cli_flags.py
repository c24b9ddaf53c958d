"""Flags several commands share (`generate`, `batch`, the engine benchmarks), declared once: the engine's, and
the model of a bench that starts its own engines or servers. An engine flag not given is absent
from the namespace (its default is the config's, applied there), so read them with getattr."""

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
    """EngineConfig's fields given as flags, and the model (None, the default model, unless given); the rest keep
    the config's defaults (or a benchmark's own)."""
    given = {name: getattr(args, name) for name in EngineConfig.model_fields if hasattr(args, name)}
    return {name: value for name, value in {"model": None, **given}.items() if name not in exclude}


def add_model_flag(p: argparse.ArgumentParser, default: str) -> None:
    """--model for a bench without the engine's flags; `default` names the model it takes without one."""
    p.add_argument("--model", default=None, help=f"HF model directory (default: {default})")


def llm_kwargs(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
    """The offline LLM's arguments the flags give: the executor, the Ray cluster's address and engine_kwargs."""
    return {"executor": args.executor, "address": getattr(args, "address", None), **engine_kwargs(args, exclude)}
