"""``pdserve verify``: probe every prefill/decode pair of a running deployment and judge it.

Per pair: the KV path each engine logged (NIXL backend, UCX transports, libfabric provider, where its
KV buffer lives and why), the KV bandwidth of a probe of known size against what the link can do, and
PD output == local output (greedy). A deployment that asked for EFA fails on any other path.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdserve.access import admin_key_needed, load_access_keys
from pdserve.config import Settings
from pdserve.engine_key import engine_session, load_engine_key
from pdserve.engines.kv_link import is_efa_asked
from pdserve.engines.kv_path import KvPath, kv_path_from_log
from pdserve.errors import GatewayUnavailable
from pdserve.gateway_address import GatewayTarget, unreachable
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.kv_proof import IntegrityResult
from pdserve.role import Role
from pdserve.verify import microbench
from pdserve.verify.checks import NOMINAL_GBPS, Link, Verdict, classify_link, judge, kv_path_problems
from pdserve.verify.content import check_content
from pdserve.verify.interface import link_interface
from pdserve.verify.probe import HandoffProbe, pd_and_local_token_ids, probe_handoff
from pdserve.verify.transfers import Path as TransferPath
from pdserve.verify.transfers import PathKind

_MEMCPY_BYTES = 256 * 1024 * 1024


CONTENT_NOTES = {  # what a pair's content check found, where not ok (docs/reliability.md, "KV integrity")
    IntegrityResult.RECOMPUTED: "check FAILED: the decode engine computed the prompt instead of using the KV it "
                                "pulled (a digest mismatch or a failed pull: its log says which)",
    IntegrityResult.UNCHECKED: "unchecked: the prefill engine sent no block digests (vLLM 0.29, or a KV layout the "
                               "check cannot index: its log says so at start)",
}


@dataclass(frozen=True, slots=True)
class PairReport:
    prefill: str
    decode: str
    backends: list[str]
    transports: list[str]
    providers: list[str]  # libfabric providers of the LIBFABRIC backend, if any
    kv_paths: dict[str, KvPath]  # by role, as each engine logged it
    kv_bytes: float
    prefill_ms: float
    decode_ms: float
    verdict: Verdict
    is_pd_equal_local: bool | None  # None: no gateway to ask
    path_problems: tuple[str, ...] = ()
    interface: str = ""  # a network pair's: this host's interface toward the decode engine, and its speed
    content: IntegrityResult = IntegrityResult.UNKNOWN  # the decode engine's KV integrity check of one handoff

    @property
    def is_ok(self) -> bool:
        return (self.verdict.is_ok and not self.path_problems and self.is_pd_equal_local is not False
                and self.content is not IntegrityResult.RECOMPUTED)


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine to probe, and the KV path it logged."""

    url: str
    kv_path: KvPath


async def verify(
    settings: Settings, *, gateway: GatewayTarget | None, min_fraction: float, expected_gbps: float | None,
    prompt_tokens: int | None, probes: int = 3, slack_ms: float | None = None, timeout_s: float = 120.0,
) -> list[PairReport]:
    """Probe each (prefill, decode) pair ``probes`` times and judge the fastest handoff: bandwidth is
    what the path can do, and one probe can land on a scheduling hiccup of a busy host. Raises
    LegFailed or aiohttp.ClientError if an engine is unreachable, GatewayUnavailable if the gateway is
    (or refuses the probes for want of the admin key).

    The engines are those the gateway routes to, wherever they run (another node of a Ray
    cluster too); without a gateway, the configured ones. Their key: engine_key.py's load_engine_key.
    """
    tokens = prompt_tokens or max(settings.model.max_model_len - 64, 16)
    engine_key = load_engine_key(settings.gateway, run_dir=settings.run_dir)  # the engines', to them alone
    client = EngineClient(connect_timeout_s=settings.gateway.connect_timeout_s, headers=engine_key.headers())
    try:
        # The admin key lets /health list the engines and completions through; it goes to the gateway alone.
        async with aiohttp.ClientSession(headers=load_access_keys(settings.gateway).headers()) as gateway_session, \
                engine_session(engine_key) as session:
            engines = await _engines(gateway_session, settings, gateway)
            pairs = [(prefill, decode) for prefill in engines[Role.PREFILL] for decode in engines[Role.DECODE]]
            is_equal = await _pd_equals_local(gateway_session, gateway.url, settings, timeout_s) if gateway else None
            fastest = [await _fastest_probe(session, client, settings, prefill_url=prefill.url, decode_url=decode.url,
                                            prompt_tokens=tokens, probes=probes, timeout_s=timeout_s)
                       for prefill, decode in pairs]
            contents = [await check_content(client, prefill_url=prefill.url, decode_url=decode.url,
                                            model=settings.model.served_name, connector=settings.kv.connector,
                                            seed=random.randrange(1 << 30), timeout_s=timeout_s)
                        for prefill, decode in pairs]
    finally:
        client.close()
    reports = []
    efa = is_efa_asked(settings.kv, (settings.prefill, settings.decode))
    for (prefill, decode), probe, content in zip(pairs, fastest, contents, strict=True):
        link = classify_link(settings.prefill, settings.decode, prefill_host=urlsplit(prefill.url).hostname or "",
                             decode_host=urlsplit(decode.url).hostname or "",
                             buffer_devices=(prefill.kv_path.buffer_device, decode.kv_path.buffer_device))
        via = link_interface([urlsplit(url).hostname or "" for url in (decode.url, prefill.url)]
                             ) if link is Link.NETWORK else None
        # Across hosts the link is judged by the interface's own speed where the kernel knows it.
        expected = expected_gbps or (via.gbps if via is not None else None) or NOMINAL_GBPS.get(link, 0.0)
        if not expected:  # host memory: measure this machine rather than assume
            expected = await asyncio.to_thread(_host_memcpy_gbps)
        paths = {Role.PREFILL.value: prefill.kv_path, Role.DECODE.value: decode.kv_path}
        reports.append(PairReport(
            prefill=prefill.url, decode=decode.url,
            backends=sorted({backend for path in paths.values() for backend in path.backends}),
            transports=sorted({transport for path in paths.values() for transport in path.transports}),
            providers=sorted({path.provider for path in paths.values() if path.provider}), kv_paths=paths,
            path_problems=tuple(problem for (role, path), engine in zip(paths.items(), (prefill, decode), strict=True)
                                for problem in kv_path_problems(path, role=role, url=engine.url, is_efa_asked=efa,
                                                                 link=link)),
            kv_bytes=probe.engine.bytes, prefill_ms=probe.prefill_s * 1000, decode_ms=probe.decode_s * 1000,
            verdict=judge(probe, link=link, expected_gbps=expected, min_fraction=min_fraction, slack_ms=slack_ms,
                          is_bar_given=expected_gbps is not None, via="" if via is None else via.describe()),
            is_pd_equal_local=is_equal, interface="" if via is None else via.describe(), content=content,
        ))
    return reports


async def _engines(session: aiohttp.ClientSession, settings: Settings, gateway: GatewayTarget | None
                   ) -> dict[Role, list[Engine]]:
    """The gateway's engines with the KV path each reported, else the configured ones; an engine
    that reported nothing is looked up in this host's engine logs."""
    local_logs = {spec.base_url: settings.engine_log_dir / f"{spec.name}.log" for spec in settings.engine_specs()}
    listed: dict[str, list[dict[str, Any]]] = {
        role.value: [{"url": url} for url in settings.endpoint_urls(role)] for role in Role}
    if gateway:
        try:
            async with session.get(f"{gateway.url}/health", timeout=aiohttp.ClientTimeout(total=30)) as reply:
                health = await reply.json()  # 503 (degraded) still lists the engines
        except aiohttp.ClientConnectorError as exc:
            raise unreachable(gateway, exc.strerror or type(exc).__name__) from exc
        if "engines" not in health:  # listed to the admin only, once any key is set (gateway/admin_routes.py)
            raise GatewayUnavailable(admin_key_needed(f"{gateway.url}/health"))
        listed = health["engines"]
    engines: dict[Role, list[Engine]] = {}
    for role in Role:
        engines[role] = []
        for entry in listed.get(role.value, []):
            path = _kv_path(entry.get("kv_path") or {})
            if not path.backends and entry["url"] in local_logs:
                path = kv_path_from_log(_log_text(local_logs[entry["url"]]))
            engines[role].append(Engine(entry["url"], path))
    return engines


async def _fastest_probe(
    session: aiohttp.ClientSession, client: EngineClient, settings: Settings, *, prefill_url: str, decode_url: str,
    prompt_tokens: int, probes: int, timeout_s: float,
) -> HandoffProbe:
    """Of ``probes`` handoffs through one pair, each with a prompt of its own, the one that moved KV fastest."""
    results = [await probe_handoff(
        session, client, prefill_url=prefill_url, decode_url=decode_url, model=settings.model.served_name,
        connector=settings.kv.connector, prompt_tokens=prompt_tokens, seed=random.randrange(1 << 30), timeout_s=timeout_s,
    ) for _ in range(probes)]
    return max(results, key=lambda probe: probe.engine.gbps)


async def _pd_equals_local(session: aiohttp.ClientSession, gateway_url: str, settings: Settings, timeout_s: float) -> bool:
    pd, local = await pd_and_local_token_ids(session, gateway_url, model=settings.model.served_name, timeout_s=timeout_s)
    return pd == local


def _host_memcpy_gbps() -> float:
    """This host's memcpy bandwidth: the ceiling for KV moving through host memory."""
    paths = [TransferPath(kind=PathKind.HOST_MEMCPY)]
    (result,) = microbench.run_microbench(size_bytes=_MEMCPY_BYTES, block_bytes=_MEMCPY_BYTES, paths=paths)
    return result.gbps


def _kv_path(reported: dict[str, Any]) -> KvPath:
    """A KvPath from the gateway's /health JSON (lists for tuples)."""
    return KvPath(backends=tuple(reported.get("backends", ())), transports=tuple(reported.get("transports", ())),
                  provider=reported.get("provider", ""), buffer_device=reported.get("buffer_device", ""),
                  buffer_reason=reported.get("buffer_reason", ""))


def _log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def is_healthy(reports: list[PairReport]) -> bool:
    return bool(reports) and all(r.is_ok for r in reports)


def format_reports(reports: list[PairReport]) -> str:
    """kubectl-style table, then one line per problem with what to change."""
    header = ("PREFILL", "DECODE", "LINK", "BACKENDS", "PROVIDER", "KV_BUFFER", "TRANSPORTS", "KV_MB",
              "ENGINE_GB/s", "HANDOFF_GB/s", "EXPECTED_GB/s", "PD==LOCAL", "CONTENT", "STATUS")
    rows = [header] + [
        (r.prefill, r.decode, f"{r.verdict.link.value} ({r.interface})" if r.interface else r.verdict.link.value, ",".join(r.backends) or "?", ",".join(r.providers) or "-",
         "/".join(path.buffer_device or "?" for path in r.kv_paths.values()), ",".join(r.transports) or "-",
         f"{r.kv_bytes / 1e6:.1f}", f"{r.verdict.measured_gbps:.2f}", f"{r.verdict.handoff_gbps:.2f}",
         f"{r.verdict.expected_gbps:.1f}", {None: "-", True: "yes", False: "NO"}[r.is_pd_equal_local],
         r.content.value, "OK" if r.is_ok else "FAIL")
        for r in reports
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    buffers = {(role, url, path.buffer_device, path.buffer_reason) for r in reports
               for (role, path), url in zip(r.kv_paths.items(), (r.prefill, r.decode), strict=True)}
    lines += [f"{role} {url}: KV buffer {device or '?'}: {reason or 'not logged'}"
              for role, url, device, reason in sorted(buffers)]
    for r in reports:
        lines += [f"{r.prefill} -> {r.decode}: {problem}" for problem in (*r.verdict.problems, *r.path_problems)]
        if r.is_pd_equal_local is False:
            lines.append(f"{r.prefill} -> {r.decode}: greedy PD output differs from local output")
        if r.content is not IntegrityResult.OK:
            lines.append(f"{r.prefill} -> {r.decode}: KV content {CONTENT_NOTES.get(r.content, r.content.value)}")
    return "\n".join(lines)


def reports_json(reports: list[PairReport]) -> str:
    return json.dumps([asdict(r) | {"ok": r.is_ok, "content": r.content.value} for r in reports], indent=2, default=str)

