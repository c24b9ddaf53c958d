"""AppArgs' prefill/decode settings: the prefill side is the decode side's settings overlaid with prefill_config's,
and what PD cannot serve is refused naming the values."""

import pytest
from pydantic import ValidationError

from engine.config import AppArgs, EngineConfig


def test_the_prefill_side_takes_the_decode_sides_settings_but_those_prefill_config_gives():
    args = AppArgs(
        engine=EngineConfig(model="/m", max_num_seqs=8, enable_lora=True, lora_modules=["a=/a"]),
        pd=True,
        max_replicas=3,
        prefill_config={"tensor_parallel_size": 2, "min-replicas": 2, "max_num_batched_tokens": 4096},
    )
    prefill = args.prefill
    assert (prefill.engine.tensor_parallel_size, prefill.engine.max_num_batched_tokens) == (2, 4096)
    assert (prefill.engine.model, prefill.engine.max_num_seqs, prefill.engine.block_size) == ("/m", 8, 16)
    assert (prefill.min_replicas, prefill.max_replicas) == (2, 3)
    assert (prefill.engine.enable_lora, prefill.engine.lora_modules) == (False, [])  # LoRA requests run on decode
    assert (prefill.pd, args.engine.tensor_parallel_size) == (False, 1)
    assert AppArgs(engine=EngineConfig(model="/m")).prefill is None


def test_pd_binds_no_threads_by_default_its_two_sides_may_share_a_node():
    args = AppArgs(engine=EngineConfig(model="/m"), pd=True)
    assert args.engine.cpu_omp_threads_bind == args.prefill.engine.cpu_omp_threads_bind == "nobind"


@pytest.mark.parametrize(
    ("decode", "prefill", "message"),
    [
        ({}, {"block_size": 32}, "prefill_config block_size=32 differs from the decode engines' block_size=16"),
        ({}, {"model": "/n"}, "prefill_config model='/n' differs from the decode engines' model='/m'"),
        (
            {"kv_cache_dtype": "fp8"},
            {"kv_cache_dtype": "auto"},
            "prefill_config kv_cache_dtype='auto' differs from the decode engines' kv_cache_dtype='fp8'",
        ),
        ({}, {"dtype": "bfloat16"}, "prefill_config dtype='bfloat16' differs from the decode engines' dtype='auto'"),
        ({"pipeline_parallel_size": 2}, {}, "pd cannot be served with pipeline_parallel_size=2"),
        ({}, {"pipeline_parallel_size": 2}, "pd cannot be served with prefill_config pipeline_parallel_size=2"),
        (
            {"speculative_config": {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}},
            {},
            "pd cannot be served with speculative_config method='draft_model'",
        ),
        (
            {"max_model_len": 2048},
            {"max_model_len": 1024},
            "prefill_config max_model_len=1024 is below the decode engines' max_model_len=2048",
        ),
        ({}, {"tensor_parallel_size": 0}, "prefill_config: tensor_parallel_size=0 is invalid"),
        ({}, {"min_replicas": 2}, "prefill_config: min_replicas=2 is greater than max_replicas=1"),
        ({}, {"served_model_name": "x"}, "prefill_config has unknown keys ['served_model_name']"),
    ],
)
def test_a_prefill_side_pd_cannot_serve_is_refused_naming_the_values(decode, prefill, message):
    with pytest.raises(ValidationError, match="pd|prefill_config") as error:
        AppArgs(engine=EngineConfig(model="/m", **decode), pd=True, prefill_config=prefill)
    assert message in str(error.value)


def test_fp8_and_fp8_e4m3_name_the_same_kv_pages():
    args = AppArgs(
        engine=EngineConfig(model="/m", kv_cache_dtype="fp8"), pd=True, prefill_config='{"kv_cache_dtype": "fp8_e4m3"}'
    )
    assert args.prefill.engine.kv_cache_dtype == "fp8_e4m3"
