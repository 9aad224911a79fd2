"""Which engines serve, as one Ray Serve replica: engine replicas register with it on each health
check, and every gateway replica copies it every ``MIRROR_INTERVAL_S`` (gateway_replica.py).

A call through a Serve handle reaches one replica of a deployment, so engines registering with
the gateways themselves would each be known to only some of them once there are several.
"""

from __future__ import annotations

import time

from pdserve.engines.kv_path import KvPath
from pdserve.role import Role
from pdserve.routing.sources import RegisteredEndpoints

MIRROR_INTERVAL_S = 0.5


class EngineRegistry:
    """``ttl_s``: an engine not renewed this long is dropped (its replica is gone)."""

    def __init__(self, ttl_s: float) -> None:
        self._engines = RegisteredEndpoints(ttl_s=ttl_s)
        self._started_s = time.monotonic()

    def register(self, role: str, url: str, kv_path: KvPath) -> None:
        """Called by engine replicas once ready and on each of their health checks."""
        self._engines.register(Role(role), url, kv_path=kv_path)

    def unregister(self, role: str, url: str) -> None:
        """Called by an engine replica that Serve is stopping."""
        self._engines.unregister(Role(role), url)

    def engines(self) -> tuple[float, list[tuple[Role, str, KvPath]]]:
        """(seconds this registry has run, the engines registered now): one restarted less than a
        ttl ago may not have heard from every engine yet."""
        return time.monotonic() - self._started_s, self._engines.snapshot()
