"""Build the Ray Serve application from pdserve's configuration: a prefill and a decode
deployment of engine replicas, the registry they announce themselves to, and the gateway
replicas that front them.

Ray Serve places, restarts and counts the replicas; nothing here schedules anything.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from pdserve.config import Settings, parse_settings
from pdserve.deploy.serve import pool_size_options
from pdserve.engine_config import PoolSpec
from pdserve.ray.engine_replica import EngineReplica, stop_budget_s
from pdserve.ray.gateway_replica import GatewayReplica, registration_ttl_s
from pdserve.ray.names import GATEWAY_DEPLOYMENT, REGISTRY_DEPLOYMENT
from pdserve.ray.registry_replica import EngineRegistry
from pdserve.role import Role

HEALTH_CHECK_MARGIN_S = 5.0
# Serve's own default. Three checks in a row past it replace the replica, and a busy node can hold
# up the replica actor itself; whether the engine answers is judged by ray.engine_unresponsive_s.
SERVE_HEALTH_CHECK_TIMEOUT_S = 30.0
# Every engine renews each health check and every gateway reads every MIRROR_INTERVAL_S: far below this.
REGISTRY_ONGOING_REQUESTS = 1000


def app(args: dict[str, Any]) -> Application:
    """The Serve application for ``args``, a pdserve configuration tree (as `render serve` writes)."""
    settings = parse_settings(args, source="Serve application args")
    engines = {
        role: serve.deployment(**engine_options(settings, role))(EngineReplica).bind(args, role.value) for role in Role
    }
    ttl_s = registration_ttl_s(settings.ray, health_timeout_s=settings.gateway.health_timeout_s)
    registry = serve.deployment(
        name=REGISTRY_DEPLOYMENT, num_replicas=1, max_ongoing_requests=REGISTRY_ONGOING_REQUESTS,
        # Nothing but memory: a share of ray.gateway_resources would leave a gateway node's replica no room.
        ray_actor_options={"num_cpus": 0},
    )(EngineRegistry).bind(ttl_s)
    gateway = serve.deployment(
        name=GATEWAY_DEPLOYMENT, num_replicas=settings.gateway.replicas, max_replicas_per_node=1,
        ray_actor_options={"num_cpus": settings.ray.gateway_cpus, "resources": dict(settings.ray.gateway_resources)},
        health_check_period_s=settings.ray.health_check_period_s,
    )(GatewayReplica)
    application: Application = gateway.bind(args, engines[Role.PREFILL], engines[Role.DECODE], registry)
    return application


def engine_options(settings: Settings, role: Role) -> dict[str, Any]:
    """Serve deployment options for one pool: its replica count or autoscaling, and per replica the
    CPUs, GPUs (one per tensor-parallel rank) and custom resources its engine needs."""
    pool = settings.pool(role)
    options: dict[str, Any] = {
        "name": role.value,
        **pool_size_options(settings, role),  # `render serve` sets them in the config's deployments instead
        "ray_actor_options": replica_resources(pool),
        "health_check_period_s": settings.ray.health_check_period_s,
        # The replica's check waits up to the probe's own timeout; Serve must not cut it short.
        "health_check_timeout_s": max(settings.gateway.health_timeout_s + HEALTH_CHECK_MARGIN_S,
                                      SERVE_HEALTH_CHECK_TIMEOUT_S),
        "graceful_shutdown_timeout_s": stop_budget_s(drain_timeout_s=settings.ray.drain_timeout_s),
        "max_ongoing_requests": 1,  # Serve only calls the replica for health; tokens go over HTTP
    }
    if pool.device == "cuda" and pool.tensor_parallel_size > 1:
        # All of one engine's GPUs on one node: vLLM's tensor-parallel workers share it.
        bundle = {"CPU": pool.placement.cpus, "GPU": float(pool.tensor_parallel_size), **pool.placement.resources}
        options |= {"placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK"}
    return options


def replica_resources(pool: PoolSpec) -> dict[str, Any]:
    gpus = pool.tensor_parallel_size if pool.device == "cuda" else 0
    return {"num_cpus": pool.placement.cpus, "num_gpus": gpus, "resources": dict(pool.placement.resources)}
