"""`raylm batch`: an OpenAI Batch API file (JSONL) answered by a pool of engines on Ray Data (batch/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from batch.config import BatchConfig
from engine.cli_flags import engine_kwargs
from engine.config import EngineConfig, LaunchConfig
from engine.flags import add_flags


def add_parser(sub) -> None:
    p = sub.add_parser(
        "batch",
        help="answer an OpenAI batch file (JSONL) with a pool of engines on Ray Data",
        description="Each input line is a request (custom_id, method, url of /v1/chat/completions or "
        "/v1/completions, body); each output line its answer, as the server gives it, or the error of a bad "
        "line, naming its line and field. Rerun with the same output file to resume: requests it answers are "
        "skipped, so each custom_id is answered once.",
    )
    p.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="the requests: a JSONL file (one request a line) or a Parquet file (one a row, its body a struct or a "
        "JSON string), a directory of them (in name order), or a URI of either (s3://, gs://, hdfs://)",
    )
    p.add_argument("-o", "--output-file", required=True, help="the answers, appended one JSON line each")
    add_flags(p, EngineConfig, title="engine")
    add_flags(p, BatchConfig, title="batch")
    add_flags(p, LaunchConfig, ("host", "port", "grpc_port"), title="cluster")
    p.set_defaults(run=run)


def batch_config(args: argparse.Namespace) -> BatchConfig:
    pool = {name: getattr(args, name) for name in BatchConfig.model_fields if hasattr(args, name)}
    return BatchConfig(engine=EngineConfig(**engine_kwargs(args)), **pool)


def run(args: argparse.Namespace) -> None:
    from batch.openai_file import run_file

    config = batch_config(args)
    counts = run_file(config, args.input_file, Path(args.output_file), getattr(args, "address", None))
    print(", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=str)) or "nothing left to answer")
