"""EngineConfig's resolution of what is left unset: the block size both the scheduler and the ranks use; the
settings import no model stack (tests/test_layout.py holds the import graph)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import kernels
from engine.config import derive_scheduler_config, derive_worker_config
from engine.config.choices import ATTENTION_BACKENDS, DEFAULT_BLOCK_SIZE, DTYPES, QUANTIZATIONS
from kernels import flash_attention
from raylm import EngineConfig
from workers import worker
from workers.quantization import config as quantization

# What the engine reads from the checkpoints; these tests name no model directory and check the other fields.
NO_SPECS = {"model_spec": None, "draft_spec": None}

FLASH_STAND_INS = (lambda *args, **kwargs: None, lambda *args, **kwargs: None)


@pytest.fixture
def cuda_with_flash_attn(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_attention, "load_flash_attn", lambda: FLASH_STAND_INS)
    find_spec = importlib.util.find_spec  # the settings look for flash_attn before importing torch to ask kernels/
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a)
    )


def test_unset_block_size_is_flash_attns_page_where_it_serves(cuda_with_flash_attn):
    assert EngineConfig().block_size == 256  # device auto sees a GPU, dtype auto is half precision there
    assert EngineConfig(dtype="float32").block_size == 16  # flash-attn refuses fp32: Triton, with small blocks
    assert EngineConfig(attention_backend="triton").block_size == 16
    assert EngineConfig(device="cpu").block_size == 16
    assert EngineConfig(block_size=32).block_size == 32
    assert (
        derive_worker_config(EngineConfig(), "m", 64, **NO_SPECS).block_size
        == derive_scheduler_config(EngineConfig(), 9, 64).block_size
    )


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "greater than or equal to 0"),
        ("lots", "valid number"),
        (
            1 << 30,
            r"swap_space=1.07374e\+09 GiB per rank: .* more than this host can give, \d+ bytes of memory are "
            r"available",
        ),
    ],
)
def test_bad_swap_space_is_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message) as e:
        EngineConfig(swap_space=value)
    assert "swap_space" in str(e.value)


def test_swap_preemption_needs_a_host_tier():
    with pytest.raises(ValueError, match="preemption_mode='swap' needs a host tier"):
        EngineConfig(preemption_mode="swap")
    config = EngineConfig(device="cpu", swap_space=1 / 1024, preemption_mode="swap")
    assert derive_worker_config(config, "m", 64, **NO_SPECS).swap_space_bytes == 1 << 20
    assert derive_scheduler_config(config, 9, 64, num_host_blocks=4).preemption_mode == "swap"


def test_unset_block_size_on_cpu_is_16_and_dtype_auto_passes_to_the_ranks():
    config = EngineConfig(device="cpu")
    assert config.block_size == 16 and derive_worker_config(config, "m", 64, **NO_SPECS).dtype == "auto"


def test_the_ranks_get_every_setting_they_need_from_the_engine_config():
    """WorkerConfig has no defaults: a field EngineConfig forgot to pass would fail here, not on a rank."""
    config = EngineConfig(
        model="org/name", revision="v1", download_dir="/d", device="cpu", seed=3, num_threads=2, quantization="fp8"
    )
    worker = derive_worker_config(config, "/local/copy", 64, **NO_SPECS)
    assert (worker.model, worker.revision, worker.download_dir, worker.seed, worker.num_threads) == (
        "org/name",
        "v1",
        "/d",
        3,
        2,
    )
    assert worker.quantization == "fp8"
    assert (
        derive_worker_config(EngineConfig(device="cpu"), "/default/converted", 64, **NO_SPECS).model
        == "/default/converted"
    )


def test_an_fp8_kv_cache_is_refused_where_it_cannot_be_read():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' .* attention_backend='flash_attn' cannot read"):
        EngineConfig(kv_cache_dtype="fp8", attention_backend="flash_attn")
    with pytest.raises(ValueError, match=r"kv_cache_dtype\n.*Input should be 'auto', 'fp8' or 'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", attention_backend="triton", device="cpu").block_size == 16


def test_generation_config_names_auto_vllm_or_a_directory(tmp_path):
    with pytest.raises(ValueError, match="generation_config='nowhere' is neither auto, vllm nor a directory"):
        EngineConfig(generation_config="nowhere")
    (tmp_path / "generation_config.json").write_text("{}")
    assert EngineConfig(generation_config=str(tmp_path)).generation_config == str(tmp_path)


def test_checks_that_need_the_ranks_numbers_are_made_when_the_scheduler_is_configured():
    config = EngineConfig(device="cpu", swap_space=1 / 1024, preemption_mode="swap")
    with pytest.raises(
        ValueError,
        match=r"preemption_mode='swap' needs a host tier, but swap_space=0.000976562 GiB "
        r"holds 1 KV blocks per rank",
    ):
        derive_scheduler_config(config, 9, 64, num_host_blocks=1)
    with pytest.raises(
        ValueError,
        match="max_num_batched_tokens=64 is invalid: without chunked prefill it must be >= max_model_len=128",
    ):
        derive_scheduler_config(
            EngineConfig(device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=64), 9, 128
        )
    assert not derive_scheduler_config(
        EngineConfig(device="cpu", enable_chunked_prefill=False), 9, 64
    ).enable_chunked_prefill


@pytest.mark.parametrize(
    "async_scheduling,pp,on_gpu,expected",
    [
        (None, 1, False, 1),  # one CPU stage: a new request would wait a whole step more
        (None, 1, True, 2),
        (None, 2, False, 2),  # a pipeline needs a step per stage in flight
        (None, 3, False, 3),
        (True, 1, False, 2),
        (False, 1, True, 1),
        (False, 2, False, 1),
    ],
)
def test_steps_in_flight_default_to_async_on_gpus_and_pipelines_only(async_scheduling, pp, on_gpu, expected):
    config = EngineConfig(device="cpu", async_scheduling=async_scheduling, pipeline_parallel_size=pp)
    assert derive_scheduler_config(config, 9, 64, on_gpu=on_gpu).steps_in_flight == expected


def test_auto_binding_leaves_threads_alone_where_replicas_may_share_a_node():
    """auto binds one engine's ranks per node; several replicas there would all bind to the same cores."""
    from engine.config import AppArgs

    assert AppArgs(engine=EngineConfig(model="/m")).engine.cpu_omp_threads_bind == "auto"
    assert AppArgs(engine=EngineConfig(model="/m"), max_replicas=2).engine.cpu_omp_threads_bind == "nobind"
    pinned = EngineConfig(model="/m", cpu_omp_threads_bind="0|1")
    assert AppArgs(engine=pinned, max_replicas=2).engine.cpu_omp_threads_bind == "0|1"  # the user's own lists stay


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 4}, "model=None is invalid"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, "unknown keys"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 17}, r"\[1, 16\]"),
        ({"method": "eagle", "model": "d", "num_speculative_tokens": 2}, "method='eagle'"),
    ],
)
def test_bad_speculative_config_is_refused_naming_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


def test_a_draft_model_reaches_the_sampling_rank_and_is_refused_with_pipeline_stages():
    spec = {"method": "draft_model", "model": "/draft", "num_speculative_tokens": 3}
    config = EngineConfig(device="cpu", speculative_config=spec)
    ranks = derive_worker_config(config, "/target", 256, **NO_SPECS)
    assert (ranks.draft_model, ranks.num_speculative_tokens) == ("/draft", 3)
    assert derive_scheduler_config(config, 64, 256).speculative_method == "draft_model"
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        EngineConfig(pipeline_parallel_size=2, speculative_config=spec)


def test_the_settings_and_the_cli_parser_import_no_model_stack():
    """`raylm --help` and a config's checks (a default config's too: `raylm serve`'s own process makes one) run where
    torch and Ray are slow to import or absent."""
    code = (
        "import sys, engine.config, cli; cli.build_parser(); engine.config.EngineConfig(); "
        "print(sorted({m.partition('.')[0] for m in sys.modules} & {'torch', 'transformers', 'workers', 'kernels', "
        "'ray', 'fastapi'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_settings_name_the_dtypes_attention_backends_and_quantizations_the_layers_run():
    assert tuple(worker.DTYPES) == DTYPES
    assert kernels.BACKENDS == ATTENTION_BACKENDS
    assert kernels.DEFAULT_BLOCK_SIZE == DEFAULT_BLOCK_SIZE
    assert quantization.AT_LOAD_METHODS == QUANTIZATIONS
