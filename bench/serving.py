"""`raylm bench serve`'s flags and the run they pick: the serving path's ceiling (serve_ceiling.py), the
multi-tenant workload (tenants.py) or the HTTP benchmark against a server (serve.py). It sits above those three,
which serve.py cannot (the other two import it)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.serve import bench_serve, run_workload
from bench.serve_ceiling import bench_serve_ceiling
from bench.tenants import compare_routers, multi_tenant_workload
from engine.cli_flags import add_model_flag
from workers.default_model import default_model_path

# make_workload's arguments that are flags of the same name (bench_serve hands them on as its work_args)
WORKLOAD_FLAGS = ("dataset", "num_requests", "input_len", "output_len", "min_len", "max_len", "request_rate")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server to measure (unless --compare or --no-work-model, which start their own)",
    )
    add_model_flag(p, "SmolLM2")
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        choices=["vllm", "offline", "routers"],
        help="start raylm serve, then vllm serve (its own venv), one at a time, with the same client and "
        "requests; offline: also raylm's offline Ray engine on the same requests; routers (with "
        "--dataset multi-tenant): two replicas with the prefix-cache router, then with Serve's own",
    )
    p.add_argument(
        "--no-work-model",
        action="store_true",
        help="the serving path's ceiling: a raylm serve whose ranks do no tensor work, at --concurrency",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="with --no-work-model: concurrent streams per level",
    )
    p.add_argument(
        "--dataset",
        default="uniform",
        choices=["uniform", "random", "multi-tenant"],
        help="random: fixed --input-len / --output-len (vllm bench serve's); uniform: both in "
        "[--min-len, --max-len]; multi-tenant: --groups shared prefixes of --prefix-len tokens, "
        "--requests-per-group each with --input-len own tokens, interleaved",
    )
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--requests-per-group", type=int, default=8)
    p.add_argument(
        "--replica-max-num-seqs",
        type=int,
        default=16,
        help="with --compare routers: each replica's max_num_seqs (its batch, and Serve's max ongoing)",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals, requests/s (default: all at once)"
    )
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads of the servers it starts")
    p.add_argument(
        "--client",
        default="raylm",
        choices=["raylm", "vllm"],
        help="the load generator: ours, or vllm bench serve unmodified, from the vllm venv (--dataset random)",
    )
    p.add_argument(
        "--token-id-prompts", action="store_true", help="our client sends prompts as token ids (default: text)"
    )
    p.add_argument(
        "--raylm-variants",
        nargs="+",
        default=[""],
        metavar="VARIANT",
        help="with --compare: start raylm serve once per variant, each 'ENV=VALUE ... --flag value ...' "
        "(quoted; '' is the defaults), e.g. '' '--cpu-omp-threads-bind nobind'",
    )
    p.add_argument("--api-key", default=None, help="default: $RAYLM_API_KEY")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workload's seed: a server keeps its prefix cache, so a repeated seed measures cache hits",
    )


def main(args: argparse.Namespace) -> None:
    if args.no_work_model:
        bench_serve_ceiling(
            model=args.model,
            concurrency=tuple(args.concurrency),
            output_len=args.output_len,
            input_len=args.input_len,
            seed=args.seed,
            token_ids=args.token_id_prompts,
        )
    elif args.dataset == "multi-tenant":
        _multi_tenant(args)
    else:
        work = {name: getattr(args, name) for name in WORKLOAD_FLAGS}
        bench_serve(
            url=args.url,
            model=args.model,
            work_args=work,
            compare=args.compare,
            api_key=_api_key(args),
            seed=args.seed,
            num_threads=args.num_threads,
            client=args.client,
            token_ids=args.token_id_prompts,
            variants=args.raylm_variants,
        )


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("RAYLM_API_KEY")


def _multi_tenant(args: argparse.Namespace) -> None:
    model_path = args.model or default_model_path()
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    work = multi_tenant_workload(
        groups=args.groups,
        per_group=args.requests_per_group,
        prefix_len=args.prefix_len,
        suffix_len=args.input_len,
        output_len=args.output_len,
        vocab_size=vocab_size,
        request_rate=args.request_rate,
        seed=args.seed,
    )
    print(f"raylm bench serve: {work.description}")
    if "routers" in args.compare:
        compare_routers(args.model, model_path, work, args.groups, args.replica_max_num_seqs, args.seed)
    else:
        run_workload(f"server at {args.url}", args.url, work, _api_key(args), args.seed)
