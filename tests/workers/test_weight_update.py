"""Weights pushed into a loaded model (workers/weight_update.py): the same parameters a load of a checkpoint holding
those tensors gives, on every tensor-parallel rank's shard; all or nothing; and its CPU-packed copies along."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.workers.configs import worker_config
from tests.workers.test_models import MIXTRAL
from workers.layers import FEW_ROWS, ColumnParallelLinear, RowParallelLinear, linear
from workers.model_loader import load_model
from workers.weight_update import update_weights, update_weights_from_disk
from workers.worker import Worker

Q = "model.layers.0.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"


def perturbed(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, those of `names` plus noise (seeded)."""
    tensors = load_file(Path(path) / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in names:
        tensors[name] = tensors[name] + 0.1 * torch.randn(tensors[name].shape, generator=gen)
    return tensors


def saved(src: str, dst: Path, tensors: dict[str, torch.Tensor]) -> str:
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def update(model: torch.nn.Module, tensors, pack: bool = False) -> set[str]:
    return update_weights(model, list(tensors), torch.float32, pack)


def test_the_checkpoints_own_weights_leave_every_parameter_bitwise_equal(default_model_dir):
    model = load_model(default_model_dir)
    before = params(model)
    update(model, load_file(Path(default_model_dir) / "model.safetensors").items())
    assert_same(model, before)


@pytest.mark.parametrize("tied", [False, True])
def test_an_update_equals_a_load_of_a_checkpoint_holding_its_tensors(tiny_model_dir, tmp_path, tied):
    path = tiny_model_dir("llama", tie_word_embeddings=tied)
    names = [Q, "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.o_proj.weight", EMBED]
    names += [] if tied else ["lm_head.weight"]
    tensors = perturbed(path, names + ["model.norm.weight"])
    model = load_model(path)
    assert update(model, ((n, tensors[n]) for n in names)) == set(names)
    update(model, [("model.norm.weight", tensors["model.norm.weight"].bfloat16())])  # any float dtype, cast
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16().float()
    assert_same(model, params(load_model(saved(path, tmp_path / "new", tensors))))


def test_the_cpu_packed_copies_follow_the_update(tiny_model_dir):
    path = tiny_model_dir("llama", tie_word_embeddings=True)
    worker = Worker(worker_config(path, 256, kv_cache_bytes=1 << 20))
    worker.init_device()
    worker.load_model()
    model = worker.model
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert all(m.packed is not None for m in layers) and model.lm_head.packed_head is not None
    tensors = perturbed(path, [Q, "model.layers.1.mlp.down_proj.weight", EMBED])
    worker.update_weights([(n, tensors[n]) for n in (Q, "model.layers.1.mlp.down_proj.weight", EMBED)])
    for m in layers:
        x = torch.randn(4 * FEW_ROWS, m.weight.shape[1])  # past FEW_ROWS: the packed weight computes
        torch.testing.assert_close(linear(x, m.weight, m.packed), F.linear(x, m.weight))
    x = torch.randn(4 * FEW_ROWS, 64)
    # Tied: the embedding's update is the head's.
    torch.testing.assert_close(model.compute_logits(x), F.linear(x, tensors[EMBED]))
    assert torch.equal(worker.get_weights_by_name(EMBED), tensors[EMBED])
    with pytest.raises(ValueError, match="no parameter model.embed_tokens.weigh "):
        worker.get_weights_by_name("model.embed_tokens.weigh")


@pytest.mark.parametrize(
    "model_type,overrides,expert_parallel",
    [
        ("llama", dict(num_key_value_heads=1, vocab_size=251, tie_word_embeddings=True), False),
        ("mixtral", dict(vocab_size=251, **MIXTRAL), False),
        ("mixtral", dict(vocab_size=251, **MIXTRAL), True),
    ],
    ids=["llama tied, kv heads copied", "mixtral", "mixtral expert parallel"],
)
def test_each_tensor_parallel_rank_takes_its_shard(tiny_model_dir, tmp_path, model_type, overrides, expert_parallel):
    path = tiny_model_dir(model_type, None, **overrides)
    tensors = load_file(Path(path) / "model.safetensors")
    tensors = perturbed(path, list(tensors))  # every one: fused, row, vocab, router and expert shards
    new = saved(path, tmp_path / "new", tensors)
    for rank in (0, 1):
        model = load_model(path, tp_rank=rank, tp_size=2, expert_parallel=expert_parallel)
        update(model, tensors.items())  # every expert named: each rank takes its own
        assert_same(model, params(load_model(new, tp_rank=rank, tp_size=2, expert_parallel=expert_parallel)))


def test_an_update_from_disk_equals_a_load(tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen3_moe", None, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    new = saved(path, tmp_path / "new", perturbed(path, [Q, "model.layers.1.mlp.experts.3.down_proj.weight"]))
    model = load_model(path)
    update_weights_from_disk(model, new, torch.float32, pack=False)
    assert_same(model, params(load_model(new)))


@pytest.mark.parametrize(
    "bad,match",
    [
        (("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(128, 64)), "qkv_proj.weight: .* has no such weight"),
        ((Q, torch.zeros(64, 64, dtype=torch.int32)), f"{Q}: torch.int32 is not a floating-point tensor"),
        ((Q, torch.zeros(64, 63)), rf"{Q} has shape \[64, 63\].*expected \[64, 64\]"),
        (("lm_head.weight", torch.zeros(255, 64)), r"lm_head.weight has shape \[255, 64\], expected \[256, 64\]"),
    ],
    ids=["unknown name", "int dtype", "wrong shape", "tied head of another shape"],
)
def test_a_refused_tensor_is_named_and_nothing_changes(tiny_model_dir, bad, match):
    model = load_model(tiny_model_dir("llama", tie_word_embeddings=True))
    before = params(model)
    good = [(Q, torch.ones(64, 64)), (EMBED, torch.ones(256, 64))]
    with pytest.raises(ValueError, match=match):
        update(model, [*good, bad])
    assert_same(model, before)


def test_a_tied_head_of_the_embeddings_shape_is_skipped(tiny_model_dir):
    model = load_model(tiny_model_dir("llama", tie_word_embeddings=True))
    before = params(model)
    assert update(model, [("lm_head.weight", torch.ones(256, 64))]) == set()
    assert_same(model, before)
