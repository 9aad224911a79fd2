"""Where the gateway learns which engines exist: a fixed list, or engines that register.

The one seam between placement and the request path: a source keeps the pool's endpoint lists
current; the orchestrator, policies and health loop only ever read the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from pdserve.engines.kv_path import KvPath, KvPathLog
from pdserve.engines.members import MembersFolder
from pdserve.role import Role
from pdserve.routing.pool import Pool

log = logging.getLogger(__name__)


KV_PATH_READ_INTERVAL_S = 2.0
UNREPORTED = KvPath()  # an engine that has logged nothing of its KV path yet


class EndpointSource(Protocol):
    async def follow(self, pool: Pool) -> None:
        """Keep ``pool``'s endpoints current until cancelled."""


class FixedEndpoints:
    """Engines at known addresses: launched by ``pdserve up`` on this host, or given as urls.

    Engines launched here report their KV path through their logs (``kv_logs``: url -> log file),
    as Ray replicas do through registration.
    """

    def __init__(self, *, prefill_urls: Sequence[str], decode_urls: Sequence[str],
                 kv_logs: Mapping[str, Path] | None = None) -> None:
        self._urls = {Role.PREFILL: list(prefill_urls), Role.DECODE: list(decode_urls)}
        self._kv_logs = {url: KvPathLog(path) for url, path in (kv_logs or {}).items()}

    async def follow(self, pool: Pool) -> None:
        for role, urls in self._urls.items():
            pool.set_urls(role, urls)
        while self._kv_logs:
            read_kv_paths(pool, self._kv_logs)
            await asyncio.sleep(KV_PATH_READ_INTERVAL_S)


class LaunchedEngines:
    """Engines `pdserve up` launched and may scale (engines/members.py), plus any external urls:
    an engine joins the pool once it serves and leaves it as it starts to drain."""

    def __init__(self, folder: MembersFolder, *, external: Mapping[Role, Sequence[str]],
                 look_interval_s: float = 0.25) -> None:
        self._folder, self._external, self._look_interval_s = folder, external, look_interval_s

    async def follow(self, pool: Pool) -> None:
        stamp, kv_logs, kv_read_s = 0.0, dict[str, KvPathLog](), 0.0
        while True:
            if (changed := self._folder.changed_since(stamp)) is not None and (members := self._folder.read()):
                stamp = changed
                for role in Role:
                    urls = [member.url for member in members.serving(role)] + list(self._external.get(role, ()))
                    if pool.set_urls(role, urls):
                        log.info("%s engines now: %s", role.value, ", ".join(urls) or "none")
                kv_logs = {member.url: kv_logs.get(member.url) or KvPathLog(Path(member.log_path))
                           for member in members.engines}
            if time.monotonic() - kv_read_s >= KV_PATH_READ_INTERVAL_S:
                kv_read_s = time.monotonic()
                read_kv_paths(pool, kv_logs)
            await asyncio.sleep(self._look_interval_s)


def read_kv_paths(pool: Pool, kv_logs: Mapping[str, KvPathLog]) -> None:
    """What each engine in ``pool`` with a log in ``kv_logs`` has logged of its KV path so far."""
    for role in Role:
        for endpoint in pool.all(role):
            if reader := kv_logs.get(endpoint.url):
                endpoint.kv_path = reader.read()


class RegisteredEndpoints:
    """Engines that announce themselves and renew the announcement, as Ray Serve replicas do on
    every health check; one not renewed within ``ttl_s`` is dropped (its replica is gone).

    ``register`` and ``unregister`` may be called from any thread; ``follow`` runs on the
    gateway's event loop and copies the current view into the pool every ``sync_interval_s``.
    """

    def __init__(self, *, ttl_s: float, sync_interval_s: float = 0.5) -> None:
        self._ttl_s, self._sync_interval_s = ttl_s, sync_interval_s
        self._lock = threading.Lock()
        self._last_seen_s: dict[tuple[Role, str], float] = {}
        self._kv_paths: dict[str, KvPath] = {}

    def register(self, role: Role, url: str, *, kv_path: KvPath = UNREPORTED) -> None:
        """``kv_path``: what the engine has logged of its KV path so far."""
        with self._lock:
            if (role, url) not in self._last_seen_s:
                log.info("%s engine %s registered", role.value, url)
            self._last_seen_s[(role, url)] = time.monotonic()
            self._kv_paths[url] = kv_path

    def unregister(self, role: Role, url: str) -> None:
        with self._lock:
            self._kv_paths.pop(url, None)
            if self._last_seen_s.pop((role, url), None) is not None:
                log.info("%s engine %s unregistered", role.value, url)

    def snapshot(self) -> list[tuple[Role, str, KvPath]]:
        """Every engine registered and renewed within the ttl, with its KV path, oldest first."""
        current = {role: self.current(role) for role in Role}
        with self._lock:
            return [(role, url, self._kv_paths.get(url, UNREPORTED)) for role, urls in current.items() for url in urls]

    def mirror(self, engines: Sequence[tuple[Role, str, KvPath]], *, keep_missing: bool = False) -> None:
        """Become a copy of another registry's ``snapshot``; with ``keep_missing``, engines not in it stay
        (a registry restarted moments ago has not heard from every engine yet)."""
        listed = {(role, url) for role, url, _ in engines}
        with self._lock:
            missing = [] if keep_missing else [key for key in self._last_seen_s if key not in listed]
        for role, url in missing:
            self.unregister(role, url)
        for role, url, kv_path in engines:
            self.register(role, url, kv_path=kv_path)

    def current(self, role: Role) -> list[str]:
        """Registered urls of ``role`` renewed within the ttl, oldest registration first."""
        expired_before_s = time.monotonic() - self._ttl_s
        with self._lock:
            for key in [key for key, seen_s in self._last_seen_s.items() if seen_s < expired_before_s]:
                log.warning("%s engine %s stopped renewing its registration; dropped", key[0].value, key[1])
                del self._last_seen_s[key]
                self._kv_paths.pop(key[1], None)
            return [url for (kind, url) in self._last_seen_s if kind is role]

    async def follow(self, pool: Pool) -> None:
        while True:
            for role in Role:
                urls = self.current(role)
                if pool.set_urls(role, urls):
                    log.info("%s engines now: %s", role.value, ", ".join(urls) or "none")
                with self._lock:
                    for endpoint in pool.all(role):
                        endpoint.kv_path = self._kv_paths.get(endpoint.url, UNREPORTED)
            await asyncio.sleep(self._sync_interval_s)
