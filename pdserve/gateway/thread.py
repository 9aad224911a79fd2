"""Run the gateway on a thread of its own, with its own event loop, beside a host that owns the
main loop (a Ray Serve replica): the relay never waits behind the host's work."""

from __future__ import annotations

import asyncio
import threading
import time

import uvloop
from starlette.types import ASGIApp

from pdserve.errors import EngineStartFailed
from pdserve.gateway.connections import ConnectionLimits
from pdserve.gateway.server import make_server
from pdserve.gateway_config import GatewaySpec


class GatewayThread:
    """uvicorn serving ``app`` on ``host:port`` from a daemon thread (HTTPS with ``tls``'s files, where set),
    each client connection held to ``limits`` (gateway/connections.py)."""

    def __init__(self, app: ASGIApp, *, host: str, port: int, tls: GatewaySpec | None = None,
                 limits: ConnectionLimits | None = None) -> None:
        self.host, self.port = host, port
        self._server = make_server(app, host=host, port=port, tls=tls, limits=limits)
        self._thread = threading.Thread(target=self._serve, name="pdserve-gateway", daemon=True)
        self._failure: BaseException | None = None

    def _serve(self) -> None:
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self._server.serve())
        except BaseException as exc:  # noqa: BLE001 - uvicorn exits with SystemExit when it cannot bind; check() reports it
            self._failure = exc

    def start(self, *, timeout_s: float) -> None:
        """Start serving; raises EngineStartFailed if it is not listening within ``timeout_s``."""
        self._thread.start()
        deadline_s = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline_s:
                self.stop()
                raise EngineStartFailed(f"gateway did not start on {self.host}:{self.port} ({self._failure!r}); "
                                        f"is the port taken?")
            time.sleep(0.05)

    def check(self) -> None:
        """Raises EngineStartFailed once the server has stopped."""
        if not self._thread.is_alive():
            raise EngineStartFailed(f"gateway on {self.host}:{self.port} stopped ({self._failure!r})")

    def stop(self, *, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
