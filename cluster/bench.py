"""`raylm bench ...`: benchmark commands that print figures (never timed assertions in tests)."""

from __future__ import annotations

import gc
import random
import statistics
import time

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


def run_transformers_static(model_path: str, work, threads: int | None) -> float:
    """One padded batch of all requests through transformers generate (greedy), as static batching does."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
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
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t0


def bench_throughput(model: str | None = None, num_requests: int = 64, min_len: int = 32, max_len: int = 256,
                     compare: list[str] = ("transformers",), **engine_kwargs) -> dict:
    from cluster.llm import LLM

    llm = LLM(model=model, max_num_seqs=max(num_requests, 1), **engine_kwargs)
    work = throughput_workload(num_requests, min_len, max_len, llm.engine.spec.vocab_size)
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    print(f"raylm bench throughput: {num_requests} requests, prompt and output lengths uniform in "
          f"[{min_len}, {max_len}] (seed 0, ignore_eos), {prompt_tokens} prompt + {output_tokens} output tokens; "
          f"model {llm.engine.model_path}, {llm.config.dtype}, device {llm.engine.worker.device}")
    results = {"raylm": _report("raylm", run_raylm(llm, work), num_requests, prompt_tokens, output_tokens)}
    if "transformers" in compare:
        secs = run_transformers_static(llm.engine.model_path, work, llm.config.num_threads)
        results["transformers"] = _report("transformers", secs, num_requests, prompt_tokens, output_tokens)
        print(f"  raylm / transformers (static batching), output tok/s: "
              f"{results['raylm'] / results['transformers']:.2f}x")
    return results
