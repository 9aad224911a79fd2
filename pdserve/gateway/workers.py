"""What several gateway processes on one port (``gateway.workers``) share, and nothing on the request path.

Each worker binds the port with SO_REUSEPORT, so the kernel spreads connections over them, and
runs the whole gateway app with its own pool, engine connections and metrics. Worker 0 alone
probes engine health and scrapes engines' metrics, and publishes health and load in shared memory
that the others copy into their pools. ``/metrics`` on any worker gathers every worker's registry over
unix sockets and sums them. In-flight counts stay per worker (see ``docs/architecture.md``).
The processes themselves are started by gateway/server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import SynchronizedArray
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import Settings
from pdserve.errors import EngineStartFailed
from pdserve.role import Role
from pdserve.routing.load import EngineLoad
from pdserve.routing.pool import Endpoint, Pool

log = logging.getLogger(__name__)
_SYNC_INTERVAL_S = 0.25  # how soon a worker sees a health change or load reading worker 0 made
_LOAD_FIELDS = len(dataclasses.fields(EngineLoad))
_GATHER_TIMEOUT_S = 2.0


class SharedHealth:
    """Per engine the deployment may have (prefill urls, then decode urls, up to
    ``launch.max_engines_per_pool`` launched per pool, for `pdserve scale`): one byte, 1 = healthy, and
    its last load reading (routing/load.py) as doubles, which routing in every worker weighs. Also per
    engine, the legs each worker has ended on it, and how many had ended when the load was read: a
    read still counts a conversation's last turn that ended in another worker, so each worker takes
    what ended since off it (routing/router.py, ``without_ended_legs``)."""

    def __init__(self, settings: Settings) -> None:
        self._keys = [(role, url.rstrip("/")) for role in (Role.PREFILL, Role.DECODE)
                      for url in settings.endpoint_urls(role, scalable=True)]
        context = multiprocessing.get_context("spawn")
        self._flags: SynchronizedArray[int] = context.Array("b", [1] * len(self._keys))
        self._loads: SynchronizedArray[float] = context.Array(
            "d", [value for _ in self._keys for value in dataclasses.astuple(EngineLoad())])
        self._workers = settings.gateway.workers
        self._ended: SynchronizedArray[int] = context.Array("q", [0] * (self._workers * len(self._keys)))
        self._ended_at_read: SynchronizedArray[int] = context.Array("q", [0] * len(self._keys))

    def publish(self, pool: Pool) -> None:
        """Write ``pool``'s health and loads (worker 0's, which probes and scrapes) for the others."""
        endpoints = _by_key(pool)
        self._flags[:] = [int(endpoints[key].is_healthy) if key in endpoints else 1 for key in self._keys]
        self._loads[:] = [value for key in self._keys for value in dataclasses.astuple(
            endpoints[key].load if key in endpoints else EngineLoad())]
        self._ended_at_read[:] = [endpoints[key].legs_ended_at_read if key in endpoints else 0 for key in self._keys]

    def share_ended_legs(self, pool: Pool, *, worker: int) -> None:
        """Write the legs ``worker`` ended on each engine, and take in those every other worker ended."""
        count, endpoints = len(self._keys), _by_key(pool)
        self._ended[worker * count:(worker + 1) * count] = [
            endpoints[key].legs_ended if key in endpoints else 0 for key in self._keys]
        ended = self._ended[:]
        for index, key in enumerate(self._keys):
            if (endpoint := endpoints.get(key)) is not None:
                endpoint.legs_ended_elsewhere = sum(ended[other * count + index] for other in range(self._workers)
                                                    if other != worker)

    def read(self) -> dict[tuple[Role, str], bool]:
        return {key: bool(flag) for key, flag in zip(self._keys, self._flags[:], strict=True)}

    def read_loads(self) -> dict[tuple[Role, str], EngineLoad]:
        values, width = self._loads[:], _LOAD_FIELDS
        return {key: EngineLoad(*values[index * width:(index + 1) * width]) for index, key in enumerate(self._keys)}

    async def publish_forever(self, pool: Pool, *, interval_s: float = _SYNC_INTERVAL_S) -> None:
        while True:
            self.share_ended_legs(pool, worker=0)
            self.publish(pool)
            await asyncio.sleep(interval_s)

    async def follow(self, pool: Pool, *, worker: int, interval_s: float = _SYNC_INTERVAL_S) -> None:
        """Copy published health into ``pool`` whenever it changes. A worker that marked an engine
        down after a failed leg keeps it down until worker 0's probes change their verdict."""
        applied: dict[tuple[Role, str], bool] = {}
        while True:
            self.share_ended_legs(pool, worker=worker)
            current, loads = self.read(), self.read_loads()
            ended_at_read = dict(zip(self._keys, self._ended_at_read[:], strict=True))
            for role in Role:
                for endpoint in pool.all(role):
                    shared = loads.get((role, endpoint.url))
                    if shared is not None and shared.read_s != endpoint.load.read_s:
                        endpoint.take_load(shared, legs_ended_at_read=ended_at_read[(role, endpoint.url)])
                    if current != applied:
                        endpoint.is_healthy = current.get((role, endpoint.url), endpoint.is_healthy)
            applied = current
            await asyncio.sleep(interval_s)


def _by_key(pool: Pool) -> dict[tuple[Role, str], Endpoint]:
    return {(endpoint.role, endpoint.url): endpoint for role in Role for endpoint in pool.all(role)}


@dataclass(frozen=True, slots=True)
class Worker:
    """What one worker process knows of the group: its index, the shared health, the run folder."""

    index: int
    count: int
    run_dir: Path
    health: SharedHealth

    @property
    def probes(self) -> bool:
        """Worker 0 probes health and scrapes KV counters for all."""
        return self.index == 0

    def metrics_path(self, index: int) -> Path:
        return self.run_dir / f"metrics-{index}.sock"

    async def serve_metrics(self, render: Callable[[], bytes]) -> None:
        """Answer each connection on this worker's unix socket with its own registry, until cancelled."""
        async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(render())
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(answer, path=self.metrics_path(self.index))
        async with server:
            await server.serve_forever()

    async def gather_metrics(self, own: bytes) -> bytes:
        """``own`` registry summed with every other worker's; a worker that does not answer in
        2 s is left out (and logged), so /metrics always answers."""
        others = [index for index in range(self.count) if index != self.index]
        texts = await asyncio.gather(*(self._read_metrics(index) for index in others))
        return merge_exposition([own.decode(), *(text for text in texts if text is not None)])

    async def _read_metrics(self, index: int) -> str | None:
        try:
            async with asyncio.timeout(_GATHER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(self.metrics_path(index))
                text = await reader.read()
                writer.close()
                return text.decode()
        except (OSError, TimeoutError) as exc:
            log.warning("gateway worker %d did not give its metrics: %r", index, exc)
            return None


def merge_exposition(texts: Sequence[str]) -> bytes:
    """Prometheus text from several processes as one: samples with equal names and labels are
    summed (counters, histogram buckets, gauges of in-flight work), ``_created`` takes the
    earliest. Pure."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sample.labels.items()))
                if key in values and sample.name.endswith("_created"):
                    values[key] = min(values[key], sample.value)
                else:
                    values[key] = values.get(key, 0.0) + sample.value
    for (family_name, sample_name, labels), value in values.items():
        families[family_name].add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EngineStartFailed(f"gateway cannot bind {host}:{port}: {exc}") from exc
    return sock
