"""A prefill engine seen through a small proxy that rewrites the ``kv_transfer_params`` of its replies, for e2e tests
of what a decode engine does with a handoff it cannot pull (test_kv_proof.py) or cannot check (test_kv_integrity.py).
The gateway's engine key is passed on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PATHS = ("/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions")


def rewriting_prefill(prefill_url: str, rewrite: Callable[[dict[str, Any]], None]) -> Starlette:
    """The engine at ``prefill_url``, each successful reply's ``kv_transfer_params`` changed in place by ``rewrite``."""
    async def forward(request: Request) -> Response:
        headers = {"content-type": "application/json", "authorization": request.headers.get("authorization", "")}
        async with httpx.AsyncClient(timeout=300) as client:
            reply = await client.request(request.method, prefill_url + request.url.path,
                                         content=await request.body(), headers=headers)
        body = reply.json() if request.method == "POST" and reply.status_code == 200 else None
        if isinstance(body, dict) and isinstance(body.get("kv_transfer_params"), dict):
            rewrite(body["kv_transfer_params"])
            return Response(httpx.Response(200, json=body).content, media_type="application/json")
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    return Starlette(routes=[Route(path, forward, methods=["GET", "POST"]) for path in PATHS])
