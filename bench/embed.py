"""`raylm bench embed`: embeddings per second of the engine's pooling path (every input one request, batched by
the scheduler) against transformers' forward over the same inputs in batches, on one model, one thread count,
last-token pooling, in one invocation; and the largest difference between the two sets of vectors."""

from __future__ import annotations

import argparse
import os
import random
import time

from engine.cli_flags import add_model_flag


def _engine_embeddings(engine, work: list[list[int]]) -> tuple[list[list[float]], float]:
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=1, pooling="last")
    vectors: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(work):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
    while engine.has_unfinished_requests():
        vectors.update((o.request_id, o.embedding) for o in engine.step() if o.finished)
    return [vectors[str(i)] for i in range(len(work))], time.perf_counter() - start


def _transformers_embeddings(model_path: str, work: list[list[int]], batch: int) -> tuple[object, float]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            # Inputs of one length: no padding, so the last position is every row's last token.
            hidden = model(torch.tensor(work[i : i + batch])).last_hidden_state[:, -1]
            out.append(torch.nn.functional.normalize(hidden.float(), dim=-1))
    return torch.cat(out), time.perf_counter() - start


def bench_embed(model: str | None, num_inputs: int, input_len: int, batch: int, num_threads: int | None) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.inprocess import InProcessEngine

    config = EngineConfig(model=model, num_threads=num_threads, max_num_batched_tokens=max(2048, input_len))
    engine = InProcessEngine(config)
    torch.set_num_threads(num_threads or torch.get_num_threads())
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    work = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(num_inputs)]
    print(
        f"raylm bench embed: {num_inputs} inputs x {input_len} tokens, last-token pooling, "
        f"{torch.get_num_threads()} threads, transformers batch {batch}, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    _engine_embeddings(engine, work[: min(4, num_inputs)])  # warm-up
    ours, ours_s = _engine_embeddings(engine, work)
    engine.shutdown()
    theirs, theirs_s = _transformers_embeddings(engine.model_path, work, batch)
    diff = (torch.tensor(ours) - theirs).abs().max().item()
    print(f"{'':14}{'inputs/s':>10}{'seconds':>10}")
    print(f"{'raylm':14}{num_inputs / ours_s:>10.1f}{ours_s:>10.2f}")
    print(f"{'transformers':14}{num_inputs / theirs_s:>10.1f}{theirs_s:>10.2f}")
    print(f"raylm / transformers: {theirs_s / ours_s:.2f}x; max |difference| {diff:.2e}")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "SmolLM2-135M-Instruct")
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for both (default: all cores)")


def main(args: argparse.Namespace) -> None:
    bench_embed(args.model, args.num_inputs, args.input_len, args.batch, args.num_threads)
