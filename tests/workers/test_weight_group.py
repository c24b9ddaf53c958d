"""Weights broadcast by a trainer over a group of their own (workers/weight_group.py), on gloo: the trainer's
WeightSender in a thread, a rank's Worker in the test's."""

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.workers.configs import worker_config
from tests.workers.test_weight_update import perturbed, saved
from workers.model_loader import load_model
from workers.weight_group import WeightSender
from workers.worker import Worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_buckets_cut_in_order_at_their_size():
    named = [(str(i), torch.zeros(n)) for i, n in enumerate([2, 2, 5, 1])]  # float32: 4 bytes each
    buckets = WeightSender.buckets(named, 16)
    assert [[name for name, _ in b] for b in buckets] == [["0", "1"], ["2"], ["3"]]
    assert WeightSender.bucket_metadata([("w", torch.zeros(2, 3, dtype=torch.bfloat16))]) == (
        ["w"],
        ["bfloat16"],
        [[2, 3]],
    )


def test_a_rank_takes_the_broadcast_buckets_and_refuses_a_bad_one_after_receiving_it(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    tensors = perturbed(path, list(load_file(Path(path) / "model.safetensors")))
    worker = Worker(worker_config(path, 256, kv_cache_bytes=1 << 20))
    worker.init_device()
    worker.load_model()
    port = free_port()
    with ThreadPoolExecutor(1) as trainer:
        # A rank that refused before receiving would leave the trainer's broadcast waiting: it times out then.
        joining = trainer.submit(WeightSender, "127.0.0.1", port, 2, "rl", timeout_s=30)
        worker.init_weights_update_group("127.0.0.1", port, 1, 2, "rl")
        sender = joining.result()

        def push(bucket: list[tuple[str, torch.Tensor]]) -> None:
            sending = trainer.submit(sender.send, bucket)
            try:
                worker.update_weights_from_distributed(*WeightSender.bucket_metadata(bucket), "rl")
            finally:
                sending.result()

        # Odd-sized bfloat16 first: the float32 after it is not aligned in the buffer.
        bad = [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3, dtype=torch.bfloat16))]
        with pytest.raises(ValueError, match="qkv_proj.weight: .* has no such weight"):
            push([*bad, ("model.norm.weight", torch.zeros(64))])
        buckets = WeightSender.buckets(tensors.items(), sum(t.nbytes for t in tensors.values()) // 2 + 1)
        assert len(buckets) > 1
        for bucket in buckets:
            push(bucket)
        worker.destroy_weights_update_group("rl")
        sender.close()
    expected = load_model(saved(path, tmp_path / "new", tensors))
    got = dict(worker.model.named_parameters())
    for name, value in expected.named_parameters():
        assert torch.equal(got[name], value), name
