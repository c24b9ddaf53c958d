"""`raylm bench pipeline`: output tok/s and each stage's busy fraction at pp=1 and pp=2 (one thread per rank),
with one step in flight and with P, and the bytes and time of the stage-to-stage transfers."""

from __future__ import annotations

import argparse
import os
import random
import time

from engine.cli_flags import add_model_flag


def _link_counters(actor) -> tuple[float, float, int]:
    """Runs inside a rank's actor: seconds busy in steps, seconds its stage link waited, bytes it sent on."""
    worker = actor.worker
    link = worker.link
    return worker.busy_s, link.wait_s if link else 0.0, link.bytes_sent if link else 0


def _probe_link(actor, num_tokens: int, repeats: int) -> float | None:
    """Runs inside a rank's actor while the engine is idle: a [2, num_tokens, hidden] activation sent from the
    first stage to the second and back ``repeats`` times; the first stage returns the one-way seconds."""
    import torch
    import torch.distributed as dist

    link = actor.worker.link
    if link is None or (link.prev_rank is not None and link.next_rank is not None):
        return None  # one stage, or a middle one
    buf = torch.zeros(2, num_tokens, link.hidden_size, dtype=link.dtype, device=link.device)
    first = link.prev_rank is None
    peer = link.next_rank if first else link.prev_rank
    start = time.perf_counter()
    for _ in range(repeats):
        if first:
            dist.send(buf, dst=peer)
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.send(buf, dst=peer)
    return (time.perf_counter() - start) / (2 * repeats) if first else None


def _run(engine, work: list[list[int]], output_len: int) -> float:
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(work):
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def bench_pipeline(
    model: str | None,
    num_requests: int = 64,
    input_len: int = 128,
    output_len: int = 256,
    seed: int = 0,
    layer_partition: str | None = None,
) -> dict:
    """Each configuration runs the same workload (``num_requests`` random prompts of ``input_len`` tokens, each
    decoding ``output_len`` greedily) on a fresh Ray engine whose every rank has one torch thread; the pp=2 ones
    cut the layers by ``layer_partition`` when given (EngineConfig's, e.g. "19,11"), else evenly."""
    import ray

    from engine.config import EngineConfig
    from engine.connect import connect
    from engine.placement import SCHEDULER_CPUS
    from engine.ray_client import RayEngine

    connect(None, SCHEDULER_CPUS + 2)
    rng = random.Random(seed)
    configs = [("pp=1, 2 in flight", 1, True), ("pp=2, 1 in flight", 2, False), ("pp=2, 2 in flight", 2, True)]
    print(
        f"raylm bench pipeline: {num_requests} requests, {input_len} in / {output_len} out, 1 thread per rank, "
        f"pp=2 layers {layer_partition or 'balanced by count'}, load average {os.getloadavg()[0]:.1f} at start"
    )
    results: dict = {}
    for name, pp, in_flight in configs:
        engine = RayEngine(
            EngineConfig(
                model=model,
                pipeline_parallel_size=pp,
                pp_layer_partition=layer_partition if pp > 1 else None,
                num_threads=1,
                async_scheduling=in_flight,
                max_num_seqs=num_requests,
                max_model_len=input_len + output_len + 16,
            )
        )
        try:
            vocab = engine.spec.vocab_size
            work = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(num_requests)]
            _run(engine, work[:2], 4)  # warm-up: first-call allocations
            steps0 = engine.stats().num_steps
            before = ray.get([w.__ray_call__.remote(_link_counters) for w in engine.workers])
            wall = _run(engine, work, output_len)
            after = ray.get([w.__ray_call__.remote(_link_counters) for w in engine.workers])
            steps = engine.stats().num_steps - steps0
            busy = [(a[0] - b[0]) / wall for a, b in zip(after, before)]
            sent = after[0][2] - before[0][2]
            probe = ray.get([w.__ray_call__.remote(_probe_link, num_requests, 20) for w in engine.workers])[0]
        finally:
            engine.shutdown()
        tps = num_requests * output_len / wall
        results[name] = {"tok_s": tps, "busy": busy, "bytes_per_step": sent / steps, "link_s": probe}
        line = f"  {name:18s} {tps:7.1f} output tok/s  {wall:6.1f} s  {steps} steps  busy " + " ".join(
            f"stage {s}: {b:4.0%}" for s, b in enumerate(busy)
        )
        if pp > 1:
            line += (
                f"  transfers {sent / steps / 1024:.0f} KiB/step; one decode step's at batch {num_requests} "
                f"({2 * num_requests * engine.spec.hidden_size * 4 / 1024:.0f} KiB fp32) takes {probe * 1e3:.2f} ms"
            )
        print(line, flush=True)
    base = results[configs[0][0]]["tok_s"]
    for name, *_ in configs[1:]:
        print(f"  {name} / pp=1: {results[name]['tok_s'] / base:.2f}x")
    print(f"  load average {os.getloadavg()[0]:.1f} at the end")
    return results


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--pp-layer-partition", default=None, help="the pp=2 runs' layers per stage, e.g. 19,11 (default: even)"
    )


def main(args: argparse.Namespace) -> None:
    bench_pipeline(
        args.model, args.num_requests, args.input_len, args.output_len, layer_partition=args.pp_layer_partition
    )
