"""A synthetic OpenAI-compatible engine that streams tokens at a set pace: the stand-in upstream
for measuring the gateway's own cost, and a fast fake for tests. It computes nothing.

It speaks the two PD legs like vLLM 0.26 with the NixlConnector: a non-streamed request with
``kv_transfer_params.do_remote_decode`` is a prefill leg (waits ``ttft_s``, answers JSON with
``kv_transfer_params``, and with ``return_token_ids`` the prompt's and its token's ids); a request carrying
``do_remote_prefill`` is a decode leg (its first token comes ``handoff_s`` later); anything else is a whole
request (first token after ``ttft_s``). Its ``/metrics`` says its KV block size, as vLLM's
``vllm:cache_config_info`` does, which the gateway needs to hand a decode engine the prefill engine's token
(pd/first_token.py), and its ``/v1/models`` card the context length, as vLLM's does. Token i's text is
``token_text(i)`` and its id ``TOKEN_ID_BASE + i``, and a decode leg whose prompt ends in such an id continues
after it, so tests can check a relay kept every byte.

Bare asyncio protocol + httptools, tokens sent from timer callbacks: tens of microseconds per
request and per token, so that on a small machine it never competes with what it measures.
HTTP/1.1 keep-alive, one request at a time per connection (no pipelining, as aiohttp sends).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import httptools

from pdserve.bench.frames import Frames, prompt_token_ids, prompt_tokens

_BLOCK_TOKENS = 16
TOKEN_ID_BASE = 1_000_000  # above any vocabulary: a prompt id this high is a token this engine generated
_PROMPT_ID_BASE = 100  # a text prompt's stand-in ids, one per word (frames.prompt_tokens)
# vLLM's cache_config_info gauge (v1/metrics/loggers.py, log_metrics_info), cut to the labels the gateway reads
_METRICS = (b'vllm:cache_config_info{block_size="%d",num_gpu_blocks="65536"} 1.0\n' % _BLOCK_TOKENS)
# vLLM's GET /version reply (entrypoints/serve/instrumentator/basic.py: {"version": vllm.__version__}), as the CPU
# build this project runs answers it, so the gateway's version gate lets a synthetic engine through as vLLM
_VERSION = b'{"version": "0.32.0"}'
# vLLM's /v1/models reply (entrypoints/openai/serving_models.py, ModelCard), with a context few prompts fill
_MAX_MODEL_LEN = 131_072
_MODELS = json.dumps({"object": "list", "data": [{
    "id": "synthetic", "object": "model", "created": 0, "owned_by": "vllm", "root": "synthetic", "parent": None,
    "max_model_len": _MAX_MODEL_LEN, "permission": []}]}).encode()
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")
_CHAT_PATH = b"/v1/chat/completions"
_PATHS = (b"/v1/completions", _CHAT_PATH)


@dataclass(frozen=True, slots=True)
class Pace:
    ttft_s: float = 0.02  # prefill time of a whole request or a prefill leg
    tokens_per_s: float = 100.0  # per stream
    handoff_s: float = 0.0  # decode leg: from request to first token (the KV pull)


@dataclass(slots=True)
class LegCounts:
    """How many requests of each kind arrived; tests read it to see the gateway ran both legs."""

    prefill: int = 0
    decode: int = 0
    whole: int = 0


@dataclass(slots=True)
class Upstream:
    """A running synthetic engine: where it listens and what it has served."""

    url: str
    counts: LegCounts


def token_text(index: int) -> str:
    return f" w{index}"


def reply_text(max_tokens: int, *, start: int = 0) -> str:
    """The whole text of a reply of ``max_tokens`` tokens, from token ``start``."""
    return "".join(token_text(index) for index in range(start, start + max_tokens))


@asynccontextmanager
async def serving_upstream(pace: Pace, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[Upstream]:
    """Serve a synthetic engine on ``host:port`` (0 = any free port) for the block."""
    loop = asyncio.get_running_loop()
    connections: set[_Connection] = set()
    counts = LegCounts()
    server = await loop.create_server(lambda: _Connection(pace, counts, connections), host, port, backlog=4096)
    bound_port = server.sockets[0].getsockname()[1]
    try:
        yield Upstream(url=f"http://{host}:{bound_port}", counts=counts)
    finally:
        server.close()
        for connection in list(connections):
            connection.close()
        await server.wait_closed()


async def serve_forever(pace: Pace, *, port: int, announce: Callable[[str], None]) -> None:
    """Serve on 127.0.0.1:``port`` until cancelled (Ctrl-C) or killed."""
    async with serving_upstream(pace, port=port) as upstream:
        announce(f"synthetic upstream on {upstream.url}/v1 (TTFT {pace.ttft_s * 1000:g} ms, "
                 f"{pace.tokens_per_s:g} tokens/s per stream)")
        await asyncio.Event().wait()


@dataclass(frozen=True, slots=True)
class _Stream:
    frames: Frames
    max_tokens: int
    first_token_s: float  # time.monotonic() deadline of token first_index
    first_index: int  # 0, or where a decode leg continues after the prefill engine's token
    usage: bytes  # the usage event, or b"" when the client did not ask for it


class _Connection(asyncio.Protocol):
    """One client connection: parse each request, answer it, stop its timers if the client leaves."""

    def __init__(self, pace: Pace, counts: LegCounts, connections: set[_Connection]) -> None:
        self._pace, self._counts, self._connections = pace, counts, connections
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url, self._body = b"", bytearray()
        self._timer: asyncio.Handle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()  # the client went away: stop generating, as vLLM aborts

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        path, raw = self._url.split(b"?")[0], bytes(self._body)
        self._url, self._body = b"", bytearray()
        if self._parser.get_method() == b"GET" and path == b"/health":
            self._send_json(200, b"")
        elif self._parser.get_method() == b"GET" and path == b"/metrics":
            self._send(200, b"text/plain; version=0.0.4", _METRICS)
        elif self._parser.get_method() == b"GET" and path == b"/version":
            self._send_json(200, _VERSION)
        elif self._parser.get_method() == b"GET" and path == b"/v1/models":
            self._send_json(200, _MODELS)
        elif path in _PATHS:
            self._complete(is_chat=path == _CHAT_PATH, raw=raw)
        else:
            self._send_json(404, b'{"error": {"message": "not found", "type": "invalid_request_error"}}')

    def _complete(self, *, is_chat: bool, raw: bytes) -> None:
        try:
            body: dict[str, Any] = json.loads(raw)
        except ValueError:
            self._send_json(400, b'{"error": {"message": "invalid JSON", "type": "invalid_request_error"}}')
            return
        arrived_s = time.monotonic()
        frames = Frames(is_chat=is_chat, model=str(body.get("model")), request_id=uuid.uuid4().hex,
                        created_s=int(time.time()))
        kv = body.get("kv_transfer_params") or {}
        max_tokens = int(body.get("max_tokens") or 16)
        if kv.get("do_remote_decode"):
            self._counts.prefill += 1
            reply = _prefill_reply(frames, body)
            self._timer = _call_at(arrived_s + self._pace.ttft_s, self._send_json, 200, json.dumps(reply).encode())
            return
        is_decode_leg = bool(kv.get("do_remote_prefill"))
        self._counts.decode += is_decode_leg
        self._counts.whole += not is_decode_leg
        first_token_s = arrived_s + (self._pace.handoff_s if is_decode_leg else self._pace.ttft_s)
        first_index = _continues_at(body) if is_decode_leg else 0
        if not body.get("stream"):
            whole = frames.whole_reply(reply_text(max_tokens, start=first_index), prompt_tokens=prompt_tokens(body),
                                       completion_tokens=max_tokens)
            done_s = first_token_s + (max_tokens - 1) / self._pace.tokens_per_s
            self._timer = _call_at(done_s, self._send_json, 200, json.dumps(whole).encode())
            return
        usage = frames.usage(prompt_tokens=prompt_tokens(body), completion_tokens=max_tokens) if (
            (body.get("stream_options") or {}).get("include_usage")) else b""
        self._write(_SSE_HEAD)
        stream = _Stream(frames, max_tokens=max_tokens, first_token_s=first_token_s, first_index=first_index,
                         usage=usage)
        self._timer = _call_at(first_token_s, self._send_token, stream, first_index)

    def _send_token(self, stream: _Stream, index: int) -> None:
        """Token ``index`` now; each is due at first_token_s + its place / rate (absolute, so delays never add up)."""
        place = index - stream.first_index
        is_last = place == stream.max_tokens - 1
        event = stream.frames.token(token_text(index), is_last=is_last)
        if place == 0:
            event = stream.frames.role() + event
        if not is_last:
            self._write_chunk(event)
            due_s = stream.first_token_s + (place + 1) / self._pace.tokens_per_s
            self._timer = _call_at(due_s, self._send_token, stream, index + 1)
            return
        self._timer = None
        self._write_chunk(event + stream.usage + stream.frames.done(), is_end=True)

    def _write_chunk(self, data: bytes, *, is_end: bool = False) -> None:
        self._write(b"%x\r\n%b\r\n%b" % (len(data), data, b"0\r\n\r\n" if is_end else b""))

    def _send_json(self, status: int, payload: bytes) -> None:
        self._send(status, b"application/json", payload)

    def _send(self, status: int, content_type: bytes, payload: bytes) -> None:
        self._timer = None
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}[status]
        self._write(b"HTTP/1.1 %d %b\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                    % (status, reason, content_type, len(payload), payload))

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


def _call_at(due_s: float, callback: Callable[..., None], *args: Any) -> asyncio.Handle:
    """Run ``callback`` at ``due_s`` on the time.monotonic() clock, at once if that is past.

    Not ``loop.time()``-based: under uvloop that is the start of the current loop pass in whole ms,
    so deadlines counted from it land up to a millisecond early, and a zero delay becomes a 1 ms
    timer: either would skew direct-vs-gateway comparisons by as much as the gateway costs.
    """
    loop = asyncio.get_running_loop()
    if due_s <= time.monotonic():
        return loop.call_soon(callback, *args)
    return loop.call_at(due_s, callback, *args)


def _prefill_reply(frames: Frames, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.26's prefill reply: completion/serving.py (``prompt_token_ids`` and ``token_ids`` with
    ``return_token_ids``; a chat's prompt ids beside its choices), nixl/pull_scheduler.py request_finished
    (the handoff, ``remote_num_tokens``). A decode leg given the token as output (``vllm_xargs``, pdserve's
    logits processor) starts at token 0 again, role event included, as such an engine writes it."""
    prompt = prompt_tokens(body)
    reply = frames.whole_reply(token_text(0), prompt_tokens=prompt, completion_tokens=1)
    if frames.is_chat:  # every field vLLM 0.32 writes (JSONResponse of model_dump(), chat_completion/api_router.py)
        _as_vllm_032_chat(reply)
    if body.get("return_token_ids") and frames.is_chat:  # vLLM 0.32 chat_completion/serving.py:1123, 1200
        reply["choices"][0]["token_ids"], reply["prompt_token_ids"] = [TOKEN_ID_BASE], _prompt_ids(body, prompt)
    elif body.get("return_token_ids"):
        reply["choices"][0] |= {"prompt_token_ids": _prompt_ids(body, prompt), "token_ids": [TOKEN_ID_BASE]}
    reply["kv_transfer_params"] = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": list(range(math.ceil(prompt / _BLOCK_TOKENS))),
        "remote_engine_id": "synthetic-upstream", "remote_host": "127.0.0.1", "remote_port": 0,
        "remote_request_id": frames.request_id, "tp_size": 1, "remote_num_tokens": prompt,
    }
    return reply


def _as_vllm_032_chat(reply: dict[str, Any]) -> None:
    """A whole chat reply with the fields vLLM 0.32's ChatCompletionResponse dumps as null
    (chat_completion/protocol.py: ChatMessage, which drops an empty ``tool_calls``; ChatCompletionResponseChoice;
    ChatCompletionResponse; serve/engine/protocol.py UsageInfo). Its message is what vLLM writes for a token that is
    content with or without a reasoning or tool-call parser (serving.py chat_completion_full_generator: the parser's
    ``reasoning`` None), so a gateway told the engines parse chat output reads it as it would a real engine's."""
    choice = reply["choices"][0]
    choice["message"] |= {"refusal": None, "annotations": None, "audio": None, "function_call": None,
                          "reasoning": None}
    choice |= {"stop_reason": None, "token_ids": None, "routed_experts": None}
    reply["usage"] |= {"prompt_tokens_details": None, "completion_tokens_details": None}
    reply |= {"service_tier": None, "system_fingerprint": None, "prompt_logprobs": None, "prompt_token_ids": None,
              "prompt_text": None, "ec_transfer_params": None, "metrics": None}


def _prompt_ids(body: dict[str, Any], count: int) -> list[int]:
    """The prompt's token ids as given, or ``count`` stand-in ids for a text prompt."""
    return prompt_token_ids(body) or list(range(_PROMPT_ID_BASE, _PROMPT_ID_BASE + count))


def _continues_at(body: dict[str, Any]) -> int:
    """The token a decode leg starts at: after the one its prompt ends in, if this engine generated it."""
    ids = prompt_token_ids(body)
    return ids[-1] - TOKEN_ID_BASE + 1 if ids and ids[-1] >= TOKEN_ID_BASE else 0
