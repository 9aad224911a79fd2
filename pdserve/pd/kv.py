"""KV transfer parameters as they travel between the two legs; connector quirks kept as data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pdserve.pd.first_token import FirstToken

# What the prefill leg sends so the engine keeps the KV cache for a remote decode engine.
REMOTE_DECODE_REQUEST: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "NixlConnector": MappingProxyType(
            {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
        ),
    }
)


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """The prefill engine's ``kv_transfer_params``: opaque to us, passed to the decode leg."""

    fields: Mapping[str, Any]
    prompt_tokens: int
    prefill_url: str = ""  # the prefill engine holding the blocks (set by the orchestrator; not sent)
    block_size: int = 0  # tokens per KV block of that engine, from its /metrics; 0: not read yet
    first: FirstToken | None = None  # the prefill engine's token, when the client is to get it (first_token.py)

    @property
    def block_count(self) -> int:
        block_ids = self.fields.get("remote_block_ids") or []
        # vLLM sends one list per KV cache group in newer versions, a flat list in older ones.
        if block_ids and isinstance(block_ids[0], list):
            return sum(len(group) for group in block_ids)
        return len(block_ids)
