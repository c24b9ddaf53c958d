"""`--kv-cache-dtype fp8` on a rank: FP8 pages hold twice a bf16 cache's blocks in the same bytes, each layer's
scales come from the checkpoint (else 1.0, said once), and a tiny model's logits over FP8 pages are those of its
keys and values rounded to FP8."""

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import TorchBackend
from tests.workers.configs import worker_config
from tests.workers.test_models import random_seqs, run_paged
from workers.model_loader import load_model
from workers.worker import Worker

FP8 = torch.float8_e4m3fn


def loaded_worker(path: str, **settings) -> Worker:
    worker = Worker(worker_config(path, kv_cache_bytes=1 << 20, **settings))
    worker.init_device()
    worker.load_model()
    return worker


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_pages_hold_twice_the_blocks_of_bf16_pages(tiny_model_dir, name):
    bf16 = loaded_worker(tiny_model_dir("llama"), dtype="bfloat16")
    fp8 = loaded_worker(tiny_model_dir("llama"), dtype="bfloat16", kv_cache_dtype=name)
    assert (fp8.dtype, fp8.kv_dtype) == (torch.bfloat16, FP8)
    assert fp8.block_bytes() * 2 == bf16.block_bytes()
    assert fp8.determine_num_blocks() == 2 * bf16.determine_num_blocks()
    fp8.init_cache(fp8.determine_num_blocks())
    assert fp8.cache.kv_cache.dtype == FP8 and fp8.cache.kv_cache.nbytes <= 1 << 20


def _with_kv_scales(src: str, dst: Path, scales: dict[str, torch.Tensor]) -> str:
    dst.mkdir()
    (dst / "config.json").write_text((Path(src) / "config.json").read_text())
    save_file({**load_file(Path(src) / "model.safetensors"), **scales}, dst / "model.safetensors")
    return str(dst)


def test_kv_scales_come_from_the_checkpoint_else_they_are_1_and_said_once(tiny_model_dir, tmp_path, caplog):
    src = tiny_model_dir("llama")
    with caplog.at_level(logging.WARNING, logger="workers.model_loader"):
        plain = loaded_worker(src, kv_cache_dtype="fp8")
    assert all((a.k_scale, a.v_scale) == (1.0, 1.0) for a in plain.model.attention_layers)
    assert sum("no k_scale/v_scale" in r.message for r in caplog.records) == 1
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.25 * (i + 1)) for i in (0, 1) for kv in "kv"}
    scaled = loaded_worker(_with_kv_scales(src, tmp_path / "scaled", scales), kv_cache_dtype="fp8")
    assert [(a.k_scale, a.v_scale) for a in scaled.model.attention_layers] == [(0.25, 0.25), (0.5, 0.5)]
    del scales["model.layers.1.self_attn.v_scale"]
    with pytest.raises(ValueError, match=r"has model.layers.1.self_attn.k_scale but not .*layers.1.self_attn.v_scale"):
        loaded_worker(_with_kv_scales(src, tmp_path / "half", scales), kv_cache_dtype="fp8")


class RoundedKV(TorchBackend):
    """The reference: keys and values rounded as an FP8 cache holds them, kept dequantized in the model's dtype."""

    def store_kv(self, k, v, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        def rounded(x, scale):
            return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(x.dtype)

        super().store_kv(rounded(k, k_scale), rounded(v, v_scale), kv_cache, slot_mapping)


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.25, 4.0)])
def test_logits_over_fp8_pages_are_those_of_the_rounded_keys_and_values(tiny_model_dir, k_scale, v_scale):
    model = load_model(tiny_model_dir("llama"), attn_backend=TorchBackend())
    seqs = random_seqs(model.spec.vocab_size)
    plain = run_paged(model, seqs)
    for layer in model.attention_layers:
        layer.k_scale, layer.v_scale = k_scale, v_scale
    fp8 = run_paged(model, seqs, kv_dtype=FP8)
    for layer in model.attention_layers:
        layer.backend = RoundedKV()
    for ours, reference, auto in zip(fp8, run_paged(model, seqs), plain):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))  # greedy agrees at every position
        # FP8 keeps 3 mantissa bits: the logits differ from the fp32 cache's, by a few percent of their size.
        assert 0 < (ours - auto).abs().mean() < 0.1 * auto.abs().mean()
