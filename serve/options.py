"""The Ray options of the application's deployment, from its settings (AppArgs, declared in engine/config/app.py)."""

from __future__ import annotations

from typing import Any

import ray
from ray.serve.config import RequestRouterConfig

from engine.config import AppArgs
from engine.placement import engine_bundles, resolve_device
from serve import controls, drain
from serve.lora_registry import registry_config

REPLICA_CPUS = 1.0  # the replica tokenizes, detokenizes and formats every token it streams
ROUTING_STATS_PERIOD_S = 1.0  # how often each replica publishes its prefix-cache digest (serve/router.py)


def uses_prefix_cache_router(args: AppArgs) -> bool:
    return args.request_router == "prefix_cache" and args.max_replicas > 1


def deployment_options(args: AppArgs) -> dict[str, Any]:
    """Each replica reserves its own bundle plus its engine's (scheduler, one per rank) in one placement group,
    so Serve only starts a replica, or scales up, where the whole engine fits."""
    cfg = args.engine
    use_gpu = resolve_device(cfg.device) == "cuda" if ray.is_initialized() else cfg.device == "cuda"
    extra: dict[str, Any] = {}
    actors = []
    if cfg.enable_lora:  # adapters loaded at run time reach every replica (lora_registry.py)
        actors.append(registry_config(cfg.lora_paths))
    if args.enable_control_routes:  # a control reaches every replica (controls.py)
        if args.pd:
            raise ValueError(
                "enable_control_routes cannot be served with pd: the controls reach the decode deployment's "
                "engines only, and the prefill engines would keep the old weights"
            )
        actors.append(controls.registry_config())
    if actors:
        extra["deployment_actors"] = actors
    if uses_prefix_cache_router(args):
        extra["request_router_config"] = RequestRouterConfig(
            request_router_class="serve.router:PrefixCacheRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    return dict(
        **extra,
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
            "min_replicas": args.min_replicas,
            "initial_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests or max(1, cfg.max_num_seqs // 2),
        },
    )
