"""The gateway as a Ray Serve replica: it serves the OpenAI API on its own port (tokens never pass
through Serve's proxy or object store) and copies which engines serve from the engine registry
(registry_replica.py). Any number of them: ``gateway.replicas``, at most one per node."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request

from pdserve.cluster_config import RaySpec
from pdserve.config import Settings, parse_settings
from pdserve.gateway.app import build_app
from pdserve.gateway.connections import connection_limits
from pdserve.gateway.thread import GatewayThread
from pdserve.gateway_config import NODE_HOST
from pdserve.ray.deployment_key import GcsKeyStore, application_engine_key
from pdserve.ray.node_address import replica_bind_host
from pdserve.ray.registry_replica import MIRROR_INTERVAL_S
from pdserve.routing.sources import RegisteredEndpoints

log = logging.getLogger(__name__)
GATEWAY_START_S = 30.0


async def bound_settings(settings: Settings) -> Settings:
    """``settings`` with gateway.host ``node`` made the address this replica binds on its node (node_address.py:
    loopback on a one-machine cluster), so that the gateway's own checks (gateway/exposure.py) judge that one."""
    if settings.gateway.host != NODE_HOST:
        return settings
    gateway = settings.gateway.model_copy(update={"host": await replica_bind_host()})
    return settings.model_copy(update={"gateway": gateway})


def registration_ttl_s(spec: RaySpec, *, health_timeout_s: float) -> float:
    """How long an engine stays known without renewing: three missed Serve health checks."""
    return 3 * spec.health_check_period_s + health_timeout_s


class GatewayReplica:
    async def __init__(self, args: dict[str, Any], prefill: DeploymentHandle[Any], decode: DeploymentHandle[Any],  # type: ignore[misc]  # Serve awaits it
                 registry: DeploymentHandle[Any]) -> None:
        settings = parse_settings(args, source="Serve application args")
        self._registry_ttl_s = registration_ttl_s(settings.ray, health_timeout_s=settings.gateway.health_timeout_s)
        self._engines = RegisteredEndpoints(ttl_s=math.inf)  # the registry drops engines that stop renewing
        self._engine_deployments = (prefill, decode)  # bound so Serve deploys them with the gateway
        self._registry = registry
        settings = await bound_settings(settings)
        engine_key = await application_engine_key(settings, app_name=serve.get_replica_context().app_name,
                                                  store=GcsKeyStore())
        self._server = GatewayThread(build_app(settings, self._engines, engine_key=engine_key),
                                     host=settings.gateway.host, port=settings.gateway.port, tls=settings.gateway,
                                     limits=connection_limits(settings))
        self._scheme = settings.gateway.scheme
        self._server.start(timeout_s=GATEWAY_START_S)
        self._mirroring = asyncio.create_task(self._mirror_registry())

    async def _mirror_registry(self) -> None:
        """Copy the registry every MIRROR_INTERVAL_S; while it cannot be read, the engines known stay
        (the gateway's own health probes still take a dead one out of rotation)."""
        while True:
            try:
                age_s, engines = await asyncio.wait_for(self._registry.engines.remote(), timeout=GATEWAY_START_S)
                self._engines.mirror(engines, keep_missing=age_s < self._registry_ttl_s)
            except (TimeoutError, RayError, RayServeException) as exc:
                log.warning("could not read the engine registry: %r; keeping the engines known", exc)
            await asyncio.sleep(MIRROR_INTERVAL_S)

    def check_health(self) -> None:
        if self._mirroring.done():
            self._mirroring.result()  # raises what ended it
        self._server.check()

    async def __call__(self, _request: Request) -> dict[str, Any]:
        """Serve's own HTTP route, which answers anyone who reaches Serve's proxy: where the OpenAI API is, and
        no more. The engines' addresses are behind the gateway's admin key (its /health listing)."""
        return {"openai_api": f"{self._scheme}://{self._server.host}:{self._server.port}/v1"}

    def __del__(self) -> None:
        self._mirroring.cancel()
        self._server.stop()
