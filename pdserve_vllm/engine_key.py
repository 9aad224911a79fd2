"""Runs inside every engine pdserve launches, named by vLLM's ``--middleware``: every HTTP (and WebSocket) route but
``GET /health`` answers only a request whose ``Authorization: Bearer`` is the deployment's engine key (ENGINE_KEY_ENV);
an engine started without that key refuses to start.

vLLM's own ``--api-key``/``VLLM_API_KEY`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(vllm/entrypoints/serve/middleware/authenticate.py, ``GUARDED_PREFIX``, checked at its line 59), so ``/invocations``
(generation, SageMaker's route), ``/tokenize``, ``/detokenize``, ``/pooling``, ``/metrics``, ``/version``, ``/ping``,
``/load`` and, in its dev mode, ``/reset_prefix_cache``, ``/sleep`` or ``/collective_rpc`` stay open to anyone who
reaches the port. vLLM adds a ``--middleware`` class last (serve/middleware/register.py, ``app.add_middleware``), so
this one runs first, before CORS and vLLM's own guard. ``GET /health`` stays open: Kubernetes' and pdserve's probes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve_vllm import EngineKeyMissing, read_engine_key
from pdserve_vllm.contract import Hook
from pdserve_vllm.contract_check import require

require(Hook.ENGINE_KEY)  # vLLM's --middleware and where it adds it (contract.py), checked as vLLM loads this module

OPEN_ROUTE = ("GET", "/health")  # (method, path) answered without the key
POLICY_VIOLATION = 1008  # WebSocket close code (RFC 6455)


def _unauthorized_body(presented: bool) -> bytes:
    """OpenAI's shape of a 401, as the gateway's own; the key is never echoed."""
    message = ("Incorrect engine key provided." if presented else
               "This engine answers only pdserve: send the deployment's engine key as `Authorization: Bearer <key>`.")
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    return json.dumps({"error": error}).encode()


def _bearer(scope: Scope) -> bytes | None:
    """The token of the request's ``Authorization: Bearer`` header (scheme case-insensitive), or None."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class EngineKeyMiddleware:
    """Pure ASGI middleware. Without a valid key in ``environ`` it fails the server's start (the ASGI lifespan's
    ``startup.failed``: uvicorn logs its one line and exits) and answers every request 401 where no lifespan runs."""

    def __init__(self, app: ASGIApp, *, environ: Mapping[str, str] = os.environ) -> None:
        self.app = app
        try:
            self._key_digest: bytes | None = hashlib.sha256(read_engine_key(environ).encode()).digest()
            self._problem = ""
        except EngineKeyMissing as exc:
            self._key_digest, self._problem = None, str(exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self._key_digest is None:
            await self._refuse_start(receive, send)
        elif scope["type"] not in ("http", "websocket") or self._is_open_route(scope) or self._has_key(scope):
            await self.app(scope, receive, send)
        else:
            await self._unauthorized(scope, send, presented=_bearer(scope) is not None)

    def _has_key(self, scope: Scope) -> bool:
        """Constant-time: digests of equal length compared with hmac.compare_digest."""
        token = _bearer(scope)
        if token is None or self._key_digest is None:
            return False
        return hmac.compare_digest(hashlib.sha256(token).digest(), self._key_digest)

    @staticmethod
    def _is_open_route(scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return scope["type"] == "http" and (scope["method"], path) == OPEN_ROUTE

    async def _refuse_start(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.failed", "message": self._problem})

    @staticmethod
    async def _unauthorized(scope: Scope, send: Send, *, presented: bool) -> None:
        """401 with ``WWW-Authenticate: Bearer``; a WebSocket is closed before it is accepted (the server answers
        its handshake 403)."""
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        body = _unauthorized_body(presented)
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
