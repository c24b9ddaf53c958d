"""`raylm bench moe --tune`: the MoE grouped matmul's tiles measured per step size on this GPU, written as the table
kernels/triton_moe.py reads (vLLM's fused_moe configs, for raylm's kernel).

For each step size (tokens x top_k pairs) it times every candidate TileConfig on random experts of the given shape
and a random routing, keeps the fastest, and prints it against the defaults' time; the table goes into
--config-dir (default: the package's kernels/moe_configs/, where a run on a lent GPU leaves it to be committed).
With --fp8 (or --fp8-block ROWS COLS) the experts are FP8, as `--quantization fp8` (per row) or a block-scaled
checkpoint (per tile) makes them, and the table is the FP8 experts' own: their products quantize the activations
and may want other tiles (on Hopper an 8-bit tl.dot of 64 rows or more compiles to wgmma, fewer to mma.sync).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels.fp8 import quantize_experts
from kernels.moe import route
from kernels.triton_moe import CONFIG_DIR, TileConfig, config_name, fused_moe, write_table

# Decode sizes (a few rows per expert) up to prefill chunks: a step's token count, times top_k for its pairs.
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def candidates() -> list[TileConfig]:
    """The configs tried: every tile of 16 to 128 rows, 32 to 128 columns and 32 or 64 deep, with 4 or 8 warps and
    2 to 4 stages, but none over 128 x 128 outputs (their registers spill)."""
    grid = itertools.product((16, 32, 64, 128), (32, 64, 128), (32, 64), (4, 8), (2, 3, 4))
    return [TileConfig(*c) for c in grid if c[0] * c[1] <= 128 * 128]


def tune_tiles(
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    tokens: tuple[int, ...] = TOKENS,
    config_dir: Path = CONFIG_DIR,
    time_fn: Callable[[Callable[[], object]], float] | None = None,
    configs: list[TileConfig] | None = None,
    fp8: bool = False,
    block: tuple[int, int] | None = None,
) -> Path:
    """Measure, print and write the table for these experts on the current device; returns its path. ``time_fn``
    (a callable's seconds) defaults to Triton's CUDA-event timer, so without one the device must be a GPU. With
    `fp8` the experts are float8_e4m3fn (per output row, or per `block` tile: Qwen3-30B-A3B-FP8's 128 x 128) and
    the activations `dtype`, as FP8 experts run in a model of that dtype; the table is theirs."""
    if block is not None and not fp8:
        raise ValueError(f"an FP8 tile (block={block}) is for FP8 experts: tune with fp8")
    if time_fn is None:
        if not torch.cuda.is_available():
            raise ValueError("raylm bench moe --tune measures Triton kernels on a GPU: this machine has none")
        from triton.testing import do_bench

        def time_fn(fn: Callable[[], object]) -> float:
            return do_bench(fn, warmup=5, rep=20) / 1e3

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=gen, device=device).to(dtype) * 0.02
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=gen, device=device).to(dtype) * 0.02
    scales, weights = {}, str(dtype).removeprefix("torch.")
    if fp8:
        (w13, w13_scale), (w2, w2_scale) = quantize_experts(w13, block), quantize_experts(w2, block)
        scales = {"w13_scale": w13_scale, "w2_scale": w2_scale, "block": block}
        tile = "output row" if block is None else f"{block[0]} x {block[1]} tile"
        weights = f"{str(w13.dtype).removeprefix('torch.')} scaled per {tile}, activations {weights}"
    print(
        f"raylm bench moe --tune: {num_experts} experts of {intermediate_size} units on {hidden_size}, top-{top_k}, "
        f"{weights}, on {name}"
    )
    print(
        f"{'tokens':>7} {'pairs':>6} {'best tiles (rows x cols x depth, warps, stages)':>48} {'us':>9} {'vs default':>10}"
    )
    table: dict[int, TileConfig] = {}
    for n in tokens:
        x = torch.randn(n, hidden_size, generator=gen, device=device).to(dtype)
        topk_weights, ids = route(torch.randn(n, num_experts, generator=gen, device=device), top_k, renormalize=True)
        timed = _time_configs(configs or candidates(), time_fn, (x, w13, w2, topk_weights, ids), scales)
        best = min(timed, key=timed.get)
        table[n * top_k] = best
        tiles = f"{best.rows} x {best.cols} x {best.depth}, {best.num_warps}, {best.num_stages}"
        default = f"{timed[TileConfig()] / timed[best]:>9.2f}x" if TileConfig() in timed else f"{'-':>10}"
        print(f"{n:>7} {n * top_k:>6} {tiles:>48} {timed[best] * 1e6:>9.1f} {default}")
    path = config_dir / config_name(num_experts, hidden_size, intermediate_size, w13.dtype, name, block)
    write_table(path, table)
    # Also printed: a borrowed GPU machine's files may not come back, its logs do.
    print(f"wrote {path}:\n{path.read_text()}")
    return path


def _time_configs(
    configs: list[TileConfig],
    time_fn: Callable[[Callable[[], object]], float],
    args: tuple[torch.Tensor, ...],
    fp8: dict[str, Any],
) -> dict[TileConfig, float]:
    """Each config's seconds for fused_moe(*args, **fp8); one that fails to launch (a tile this GPU's shared memory
    cannot hold) is skipped, and if none launches the first failure is raised."""
    timed, failures = {}, []
    for config in configs:
        try:
            timed[config] = time_fn(lambda c=config: fused_moe(*args, config=c, **fp8))
        except Exception as e:
            failures.append(e)
    if not timed:
        raise RuntimeError(f"no candidate tile launched ({len(failures)} tried)") from failures[0]
    return timed
