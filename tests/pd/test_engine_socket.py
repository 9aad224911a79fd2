"""The engine connections' link watch (pd/engine_socket.py): the kernel is asked to fail a connection
whose peer's host goes silent. That it does, across a cut link, is tested on the bed of hosts
(tests/e2e/test_netbed.py)."""

from __future__ import annotations

import socket

from pdserve.pd.engine_socket import PROBES, watch_link


def test_a_silent_peer_fails_the_connection_after_about_the_link_timeout() -> None:
    with socket.socket() as sock:
        watch_link(sock, link_timeout_s=30)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle_s = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval_s = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == PROBES
        assert 25 <= idle_s + PROBES * interval_s <= 35  # keepalive alone would fail it at about 30 s
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000


def test_a_short_link_timeout_still_probes_each_second_at_most() -> None:
    with socket.socket() as sock:
        watch_link(sock, link_timeout_s=0.5)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 500
