"""What the application takes (AppArgs) and the Ray options of its deployment."""

from __future__ import annotations

from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve.config import RequestRouterConfig

from cluster.config import EngineConfig
from cluster.engine.placement import engine_bundles, resolve_device
from cluster.serve import drain

REPLICA_CPUS = 1.0  # the replica tokenizes, detokenizes and formats every token it streams
DEFAULT_MAX_BODY_BYTES = 8 << 20
ROUTING_STATS_PERIOD_S = 1.0  # how often each replica publishes its prefix-cache digest (cluster/serve/router.py)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # workers.default_model.MODEL_NAME, without importing torch here


class AppArgs(BaseModel):
    """What ``build_app`` takes: an EngineConfig plus the serving knobs.

    Autoscaling defaults suit an engine that batches: a replica runs up to
    ``max_num_seqs`` requests at once and scales out when it averages half of
    that (``target_ongoing_requests``); Serve's defaults (5 and 2) would starve
    the batch. It holds ``max_queue_len`` more in its engine's queue and
    refuses the rest with 429, so a flood gets fast refusals, not minutes of
    queueing (cluster/serve/admission.py).
    """

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = None
    api_key: str | None = None
    min_replicas: int = 1
    max_replicas: int = Field(1, ge=1)
    # prefix_cache: each HTTP request to the replica caching most of its prompt (cluster/serve/router.py);
    # serve: Serve's own balancing (HAProxy's for HTTP). Either way only with more than one replica.
    request_router: Literal["prefix_cache", "serve"] = "prefix_cache"
    target_ongoing_requests: float | None = Field(None, gt=0)
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)
    # Requests a replica queues beyond the max_num_seqs it runs; more are refused with 429 (None: max_num_seqs).
    max_queue_len: int | None = Field(None, ge=0)
    request_timeout_s: float | None = Field(None, gt=0)  # per request, from arrival; past it a 504
    # How often Serve asks each replica's health (LLMServer.check_health: the engine's ranks and scheduler);
    # three failures in a row and Serve replaces the replica. Serve's default.
    health_check_period_s: float = Field(10.0, gt=0)
    # How long a stopping replica (scale-down, redeploy) lets the requests it holds finish before it ends them
    # with a 503 (cluster/serve/drain.py). Serve's own drain period, 30 s, for requests behind HAProxy.
    drain_timeout_s: float = Field(30.0, ge=0)

    @field_validator("min_replicas")
    @classmethod
    def _no_scale_to_zero(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"min_replicas={v} is invalid: raylm needs at least 1 replica. Scale to zero is refused because a "
                "replica starts by loading the model and building its engine (tens of seconds to minutes), which "
                "the first request after idle would wait for, and because HTTP goes through HAProxy straight to "
                "replicas, which with none has nowhere to hold that request")
        return v

    @model_validator(mode="after")
    def _replica_bounds(self) -> "AppArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} is greater than max_replicas={self.max_replicas}: "
                             f"the deployment cannot keep more replicas than it may have")
        return self

    @classmethod
    def from_flat(cls, args: dict[str, Any]) -> "AppArgs":
        """From one flat mapping (``serve run ... key=value``, a Serve config's ``args``): EngineConfig's
        fields go to the engine, the rest are the serving knobs."""
        engine = {k: v for k, v in args.items() if k in EngineConfig.model_fields}
        return cls(engine=EngineConfig(**engine), **{k: v for k, v in args.items() if k not in engine})

    @property
    def queue_len(self) -> int:
        return self.engine.max_num_seqs if self.max_queue_len is None else self.max_queue_len

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or DEFAULT_MODEL_NAME


def uses_prefix_cache_router(args: AppArgs) -> bool:
    return args.request_router == "prefix_cache" and args.max_replicas > 1


def deployment_options(args: AppArgs) -> dict[str, Any]:
    """Each replica reserves its own bundle plus its engine's (scheduler, one per rank) in one placement group,
    so Serve only starts a replica, or scales up, where the whole engine fits."""
    cfg = args.engine
    use_gpu = resolve_device(cfg.device) == "cuda" if ray.is_initialized() else cfg.device == "cuda"
    routing = {}
    if uses_prefix_cache_router(args):
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class="cluster.serve.router:PrefixCacheRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    return dict(
        **routing,
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        placement_group_bundles=[{"CPU": REPLICA_CPUS}] + engine_bundles(cfg, use_gpu),
        placement_group_strategy=cfg.placement_strategy,
        # Serve's queue in front of a replica has no bound; the replica's Admission has one, so Serve sends it
        # everything Admission may hold plus room for /health, /metrics and the requests it refuses.
        max_ongoing_requests=args.max_ongoing_requests or 2 * cfg.max_num_seqs + args.queue_len,
        health_check_period_s=args.health_check_period_s,
        # Serve kills a stopping replica this long after it starts draining: after the replica's own deadline,
        # so the requests it ends hear why instead of losing their connection.
        graceful_shutdown_timeout_s=args.drain_timeout_s + drain.MARGIN_S,
        autoscaling_config={
            "min_replicas": args.min_replicas, "initial_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests or max(1, cfg.max_num_seqs // 2),
        },
    )
