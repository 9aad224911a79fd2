"""The one place that turns a failure into what the client sees: an HTTP status and an OpenAI
error body. What a client sees never names our engines or hosts and carries no stack trace; the
log line written here keeps that detail, tied to the reply by its request id.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.errors import BadRequest, LegFailed, NoHealthyEndpoint, NotReady, Overloaded, RateLimited, UpstreamRejected
from pdserve.protocol import error_body

log = logging.getLogger(__name__)
_MAX_MESSAGE_CHARS = 2000  # an engine may quote the input back
RETRY_AFTER_S = 1  # what a client told "not ready" or "no engine" should wait before trying again


@dataclass(frozen=True, slots=True)
class ClientError:
    status: int
    message: str
    type_: str
    code: str | None = None
    param: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After

    def body(self) -> bytes:
        return error_body(self.message, type_=self.type_, param=self.param, code=self.code)


def client_error(exc: Exception, *, request_id: str) -> ClientError:
    """What the client of request ``request_id`` is told about ``exc``; server-side failures are logged here."""
    if isinstance(exc, BadRequest):
        return ClientError(exc.status, exc.message, "invalid_request_error", exc.code, exc.param)
    if isinstance(exc, UpstreamRejected):
        message, param = _engine_message(exc)
        return ClientError(exc.status, message, "invalid_request_error", "engine_rejected", param)
    if isinstance(exc, NoHealthyEndpoint):
        return ClientError(503, str(exc), "server_error", "no_healthy_engine", retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, NotReady):
        return ClientError(503, str(exc), "server_error", "not_ready", retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, Overloaded):
        return ClientError(429, str(exc), "rate_limit_exceeded", "overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, RateLimited):  # OpenAI's shape: type "requests" or "tokens", code rate_limit_exceeded
        return ClientError(429, str(exc), exc.kind, "rate_limit_exceeded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, LegFailed):
        log.error("request_id=%s %s", request_id, exc)
        what = "did not answer in time" if exc.is_timeout else "failed"
        return ClientError(504 if exc.is_timeout else 502, f"the {exc.role.value} engine {what} (request id {request_id})",
                           "server_error", f"{exc.role.value}_failed")
    log.error("request_id=%s unexpected error", request_id, exc_info=exc)
    return ClientError(500, f"internal error (request id {request_id})", "server_error", "internal_error")


def _engine_message(exc: UpstreamRejected) -> tuple[str, str | None]:
    """The engine's own message and param (they say what was wrong with the input), its address cut out."""
    try:
        parsed = json.loads(exc.body)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    fields = error if isinstance(error, dict) else parsed if isinstance(parsed, dict) else {}
    message, param = fields.get("message"), fields.get("param")
    if not isinstance(message, str) or not message:
        message = f"the {exc.role.value} engine rejected the request (status {exc.status})"
    netloc = urlsplit(exc.url).netloc
    message = message[:_MAX_MESSAGE_CHARS].replace(exc.url, "the engine").replace(netloc, "the engine")
    return message, param if isinstance(param, str) else None
