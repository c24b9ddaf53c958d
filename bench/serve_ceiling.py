"""`raylm bench serve --no-work-model`: the serving path's ceiling. `raylm serve --no-work-model` returns a token
per request per step with no tensor work, so streamed tokens/s, SSE chunks/s, engine steps/s and the CPU each
process spends per token, at 64, 256 and 1,024 concurrent streams, are what the scheduler, Ray and the HTTP path
alone can carry."""

from __future__ import annotations

import json
from pathlib import Path

from bench.serve import make_workload, run_workload
from bench.servers import raylm_server
from engine.network import free_port

NO_WORK_KV_BYTES = 1 << 40  # the no-work model allocates no KV cache: only the scheduler's block count


def bench_serve_ceiling(
    model: str | None = None,
    concurrency: tuple[int, ...] = (64, 256, 1024),
    output_len: int = 256,
    input_len: int = 32,
    seed: int = 0,
    token_ids: bool = False,
) -> dict:
    """One `raylm serve --no-work-model` replica; each level sends that many streams at once."""
    model_path = model
    if model_path is None:
        from workers.default_model import default_model_path

        model_path = default_model_path()
    vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    print(
        f"raylm bench serve --no-work-model: one replica whose ranks do no tensor work; {input_len}-token prompts, "
        f"{output_len} output tokens per stream, all streams at once"
    )
    rows = {}
    args = [
        "--no-work-model",
        "--kv-cache-bytes",
        str(NO_WORK_KV_BYTES),
        "--max-num-seqs",
        str(max(concurrency)),
        "--max-num-batched-tokens",
        str(max(2048, max(concurrency) * input_len)),
    ]
    with raylm_server(free_port(), [*(["--model", model] if model else []), *args]) as server:
        for c in concurrency:
            work = make_workload(
                "random",
                c,
                vocab_size,
                input_len=input_len,
                output_len=output_len,
                seed=seed,
                tokenizer=None if token_ids else model_path,
            )
            rows[c] = run_workload(f"{c:5d} streams", server.url, work, seed=seed, meter=server.meter())
    return rows
