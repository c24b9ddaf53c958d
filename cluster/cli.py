"""The `raylm` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="raylm", description="LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    sched = bench_sub.add_parser("scheduler", help="scheduler decode-step time with no model")
    sched.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    sched.add_argument("--prompt-len", type=int, default=512)
    sched.add_argument("--block-size", type=int, default=16)
    sched.add_argument("--steps", type=int, default=100)

    args = parser.parse_args(argv)
    if args.command == "bench" and args.bench == "scheduler":
        from cluster.bench import bench_scheduler
        bench_scheduler(tuple(args.sizes), args.prompt_len, args.block_size, args.steps)


if __name__ == "__main__":
    main()
