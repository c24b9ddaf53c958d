"""The serving settings around an engine: `AppArgs` (one model's deployment), several models' settings, and
`LaunchConfig` (where `raylm serve` runs)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config.choices import DEFAULT_MAX_BODY_BYTES, DEFAULT_MODEL_NAME, REQUEST_ROUTERS
from engine.config.engine import EngineConfig
from engine.config.json_object import json_object
from engine.flags import one_line

# The serving settings prefill_config may give the prefill deployment (besides EngineConfig's): the ones that shape
# a deployment of engines; the others (the API, its limits) belong to the ingress, the decode deployment.
PREFILL_APP_KEYS = (
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "max_ongoing_requests",
    "request_router",
    "health_check_period_s",
    "drain_timeout_s",
)
# What a KV block holds depends on these: a block moved between engines that differ on one is garbage.
PD_SHARED = ("model", "revision", "block_size", "kv_cache_dtype", "dtype")
SAME_KV_DTYPES = {"fp8": "fp8_e4m3"}  # two names of float8_e4m3fn pages
# The engine settings the prefill side does not take from the decode side: LoRA requests run whole on the decode
# side, and a second KV-events publisher at the decode side's endpoint could not bind it.
PREFILL_OWN = {"enable_lora": False, "lora_modules": [], "kv_events_config": None}


class AppArgs(BaseModel):
    """What ``build_app`` takes: an EngineConfig plus the serving settings.

    Autoscaling defaults suit an engine that batches: a replica runs up to ``max_num_seqs`` requests at once and
    scales out when it averages half of that (``target_ongoing_requests``); Serve's defaults (5 and 2) would
    starve the batch. It holds ``max_queue_len`` more in its engine's queue and refuses the rest with 429, so a
    flood gets fast refusals, not minutes of queueing (serve/admission.py).
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = Field(
        None,
        description="the id clients send as `model` (default: the model "
        "path or id, or SmolLM2-135M-Instruct for the default model)",
    )
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' (default: $RAYLM_API_KEY)")
    min_replicas: int = Field(1, description="replicas kept running (at least 1)")
    max_replicas: int = Field(1, ge=1, description="replicas autoscaling may start")
    request_router: Literal[REQUEST_ROUTERS] = Field(  # type: ignore[valid-type]
        "prefix_cache",
        description="with several replicas: send each request to the replica whose prefix cache "
        "holds most of its prompt (prefix_cache), or Serve's own balancing by load (serve)",
    )
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="ongoing requests per replica that autoscaling aims at (default: max_num_seqs / 2)"
    )
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Serve's cap per replica (default: 2 * max_num_seqs + max_queue_len)"
    )
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="largest HTTP request body")
    max_queue_len: int | None = Field(
        None, ge=0, description="requests a replica queues beyond max_num_seqs; more get 429 (default: max_num_seqs)"
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="per request, from arrival: past it the request is aborted with 504 (default: none)"
    )
    health_check_period_s: float = Field(
        10.0, gt=0, description="how often Serve checks each replica's engine; 3 failures in a row replace the replica"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="a replica Serve stops (scale-down, redeploy) lets its "
        "requests finish this long, then ends the rest with a 503",
    )
    responses_store_max_entries: int = Field(
        1024,
        ge=1,
        description="/v1/responses: the responses each replica keeps (store=true) for previous_response_id and "
        "GET /v1/responses/{id}; the oldest go first",
    )
    responses_store_ttl_s: float = Field(
        3600.0, gt=0, description="/v1/responses: how long a replica keeps a stored response, in seconds"
    )
    enable_control_routes: bool = Field(
        False,
        description="serve the RL rollout controls (POST /sleep, /wake_up, /pause, /resume, /reset_prefix_cache, "
        "/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed; GET "
        "/is_sleeping, /is_paused, /get_weight_version), each reaching every replica, behind the API key "
        "(docs/rl.md); off, they are 404",
    )
    pd: bool = Field(
        False,
        description="prefill/decode disaggregation: each prompt is computed on a deployment of prefill engines "
        "(prefill_config), its KV moved over Ray to this deployment's engines, which decode the rest and serve "
        "the API (requests with n > 1, max_tokens 1, embeddings or a LoRA adapter run here whole)",
    )
    prefill_config: str | None = Field(
        None,
        description="with pd: the prefill engines' settings, a JSON object keyed by settings' names: EngineConfig's "
        f"and {', '.join(PREFILL_APP_KEYS)}, e.g. "
        '{"tensor_parallel_size": 2, "max_replicas": 4}; model, revision, block_size, dtype and kv_cache_dtype '
        "must be the decode engines' (default: every setting as the decode side's, but "
        "enable_lora, lora_modules and kv_events_config, off)",
    )

    @field_validator("min_replicas")
    @classmethod
    def _no_scale_to_zero(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"min_replicas={v} is invalid: raylm needs at least 1 replica. Scale to zero is refused because a "
                "replica starts by loading the model and building its engine (tens of seconds to minutes), which "
                "the first request after idle would wait for, and because HTTP goes through HAProxy straight to "
                "replicas, which with none has nowhere to hold that request"
            )
        return v

    @model_validator(mode="after")
    def _replica_bounds(self) -> AppArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} is greater than max_replicas={self.max_replicas}: "
                f"the deployment cannot keep more replicas than it may have"
            )
        if (self.max_replicas > 1 or self.pd) and self.engine.cpu_omp_threads_bind == "auto":
            # auto plans one engine per node: replicas (or PD's two sides) sharing a node would all bind to the
            # same cores.
            self.engine = self.engine.model_copy(update={"cpu_omp_threads_bind": "nobind"})
        return self

    @field_validator("prefill_config", mode="before")
    @classmethod
    def _json_object_as_text(cls, value: Any) -> Any:
        return json.dumps(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _pd_valid(self) -> AppArgs:
        if self.prefill_config is not None and not self.pd:
            raise ValueError(f"prefill_config={self.prefill_config!r} is set but pd is off: pass --pd (pd: true)")
        if self.pd:
            check_pd(self, self.prefill)
        return self

    @property
    def prefill(self) -> AppArgs | None:
        """With ``pd``: the prefill deployment's settings, the decode side's overlaid with ``prefill_config``'s;
        a ValueError names a bad key or value. None without ``pd``."""
        if not self.pd:
            return None
        # Keys spelled as a config file's (max-replicas) or as the fields (max_replicas), as models' entries are.
        spec = {k.replace("-", "_"): v for k, v in json_object("prefill_config", self.prefill_config or "{}").items()}
        unknown = sorted(set(spec) - set(EngineConfig.model_fields) - set(PREFILL_APP_KEYS))
        if unknown:
            raise ValueError(
                f"prefill_config has unknown keys {unknown}: its keys are EngineConfig's settings and "
                f"{list(PREFILL_APP_KEYS)}"
            )
        engine = {**PREFILL_OWN, **{k: v for k, v in spec.items() if k in EngineConfig.model_fields}}
        app = {k: spec.get(k, getattr(self, k)) for k in PREFILL_APP_KEYS}
        try:
            return AppArgs(engine=EngineConfig(**{**self.engine.model_dump(), **engine}), **app)
        except ValidationError as e:
            raise ValueError(f"prefill_config: {one_line(e, {k: k for k in spec})}") from None

    @classmethod
    def from_flat(cls, args: dict[str, Any]) -> AppArgs:
        """From one flat mapping (``serve run ... key=value``, a Serve config's ``args``): EngineConfig's
        fields go to the engine, the rest are the serving settings."""
        engine = {k: v for k, v in args.items() if k in EngineConfig.model_fields}
        return cls(engine=EngineConfig(**engine), **{k: v for k, v in args.items() if k not in engine})

    @property
    def queue_len(self) -> int:
        return self.engine.max_num_seqs if self.max_queue_len is None else self.max_queue_len

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or DEFAULT_MODEL_NAME


def check_pd(decode: AppArgs, prefill: AppArgs) -> None:
    """Refuse, naming both values, a prefill side whose KV blocks the decode side could not read or whose context
    is shorter than the decode side's, and, naming the setting, what PD cannot serve on either side."""
    for key in PD_SHARED:
        p, d = (getattr(a.engine, key) for a in (prefill, decode))
        if SAME_KV_DTYPES.get(p, p) != SAME_KV_DTYPES.get(d, d):
            raise ValueError(
                f"prefill_config {key}={p!r} differs from the decode engines' {key}={d!r}: a prompt's KV blocks "
                f"move from prefill to decode engines only when both have the same {', '.join(PD_SHARED)}"
            )
    p, d = prefill.engine.max_model_len, decode.engine.max_model_len
    if p is not None and d is not None and p < d:
        raise ValueError(
            f"prefill_config max_model_len={p} is below the decode engines' max_model_len={d}: every prompt the API "
            "takes must fit the prefill engines"
        )
    for side, engine in (("", decode.engine), ("prefill_config ", prefill.engine)):
        if engine.pipeline_parallel_size > 1:
            raise ValueError(
                f"pd cannot be served with {side}pipeline_parallel_size={engine.pipeline_parallel_size}: a KV "
                "transfer moves each tensor-parallel rank's heads of every layer, which pipeline stages split"
            )
        if engine.speculative.get("method") == "draft_model":
            raise ValueError(
                f"pd cannot be served with {side}speculative_config method='draft_model': the draft model's own KV "
                "of the prompt is not transferred (method ngram needs none)"
            )


def per_model_settings(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Several base models behind one endpoint: ``values["models"]`` lists each model's own settings (a mapping
    holding at least ``model``; keys spelled as in a config file), laid over the settings ``values`` holds for
    all of them. Each becomes one deployment (an AppArgs: its own engine, replicas and autoscaling bounds).
    Without ``models``, ``values`` is the one model's. The `raylm serve` flag ``--model A --model B`` is
    ``models: [{model: A}, {model: B}]``; a Serve config's ``args`` and ``--config``'s file take the list."""
    models = values.get("models")
    if models is None:
        return [values]
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) and "model" in m for m in models):
        raise ValueError(f"models={models!r} is invalid: a non-empty list of mappings, each naming its model")
    shared = {k: v for k, v in values.items() if k != "models"}
    return [{**shared, **{str(k).lstrip("-").replace("-", "_"): v for k, v in m.items()}} for m in models]


def check_served_names(apps: list[AppArgs]) -> None:
    """Raise ValueError unless each model is served under its own name: requests are routed by it."""
    names = [a.model_name for a in apps]
    if len(set(names)) < len(names):
        raise ValueError(
            f"models: two are served under one name ({', '.join(names)}): give each its own served_model_name"
        )


class LaunchConfig(BaseModel):
    """Where `raylm serve` runs: the Ray it joins and the ports its HTTP and gRPC ingress listen on."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    address: str | None = Field(None, description="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)")
    host: str = Field("127.0.0.1", description="HTTP address (0.0.0.0 to listen on every interface)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    grpc_port: int = Field(9000, ge=1, le=65535, description="gRPC port")
