"""`raylm bench weight-sync`: what an RL loop pays between rollouts. Per engine (tp=1 and tp=3 by default): the whole
model pushed from a trainer (this process, rank 0 of the weight-update group: workers/weight_group.py) in buckets,
against the floor of its bytes (one memcpy of the same tensors, measured in the same run); sleep and wake at both
levels; and the engine's start, which an update spares (a new policy without these controls means a restart)."""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from pathlib import Path

from engine.cli_flags import add_model_flag

GROUP = "raylm-bench"


def _checkpoint(model_path: str) -> list:
    """The trainer's tensors: the checkpoint's, by their Hugging Face names, in memory."""
    from safetensors.torch import load_file

    tensors = []
    for file in sorted(Path(model_path).glob("*.safetensors")):
        tensors += sorted(load_file(file).items())
    return tensors


def _memcpy_s(tensors: list, repeats: int = 3) -> float:
    """The floor: the fastest of ``repeats`` copies of every tensor into memory already allocated."""
    import torch

    dst = [torch.empty_like(t) for _, t in tensors]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for d, (_, t) in zip(dst, tensors):
            d.copy_(t)
        best = min(best, time.perf_counter() - start)
    return best


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _join(llm, tp: int):
    """This process and every rank of ``llm`` meet in one group: both sides block until all have joined."""
    from workers.weight_group import WeightSender

    address, port = socket.gethostbyname(socket.gethostname()), _free_port()
    joined: dict = {}
    thread = threading.Thread(target=lambda: joined.update(sender=WeightSender(address, port, 1 + tp, GROUP)))
    thread.start()
    llm.init_weights_update_group(address, port, 1, 1 + tp, GROUP)
    thread.join()
    return joined["sender"]


def _push_s(llm, sender, tensors: list, bucket_bytes: int) -> float:
    """Seconds to push every tensor, one bucket at a time: the trainer broadcasts while the engine receives."""
    buckets = sender.buckets(tensors, bucket_bytes)
    start = time.perf_counter()
    for i, bucket in enumerate(buckets):
        names, dtypes, shapes = sender.bucket_metadata(bucket)
        thread = threading.Thread(target=sender.send, args=(bucket,))
        thread.start()
        llm.update_weights_from_distributed(names, dtypes, shapes, GROUP, flush_cache=i == len(buckets) - 1)
        thread.join()
    return time.perf_counter() - start


def _timed(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


def _greedy(llm) -> list[int]:
    from scheduler import SamplingParams

    (out,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    return out.outputs[0].token_ids


def bench_weight_sync(model: str | None, tps: list[int], bucket_mb: int, num_threads: int | None, repeats: int) -> None:
    from engine.connect import connect
    from engine.llm import LLM
    from engine.placement import SCHEDULER_CPUS

    # One Ray for every engine, started large enough for the largest (the first engine's start would size it).
    connect(None, SCHEDULER_CPUS + max(tps) * (num_threads or 1))
    print(f"raylm bench weight-sync: buckets of {bucket_mb} MB, load {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"{'tp':>3}{'MB':>8}{'push1 s':>9}{'push s':>9}{'memcpy s':>10}{'ratio':>7}{'sleep1':>8}{'wake1':>8}{'sleep2':>8}"
        f"{'wake2':>8}{'start s':>9}{'start/push':>11}  same output"
    )
    for tp in tps:
        start = time.perf_counter()
        llm = LLM(model, tensor_parallel_size=tp, num_threads=num_threads)
        start_s = time.perf_counter() - start
        before = _greedy(llm)
        tensors = _checkpoint(llm.engine.model_path)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        sender = _join(llm, tp)
        # The first push also faults in the ranks' receive buffers; the best of the others is the steady state.
        pushes = [_push_s(llm, sender, tensors, bucket_mb << 20) for _ in range(repeats)]
        push_s = min(pushes[1:] or pushes)
        floor_s = _memcpy_s(tensors)
        sleep1, wake1 = _timed(llm.sleep, 1), _timed(llm.wake_up)
        sleep2, wake2 = _timed(llm.sleep, 2), _timed(llm.wake_up)
        same = _greedy(llm) == before
        sender.close()
        llm.destroy_weights_update_group(GROUP)
        llm.shutdown()
        print(
            f"{tp:>3}{nbytes / 1e6:>8.0f}{pushes[0]:>9.3f}{push_s:>9.3f}{floor_s:>10.3f}{push_s / floor_s:>7.1f}{sleep1:>8.3f}"
            f"{wake1:>8.3f}{sleep2:>8.3f}{wake2:>8.3f}{start_s:>9.1f}{start_s / push_s:>11.1f}  {same}",
            flush=True,
        )


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_model_flag(p, "SmolLM2-135M-Instruct")
    p.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1, 3],
        help="tensor-parallel sizes, one engine each (the default model's 9 heads split over 3 ranks, not 2)",
    )
    p.add_argument("--bucket-mb", type=int, default=64, help="bucket size of the push")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3, help="pushes per engine: the first, and the best of the rest")


def main(args: argparse.Namespace) -> None:
    bench_weight_sync(args.model, args.tp, args.bucket_mb, args.num_threads, args.repeats)
