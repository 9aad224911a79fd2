"""A fake vLLM OpenAI server for unit tests of routing and faults (never proof of serving)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

KV_PARAMS = {"remote_engine_id": "fake", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 1}
WORDS = ["Hello", " there", ",", " friend", "."]


@dataclass
class FakeEngine:
    """Records every body it receives; knobs make it misbehave on purpose."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    reject_status: int | None = None  # answer every request with this status
    reject_message: str = "prompt too long"
    break_stream_after: int | None = None  # drop the connection after N chunks
    token_delay_s: float = 0.0
    streams_closed_early: int = 0
    metrics_text: str = ""  # what GET /metrics answers (vLLM's Prometheus text)
    decode_gate: asyncio.Event | None = None  # when given, decode requests wait for it before answering

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/v1/chat/completions", self._complete, methods=["POST"]),
            Route("/health", lambda _request: Response(), methods=["GET"]),
            Route("/metrics", lambda _request: Response(self.metrics_text, media_type="text/plain"), methods=["GET"]),
        ]
        return Starlette(routes=routes)

    async def _complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        if self.reject_status:
            error = {"message": self.reject_message, "type": "BadRequestError", "param": None, "code": 400}
            return JSONResponse({"error": error}, status_code=self.reject_status)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return JSONResponse({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 7}, "kv_transfer_params": KV_PARAMS})
        if self.decode_gate is not None:
            await self.decode_gate.wait()
        if body.get("stream"):
            return StreamingResponse(self._sse(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "".join(WORDS)}], "usage": {"completion_tokens": len(WORDS)}})

    async def _sse(self):  # type: ignore[no-untyped-def]
        try:
            for index, word in enumerate(WORDS):
                if self.break_stream_after is not None and index == self.break_stream_after:
                    raise ConnectionResetError("fake engine died")
                await asyncio.sleep(self.token_delay_s)
                yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.streams_closed_early += 1
            raise
