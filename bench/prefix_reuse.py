"""`raylm bench prefix-reuse`: long-document QA, where each document's prefix returns after the others passed
through a device pool too small to keep them all: prefix caching off, on, and on with the host tier."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.cli_flags import add_engine_flags, llm_kwargs
from scheduler import EngineRequest, SamplingParams

# What each run changes; the device pool and the workload stay the same.
RUNS = (
    ("no prefix caching", dict(enable_prefix_caching=False)),
    ("prefix caching", dict(enable_prefix_caching=True)),
    ("prefix caching + host tier", dict(enable_prefix_caching=True)),
)


def prefix_reuse_workload(
    num_docs: int, doc_len: int, num_questions: int, question_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Prompts in rounds: round q asks question q of every document in turn, so a document's prefix comes back
    only after all the others have passed through."""
    rng = random.Random(seed)
    docs = [[rng.randrange(100, vocab_size) for _ in range(doc_len)] for _ in range(num_docs)]
    return [
        doc + [rng.randrange(100, vocab_size) for _ in range(question_len)]
        for _ in range(num_questions)
        for doc in docs
    ]


def block_bytes_of(model_path: str, block_size: int, dtype: str, device: str) -> int:
    """One KV block's bytes, as the ranks will size it (tp=1)."""
    import torch

    from workers.cache_engine import CacheEngine
    from workers.model_loader import read_model_spec
    from workers.worker import resolve_dtype

    spec = read_model_spec(model_path)
    torch_dtype = resolve_dtype(dtype, spec.dtype, torch.device(device))
    return CacheEngine.block_bytes(spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim, torch_dtype)


def run_one(engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """One request alone, as a QA session asks: its latency, its TTFT and its tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    tokens: list[int] = []
    first = None
    pending = engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
    while not pending or not pending[-1].finished:
        pending = engine.step()
        for out in pending:
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            tokens.extend(out.new_token_ids)
    return time.perf_counter() - t0, first, tokens


def bench_prefix_reuse(
    model: str | None,
    num_docs: int,
    doc_len: int,
    num_questions: int,
    question_len: int,
    max_tokens: int,
    executor: str,
    address: str | None,
    **engine_kwargs,
) -> None:
    from engine.config import GIB, EngineConfig
    from engine.llm import LLM

    config = EngineConfig(model=model, **{k: v for k, v in engine_kwargs.items() if k != "kv_cache_bytes"})
    model_path = config.resolved_model()
    device = "cuda" if config.device == "cuda" else "cpu"
    block_bytes = block_bytes_of(model_path, config.block_size, config.dtype, device)
    request_blocks = -(-(doc_len + question_len + max_tokens) // config.block_size)
    device_docs = max(1, num_docs // 4)
    kv_cache_bytes = block_bytes * (device_docs * request_blocks + 1)
    swap_space_bytes = block_bytes * ((num_docs + 1) * request_blocks + 1)
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(config.tokenizer or model_path).vocab_size
    prompts = prefix_reuse_workload(num_docs, doc_len, num_questions, question_len, vocab)
    print(
        f"prefix-reuse: {num_docs} documents of {doc_len} tokens, {num_questions} questions of {question_len} "
        f"tokens each in rounds, {max_tokens} output tokens, one request at a time ({executor} executor); "
        f"device pool {kv_cache_bytes >> 20} MiB ({device_docs} documents), host tier "
        f"{swap_space_bytes >> 20} MiB (all {num_docs})"
    )
    kwargs = {**engine_kwargs, "kv_cache_bytes": kv_cache_bytes}
    engines = []
    try:
        for name, overrides in RUNS:
            swap = swap_space_bytes if "host tier" in name else 0
            engines.append(
                LLM(
                    model=model_path,
                    executor=executor,
                    address=address,
                    **{**kwargs, **overrides, "swap_space": swap / GIB},
                ).engine
            )
            run_one(engines[-1], "warm-up", [7] * 8, 2)  # first-call allocations
        # Request by request, each run in turn: a shared machine's load swings then hit every run alike.
        latencies, ttfts, outputs = ([[] for _ in RUNS] for _ in range(3))
        for i, prompt in enumerate(prompts):
            for r, engine in enumerate(engines):
                latency, ttft, tokens = run_one(engine, f"q{i}", prompt, max_tokens)
                latencies[r].append(latency)
                ttfts[r].append(ttft)
                outputs[r].append(tokens)
        stats = [engine.stats() for engine in engines]
    finally:
        for engine in engines:
            engine.shutdown()
    totals = [sum(x) for x in latencies]
    base = totals[1]
    for (name, _), total, ttft, st in zip(RUNS, totals, ttfts, stats):
        ttft.sort()
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        print(
            f"  {name:28s} total {total:7.2f} s ({base / total:5.2f}x prefix caching alone)   TTFT median "
            f"{statistics.median(ttft) * 1e3:8.1f} ms  p99 {p99 * 1e3:8.1f} ms   prefix hit rate {hit:5.1%} "
            f"(host tier {st.host_prefix_cache_hits} tokens)   KV blocks swapped out {st.num_blocks_swapped_out}, "
            f"in {st.num_blocks_swapped_in}"
        )
    same = all(o == outputs[0] for o in outputs)
    print(f"  identical greedy outputs across runs: {same}")
    if not same:
        raise RuntimeError("the runs' greedy outputs differ")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--num-questions", type=int, default=3, help="questions per document, asked in rounds")
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    add_engine_flags(p)


def main(args: argparse.Namespace) -> None:
    bench_prefix_reuse(
        num_docs=args.num_docs,
        doc_len=args.doc_len,
        num_questions=args.num_questions,
        question_len=args.question_len,
        max_tokens=args.max_tokens,
        **llm_kwargs(args, exclude=("enable_prefix_caching", "swap_space")),
    )
