"""What the gateway reads from a client before any engine sees the request: header size, API key, request
id, mode header, body and, for an admin change, its content type and Host, each bounded and checked; every
refusal is a BadRequest with its status.
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import Receive, Scope

from pdserve.errors import BadRequest
from pdserve.gateway.disconnect import ClientDisconnected
from pdserve.gateway.exposure import names_gateway
from pdserve.protocol import PD_MODE_HEADER, REQUEST_ID_HEADER
from pdserve.routing.decision import Mode

_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")


def header_map(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (ASGI servers already lower-case them)."""
    return dict(scope["headers"])


def authorization(request: Request) -> bytes | None:
    """A Starlette route's ``Authorization`` header, as the plain ASGI routes read it (bytes)."""
    value = request.headers.get("authorization")
    return None if value is None else value.encode("latin-1")


def check_header_size(scope: Scope, *, limit: int) -> None:
    """Raises BadRequest (431) when the request line and headers exceed ``limit`` bytes."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b""))
    size += sum(len(name) + len(value) + 4 for name, value in scope["headers"])  # ": " and CRLF
    if size > limit:
        raise BadRequest(f"request headers exceed {limit} bytes", status=431, code="request_header_fields_too_large")


def request_id(header: bytes | None) -> str:
    """The client's X-Request-Id, or a fresh one; it goes into engine requests and logs."""
    if header is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(header):
        raise BadRequest(f"{REQUEST_ID_HEADER} must be 1-256 visible ASCII characters", param=REQUEST_ID_HEADER,
                         code="invalid_header")
    return header.decode("ascii")


def parse_mode(header: bytes | None) -> Mode | None:
    """The client's X-PD-Mode; None when it sent none (the router decides, routing/decision.py)."""
    if header is None:
        return None
    value = header.decode("latin-1")
    try:
        return Mode(value.strip().lower())
    except ValueError:
        raise BadRequest(f"{PD_MODE_HEADER} must be 'pd' or 'local'", param=PD_MODE_HEADER,
                         code="invalid_header") from None


def check_state_change(headers: dict[bytes, bytes], *, bound_host: str) -> None:
    """What a request that changes state (POST /admin/scale) carries besides the key, so that no web page can
    make a browser send it. Raises BadRequest: 415 unless its body is declared JSON (a cross-site form cannot
    declare it without a CORS preflight, which the gateway never grants), 421 unless its Host names this
    gateway, bound to ``bound_host`` (a page that DNS rebinding points here sends its own domain)."""
    media_type = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
    if media_type != b"application/json":
        raise BadRequest("send the body as JSON, with `Content-Type: application/json`", status=415,
                         code="unsupported_media_type")
    if not names_gateway(headers.get(b"host", b"").decode("latin-1"), bound_host=bound_host):
        raise BadRequest("the Host header does not name this gateway: send the request to the gateway's own address "
                         "or a loopback one", status=421, code="misdirected_request")


async def read_body(receive: Receive, headers: dict[bytes, bytes], *, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes without buffering them."""
    declared = headers.get(b"content-length", b"")
    if declared.isdigit() and (len(declared) > len(str(limit)) or int(declared) > limit):
        raise _too_large(limit)
    chunks, size, more_body = [], 0, True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        more_body = message.get("more_body", False)
    return b"".join(chunks)


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"request body exceeds {limit} bytes", status=413, code="request_too_large")
