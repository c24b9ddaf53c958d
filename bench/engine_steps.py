"""`raylm bench engine-steps`: the engine loop's steps/s with the no-work model, serial vs async scheduling."""

from __future__ import annotations

import argparse
import time


def _decode_steps_per_s(engine, num_requests: int, max_tokens: int) -> float:
    """Engine steps per second while ``num_requests`` requests decode ``max_tokens`` tokens each, together."""
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps0, t0 = engine.stats().num_steps, time.perf_counter()
    for i in range(num_requests):
        engine.add_request(
            EngineRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8], sampling_params=params)
        )
    while engine.has_unfinished_requests():
        engine.step()
    return (engine.stats().num_steps - steps0) / (time.perf_counter() - t0)


def bench_engine_steps(
    tp_sizes: tuple[int, ...] = (1, 2), num_requests: int = 64, max_tokens: int = 1000, rounds: int = 2
) -> dict:
    """Engine steps/s of the Ray engine with the no-work model (no forward, no KV: what is left is the scheduler,
    the Ray round trip to every rank and the loop) at ``num_requests`` running decodes, serial loop vs async
    scheduling, alternated ``rounds`` times so that a busy machine slows both alike; the best round counts."""
    import tempfile

    from bench.ray_overhead import tiny_llama
    from engine.config import EngineConfig
    from engine.connect import connect
    from engine.placement import SCHEDULER_CPUS
    from engine.ray_client import RayEngine

    connect(None, SCHEDULER_CPUS + max(tp_sizes))
    tmp = tempfile.TemporaryDirectory()
    model = tiny_llama(tmp.name, max_len=max_tokens + 64)
    print(
        f"raylm bench engine-steps: no-work model, {num_requests} requests decoding {max_tokens} tokens each, "
        f"best of {rounds}"
    )
    results: dict = {}
    try:
        for tp in tp_sizes:
            for _ in range(rounds):
                for mode in (False, True):
                    engine = RayEngine(
                        EngineConfig(
                            model=model,
                            tensor_parallel_size=tp,
                            no_work_model=True,
                            max_num_seqs=num_requests,
                            async_scheduling=mode,
                        )
                    )
                    try:
                        _decode_steps_per_s(engine, num_requests, 20)  # warm-up: Ray's workers and imports
                        rate = _decode_steps_per_s(engine, num_requests, max_tokens)
                    finally:
                        engine.shutdown()
                    results[(tp, mode)] = max(results.get((tp, mode), 0.0), rate)
            serial, pipelined = results[(tp, False)], results[(tp, True)]
            print(
                f"  tp={tp} serial {serial:7.0f} steps/s   async {pipelined:7.0f} steps/s   "
                f"ratio {pipelined / serial:.2f}x"
            )
    finally:
        tmp.cleanup()
    return results


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=64, help="decoding at once")
    p.add_argument("--max-tokens", type=int, default=1000, help="each request's output: the steps measured")
    p.add_argument("--rounds", type=int, default=2, help="serial and async alternate; the best round counts")


def main(args: argparse.Namespace) -> None:
    bench_engine_steps(tuple(args.tp_sizes), args.num_requests, args.max_tokens, args.rounds)
