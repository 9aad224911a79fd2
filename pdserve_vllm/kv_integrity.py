"""The per-request KV integrity check of a handoff, inside both engines (issue 57). The prefill engine digests each
block it hands over after the forward that wrote it and puts the digests in its reply's ``kv_transfer_params``
(``KV_DIGEST_KEY``); the decode engine digests the blocks its pull wrote and, on any difference, reports that pull
failed, so vLLM computes the prompt itself (``kv_load_failure_policy: recompute``) before any token. nixl_progress.py's
connector calls the two halves below; docs/architecture.md ("KV integrity") says why this shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve_vllm.contract import Hook
from pdserve_vllm.contract_check import require

require(Hook.KV_INTEGRITY)  # before vLLM's imports: a release without these names is refused by name (contract.py)

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.kv_cache_interface import MambaSpec

from pdserve_vllm import KV_DIGEST_KEY
from pdserve_vllm.kv_digest import block_views, digest_blocks

if TYPE_CHECKING:
    from pdserve_vllm.fault_injection import FaultInjector

log = logging.getLogger(f"vllm.{__name__}")
# Attributes pdserve adds to vLLM's connector metadata, which vLLM hands to the workers as it is (pickled).
DIGEST_REQUESTS_ATTR = "pdserve_digest_requests"  # prefill request -> its block ids per group, ending this step
EXPECTED_ATTR = "pdserve_expected_digests"  # decode request -> the prefill engine's digests of what it pulls
Views = dict[int, list[torch.Tensor]]  # KV cache group -> its layers, indexed by block
Digests = dict[int, dict[int, int]]  # KV cache group -> block id -> digest


class DigestReport(KVConnectorWorkerMetadata):
    """A step's digests, worker to scheduler: request id -> tensor-parallel rank -> its blocks' digests."""

    def __init__(self, digests: dict[str, dict[int, Digests]]) -> None:
        self.digests = digests

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, DigestReport)
        merged = {request: dict(ranks) for request, ranks in self.digests.items()}
        for request, ranks in other.digests.items():
            merged.setdefault(request, {}).update(ranks)
        return DigestReport(merged)


def cache_views(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> Views:
    """Every KV cache group's layers, indexed by logical block (kv_digest.block_views). Raises ValueError on a layout
    kv_digest.py cannot index."""
    groups = kv_cache_config.kv_cache_groups
    return block_views(kv_caches, groups={index: group.layer_names for index, group in enumerate(groups)},
                       state_pages={index: (group.kv_cache_spec.page_size_bytes, _state_bytes(group.kv_cache_spec))
                                    for index, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec)},
                       num_blocks=kv_cache_config.num_blocks)


def _state_bytes(spec: Any) -> int:
    """The bytes of a recurrent state (conv and SSM) at the start of its page, which vLLM pads to an attention page's
    size (its ``real_page_size_bytes`` from 0.30 on, computed as it computes it)."""
    return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
               for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))


def state_groups(kv_cache_config: Any) -> frozenset[int]:
    """The KV cache groups of recurrent layers."""
    return frozenset(index for index, group in enumerate(kv_cache_config.kv_cache_groups)
                     if isinstance(group.kv_cache_spec, MambaSpec))


def worker_checks(worker: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any, *,
                  fault_file: str) -> WorkerChecks | None:
    """The checks of NIXL worker ``worker`` over its registered ``kv_caches``, digesting what NIXL reads (the host
    buffer where KV is staged there) and checking what the model reads; None (logged: every handoff of this engine
    goes unchecked) on a layout kv_digest.py cannot index. ``fault_file``: a test's fault file (fault_injection.py),
    or ''."""
    try:
        received = cache_views(kv_caches, kv_cache_config)
        sent = cache_views(worker.host_xfer_buffers, kv_cache_config) if worker.use_host_buffer else received
    except ValueError as exc:
        log.warning("pdserve: this engine's KV handoffs go unchecked: %s", exc)
        return None
    return WorkerChecks(rank=worker.tp_rank, sent=sent, received=received,
                        fault=_fault(fault_file, state_groups(kv_cache_config)))


def _fault(path: str, states: frozenset[int]) -> FaultInjector | None:
    """A test's fault injector; fault_injection.py is never imported unless a test names a fault file."""
    if not path:
        return None
    from pdserve_vllm.fault_injection import FaultInjector

    log.warning("pdserve: TEST FAULT INJECTION ON: this engine's KV handoffs get the fault %s names", path)
    return FaultInjector(Path(path), state_groups=states)


class SchedulerChecks:
    """The scheduler side: which prefills end in a step, the digests a decode request expects, and the prefill
    replies that wait for their step's digests (vLLM's scheduler finishes a request, calling ``request_finished``,
    before it hands the connector that step's worker output: v1/core/sched/scheduler.py, update_from_output)."""

    def __init__(self) -> None:
        self._prefills: dict[str, Any] = {}  # request id -> a prefill request (do_remote_decode) not yet computed
        self._expected: dict[str, Any] = {}  # request id -> the digests its pull is to match
        self._held: dict[str, dict[str, Any]] = {}  # request id -> its reply's kv_transfer_params, this step

    def note(self, request: Any) -> None:
        """A request got its blocks (``update_state_after_alloc``): remember a prefill, or a pull's digests."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._prefills[request.request_id] = request
        elif params.get("do_remote_prefill") and KV_DIGEST_KEY in params:
            self._expected[request.request_id] = params[KV_DIGEST_KEY]

    def ending(self, num_scheduled_tokens: Mapping[str, int],
               block_ids_of: Callable[[str], Sequence[Sequence[int]]]) -> dict[str, list[list[int]]]:
        """The prefills whose prompt this step finishes computing, with their block ids per group."""
        ending = {request_id: [list(group) for group in block_ids_of(request_id)]
                  for request_id, request in self._prefills.items() if (count := num_scheduled_tokens.get(request_id))
                  and request.num_computed_tokens + count >= request.num_prompt_tokens}
        for request_id in ending:
            del self._prefills[request_id]
        return ending

    def expected(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """The digests each pull of ``request_ids`` (this step's) is to match, where its handoff carries them."""
        return {request_id: self._expected.pop(request_id) for request_id in request_ids
                if request_id in self._expected}

    def hold(self, request_id: str, params: dict[str, Any] | None) -> None:
        """A finished request's reply ``params``: a prefill's waits for this step's digests (``fill``)."""
        self._prefills.pop(request_id, None)
        self._expected.pop(request_id, None)
        if params and params.get("do_remote_prefill") and params.get("remote_block_ids"):
            self._held[request_id] = params

    def fill(self, report: Any) -> None:
        """Put this step's digests (a DigestReport, or None) into the replies held since ``request_finished``; a reply
        with none goes without, and its decode engine checks nothing (kv_proof.py counts it unchecked)."""
        digests = report.digests if isinstance(report, DigestReport) else {}
        for request_id, params in self._held.items():
            if ranks := digests.get(request_id):
                params[KV_DIGEST_KEY] = {"ranks": {str(rank): [[by_block.get(group, {}).get(block) for block in ids]
                                                               for group, ids in enumerate(params["remote_block_ids"])]
                                                   for rank, by_block in ranks.items()}}
        self._held.clear()


class WorkerChecks:
    """The worker side: digest the prefills a step ends, after its forward and any copy out to a host buffer; check
    each pull once it landed, after any copy in."""

    def __init__(self, *, rank: int, sent: Views, received: Views, fault: FaultInjector | None) -> None:
        self._rank, self._sent, self._received, self._fault = rank, sent, received, fault
        self._ending: dict[str, list[list[int]]] = {}
        self._digests: dict[str, dict[int, Digests]] = {}
        self._pulls: dict[str, tuple[Any, list[list[int]]]] = {}  # request id -> (expected digests, its blocks)
        self.mismatches = 0

    def bind(self, metadata: Any) -> None:
        """A step's connector metadata, before its forward."""
        self._ending = dict(getattr(metadata, DIGEST_REQUESTS_ATTR, {}))
        expected = getattr(metadata, EXPECTED_ATTR, {})
        for request_id, req_meta in metadata.reqs_to_recv.items():
            if request_id in expected:
                self._pulls[request_id] = (expected[request_id], [list(group) for group in req_meta.local_block_ids])
                if self._fault is not None:
                    self._fault.before_pull(request_id, self._received, dict(enumerate(self._pulls[request_id][1])))
        if self._fault is not None:
            for request_id, blocks in self._ending.items():
                self._fault.before_prefill_step(request_id, self._sent, dict(enumerate(blocks)))

    def after_save(self) -> None:
        """After the forward (and the copy out): digest the prefills it ended."""
        for request_id, blocks in self._ending.items():
            self._digests[request_id] = {self._rank: {
                group: dict(zip(ids, digest_blocks(self._sent[group], ids), strict=True))
                for group, ids in enumerate(blocks) if group in self._sent}}
            if self._fault is not None:
                self._fault.after_prefill_digest(request_id, self._sent, dict(enumerate(blocks)))
        self._ending = {}

    def report(self) -> DigestReport | None:
        """The digests since the last report, for the scheduler side."""
        digests, self._digests = self._digests, {}
        return DigestReport(digests) if digests else None

    def check(self, finished: set[str], failed: set[str]) -> None:
        """Check each pull in ``finished`` (landed, copied in); add those whose blocks differ to ``failed``, which
        vLLM then computes again (v1/core/sched/scheduler.py, _handle_failed_recving)."""
        for request_id in finished:
            pull = self._pulls.pop(request_id, None)
            if pull is None or request_id in failed:
                continue
            if self._fault is not None:
                self._fault.after_pull(request_id)
            differences = self._differences(*pull)
            if differences:
                self.mismatches += 1
                failed.add(request_id)
                log.warning("pdserve: KV INTEGRITY MISMATCH request_id=%s: the pulled blocks differ from the prefill "
                            "engine's digests (%s); the prompt is computed here again (%d so far)", request_id,
                            "; ".join(differences[:4]), self.mismatches)
            elif differences is None:
                log.info("pdserve: KV integrity unchecked request_id=%s: no digests for rank %d", request_id,
                         self._rank)

    def _differences(self, expected: Any, local_block_ids: list[list[int]]) -> list[str] | None:
        """Where the pulled blocks differ from the digests, one line each; None: no digests for this rank."""
        mine = (expected.get("ranks") or {}).get(str(self._rank)) if isinstance(expected, dict) else None
        if not isinstance(mine, list):
            return None
        if len(mine) < len(local_block_ids):
            return [f"{len(local_block_ids)} KV cache groups pulled, digests for {len(mine)}"]
        differences = []
        for group, local in enumerate(local_block_ids):
            pairs = [(block, want) for block, want in _paired(local, mine[group]) if block and want is not None]
            got = digest_blocks(self._received.get(group, []), [block for block, _ in pairs])
            differences += [f"group {group} block {block} of {local}" for (block, want), digest
                            in zip(pairs, got, strict=True) if digest != want]
        return differences


def _paired(local: list[int], remote: list[Any]) -> list[tuple[int, Any]]:
    """Each block a pull wrote with the prefill engine's digest of the block it came from, as vLLM pairs them
    (base_worker._apply_prefix_caching): a prefix this engine had cached is not pulled, so fewer local blocks line up
    with the end of the prefill engine's; more local blocks hold tokens this engine computes itself (the token after
    a prompt that ends a block), so the first ones line up."""
    if len(local) <= len(remote):
        return list(zip(local, remote[len(remote) - len(local):], strict=True))
    return list(zip(local[:len(remote)], remote, strict=True))
