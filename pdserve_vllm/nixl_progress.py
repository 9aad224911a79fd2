"""Runs inside every engine pdserve launches, loaded as its KV connector module (``kv_connector_module_path``):
vLLM's own NixlConnector, whose NIXL agent's progress thread pauses between rounds, whose handshake side channel
answers only peers holding the engine key (side_channel.py, installed on import), which refuses to start
without that key, and which checks each handoff's KV against the prefill engine's digests (kv_integrity.py).

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

from pdserve_vllm import KV_FAULT_ENV, PROGRESS_DELAY_ENV, pause_progress_thread, read_engine_key, side_channel
from pdserve_vllm.kv_integrity import SchedulerChecks, WorkerChecks, worker_checks

__all__ = ["NixlConnector"]
log = logging.getLogger(f"vllm.{__name__}")  # vLLM prints its own logger tree to the engine log
# vLLM 0.29 reports no failed pull by request (KVConnectorTransferResults, 0.30): there the KV goes unchecked, and its
# replies carry no digests, so the gateway counts them unchecked.
CHECKS_KV = hasattr(VllmNixlConnector, "get_transfer_results")


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
        self._kv_cache_config = kv_cache_config
        self._scheduler_checks = SchedulerChecks() if CHECKS_KV and self.connector_scheduler is not None else None
        self._worker_checks: WorkerChecks | None = None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler_checks is not None:  # before vLLM's, which clears a pull's do_remote_prefill
            self._scheduler_checks.note(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta: Any = super().build_connector_meta(scheduler_output)  # vLLM's NixlConnectorMetadata
        checks, manager = self._scheduler_checks, self._kv_cache_manager
        if checks is not None and manager is not None:
            meta.pdserve_digest_requests = checks.ending(scheduler_output.num_scheduled_tokens, manager.get_block_ids)
            meta.pdserve_expected_digests = checks.expected(list(meta.reqs_to_recv))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, self._finished(request, params)

    def request_finished_all_groups(  # vLLM's scheduler calls this one for a hybrid (SupportsHMA)
            self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, self._finished(request, params)

    def _finished(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """A finished request's reply params, as the engine sends them; a prefill's wait for its step's digests."""
        if self._scheduler_checks is not None:
            self._scheduler_checks.hold(request.request_id, params)
        return params

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._scheduler_checks is not None:
            self._scheduler_checks.fill(connector_output.kv_connector_worker_meta)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if CHECKS_KV and self.connector_worker is not None:
            self._worker_checks = worker_checks(self.connector_worker, kv_caches, self._kv_cache_config,
                                                fault_file=os.environ.get(KV_FAULT_ENV, ""))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker_checks is not None:
            self._worker_checks.bind(connector_metadata)

    def wait_for_save(self) -> None:
        super().wait_for_save()  # type: ignore[no-untyped-call]
        if self._worker_checks is not None:  # after any copy out to the host buffer NIXL reads
            self._worker_checks.after_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._worker_checks is not None:  # after any copy in from the host buffer
            self._worker_checks.check(results.finished_recving, results.failed_recving)
        return results

    def build_connector_worker_meta(self) -> Any:
        report = self._worker_checks.report() if self._worker_checks is not None else None
        return report if report is not None else super().build_connector_worker_meta()


_install()
side_channel.install()
