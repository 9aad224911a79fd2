"""Test-only faults in a KV handoff, each one a bug class that ships wrong answers with HTTP 200 (issue 57), for the
KV integrity check (kv_integrity.py) to catch. Imported only where an engine's environment names a fault file
(``KV_FAULT_ENV``, a pool's ``env`` in tests; pdserve never sets it); the file names the fault in force, read at each
handoff, so one test engine serves batches of each fault and none. Torch only: it changes blocks through kv_digest.py's
views.

- ``alter``: one block's bytes change after the prefill engine's digest (a bit flip or torn write in transit);
- ``stale``: a handed block holds another request's bytes (vllm#52234's stale block reference);
- ``short``: the pull ends with the last block not written (a partial pull; on the decode engine);
- ``state_step``: a hybrid's recurrent state is the one from before the prefill's last step.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(f"vllm.{__name__}")
Views = Mapping[int, list[torch.Tensor]]  # KV cache group -> its layers, indexed by block (kv_digest.block_views)
Blocks = Mapping[int, list[int]]  # KV cache group -> block ids
Kept = tuple[torch.Tensor, int, torch.Tensor]  # a layer's view, a block, that block's bytes as they were


class Fault(enum.Enum):
    ALTER = "alter"
    STALE = "stale"
    SHORT = "short"
    STATE_STEP = "state_step"


@dataclass(slots=True)
class FaultInjector:
    """One engine's injected faults (``path``: the file naming the one in force), with what a fault must remember
    between the steps of a handoff."""

    path: Path
    state_groups: frozenset[int]
    # group -> the last prefill's first block (``stale``): where it is not this prefill's, it holds another request's
    # bytes; else the block after this prefill's last does (in use by another request or left from one).
    _previous: dict[int, int] = field(default_factory=dict)
    _kept: dict[str, list[Kept]] = field(default_factory=dict)  # request id -> blocks to put back after a step

    def fault(self) -> Fault | None:
        """The fault the file names now; None while it is empty or absent. Raises ValueError on another word."""
        text = self.path.read_text().strip() if self.path.is_file() else ""
        return Fault(text) if text else None

    def before_prefill_step(self, request_id: str, views: Views, blocks: Blocks) -> None:
        """Before the forward that ends a prefill of ``blocks``: keep its state blocks as they are (``state_step``)."""
        if self.fault() is Fault.STATE_STEP:
            self._kept[request_id] = _last_blocks(views, blocks, self.state_groups)

    def after_prefill_digest(self, request_id: str, views: Views, blocks: Blocks) -> None:
        """After the prefill engine digested ``blocks``, before any pull: break them as the fault says."""
        fault = self.fault()
        if fault is Fault.STATE_STEP:
            self._put_back(request_id, "a recurrent state from the step before")
        elif fault is Fault.ALTER and (target := _first_block(blocks)):
            group, block = target
            views[group][0][block].add_(1)
            log.warning("pdserve fault injection: altered block %d of KV cache group %d", block, group)
        elif fault is Fault.STALE and (target := _first_block(blocks)):
            group, block = target
            source = self._previous.get(group)
            if source is None or source in blocks[group]:  # vLLM hands a freed block to the next request first
                source = (max(blocks[group]) + 1) % views[group][0].shape[0]
            for view in views[group]:
                view[block].copy_(view[source])
            log.warning("pdserve fault injection: block %d of group %d holds block %d's bytes", block, group, source)
            self._previous = {group: ids[0] for group, ids in blocks.items() if ids and ids[0]}

    def before_pull(self, request_id: str, views: Views, blocks: Blocks) -> None:
        """Before a decode engine's pull into ``blocks``: keep the last attention block as it is (``short``)."""
        if self.fault() is Fault.SHORT:
            self._kept[request_id] = _last_blocks(views, blocks, frozenset(views) - self.state_groups)

    def after_pull(self, request_id: str) -> None:
        """After the pull landed: undo its last block, as if those bytes never came (``short``)."""
        if self.fault() is Fault.SHORT:
            self._put_back(request_id, "a pull cut short of its last block")

    def _put_back(self, request_id: str, what: str) -> None:
        kept = self._kept.pop(request_id, [])
        for view, block, data in kept:
            view[block].copy_(data)
        if kept:
            log.warning("pdserve fault injection: %s (%d layer blocks)", what, len(kept))


def _last_blocks(views: Views, blocks: Blocks, groups: frozenset[int]) -> list[Kept]:
    """The last real block of each of ``groups`` in ``blocks``, in every layer of ``views``, copied."""
    last = {group: real[-1] for group, ids in blocks.items() if group in groups and (real := [b for b in ids if b])}
    return [(view, block, view[block].clone()) for group, block in last.items() for view in views.get(group, [])]


def _first_block(blocks: Blocks) -> tuple[int, int] | None:
    """The first group's first real block (not vLLM's null block 0)."""
    return next(((group, block) for group, ids in sorted(blocks.items()) for block in ids if block), None)
