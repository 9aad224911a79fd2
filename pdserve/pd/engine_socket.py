"""How the gateway's engine connections notice a link that went silent (socket options), and an idle one the
engine closed (a peek that reads nothing off the socket).

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


def is_closed_by_peer(fd: int) -> bool:
    """Whether an idle connection can no longer carry a request: a non-blocking MSG_PEEK on its socket ``fd`` sees
    the peer's EOF or an error (a reset), or bytes no request asked for. Takes nothing off the socket.
    The fd is borrowed: asyncio's and uvloop's transports give no socket that can recv."""
    borrowed = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fd)  # all given: no syscall; detach() gives fd back
    try:
        borrowed.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # nothing to read: open, and quiet as an idle connection is
    except OSError:
        return True
    finally:
        borrowed.detach()
    return True  # b'' (EOF), or bytes nobody asked for: the connection is in no known state
