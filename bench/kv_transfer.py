"""`raylm bench kv-transfer`: how fast a prompt's KV moves from a prefill engine to a decode engine, against the
object store's own copy bandwidth measured in the same invocation (one actor puts an array of the same size,
another gets it and copies it out, as a decode rank does)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import numpy as np
import ray

from engine.cli_flags import add_model_flag
from engine.config import EngineConfig
from engine.connect import connect
from engine.ray_client import RayEngine
from scheduler import EngineRequest, SamplingParams


@ray.remote(num_cpus=0)
class _Holder:
    """Puts arrays in the object store, as a prefill rank does with its share of a request's KV."""

    def put(self, nbytes: int) -> list:
        return [ray.put(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))]


@ray.remote(num_cpus=0)
class _Taker:
    """Gets them and copies them into memory it holds, as a decode rank fetches them and writes its cache."""

    def take(self, refs: list, nbytes: int) -> float:
        dest = np.ones(nbytes, dtype=np.uint8)  # touched before the clock starts, as a KV cache's pages are
        start = time.perf_counter()
        (array,) = ray.get(refs)
        np.copyto(dest, array)
        return time.perf_counter() - start


def object_store_copy_s(nbytes: int, repeats: int) -> float:
    """Median seconds for one actor to fetch and copy an array of ``nbytes`` another actor put."""
    holder, taker = _Holder.remote(), _Taker.remote()
    times = [ray.get(taker.take.remote(ray.get(holder.put.remote(nbytes)), nbytes)) for _ in range(repeats)]
    ray.kill(holder)
    ray.kill(taker)
    return statistics.median(times)


def _import_s(actor) -> float:
    """Runs inside a decode rank's actor: seconds it spent writing transferred KV into its cache."""
    return actor.worker.kv_import_s


async def _collect(engine: RayEngine, request: EngineRequest) -> list:
    return [out async for out in engine.generate(request)]


async def _one(prefill: RayEngine, decode: RayEngine, request: EngineRequest) -> tuple[float, float, list[int]]:
    """Seconds of the prefill (with its export) and of the decode side's first token, and the tokens."""
    first_block = await decode.prefix_hit_blocks(request)
    one = dataclasses.replace(request.sampling_params, max_tokens=1)
    start = time.perf_counter()
    (first,) = await _collect(
        prefill, dataclasses.replace(request, sampling_params=one, kv_export_from_block=first_block)
    )
    prefilled = time.perf_counter()
    stream = decode.generate(dataclasses.replace(request, kv_transfer=first.kv_transfer))
    tokens = list(first.new_token_ids)
    async for out in stream:
        tokens += out.new_token_ids
    return prefilled - start, time.perf_counter() - prefilled, tokens


def bench_kv_transfer(model: str | None, prompt_lens: tuple[int, ...], num_requests: int, max_tokens: int) -> None:
    config = (
        EngineConfig(model=model, enable_prefix_caching=False) if model else EngineConfig(enable_prefix_caching=False)
    )
    connect(None, 2 * (1 + config.world_size))  # a local Ray of our own holds both engines (scheduler + rank each)
    prefill, decode = RayEngine(config), RayEngine(config)
    print(f"model {prefill.model_path}; one prefill and one decode engine, tp=1; {num_requests} requests a length")
    print(
        "store copy: one actor gets and copies an array another put, of the KV's size; transfer: a decode rank's\n"
        "fetch of a request's KV and its write into the cache (the engine's own counters); share: transfer / store\n"
        "copy;\n"
        "prefill: a prefill engine's request exporting its KV, plain: the same prompt without; decode/tok: the\n"
        "decode side's time a token, its staging and first step included (medians)"
    )
    print(
        f"{'prompt':>7} {'KV MiB':>8} {'store copy':>11} {'transfer':>9} {'share':>6} {'prefill':>9} "
        f"{'plain':>9} {'export +':>9} {'decode/tok':>10}"
    )
    rng = np.random.default_rng(0)
    try:
        for length in prompt_lens:
            asyncio.run(_measure(prefill, decode, length, num_requests, max_tokens, rng))
    finally:
        prefill.shutdown()
        decode.shutdown()


async def _measure(
    prefill: RayEngine, decode: RayEngine, length: int, num_requests: int, max_tokens: int, rng: np.random.Generator
) -> None:
    vocab = prefill.spec.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before, imported_before = decode.stats(), ray.get(decode.workers[0].__ray_call__.remote(_import_s))
    pd_prefill, plain_prefill, decode_rest = [], [], []
    for i in range(num_requests):
        prompt = rng.integers(3, vocab, length).tolist()
        request = EngineRequest(request_id=f"kv-{length}-{i}", prompt_token_ids=prompt, sampling_params=params)
        prefill_s, rest_s, _ = await _one(prefill, decode, request)
        pd_prefill.append(prefill_s)
        decode_rest.append(rest_s / max_tokens)
        one = dataclasses.replace(params, max_tokens=1)
        start = time.perf_counter()
        await _collect(prefill, dataclasses.replace(request, request_id=f"plain-{length}-{i}", sampling_params=one))
        plain_prefill.append(time.perf_counter() - start)
    after, imported_after = decode.stats(), ray.get(decode.workers[0].__ray_call__.remote(_import_s))
    nbytes = (after.kv_transfer_bytes - before.kv_transfer_bytes) / num_requests
    # Fetched (staged) on the ranks' transfer thread, then written into the cache by the step that admits it.
    transfer_s = (after.kv_transfer_s - before.kv_transfer_s + imported_after - imported_before) / num_requests
    store_s = object_store_copy_s(int(nbytes), num_requests)
    pd, plain = statistics.median(pd_prefill), statistics.median(plain_prefill)
    mib = 1 << 20
    print(
        f"{length:>7} {nbytes / mib:>8.2f} {nbytes / store_s / mib:>7.0f} MiB/s {nbytes / transfer_s / mib:>5.0f} MiB/s "
        f"{store_s / transfer_s:>6.0%} {pd * 1e3:>6.0f} ms {plain * 1e3:>6.0f} ms {(pd - plain) * 1e3:>6.1f} ms "
        f"{statistics.median(decode_rest) * 1e3:>7.1f} ms"
    )


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "the default model")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--num-requests", type=int, default=8, help="per prompt length")
    p.add_argument("--max-tokens", type=int, default=16)


def main(args: argparse.Namespace) -> None:
    bench_kv_transfer(args.model, tuple(args.prompt_lens), args.num_requests, args.max_tokens)
