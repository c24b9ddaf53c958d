"""The `raylm` command line."""

from __future__ import annotations

import argparse


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                kv_cache_bytes=args.kv_cache_bytes, num_threads=args.num_threads,
                enable_prefix_caching=args.enable_prefix_caching)


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
    thr.add_argument("--compare", nargs="*", default=["transformers"], choices=["transformers"])
    _engine_args(thr)

    args = parser.parse_args(argv)
    try:
        _run(args)
    except ValueError as e:
        parser.exit(2, f"raylm: error: {e}\n")


def _run(args: argparse.Namespace) -> None:
    if args.command == "generate":
        from cluster.llm import LLM
        from scheduler import SamplingParams

        llm = LLM(model=args.model, **_engine_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        print(out.outputs[0].text)
    elif args.bench == "scheduler":
        from cluster.bench import bench_scheduler
        bench_scheduler(tuple(args.sizes), args.prompt_len, args.block_size, args.steps)
    else:
        from cluster.bench import bench_throughput
        bench_throughput(args.model, args.num_requests, args.min_len, args.max_len, args.compare,
                         **_engine_kwargs(args))


if __name__ == "__main__":
    main()
