"""The bundled SmolLM2 GGUF becomes a Hugging Face directory once, atomically, and is reused."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from workers import gguf_convert
from workers.default_model import COMPLETE_MARKER, MODEL_NAME, default_model_path
from workers.gguf_convert import unpermute_rope_rows


def test_converted_model_loads_in_transformers_and_answers(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((Path(default_model_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    with safe_open(Path(default_model_dir) / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and len(f.keys()) == 2 + 30 * 9
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    # A wrong q/k row order or dequantization garbles the model long before it gets this right.
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_tokenizer_has_the_chat_template(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    assert tok("Hello world")["input_ids"] == [19556, 905]


def test_second_call_reuses_the_directory(default_model_dir, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf", _refuse)
    cache = Path(default_model_dir).parent.parent
    assert default_model_path(str(cache)) == default_model_dir


def _refuse(*_):
    raise AssertionError("converted again")


class FakeConverter:
    """Stands in for the 20-second conversion where only the caching around it is under test."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    def __call__(self, gguf_file: Path, out_dir: Path) -> None:
        self.calls += 1
        (out_dir / "config.json").write_text("{}")
        if self.fail:
            raise KeyboardInterrupt  # interrupted half-way: config written, weights not


def test_half_written_directory_is_rebuilt(tmp_path, monkeypatch):
    target = tmp_path / "models" / MODEL_NAME
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"truncated")
    convert = FakeConverter()
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    assert default_model_path(str(tmp_path)) == str(target)
    assert convert.calls == 1 and (target / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "config.json"]
    default_model_path(str(tmp_path))
    assert convert.calls == 1


def test_interrupted_conversion_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf", FakeConverter(fail=True))
    with pytest.raises(KeyboardInterrupt):
        default_model_path(str(tmp_path))
    assert not (tmp_path / "models" / MODEL_NAME).exists()
    convert = FakeConverter()
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    default_model_path(str(tmp_path))
    assert convert.calls == 1 and not (tmp_path / "models" / f"{MODEL_NAME}.partial").exists()


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf", FakeConverter())
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path / "env"))
    assert default_model_path() == str(tmp_path / "env" / "models" / MODEL_NAME)
    assert default_model_path(str(tmp_path / "arg")) == str(tmp_path / "arg" / "models" / MODEL_NAME)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, which the GGUF file was written with.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_inverts_llama_cpp(heads):
    w = np.random.default_rng(0).standard_normal((heads * 64, 576)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(_llama_cpp_permute(w, heads), heads), w)
