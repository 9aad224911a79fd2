"""Run the gateway app under uvicorn inside the caller's event loop."""

from __future__ import annotations

import contextlib

import uvicorn
from starlette.types import ASGIApp


def make_server(app: ASGIApp, *, host: str, port: int, handle_signals: bool = False) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve()`` runs it until ``should_exit``.

    httptools parses HTTP in C where installed (h11 otherwise); access logs are off because the gateway logs one line per leg.
    No X-Forwarded-* rewriting: the gateway never uses the client's address, so that layer would
    only cost time on every request.
    Unless ``handle_signals``, signals stay with the caller (``pdserve up`` has engines to stop).
    """
    config = uvicorn.Config(
        app, host=host, port=port, http="auto", loop="none", lifespan="on",
        access_log=False, log_level="warning", timeout_keep_alive=30, backlog=4096,
        proxy_headers=False, server_header=False,
    )
    server = uvicorn.Server(config)
    if not handle_signals:
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    return server
