"""Runs inside every engine pdserve launches, loaded as its KV connector module (``kv_connector_module_path``):
vLLM's own NixlConnector, whose NIXL agent's progress thread pauses between rounds, whose handshake side channel
answers only peers holding the engine key (side_channel.py, installed on import), and which refuses to start
without that key.

NIXL's Python API starts the agent's progress thread with no pause (``pthrDelay`` 0), so each
engine keeps one core busy in system calls even while no KV moves: two idle CPU engines filled
both cores of a 2-core host. With a pause of ``PROGRESS_DELAY_ENV`` microseconds between rounds
that thread is near idle (docs/transport.md, section 6).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from pdserve_vllm.contract import Hook
from pdserve_vllm.contract_check import require

# Before vLLM's imports: a release without these names is refused by name (contract.py).
require(Hook.NIXL_PROGRESS, Hook.SIDE_CHANNEL)

# vLLM resolves the connector class by its name in this module; importing it first also lets
# vLLM set UCX's environment before NIXL loads, as it does without this module.
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as VllmNixlConnector
from vllm.distributed.nixl_utils import NixlWrapper

from pdserve_vllm import PROGRESS_DELAY_ENV, pause_progress_thread, read_engine_key, side_channel

__all__ = ["NixlConnector"]
log = logging.getLogger(f"vllm.{__name__}")  # vLLM prints its own logger tree to the engine log


def _install() -> None:
    delay_us = int(os.environ.get(PROGRESS_DELAY_ENV, "0"))
    if delay_us <= 0:
        return
    bindings = getattr(importlib.import_module(NixlWrapper.__module__), "nixlBind", None) if NixlWrapper else None
    if not hasattr(bindings, "nixlAgent"):
        log.warning("%s=%d not applied: this NIXL's Python API has no nixlBind.nixlAgent; its progress "
                    "thread spins a core", PROGRESS_DELAY_ENV, delay_us)
        return
    pause_progress_thread(bindings, delay_us)
    log.info("NIXL progress thread pauses %d us between rounds (%s)", delay_us, PROGRESS_DELAY_ENV)


class NixlConnector(VllmNixlConnector):
    """vLLM's NixlConnector, made only where the engine key is set: its side channel, keyed from it, would
    otherwise fail in its listener's thread, which vLLM's scheduler waits on with no timeout."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        read_engine_key(os.environ)
        super().__init__(vllm_config, role, kv_cache_config)


_install()
side_channel.install()
