"""Shared fixtures: free ports, and running an ASGI app under real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import random
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette

from pdserve.gateway.server import make_server


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


_HANDED_OUT: set[int] = set()  # every port free_port_block gave in this session


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive free ports (engines use base_port + index), none of them
    handed out before in this session: a block is often bound only later (Ray checks that no two of
    one node's ports meet, parameter.py ``_check_usage``, and a head's GCS port once fell inside the
    worker-port range picked next for it).

    Between Ray's worker ports and the kernel's ephemeral range: vLLM binds its internal sockets to
    ports the kernel picks from that range while engines start, and one once took a port given to a
    NIXL side channel.
    """
    low, _ = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(1000):
        block = range(base := random.randrange(20000, low - count), base + count)  # Ray's workers: 10002-19999
        if _HANDED_OUT.isdisjoint(block) and all(_is_free(port) for port in block):
            _HANDED_OUT.update(block)
            return base
    raise RuntimeError(f"no {count} consecutive free ports below {low} not handed out already")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@asynccontextmanager
async def serving(app: Starlette, port: int) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1:``port`` for the block; yields its base URL."""
    server = make_server(app, host="127.0.0.1", port=port)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def metric(text: str, series: str) -> float:
    """The sum of ``series`` (a name, or a name and its labels as written) over its lines; 0 if none."""
    name, _, labels = series.partition("{")
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for found_labels, value in pattern.findall(text)
               if all(label in found_labels for label in labels.rstrip("}").split(",") if label))
