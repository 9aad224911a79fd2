"""Read each engine's /metrics: every engine's load for routing, and each decode engine's
KV-transfer telemetry, by which the gateway's handoffs are judged.

A handoff (prefill done -> first decoded token) also waits in the decode engine's queue, so a
slow one alone says nothing about the transport. WARN only when the engine's own transfers were
slow (pd/slow_kv.py, the rule `pdserve verify` judges by too) or failed; the verdict of each
engine's last window is the live page's alarm (``pdserve_engine_kv_slow``). A slow handoff with
fast transfers is load, noted at INFO at most once per ``gateway.busy_log_interval_s`` per engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import aiohttp

from pdserve.gateway.engine_state import SAMPLE_PREFIXES as STATE_SAMPLES
from pdserve.gateway.engine_state import EngineState, parse_engine_state
from pdserve.gateway.handoffs import Handoffs, HandoffTally
from pdserve.gateway.metrics import EngineKVCollector
from pdserve.gateway_config import GatewaySpec
from pdserve.pd.slow_kv import KvBar
from pdserve.pd.transfer_stats import SAMPLE_PREFIXES as COUNTER_SAMPLES
from pdserve.pd.transfer_stats import TransferCounters, fetch_metrics_text, parse_counters
from pdserve.role import Role
from pdserve.routing.load import SAMPLE_PREFIXES as LOAD_SAMPLES
from pdserve.routing.load import parse_engine_load
from pdserve.routing.pool import Endpoint, Pool

log = logging.getLogger(__name__)
# Only the samples the three parsers read: the parser takes tens of ms for an engine's whole page
# (~50 KB), on the event loop that relays every token.
READ_PREFIXES = tuple(dict.fromkeys(COUNTER_SAMPLES + STATE_SAMPLES + LOAD_SAMPLES))


@dataclass(frozen=True, slots=True)
class Reading:
    """One read of a decode engine's /metrics: cumulative counters, scheduler gauges."""

    counters: TransferCounters = field(default_factory=TransferCounters)
    state: EngineState = field(default_factory=EngineState)


@dataclass(frozen=True, slots=True)
class BusySpell:
    """Slow handoffs to one engine that fast transfers explain, not yet logged."""

    handoffs: HandoffTally = field(default_factory=HandoffTally)
    transfers: TransferCounters = field(default_factory=TransferCounters)
    peak_waiting: float = 0.0
    peak_running: float = 0.0
    logged_s: float = -math.inf  # time.monotonic() of the last busy line


def select_samples(metrics_text: str, prefixes: tuple[str, ...]) -> str:
    """The sample lines of Prometheus text that start with one of ``prefixes``. Pure."""
    return "".join(line for line in metrics_text.splitlines(keepends=True) if line.startswith(prefixes))


def gateway_bar(spec: GatewaySpec) -> KvBar:
    """The bar the gateway judges each engine's transfers by: ``slow_kv_gbps``, allowing ``slow_kv_min_ms`` each."""
    return KvBar(gbps=spec.slow_kv_gbps, allowance_ms=spec.slow_kv_min_ms)


def check_window(url: str, window: TransferCounters, *, bar: KvBar) -> str | None:
    """A warning for one scrape window of one engine, or None when it looks fine. Pure.

    A few short prompts' KV (0.1 MB) moves at a low GB/s because each transfer costs a fixed
    latency: ``bar.allowance_ms`` a transfer is not blamed on the link (pd/slow_kv.py).
    """
    if window.failed > 0:
        return f"decode engine {url}: {window.failed:.0f} KV transfer(s) FAILED; run `pdserve verify`"
    if bar.is_slow(window):
        average_ms = window.seconds / window.transfers * 1000
        return (f"SLOW KV transfer path to decode engine {url}: {window.transfers:.0f} transfer(s), "
                f"{window.bytes / 1e6:.1f} MB at {window.gbps:.3g} GB/s, {average_ms:.0f} ms each, under "
                f"{bar.gbps:g} GB/s allowing {bar.allowance_ms:g} ms a transfer; run `pdserve verify`")
    return None


def check_transport(
    url: str, window: TransferCounters, *, slow_transfers: float, handoffs: HandoffTally, spec: GatewaySpec
) -> str | None:
    """The WARNING for one window when the engine's own transfers failed, were slow on average
    or one alone took longer than ``spec.slow_handoff_warn_s``; None otherwise. Pure."""
    warning = check_window(url, window, bar=gateway_bar(spec))
    if warning is None and slow_transfers > 0:
        warning = (f"SLOW KV transfer to decode engine {url}: {slow_transfers:.0f} transfer(s) alone took over "
                   f"{spec.slow_handoff_warn_s * 1000:.0f} ms; run `pdserve verify`")
    if warning is not None and handoffs.slow > 0:
        warning += f" ({_slow_handoffs(handoffs, slow_s=spec.slow_handoff_warn_s)})"
    return warning


def describe_busy(url: str, spell: BusySpell, *, slow_s: float) -> str:
    """The INFO line for slow handoffs that the engine's fast transfers do not explain. Pure."""
    count, seconds = spell.transfers.transfers, spell.transfers.seconds
    moved = (f"its own {count:.0f} KV transfer(s) took {seconds / count * 1000:.1f} ms on average" if count > 0
             else "it finished no KV transfer meanwhile")
    return (f"decode engine {url} busy: {_slow_handoffs(spell.handoffs, slow_s=slow_s)}, but {moved}: "
            f"the handoffs waited in the engine, load not transport "
            f"(waiting={spell.peak_waiting:.0f} running={spell.peak_running:.0f} at most when read)")


def _slow_handoffs(handoffs: HandoffTally, *, slow_s: float) -> str:
    return (f"{handoffs.slow} of {handoffs.count} handoff(s) took over {slow_s * 1000:.0f} ms from prefill done "
            f"to first decoded token, slowest {handoffs.slowest_s * 1000:.0f} ms")


class KVMonitor:
    """Per decode engine: its last reading and its unlogged busy spell; per engine: its load."""

    def __init__(self, *, spec: GatewaySpec, handoffs: Handoffs, collector: EngineKVCollector,
                 load_interval_s: float | None = None) -> None:
        """``load_interval_s``: how often every engine's load is read (default ``kv_scrape_interval_s``);
        the KV counters of one engine are judged at most every ``kv_scrape_interval_s``."""
        self._spec, self._handoffs, self._collector = spec, handoffs, collector
        self._load_interval_s = spec.kv_scrape_interval_s if load_interval_s is None else load_interval_s
        self._readings: dict[str, Reading] = {}
        self._spells: dict[str, BusySpell] = {}
        self._judged_s: dict[str, float] = {}  # time.monotonic() of each decode engine's last judged reading

    async def watch(self, session: aiohttp.ClientSession, pool: Pool) -> None:
        """Until cancelled: every ``load_interval_s`` read each healthy engine (all at once, so a slow
        one delays no other) and judge the decode engines due; then log the busy spells not logged yet."""
        try:
            while True:
                endpoints = pool.healthy(Role.PREFILL) + pool.healthy(Role.DECODE)
                await asyncio.gather(*(self._read(session, endpoint) for endpoint in endpoints))
                await asyncio.sleep(self._load_interval_s)
        finally:
            self.flush()

    async def _read(self, session: aiohttp.ClientSession, endpoint: Endpoint) -> None:
        try:
            text = await fetch_metrics_text(session, endpoint.url, timeout_s=self._spec.health_timeout_s)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("no metrics from %s: %s", endpoint.url, exc)
            return
        text, now_s = select_samples(text, READ_PREFIXES), time.monotonic()
        endpoint.take_load(parse_engine_load(text, read_s=now_s))
        if endpoint.role is Role.DECODE and now_s - self._judged_s.get(endpoint.url, -math.inf) >= (
                self._spec.kv_scrape_interval_s):
            self._judged_s[endpoint.url] = now_s
            reading = Reading(parse_counters(text),
                              parse_engine_state(text, slow_transfer_s=self._spec.slow_handoff_warn_s))
            self.judge(endpoint.url, reading, now_s=now_s)

    def flush(self) -> None:
        """Log every busy spell that holds a slow handoff, whatever the interval."""
        for url, spell in self._spells.items():
            if spell.handoffs.slow > 0:
                log.info("%s", describe_busy(url, spell, slow_s=self._spec.slow_handoff_warn_s))
        self._spells.clear()

    def judge(self, url: str, reading: Reading, *, now_s: float) -> None:
        """Judge the window since the engine's previous reading (since it started, the first time)."""
        previous = self._readings.get(url, Reading())
        self._readings[url] = reading
        self._collector.latest[url] = reading.counters
        window = reading.counters.since(previous.counters)
        handoffs = self._handoffs.take(
            url, transfer_s=window.seconds / window.transfers if window.transfers > 0 else None)
        slow_transfers = reading.state.slow_transfers - previous.state.slow_transfers
        warning = check_transport(url, window, slow_transfers=slow_transfers, handoffs=handoffs, spec=self._spec)
        self._collector.is_slow[url] = warning is not None
        if warning is not None:
            log.warning("%s", warning)
        else:
            self._note_busy(url, handoffs, window, reading.state, now_s=now_s)

    def _note_busy(self, url: str, handoffs: HandoffTally, window: TransferCounters, state: EngineState,
                   *, now_s: float) -> None:
        """Add this window to the engine's busy spell once it has a slow handoff; log the spell
        when the last line is ``busy_log_interval_s`` old, so no slow handoff goes unreported."""
        spell = self._spells.get(url, BusySpell())
        if spell.handoffs.slow > 0 or handoffs.slow > 0:
            spell = BusySpell(handoffs=spell.handoffs.plus(handoffs), transfers=spell.transfers.plus(window),
                              peak_waiting=max(spell.peak_waiting, state.waiting),
                              peak_running=max(spell.peak_running, state.running), logged_s=spell.logged_s)
        if spell.handoffs.slow > 0 and now_s - spell.logged_s >= self._spec.busy_log_interval_s:
            log.info("%s", describe_busy(url, spell, slow_s=self._spec.slow_handoff_warn_s))
            spell = BusySpell(logged_s=now_s)
        self._spells[url] = spell
