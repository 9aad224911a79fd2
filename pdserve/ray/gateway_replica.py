"""The gateway as a Ray Serve replica on the CPU head: it serves the OpenAI API on its own port
(tokens never pass through Serve's proxy or object store) and learns the engines from their
replicas, which register on every Serve health check."""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle
from starlette.requests import Request

from pdserve.config import RaySpec, parse_settings
from pdserve.engines.kv_path import KvPath
from pdserve.gateway.app import build_app
from pdserve.gateway.thread import GatewayThread
from pdserve.role import Role
from pdserve.routing.sources import RegisteredEndpoints

GATEWAY_START_S = 30.0


def registration_ttl_s(spec: RaySpec, *, health_timeout_s: float) -> float:
    """How long an engine stays known without renewing: three missed Serve health checks."""
    return 3 * spec.health_check_period_s + health_timeout_s


class GatewayReplica:
    def __init__(self, args: dict[str, Any], prefill: DeploymentHandle[Any], decode: DeploymentHandle[Any]) -> None:
        settings = parse_settings(args, source="Serve application args")
        ttl_s = registration_ttl_s(settings.ray, health_timeout_s=settings.gateway.health_timeout_s)
        self._registry = RegisteredEndpoints(ttl_s=ttl_s)
        self._engine_deployments = (prefill, decode)  # bound so Serve deploys them with the gateway
        self._server = GatewayThread(build_app(settings, self._registry), host=settings.gateway.host,
                                     port=settings.gateway.port)
        self._server.start(timeout_s=GATEWAY_START_S)

    def register(self, role: str, url: str, kv_path: KvPath) -> None:
        """Called by engine replicas once ready and on each of their health checks."""
        self._registry.register(Role(role), url, kv_path=kv_path)

    def unregister(self, role: str, url: str) -> None:
        """Called by an engine replica that Serve is stopping."""
        self._registry.unregister(Role(role), url)

    def check_health(self) -> None:
        self._server.check()

    async def __call__(self, _request: Request) -> dict[str, Any]:
        """Serve's own HTTP route: where the OpenAI API is, and the engines the gateway knows."""
        return {
            "openai_api": f"http://{self._server.host}:{self._server.port}/v1",
            "engines": {role.value: self._registry.current(role) for role in Role},
        }

    def __del__(self) -> None:
        self._server.stop()
