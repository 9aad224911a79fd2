"""What a client connection may hold before the app sees a request on it: a deadline and a size for the request's
line and headers, a cap on the connections one gateway process keeps, and on those one API key holds. Knows no
route or engine: gateway/server.py's protocol calls it at each step of a connection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.access import AccessKeys, load_access_keys
from pdserve.access_config import AccessSpec
from pdserve.config import Settings
from pdserve.errors import ConfigError
from pdserve.gateway.client_errors import RETRY_AFTER_S, ClientError
from pdserve.gateway.client_reply import JSON, error_headers, send_whole
from pdserve.gateway_config import GatewaySpec

log = logging.getLogger(__name__)
# What a gateway process holds open besides client and engine connections: the loop's own descriptors, logs,
# the workers' metrics sockets, the engines' health and metrics probes.
RESERVED_FILES = 64
_FULL_WARN_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits of gateway.* and access.* that apply to one connection before its request reaches the app."""

    header_timeout_s: float
    max_header_bytes: int
    idle_timeout_s: float
    max_connections: int  # per gateway process, after the open-file cap
    per_key_max_connections: int  # 0: no limit
    keys: AccessKeys = field(default_factory=AccessKeys)

    @property
    def counts_keys(self) -> bool:
        """Whether connections are counted per API key: a limit is set and there are keys to count by."""
        return self.per_key_max_connections > 0 and bool(self.keys.api_keys)


def limits_of(gateway: GatewaySpec, access: AccessSpec, *, keys: AccessKeys | None = None,
              open_files: int | None = None) -> ConnectionLimits:
    """The limits ``gateway`` and ``access`` set. Pure.

    ``open_files``: the process's open-file limit (None: none). Each client connection with a request in flight
    holds an engine connection too (pd/engine_http.py), so connections are capped at half of what RESERVED_FILES
    leaves; that half is also the room an accept burst has before accept(2) fails with EMFILE (see
    ``ClientConnections``). Raises ConfigError when that leaves no room at all.
    """
    max_connections = gateway.max_connections
    if open_files is not None:
        room = (open_files - RESERVED_FILES) // 2
        if room < 1:
            raise ConfigError(f"the open-file limit ({open_files}) leaves no room for client connections: "
                              f"raise it (ulimit -n) above {RESERVED_FILES + 2}")
        max_connections = min(max_connections, room)
    return ConnectionLimits(header_timeout_s=gateway.header_timeout_s, max_header_bytes=gateway.max_header_bytes,
                            idle_timeout_s=gateway.idle_timeout_s, max_connections=max_connections,
                            per_key_max_connections=access.per_key_max_connections, keys=keys or AccessKeys())


def connection_limits(settings: Settings) -> ConnectionLimits:
    """This gateway process's limits: raises its open-file soft limit to the hard limit, caps
    gateway.max_connections by what that allows (logged), and reads the API keys as the app does.
    Raises ConfigError for unreadable or malformed keys, or an open-file limit with no room for connections."""
    open_files = _raise_open_file_limit()
    limits = limits_of(settings.gateway, settings.access, keys=load_access_keys(settings.gateway),
                       open_files=open_files)
    is_capped = limits.max_connections < settings.gateway.max_connections
    log.log(logging.WARNING if is_capped else logging.INFO,
            "gateway process %d keeps at most %d client connections (gateway.max_connections %d, open-file limit %s)",
            os.getpid(), limits.max_connections, settings.gateway.max_connections, open_files or "none")
    return limits


def _raise_open_file_limit() -> int | None:
    """RLIMIT_NOFILE's soft limit raised to its hard limit, where the kernel allows; returns the soft limit
    then in force (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        with contextlib.suppress(ValueError, OSError):  # a hard limit above fs.nr_open: keep the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return None if soft == resource.RLIM_INFINITY else soft


class ClientConnections:
    """The client connections of one gateway process: those with no request in flight in the order they
    went idle (the first, the longest idle), those with one, and the API key each counts for.

    A connection past ``max_connections`` closes the longest-idle one, itself when no other is idle. That
    keeps the descriptors in use below the open-file limit, which matters more than it seems. When accept(2)
    fails with EMFILE, libuv (under uvloop) closes a spare descriptor it keeps, accepts and at once closes
    every pending connection, health probes included, and reopens the spare (libuv src/unix/stream.c,
    ``uv__emfile_trick`` called from ``uv__server_io``; the spare is opened in ``uv__stream_init``); where
    the spare is gone it hands EMFILE to uvloop, which then closes the listening socket for good (uvloop 0.23
    handles/streamserver.pyx:138-145, ``_fatal_error`` -> ``_close`` at :92-95). asyncio's own loop stops
    accepting for a second (CPython 3.11 asyncio/selector_events.py:175-189, ``_remove_reader`` then
    ``call_later(ACCEPT_RETRY_DELAY, ...)``). Both accept a burst of pending connections before any
    ``connection_made`` runs (uvloop: basetransport.pyx ``_schedule_call_connection_made``; asyncio: up to
    ``backlog`` per wake-up, selector_events.py:163), so the cap leaves room for one (``limits_of``).
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._idle: dict[ClientConnection, None] = {}  # insertion order: the order they went idle
        self._busy: set[ClientConnection] = set()
        self._key_of: dict[ClientConnection, str] = {}
        self._per_key: Counter[str] = Counter()
        self._warned_s = -_FULL_WARN_INTERVAL_S

    def watch(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> ClientConnection:
        """A new connection, idle, with its header deadline running; past ``max_connections`` the
        longest-idle connection (this one, with no other idle) is closed."""
        connection = ClientConnection(self, transport, loop)
        self._idle[connection] = None
        if len(self._idle) + len(self._busy) > self.limits.max_connections:
            self._warn_full()
            next(iter(self._idle)).close()
        return connection

    def busy(self, connection: ClientConnection) -> None:
        self._idle.pop(connection, None)
        self._busy.add(connection)

    def idle(self, connection: ClientConnection) -> None:
        self._busy.discard(connection)
        self._idle[connection] = None

    def claim(self, connection: ClientConnection, key: str) -> bool:
        """Count ``connection`` for ``key`` (a tenant, access.py; '' is not counted); False, and nothing
        counted, when that would take the key past ``per_key_max_connections``."""
        held = self._key_of.get(connection, "")
        if key == held:
            return True
        if key and self._per_key[key] >= self.limits.per_key_max_connections:
            return False
        self._release(connection)
        if key:
            self._key_of[connection] = key
            self._per_key[key] += 1
        return True

    def forget(self, connection: ClientConnection) -> None:
        """``connection`` is closing: it counts no more, for the process or its key."""
        self._idle.pop(connection, None)
        self._busy.discard(connection)
        self._release(connection)

    def _release(self, connection: ClientConnection) -> None:
        key = self._key_of.pop(connection, "")
        if key:
            self._per_key[key] -= 1
            if not self._per_key[key]:
                del self._per_key[key]

    def _warn_full(self) -> None:
        now_s = time.monotonic()
        if now_s - self._warned_s >= _FULL_WARN_INTERVAL_S:
            self._warned_s = now_s
            log.warning("gateway process %d holds %d client connections, its most: a new one closes the longest "
                        "idle (gateway.max_connections, the open-file limit)", os.getpid(), self.limits.max_connections)


class ClientConnection:
    """One client connection as the limits see it. While a request's line and headers are incomplete, it
    counts their bytes and runs their deadline (from the connection's open, or from a next request's first
    byte once no response is under way); from their end to its response's end it is busy."""

    def __init__(self, connections: ClientConnections, transport: asyncio.Transport,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._connections, self._limits = connections, connections.limits
        self._transport, self._loop = transport, loop
        self._is_reading_head, self._head_bytes, self._is_busy = True, 0, False
        self._header_timer: asyncio.TimerHandle | None = None
        self._authorization: bytes | None = None
        self._key = ""
        self._start_header_deadline()

    def take(self, data: bytes) -> bytes:
        """The leading part of ``data`` the HTTP parser may see now: all of it, but while a request's line
        and headers are incomplete, no more than ``max_header_bytes`` of them in all. b"" once they would run
        past that: then 431 is answered (unless a response is under way) and the connection closed.

        The bytes of a request pipelined behind another in the same slice go uncounted, so its head may run
        up to one limit longer (app.py checks the whole head again).
        """
        if not self._is_reading_head:
            return data
        room = self._limits.max_header_bytes - self._head_bytes
        if room <= 0:
            self._refuse_head()
            return b""
        if self._header_timer is None and not self._is_busy:
            self._start_header_deadline()
        part = data[:room]
        self._head_bytes += len(part)
        return part

    def headers_complete(self, headers: Sequence[tuple[bytes, bytes]]) -> ASGIApp | None:
        """A request's line and headers are in: it is busy until its response ends. Returns an app that
        answers 429 and closes the connection where the request's API key holds all its connections."""
        self._is_reading_head, self._head_bytes, self._is_busy = False, 0, True
        self._stop_header_deadline()
        self._connections.busy(self)
        if not self._limits.counts_keys:
            return None
        authorization = next((value for name, value in headers if name == b"authorization"), None)
        if authorization != self._authorization:  # most connections carry one key: hash it once
            self._authorization, self._key = authorization, self._limits.keys.tenant(authorization)
        return None if self._connections.claim(self, self._key) else _refusing(_too_many_connections(self._limits))

    def message_complete(self) -> None:
        """A request's body is in: the next bytes start another request. A deadline running (the body
        outlived its response) ends: the next request's first byte starts its own."""
        self._is_reading_head = True
        self._stop_header_deadline()

    def response_complete(self) -> None:
        """No request is in flight any more: the connection is idle, and a request head or body begun
        while the response went out must now end within the header deadline."""
        self._is_busy = False
        if self._transport.is_closing():
            return
        self._connections.idle(self)
        if self._head_bytes or not self._is_reading_head:
            self._start_header_deadline()

    def lost(self) -> None:
        self._stop_header_deadline()
        self._connections.forget(self)

    def close(self) -> None:
        self.lost()
        self._transport.close()

    def _refuse_head(self) -> None:
        if not self._is_busy:  # never bytes of another reply in the midst of one under way
            error = ClientError(431, f"the request line and headers exceed {self._limits.max_header_bytes} bytes",
                                "invalid_request_error", "request_header_fields_too_large")
            self._transport.write(_whole_reply(error))
        self.close()

    def _start_header_deadline(self) -> None:
        self._stop_header_deadline()
        self._header_timer = self._loop.call_later(self._limits.header_timeout_s, self.close)

    def _stop_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


def _too_many_connections(limits: ConnectionLimits) -> ClientError:
    return ClientError(429, f"this API key already holds {limits.per_key_max_connections} connections to the "
                       "gateway, its most (access.per_key_max_connections): reuse one, or close one first",
                       "rate_limit_exceeded", "too_many_connections", retry_after_s=RETRY_AFTER_S)


def _whole_reply(error: ClientError) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes the connection, for a request the app never saw."""
    body = error.body()
    lines = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", f"content-type: {JSON}",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in error_headers(error))]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _refusing(error: ClientError) -> ASGIApp:
    """An app answering ``error`` with ``Connection: close``: uvicorn closes the connection after it."""
    headers = tuple((name.encode(), value.encode()) for name, value in [*error_headers(error), ("connection", "close")])

    async def refuse(_scope: Scope, _receive: Receive, send: Send) -> None:
        await send_whole(send, error.status, error.body(), extra_headers=headers)

    return refuse
