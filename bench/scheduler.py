"""`raylm bench scheduler`: one decode step of the Scheduler with no model."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from engine.config import EngineConfig, derive_scheduler_config
from scheduler import EngineRequest, ModelRunnerOutput, SamplingParams, Scheduler
from scheduler.block_pool import BlockPool


def _decode_step_times(num_requests: int, prompt_len: int, block_size: int, steps: int) -> list[float]:
    num_blocks = num_requests * ((prompt_len + steps + 8) // block_size + 2) + 1
    engine = EngineConfig(
        device="cpu", block_size=block_size, max_num_seqs=num_requests, max_num_batched_tokens=max(8192, prompt_len)
    )
    cfg = derive_scheduler_config(engine, num_blocks, prompt_len + 4096)
    sched = Scheduler(cfg, eos_token_id=0)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(
            EngineRequest(
                request_id=f"req-{i}",
                prompt_token_ids=[rng.randrange(1, 49152) for _ in range(prompt_len)],
                sampling_params=params,
            )
        )

    def one_step() -> float:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        # The fake model: one token for every request that finished its prompt (built outside the timer).
        sampled = [
            rid
            for rid, n in so.num_scheduled_tokens.items()
            if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
        ]
        out = ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[rng.randrange(1, 49152) for _ in sampled])
        t2 = time.perf_counter()
        sched.update_from_output(so, out)
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2)

    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        one_step()
    for _ in range(5):
        one_step()
    # The engine freezes its long-lived objects after start-up too, so the collector never rescans them.
    gc.collect()
    gc.freeze()
    try:
        return [one_step() for _ in range(steps)]
    finally:
        gc.unfreeze()


def _pool_pairs_seconds(n: int) -> float:
    pool = BlockPool(1024)
    get, free = pool.get_new_blocks, pool.free_blocks
    t0 = time.perf_counter()
    for _ in range(n):
        free(get(1))
    return time.perf_counter() - t0


def bench_scheduler(
    sizes: tuple[int, ...] = (64, 256, 1024),
    prompt_len: int = 512,
    block_size: int = 16,
    steps: int = 100,
    pool_pairs: int = 1_000_000,
) -> dict:
    """Median and p90 of one decode step (schedule + update_from_output) at each batch size."""
    print(
        f"raylm bench scheduler: {prompt_len}-token distinct prompts, block_size {block_size}, "
        f"prefix caching on, {steps} decode steps per size (fake sampled tokens, no model)"
    )
    results = {}
    for n in sizes:
        times = sorted(_decode_step_times(n, prompt_len, block_size, steps))
        med = statistics.median(times) * 1e6
        p90 = times[int(0.9 * (len(times) - 1))] * 1e6
        results[n] = (med, p90)
        print(
            f"  {n:5d} running requests: decode step median {med:8.1f} us   p90 {p90:8.1f} us   "
            f"({med / n:.2f} us per request)"
        )
    if 256 in results and 1024 in results:
        print(f"  growth 1024/256: {results[1024][0] / results[256][0]:.2f}x (linear would be 4.00x)")
    secs = _pool_pairs_seconds(pool_pairs)
    print(
        f"  BlockPool: {pool_pairs:,} get-one-block/free-one-block pairs in {secs:.2f} s "
        f"({secs / pool_pairs * 1e9:.0f} ns per pair)"
    )
    results["pool_pairs_s"] = secs
    return results


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)


def main(args: argparse.Namespace) -> None:
    bench_scheduler(tuple(args.sizes), args.prompt_len, args.block_size, args.steps)
