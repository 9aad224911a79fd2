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

from pdserve_vllm import WHOLE_PROMPT_KEPT_KEY, WHOLE_PROMPT_KEY

KV_PARAMS = {"remote_engine_id": "fake", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 1}
FIRST_TOKEN_ID = 7  # the token a prefill reply samples
WORDS = ["Hello", " there", ",", " friend", "."]
# vLLM's /v1/models card (vllm/entrypoints/serve/engine/protocol.py ModelCard), as the demo engines give it.
MODEL_CARD = {"id": "pdserve-demo", "object": "model", "created": 1764000000, "owned_by": "vllm",
              "root": "/models/pdserve-demo", "parent": None, "max_model_len": 2048,
              "permission": [{"id": "modelperm-1", "object": "model_permission", "allow_sampling": True}]}


@dataclass
class FakeEngine:
    """Records every body it receives; knobs make it misbehave on purpose."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of each body's request, lower-case names
    reject_status: int | None = None  # answer every request with this status
    reject_message: str = "prompt too long"
    break_stream_after: int | None = None  # drop the connection after N chunks
    error_event_after: int | None = None  # end the stream after N chunks as vLLM does when its engine core dies
    # End the stream after N chunks as vLLM does when it stops (Ctrl-C) with the request in flight: the request's
    # output finished as aborted (v1/engine FinishReason.ABORT), then [DONE]; compact JSON, as pydantic writes it.
    abort_after: int | None = None
    token_delay_s: float = 0.0
    # Silent this long after N chunks, then on: a starved engine (seen in tests/e2e/test_faults.py beside CPU hogs,
    # a decode engine sending nothing for 10 s and then finishing its streams).
    pause_after: int | None = None
    pause_s: float = 0.0
    streams_closed_early: int = 0
    # What GET /health answers: vLLM's is 200, or 503 once its engine core is dead (entrypoints/serve/instrumentator/
    # health.py: EngineDeadError); a starved engine answers nothing within the probe's timeout, read as the same.
    health_status: int = 200
    metrics_text: str = ""  # what GET /metrics answers (vLLM's Prometheus text)
    metrics_when_decoding: str | None = None  # when given, becomes metrics_text as the first decoded token goes out
    decode_gate: asyncio.Event | None = None  # when given, decode requests wait for it before answering
    model_card: dict[str, Any] | None = field(default_factory=lambda: dict(MODEL_CARD))  # None: /v1/models is 404
    models_requests: int = 0
    served_model: str = "pdserve-demo"  # any other model gets vLLM's 404
    words: list[str] = field(default_factory=lambda: list(WORDS))  # what it generates, one token each
    # Token events written at once, in one HTTP chunk: a burst, as a busy engine's socket delivers them.
    burst: int = 1
    # Between ``data: [DONE]`` and the reply's last chunk: uvicorn writes them apart, and an SSE client
    # that stops at [DONE] may close its connection in between.
    end_delay_s: float = 0.0
    prefill_stops_short: int = 0  # prompt tokens a prefill leaves to the decode engine (1: a hybrid model's)
    # A hybrid's prefill engine running pdserve_vllm.hybrid_connector: one asked for the whole prompt computes it.
    keeps_whole_prompt: bool = False
    # A decode reply's usage.prompt_tokens_details.cached_tokens, as vLLM with --enable-prompt-tokens-details
    # gives it (entrypoints/openai/chat_completion/serving.py, num_cached_tokens); None: no details.
    # The prompt's length: its KV came over; 0: the engine computed it again (its pull failed).
    cached_tokens: int | None = None
    # When given, a decode request with a handoff waits for it, as vLLM's does when the link to the prefill
    # engine is cut mid-pull: the request stays in WAITING_FOR_REMOTE_KVS (v1/core/sched/scheduler.py), no error.
    pull_gate: asyncio.Event | None = None
    # As engines with a reasoning or tool-call parser: the delta its chat stream writes for each word (None: no
    # event, a tag the parser holds), and the message of a whole one-token reply (the parser's reading of it).
    chat_deltas: list[dict[str, Any] | None] | None = None
    first_message: dict[str, Any] | None = None
    # What GET /version answers, as vLLM's does: {"version": vllm.version.__version__}
    # (vllm/entrypoints/serve/instrumentator/basic.py:53-56, 0.32).
    vllm_version: str = "0.32.0"

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/v1/chat/completions", self._complete, methods=["POST"]),
            Route("/health", lambda _request: Response(status_code=self.health_status), methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/metrics", lambda _request: Response(self.metrics_text, media_type="text/plain"), methods=["GET"]),
            Route("/version", lambda _request: JSONResponse({"version": self.vllm_version}), methods=["GET"]),
        ]
        return Starlette(routes=routes)

    async def closed_early_within(self, seconds: float = 2.5) -> int:
        """``streams_closed_early`` once one was, or after ``seconds``: the server sees a connection
        the gateway closed a few loop turns later, and the stream ends at its next await."""
        for _ in range(int(seconds / 0.02)):
            if self.streams_closed_early:
                break
            await asyncio.sleep(0.02)
        return self.streams_closed_early

    async def _models(self, _request: Request) -> Response:
        self.models_requests += 1
        if self.model_card is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"object": "list", "data": [self.model_card]})

    async def _complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if body.get("model") != self.served_model:
            error = {"message": f"The model `{body.get('model')}` does not exist.", "type": "NotFoundError",
                     "param": "model", "code": 404}
            return JSONResponse({"error": error}, status_code=404)
        if self.reject_status:
            error = {"message": self.reject_message, "type": "BadRequestError", "param": None, "code": 400}
            return JSONResponse({"error": error}, status_code=self.reject_status)
        if (too_long := self._past_context(body)) is not None:
            return JSONResponse({"error": too_long}, status_code=400)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return JSONResponse(self._prefilled(body, request_id=request.headers.get("x-request-id", "fake")))
        if self.decode_gate is not None:
            await self.decode_gate.wait()
        gate = self.pull_gate if body.get("kv_transfer_params") else None
        if gate is not None and not body.get("stream"):  # vLLM answers a whole reply once it is done
            await gate.wait()
        usage = self._usage(body)
        if body.get("stream"):
            wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._sse(is_chat=request.url.path.endswith("/chat/completions"),
                                               usage=usage if wants_usage else None, gate=gate),
                                     media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "".join(self.words)}], "usage": usage})

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt_tokens = len(self._prompt_ids(body))
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": len(self.words),
                                 "total_tokens": prompt_tokens + len(self.words)}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def _past_context(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """vLLM's refusal of a prompt that leaves no room in the context for one output token
        (v1/engine/input_processor.py, _validate_prompt_len; its message); None when there is room.
        A larger max_tokens is no refusal: vLLM caps it at the context left (get_max_tokens)."""
        max_model_len = (self.model_card or MODEL_CARD)["max_model_len"]
        if (length := len(self._prompt_ids(body))) < max_model_len:
            return None
        message = (f"The decoder prompt (length {length}) plus the number of requested output tokens (at least 1) "
                   f"is longer than the maximum model length of {max_model_len}.")
        return {"message": message, "type": "BadRequestError", "param": None, "code": 400}

    @staticmethod
    def _prompt_ids(body: dict[str, Any]) -> list[int]:
        """This fake's tokens: the ids given, else one per word of a text prompt, ids from 100."""
        prompt = body.get("prompt") if "prompt" in body else body.get("messages")
        return prompt if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt) else [
            100 + index for index, _ in enumerate(str(prompt).split())]

    def _prefilled(self, body: dict[str, Any], *, request_id: str) -> dict[str, Any]:
        """A prefill reply as vLLM 0.26 shapes it (entrypoints/openai/completion/serving.py,
        request_output_to_completion_response; kv_connector/v1/nixl/pull_scheduler.py, request_finished):
        with ``return_token_ids``, the prompt's and the token's ids; ``remote_num_tokens``, the prompt
        tokens the engine computed."""
        ids = self._prompt_ids(body)
        is_whole = self.keeps_whole_prompt and body["kv_transfer_params"].get(WHOLE_PROMPT_KEY) is True
        kv_params = {**KV_PARAMS, "remote_num_tokens": len(ids) - (0 if is_whole else self.prefill_stops_short)}
        if is_whole:
            kv_params[WHOLE_PROMPT_KEPT_KEY] = True
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        if "messages" in body:  # a chat reply (vLLM 0.32 chat_completion/serving.py:1095-1205): prompt ids beside the choices
            message = self.first_message or {"role": "assistant", "content": self.words[0], "reasoning": None,
                                             "tool_calls": []}
            chat_choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                                           "stop_reason": None, "token_ids": None}
            reply: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": 1764000000,
                                     "model": body.get("model"), "choices": [chat_choice], "usage": usage,
                                     "prompt_token_ids": None, "kv_transfer_params": kv_params}
            if body.get("return_token_ids"):
                chat_choice["token_ids"], reply["prompt_token_ids"] = [FIRST_TOKEN_ID], ids
            return reply
        choice: dict[str, Any] = {"index": 0, "text": self.words[0], "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}
        if body.get("return_token_ids"):
            choice.update(prompt_token_ids=ids, token_ids=[FIRST_TOKEN_ID])
        return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": 1764000000,
                "model": body.get("model"), "choices": [choice], "usage": usage, "kv_transfer_params": kv_params}

    async def _sse(self, *, is_chat: bool, usage: dict[str, Any] | None = None,  # type: ignore[no-untyped-def]
                   gate: asyncio.Event | None = None):
        try:
            if gate is not None:  # vLLM's stream opens at once; its first event waits for the KV
                await gate.wait()
            if is_chat:  # vLLM opens a chat stream with the role, as OpenAI does
                yield f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant', 'content': ''}}]})}\n\n".encode()
            burst: list[bytes] = []
            for index, word in enumerate(self.words):
                if self.break_stream_after is not None and index == self.break_stream_after:
                    raise ConnectionResetError("fake engine died")
                if self.error_event_after is not None and index == self.error_event_after:
                    error = {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}
                    yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
                    return
                if self.abort_after is not None and index == self.abort_after:
                    aborted = {"index": 0, "finish_reason": "abort", **({"delta": {}} if is_chat else {"text": ""})}
                    yield f"data: {json.dumps({'choices': [aborted]}, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
                    return
                await asyncio.sleep(self.pause_s if index == self.pause_after else self.token_delay_s)
                if index == 0 and self.metrics_when_decoding is not None:  # the KV pull ends before decoding starts
                    self.metrics_text = self.metrics_when_decoding
                delta = {"content": word} if self.chat_deltas is None else self.chat_deltas[index]
                if is_chat and delta is None:
                    continue
                choice = {"delta": delta} if is_chat else {"text": word}
                burst.append(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                if len(burst) == self.burst:
                    yield b"".join(burst)
                    burst.clear()
            if burst:
                yield b"".join(burst)
            if usage is not None:  # vLLM's last event with include_usage: compact JSON, no choices
                yield f"data: {json.dumps({'choices': [], 'usage': usage}, separators=(',', ':'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
            await asyncio.sleep(self.end_delay_s)
        except (asyncio.CancelledError, GeneratorExit):
            self.streams_closed_early += 1
            raise
