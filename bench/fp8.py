"""`raylm bench fp8`: one model served three ways in one invocation, in process, one engine at a time: as it is
(the baseline), with its weights quantized at load (`--quantization fp8`), and with its KV cache in FP8
(`--kv-cache-dtype fp8`). For each: offline output tok/s of --num-requests requests (lengths uniform in
[--min-len, --max-len], as `raylm bench throughput`), the decode step at 1, 32 and 256 requests of ~--context tokens
(on CUDA with the HBM floor of the bytes the step reads), the KV cache's blocks, and for the baseline and the FP8
cache the decode step at --long-batch requests of --long-context tokens, where the KV pages are most of what a
step reads. Then each variant's figures as ratios of the baseline's.

On a CPU every variant runs (the FP8 weights dequantized at load, the FP8 pages read by the torch backend), so
the bench is checked there; its figures mean something on a GPU of compute capability 8.9 or above, where the
products and pages are FP8.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import torch

from bench.throughput import (
    _report,
    decode_figures,
    decode_step_seconds,
    run_raylm,
    throughput_workload,
)
from engine.cli_flags import add_engine_flags, engine_kwargs
from engine.llm import LLM

VARIANTS = {"baseline": {}, "fp8 weights": {"quantization": "fp8"}, "fp8 KV": {"kv_cache_dtype": "fp8"}}
BATCHES = (1, 32, 256)


@dataclass(slots=True)
class Figures:
    """One variant's figures: output tok/s, seconds per decode step by batch size, KV blocks, and the long-context
    decode step (None where it was not run or the cache could not hold it)."""

    tokens_per_s: float = 0.0
    step_s: dict[int, float] = field(default_factory=dict)
    num_blocks: int = 0
    long_step_s: float | None = None


def bench_fp8(
    model: str | None,
    num_requests: int = 256,
    min_len: int = 32,
    max_len: int = 256,
    long_context: int = 2048,
    long_batch: int = 256,
    steps: int = 20,
    context: int = 512,
    **engine_kwargs,
) -> dict[str, Figures]:
    """The module docstring's run; returns each variant's figures."""
    for flag in ("quantization", "kv_cache_dtype"):
        if engine_kwargs.get(flag) not in (None, "auto"):
            raise ValueError(f"bench fp8 sets {flag} itself, per variant: got {flag}={engine_kwargs[flag]!r}")
        engine_kwargs.pop(flag, None)
    engine_kwargs.setdefault("max_num_seqs", max(num_requests, long_batch))
    figures = {}
    for name, variant in VARIANTS.items():
        llm = LLM(model=model, executor="inprocess", **engine_kwargs, **variant)
        try:
            work = throughput_workload(num_requests, min_len, max_len, llm.engine.spec.vocab_size)
            figures[name] = _measure(name, llm, work, context, long_batch, long_context, steps)
        finally:
            llm.shutdown()
    _print_ratios(figures)
    return figures


def _measure(name: str, llm: LLM, work: list, context: int, long_batch: int, long_context: int, steps: int) -> Figures:
    engine = llm.engine
    params = list(engine.worker.model.parameters())
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in params)
    print(
        f"{name}: {engine.model_path}, {engine.worker.dtype}, {fp8} of {len(params)} weight tensors float8, KV "
        f"pages {engine.worker.kv_dtype}, {engine.num_blocks - 1} KV blocks of {engine.config.block_size} tokens, "
        f"device {engine.device}"
    )
    seconds = run_raylm(llm, work)
    out = Figures(num_blocks=engine.num_blocks - 1)
    out.tokens_per_s = _report(name, seconds, len(work), sum(len(p) for p, _ in work), sum(n for _, n in work))
    out.step_s = decode_figures(engine, BATCHES, context, steps)
    if name != "fp8 weights":
        try:
            out.long_step_s = decode_step_seconds(engine, long_batch, long_context, steps, random.Random(1))
            print(f"    {long_batch:4d} requests at ~{long_context} tokens: {out.long_step_s * 1e3:7.3f} ms per step")
        except ValueError as e:  # the cache cannot hold them: said, not measured
            print(f"    {long_batch} requests at {long_context} tokens: not run: {e}")
    return out


def _print_ratios(figures: dict[str, Figures]) -> None:
    base = figures["baseline"]
    for name in ("fp8 weights", "fp8 KV"):
        f = figures[name]
        steps = ", ".join(f"{b}: {f.step_s[b] / base.step_s[b]:.2f}x" for b in f.step_s if b in base.step_s)
        line = (
            f"  {name} / baseline: output tok/s {f.tokens_per_s / base.tokens_per_s:.2f}x; decode step by "
            f"requests {steps}; KV blocks {f.num_blocks / base.num_blocks:.2f}x"
        )
        if f.long_step_s is not None and base.long_step_s is not None:
            line += f"; long-context decode step {f.long_step_s / base.long_step_s:.2f}x"
        print(line)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--long-context", type=int, default=2048, help="the long-context decode step's tokens a request")
    p.add_argument("--long-batch", type=int, default=256, help="the long-context decode step's requests")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per figure")
    p.add_argument("--context", type=int, default=512, help="the decode steps' tokens a request")
    add_engine_flags(p, exclude=("quantization", "kv_cache_dtype"))


def main(args: argparse.Namespace) -> None:
    bench_fp8(
        num_requests=args.num_requests,
        min_len=args.min_len,
        max_len=args.max_len,
        long_context=args.long_context,
        long_batch=args.long_batch,
        steps=args.steps,
        context=args.context,
        **engine_kwargs(args),
    )
