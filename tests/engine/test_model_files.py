"""What the engine's settings select from a model directory: the chat template in force and the sampling
defaults of --generation-config, offline (LLM) and per request (the server's protocol)."""

import json
import shutil
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_files import (
    chat_template_text,
    generation_defaults,
    load_tokenizer,
    pooling_type,
    serves_embeddings,
)
from scheduler import SamplingParams
from serve.protocol.completions import CompletionRequest


def with_generation_config(model_dir: str, tmp_path: Path, **fields) -> str:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields}))
    return str(copy)


def test_generation_config_auto_reads_the_models_sampling_fields_and_vllm_none(tmp_path, tiny_model_dir):
    model = with_generation_config(
        tiny_model_dir("llama"), tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=99, do_sample=True
    )
    assert generation_defaults(EngineConfig(device="cpu"), model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(EngineConfig(device="cpu", generation_config="vllm"), model) == {}
    elsewhere = with_generation_config(tiny_model_dir("llama"), tmp_path / "other", min_p=0.1)
    assert generation_defaults(EngineConfig(device="cpu", generation_config=elsewhere), model) == {"min_p": 0.1}


def test_a_request_keeps_what_it_set_and_takes_the_defaults_for_the_rest():
    defaults = {"temperature": 0.0, "top_k": 20}
    params = CompletionRequest(prompt="x").sampling_params(8, None, defaults=defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 20, 1.0)
    params = CompletionRequest(prompt="x", temperature=0.7, top_k=0).sampling_params(8, None, defaults=defaults)
    assert (params.temperature, params.top_k) == (0.7, -1)  # top_k=0 is off, as the request asked


def test_offline_generate_without_params_samples_with_the_models_defaults(tmp_path, tiny_model_dir, default_model_dir):
    model = with_generation_config(tiny_model_dir("llama", vocab_size=49152), tmp_path, temperature=0.0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_dir) / name, Path(model) / name)
    llm = LLM(model, executor="inprocess", device="cpu", kv_cache_bytes=8 << 20, seed=None)
    try:
        assert llm.default_sampling_params() == SamplingParams(temperature=0.0)
        (free,) = llm.generate([5, 6, 7], use_tqdm=False)
        (greedy,) = llm.generate([5, 6, 7], SamplingParams(temperature=0.0), use_tqdm=False)
        assert free.outputs[0].token_ids == greedy.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path, default_model_dir):
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!")
    assert chat_template_text(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}!"
    assert chat_template_text("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="chat_template='chatml' is neither a file nor a Jinja template"):
        chat_template_text("chatml")
    tokenizer = load_tokenizer(EngineConfig(device="cpu", chat_template=str(tmp_path / "t.jinja")), default_model_dir)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"


@pytest.mark.parametrize(
    "files, runner, serves, pooling",
    [
        ({}, "auto", False, "last"),  # a chat model: generate only
        ({}, "pooling", True, "last"),
        ({"modules.json": []}, "generate", False, "last"),
        # sentence-transformers exports: Qwen3-Embedding pools the last token, most encoders the mean
        ({"modules.json": [], "1_Pooling/config.json": {"pooling_mode_lasttoken": True}}, "auto", True, "last"),
        ({"1_Pooling/config.json": {"pooling_mode_mean_tokens": True}}, "auto", True, "mean"),
    ],
    ids=["chat model", "runner pooling", "runner generate", "last-token export", "mean export"],
)
def test_embeddings_are_served_for_an_embedding_model_pooled_as_its_export_says(
    tmp_path, files, runner, serves, pooling
):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(content))
    assert serves_embeddings(runner, str(tmp_path)) is serves
    assert pooling_type("auto", str(tmp_path)) == pooling
    assert pooling_type("mean", str(tmp_path)) == "mean"
