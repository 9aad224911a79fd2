"""The legs' lean HTTP/1.1 client, the gateway's hot path to its engines: pooled keep-alive connections,
each request written once, with one syscall (pd/engine_reply.py parses the reply and hands it on)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from pdserve.pd.engine_reply import EngineConnection, EngineReply, EngineUnreachable
from pdserve.pd.engine_socket import is_closed_by_peer, watch_link


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    host_header: bytes


@lru_cache(maxsize=256)
def _split_url(url: str) -> tuple[_Origin, bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"engine URLs must be plain http://host:port/..., not {url!r}")
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Origin(parts.hostname, port, parts.netloc.encode("ascii")), path.encode("ascii")


def _header_lines(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")  # would smuggle a header in
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    return b"".join(lines)


def _format_request(path: bytes, origin: _Origin, headers: Mapping[str, str], payload: bytes, *, fixed: bytes) -> bytes:
    """``fixed``: the header lines every request of the client carries, formatted once."""
    head = b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\n" % (path, origin.host_header, len(payload))
    return b"".join((head, fixed, _header_lines(headers), b"\r\n", payload))


# Why not aiohttp here: on a small VM it spends 0.25-0.35 ms of Python per request (URL and
# header objects, timers, trace hooks, its stream reader), and a PD request makes two requests
# before its first token. This client writes each request with one syscall on a pooled keep-alive
# connection, parses replies with httptools (C), and hands body bytes to the relay as they arrive.
# Control-plane calls (health probes, metrics scrapes) stay on aiohttp: they are off that path.
class EngineClient:
    """Keep-alive connections per engine, reused newest first; one request at a time on each.

    An idle connection is dropped after ``keepalive_s``, shorter than the engines' own idle limit
    (uvicorn's default is 5 s), and, just before its reuse, if the engine has closed it (pd/engine_socket.py).
    A request is written once: a connection that fails after that fails the request, never sends it again,
    since the engine may have read it (a prefill run twice holds its KV blocks twice).
    A connection whose engine host answers nothing for ``link_timeout_s`` fails (pd/engine_socket.py).
    ``headers`` (the engine key's, engine_key.py) go with every request, formatted once here.
    """

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float = 4.0, link_timeout_s: float = 30.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self._connect_timeout_s, self._keepalive_s, self._link_timeout_s = connect_timeout_s, keepalive_s, link_timeout_s
        self._fixed_headers = _header_lines(headers or {})
        self._idle: dict[_Origin, list[EngineConnection]] = {}

    async def post(self, url: str, payload: bytes, *, headers: Mapping[str, str]) -> EngineReply:
        """Send ``payload``; return once the reply's status line and headers are in.

        Raises EngineUnreachable. The caller bounds the wait (asyncio.timeout) and must
        ``close()`` the reply.
        """
        origin, path = _split_url(url)
        request = _format_request(path, origin, headers, payload, fixed=self._fixed_headers)
        return await _send(await self._acquire(origin), request)

    def close(self) -> None:
        """Close the idle connections; those in use close with their replies."""
        for connections in self._idle.values():
            for connection in connections:
                connection.abort()
        self._idle.clear()

    async def _acquire(self, origin: _Origin) -> EngineConnection:
        idle = self._idle.get(origin, [])
        now_s = time.monotonic()
        while idle:
            connection = idle.pop()
            # is_open lags: the loop may not have read the engine's close yet, the kernel has.
            if (connection.is_open and now_s - connection.idle_since_s < self._keepalive_s
                    and not is_closed_by_peer(connection.fd)):
                return connection
            connection.abort()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: EngineConnection(lambda done: self._release(origin, done)), origin.host, origin.port)
        except OSError as exc:
            raise EngineUnreachable(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        except TimeoutError as exc:
            raise EngineUnreachable(f"connect to {origin.host}:{origin.port} timed out "
                                    f"after {self._connect_timeout_s:g} s") from exc
        watch_link(connection.socket, link_timeout_s=self._link_timeout_s)
        return connection

    def _release(self, origin: _Origin, connection: EngineConnection) -> None:
        idle = self._idle.setdefault(origin, [])
        idle.append(connection)
        # Reuse takes the newest, so after a burst the oldest would linger: drop those past their time.
        expired_before_s = connection.idle_since_s - self._keepalive_s
        while not idle[0].is_open or idle[0].idle_since_s < expired_before_s:
            idle.pop(0).abort()


async def _send(connection: EngineConnection, request: bytes) -> EngineReply:
    reply = connection.send(request)
    try:
        await reply.wait_headers()
    except BaseException:
        reply.close()
        raise
    return reply
