"""`raylm bench ray-overhead`: the round trip of an empty step to every rank, three ways."""

from __future__ import annotations

import argparse
import statistics
import time

from engine.cli_flags import add_model_flag


def tiny_llama(path: str, max_len: int = 256) -> str:
    """A 2-layer random Llama (4 heads, 2 KV heads): splits over tp=2, unlike the default model's 9 heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def _empty_step(step_id: int):
    from scheduler import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(),
        preempted_req_ids=set(),
        step_id=step_id,
    )


class _RoundTrips:
    """An async actor, like the scheduler actor, timing empty steps to the engine's ranks three ways."""

    def __init__(self, workers: list) -> None:
        self.workers = workers

    async def plain(self, steps: int, put: bool) -> list[float]:
        """The engine loop's own path (execute_step: the step by value), or one ray.put broadcast per step."""
        import asyncio

        import ray

        from engine.scheduler_actor import execute_step

        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            if put:
                ref = ray.put(_empty_step(i))
                await asyncio.gather(*[w.execute_model.remote(ref) for w in self.workers])
            else:
                await execute_step(self.workers, _empty_step(i))
            times.append(time.perf_counter() - t0)
        return times

    async def compiled(self, steps: int, idle_s: float) -> tuple[list[float], float]:
        """Through a Ray compiled graph; also the CPU this process burns while it waits idle_s for nothing."""
        import asyncio

        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step:
            graph = MultiOutputNode([w.execute_model.bind(step) for w in self.workers])
        dag = graph.experimental_compile(enable_asyncio=True)
        try:
            times = []
            for i in range(steps):
                t0 = time.perf_counter()
                await asyncio.gather(*await dag.execute_async(_empty_step(i)))
                times.append(time.perf_counter() - t0)
            cpu0 = time.process_time()
            await asyncio.sleep(idle_s)
            return times, (time.process_time() - cpu0) / idle_s
        finally:
            dag.teardown()


def bench_ray_overhead(
    model: str | None = None, tp_sizes: tuple[int, ...] = (1, 2), steps: int = 300, warmup: int = 30
) -> dict:
    """Round trip of an empty step (nothing scheduled) from an async actor to every rank of a Ray engine:
    the engine loop's path (step by value), a ray.put broadcast, and a Ray compiled graph."""
    import tempfile

    import ray

    from engine.config import EngineConfig
    from engine.connect import connect
    from engine.placement import SCHEDULER_CPUS
    from engine.ray_client import RayEngine

    # A local Ray sized for the largest engine: the first, smaller one would otherwise size it too small.
    connect(None, SCHEDULER_CPUS + max(tp_sizes))
    tmp = tempfile.TemporaryDirectory() if model is None else None
    model = model or tiny_llama(tmp.name)
    print(f"raylm bench ray-overhead: empty-step round trip, {steps} steps after {warmup} warm-up; model {model}")
    results: dict = {}
    for tp in tp_sizes:
        engine = RayEngine(EngineConfig(model=model, tensor_parallel_size=tp, kv_cache_bytes=1 << 22))
        prober = ray.remote(_RoundTrips).options(num_cpus=0).remote(engine.workers)
        try:
            row = {
                "by value (engine loop)": ray.get(prober.plain.remote(warmup + steps, False))[warmup:],
                "ray.put broadcast": ray.get(prober.plain.remote(warmup + steps, True))[warmup:],
            }
            try:
                times, idle_cpu = ray.get(prober.compiled.remote(warmup + steps, 2.0))
                row["compiled graph"] = times[warmup:]
                print(f"  tp={tp} compiled graph: the waiting driver burns {idle_cpu:.2f} CPU cores while idle")
                results[(tp, "compiled idle cores")] = idle_cpu
            except Exception as e:
                print(f"  tp={tp} compiled graph failed: {type(e).__name__}: {e}")
            for name, times in row.items():
                times.sort()
                med, p90 = statistics.median(times) * 1e6, times[int(0.9 * (len(times) - 1))] * 1e6
                results[(tp, name)] = med
                print(f"  tp={tp} {name:24s} median {med:7.0f} us   p90 {p90:7.0f} us")
        finally:
            ray.kill(prober)
            engine.shutdown()
    if tmp is not None:
        tmp.cleanup()
    return results


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "a tiny random Llama")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=300)


def main(args: argparse.Namespace) -> None:
    bench_ray_overhead(args.model, tuple(args.tp_sizes), args.steps)
