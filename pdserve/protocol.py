"""The OpenAI request fields the gateway accepts, OpenAI error bodies and SSE framing.

Validation here is the gateway's own gate: a request that passes is forwarded to the engines
as the client's original JSON (never re-serialised from these models). Pure; no I/O.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.errors import BadRequest

SSE_DONE = b"data: [DONE]\n\n"
SSE_EVENT_PREFIX = b"data: "
REQUEST_ID_HEADER = "X-Request-Id"
PD_MODE_HEADER = "X-PD-Mode"
MAX_NESTING = 64  # JSON levels; a request's own structure needs about 10, a tool's JSON schema a few more

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Engines keep counts and token ids in 32-bit fields and seeds in 64-bit ones; a larger number
# from a client must be refused here, not overflow an engine into a 500.
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Stop = str | Annotated[list[str], Field(max_length=16)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints: OpenAI's, plus the vLLM sampling extras users rely on."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's guided decoding (json, regex, choice, grammar, ...)
    # vLLM's prefix-cache salt, as its validator takes it (entrypoints/generate/base/protocol.py, validate_cache_salt);
    # the gateway folds it into its tenant's own (gateway/tenants.py), so it parts that tenant's cache, no other's.
    cache_salt: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]+$")] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class CompletionRequest(_Sampling):
    # One prompt per request: a batch would return one KV handoff per prompt.
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body; raises BadRequest (400) unless it is one UTF-8 JSON object whose
    numbers are finite, whose strings hold no lone surrogates (an engine's tokenizer cannot encode
    them) and which nests at most MAX_NESTING levels (deeper would exhaust a parser's stack)."""
    try:
        text = raw.decode("utf-8")
        body = _DECODER.decode(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid UTF-8 JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise BadRequest(f"request body nests deeper than {MAX_NESTING} levels", code="invalid_json") from exc
    except ValueError as exc:  # an integer of more than 4300 digits, or a non-finite number
        raise BadRequest("request body has a number out of range", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    # Both checks below walk the whole body, so they run only when a cheap scan says they could fail.
    if text.count("[") + text.count("{") > MAX_NESTING or _SURROGATE_ESCAPE.search(text):
        _check_nesting_and_strings(body)
    return body


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise ValueError(f"{literal[:20]} is out of range")
    return number


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)  # json.loads would build one per call


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_nesting_and_strings(body: dict[str, Any]) -> None:
    """Raise BadRequest for nesting deeper than MAX_NESTING or a lone surrogate in any string or key."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"request body nests deeper than {MAX_NESTING} levels", code="invalid_json")
        if isinstance(value, dict):
            stack.extend((key, depth) for key in value)
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise BadRequest("request body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string",
                             code="invalid_json")


def validate_request(body: dict[str, Any], schema: type[ChatRequest | CompletionRequest]) -> None:
    """Check ``body`` against ``schema``; raises BadRequest naming the first bad field."""
    if body.get("stream_options") is not None and not body.get("stream"):
        raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _field_path(error["loc"])
        if error["type"] == "extra_forbidden":
            message = f"Unrecognized or unsupported request argument: {param}"
            raise BadRequest(message, param=param, code="unsupported_parameter") from exc
        if error["type"] == "missing":
            raise BadRequest(f"Missing required parameter: {param}", param=param) from exc
        raise BadRequest(f"Invalid value for {param}: {error['msg']}", param=param) from exc


def _field_path(loc: tuple[int | str, ...]) -> str:
    """``messages.0.role`` from pydantic's location, minus union-member tags like ``list[int]``."""
    known = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields) | set(ChatMessage.model_fields)
    head, *rest = loc
    return ".".join([str(head)] + [str(part) for part in rest if isinstance(part, int) or part in known])


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """An OpenAI-style error object, serialised."""
    error = {"message": message, "type": type_, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


def sse_error_event(message: str, *, code: str) -> bytes:
    """The one event a stream that already started sends when it fails, then it ends."""
    return SSE_EVENT_PREFIX + error_body(message, type_="server_error", code=code) + b"\n\n" + SSE_DONE
