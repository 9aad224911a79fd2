"""The one rule by which KV transfers are slow: the gateway's warning and the live page's alarm
(gateway/kv_monitor.py, exported as ``pdserve_engine_kv_slow``) and `pdserve verify` (verify/checks.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.pd.transfer_stats import TransferCounters


@dataclass(frozen=True, slots=True)
class KvBar:
    """A bar for KV transfers. ``allowance_ms`` is what one transfer may take beyond its bytes at ``gbps``
    unblamed on the link: a fixed cost per transfer (the decode engine sees a transfer end only when it
    next polls NIXL, between its steps), which is most of a small transfer's time whatever the link."""

    gbps: float
    allowance_ms: float

    def is_slow(self, window: TransferCounters) -> bool:
        """The window's transfers took longer than their bytes take at ``gbps``, plus ``allowance_ms`` each. Pure."""
        return window.transfers > 0 and window.seconds > (
            window.bytes / (self.gbps * 1e9) + self.allowance_ms / 1000 * window.transfers)
