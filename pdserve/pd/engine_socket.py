"""How the gateway's engine connections notice a link that went silent. Socket options only; no I/O.

A cut link or a dead host sends no reset: a connection waiting on a reply that has no bytes until its
end (a whole, non-streamed reply) would otherwise wait for the request's deadline (an hour by default).
TCP keepalive probes the peer while nothing flows, and TCP_USER_TIMEOUT bounds data left
unacknowledged, so the kernel fails the connection (ETIMEDOUT) once the peer's host has answered
nothing for ``link_timeout_s``. A busy engine still answers: its kernel acknowledges the probes.
"""

from __future__ import annotations

import socket
from typing import Protocol

PROBES = 3  # unanswered keepalive probes, after a first silence of the same length, that fail a link


class SocketOptions(Protocol):
    """What asyncio's and uvloop's transports give as their socket."""

    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def watch_link(sock: SocketOptions, *, link_timeout_s: float) -> None:
    """Fail ``sock`` once its peer's host has acknowledged nothing for about ``link_timeout_s`` (Linux's options)."""
    interval_s = max(1, round(link_timeout_s / (PROBES + 1)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, PROBES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(link_timeout_s * 1000))
