"""tools/random_model.py: the named real shapes as raylm and transformers read them (on the meta device, nothing
allocated), one-layer builds of them on CPU as the hub lays checkpoints out, and a small build that raylm serves
token for token as transformers does."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from kernels import select_backend
from raylm import SamplingParams
from tests.workers.test_families import transformers_greedy
from tests.workers.test_model_runner import engine, prompts, run
from tools.random_model import INDEX, SHAPES, build, checkpoint_shapes, shape_config
from workers.draft import check_draft
from workers.model_loader import _checkpoint_names, load_model, read_model_spec
from workers.models import MODEL_REGISTRY

VOCAB = 49152  # the default model's tokenizer's


def llama_8b_params() -> int:
    """Llama-3.1-8B's parameters with the default model's vocabulary: 7.38B (8.03B with its own 128256)."""
    h, layers, kv_dim, mlp = 4096, 32, 8 * 128, 14336
    layer = 2 * h * h + 2 * h * kv_dim + 3 * h * mlp + 2 * h  # q, o; k, v; gate, up, down; two norms
    return layers * layer + h + 2 * VOCAB * h  # final norm, untied embeddings and head


def qwen3_30b_a3b_params() -> int:
    """Qwen3-30B-A3B's with the default model's vocabulary: 30.11B (30.53B with its own 151936)."""
    h, layers, q_dim, kv_dim, experts, unit = 2048, 48, 32 * 128, 4 * 128, 128, 768
    attention = 2 * h * q_dim + 2 * h * kv_dim + 2 * 128  # q, o; k, v; q and k norms
    layer = attention + experts * 3 * h * unit + experts * h + 2 * h  # experts, router, two norms
    return layers * layer + h + 2 * VOCAB * h


def qwen25_05b_params() -> int:
    """Qwen2.5-0.5B's with the default model's vocabulary, its table tied: 0.40B (0.49B with its own 151936)."""
    h, layers, q_dim, kv_dim, mlp = 896, 24, 14 * 64, 2 * 64, 4864
    attention = 2 * h * q_dim + 2 * h * kv_dim + q_dim + 2 * kv_dim  # q, o; k, v; the q, k and v biases
    return layers * (attention + 3 * h * mlp + 2 * h) + h + VOCAB * h


def write_config(folder: Path, shape: str, tokenizer: str) -> AutoConfig:
    (folder / "config.json").write_text(json.dumps(shape_config(shape, Path(tokenizer), torch.bfloat16)))
    return AutoConfig.from_pretrained(folder)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_full_shape_names_the_tensors_raylm_loads(shape, default_model_dir, tmp_path):
    config = write_config(tmp_path, shape, default_model_dir)
    shapes = checkpoint_shapes(config)
    spec = read_model_spec(tmp_path)
    assert spec.num_layers == SHAPES[shape]["num_hidden_layers"]
    assert (spec.vocab_size, spec.bos_token_id, spec.eos_token_id) == (VOCAB, 1, 2)  # the tokenizer's
    with torch.device("meta"):
        model = MODEL_REGISTRY[spec.architecture](spec, select_backend("auto", torch.device("cpu")))
    assert set(_checkpoint_names(model)) == set(shapes)
    params = sum(s.numel() for s in shapes.values())
    if shape == "Llama-3.1-8B":
        assert params == llama_8b_params() == 7_382_241_280
        assert spec.rope.rope_type == "llama3" and not spec.tie_word_embeddings
    if shape == "Qwen3-30B-A3B":
        assert params == qwen3_30b_a3b_params() == 30_111_119_360
        assert spec.moe.num_experts == 128 and spec.moe.top_k == 8 and spec.moe.sparse_layers == tuple(range(48))
        assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    if shape == "Qwen2.5-0.5B":
        assert params == qwen25_05b_params() == 401_938_304
        assert spec.qkv_bias and spec.tie_word_embeddings and spec.layer_windows == ()  # its window is off
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rope.theta) == (14, 2, 64, 1e6)


@pytest.mark.parametrize("shape", ["Llama-3.1-8B", "Qwen3-30B-A3B"])
def test_a_one_layer_build_is_sharded_as_the_hub_shards(shape, default_model_dir, tmp_path):
    """Shards of at most 600 MB (the hub's are 5 GB): each tensor in the file the index names, under the name
    and shape transformers' model has, in bf16; norms 1; raylm loads it (on the meta device: the names and
    shapes are checked, nothing kept)."""
    built = build(shape, tmp_path, Path(default_model_dir), layers=1, shard_bytes=600 * 10**6)
    shapes = checkpoint_shapes(AutoConfig.from_pretrained(tmp_path))
    index = json.loads((tmp_path / INDEX).read_text())
    assert len(built.shards) >= 3 and sorted(set(index["weight_map"].values())) == built.shards
    assert list(index["weight_map"]) == list(shapes)
    assert index["metadata"]["total_size"] == built.nbytes == 2 * sum(s.numel() for s in shapes.values())
    for file in built.shards:
        with safe_open(tmp_path / file, framework="pt") as f:
            assert sorted(f.keys()) == sorted(n for n, shard in index["weight_map"].items() if shard == file)
            for name in f.keys():
                t = f.get_slice(name)
                assert (tuple(t.get_shape()), t.get_dtype()) == (tuple(shapes[name]), "BF16")
    with safe_open(tmp_path / index["weight_map"]["model.norm.weight"], framework="pt") as f:
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(SHAPES[shape]["hidden_size"]).bfloat16())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    backend = select_backend("auto", torch.device("cpu"), dtype=torch.bfloat16)
    load_model(tmp_path, dtype=torch.bfloat16, device="meta", attn_backend=backend)


@pytest.mark.parametrize("shape", ["SmolLM2-135M", "Qwen2.5-0.5B"])
def test_raylm_serves_a_small_build_as_transformers_does(shape, default_model_dir, tmp_path):
    """The shape with 2 layers in 40 MB shards: transformers finds every tensor it expects and no other, and
    raylm's engine generates greedily the tokens transformers generates."""
    built = build(shape, tmp_path, Path(default_model_dir), dtype=torch.float32, layers=2, shard_bytes=40 << 20)
    assert len(built.shards) > 1
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    ids = prompts(3)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3
    assert run(engine(str(tmp_path)), ids, params) == transformers_greedy(str(tmp_path), ids, 8)


def test_the_qwen2_5_shape_drafts_for_the_8b_shape_up_to_its_positions(default_model_dir, tmp_path):
    """Every shape takes the default model's tokenizer, so raylm takes Qwen2.5-0.5B's (0.40B parameters) as a draft
    for Llama-3.1-8B's (7.38B), up to the 0.5B's 32,768 positions: serving the 8B's own 131,072 is refused, so the
    pair runs with --max-model-len."""
    target, draft = tmp_path / "8b", tmp_path / "0.5b"
    for folder, shape in ((target, "Llama-3.1-8B"), (draft, "Qwen2.5-0.5B")):
        folder.mkdir()
        write_config(folder, shape, default_model_dir)
        shutil.copy(Path(default_model_dir) / "tokenizer.json", folder)
    spec = read_model_spec(target)
    assert check_draft(spec, str(target), str(draft), 32768).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="max_position_embeddings=32768, under max_model_len=131072"):
        check_draft(spec, str(target), str(draft), spec.max_position_embeddings)
