"""KV transfer parameters as they travel between the two legs; connector quirks kept as data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pdserve.pd.first_token import FirstToken, Reason
from pdserve_vllm import RESTORE_LAST_KEY, WHOLE_PROMPT_KEPT_KEY

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
    # The prefill engine's token, when the client is to get it (first_token.py), or why its reply cannot give it.
    first: FirstToken | Reason | None = None

    @property
    def is_grouped(self) -> bool:
        """vLLM sends ``remote_block_ids`` as one list per KV cache group in newer versions, a flat list in older ones."""
        block_ids = self.fields.get("remote_block_ids") or []
        return bool(block_ids) and isinstance(block_ids[0], list)

    @property
    def block_groups(self) -> list[list[Any]]:
        """The prefill engine's block ids, one list per KV cache group."""
        block_ids = list(self.fields.get("remote_block_ids") or [])
        return block_ids if self.is_grouped else [block_ids]

    @property
    def is_whole_prompt(self) -> bool:
        """A hybrid model's prefill engine computed the whole prompt, where vLLM's connector leaves the last token to
        the decode engine (pdserve_vllm/whole_prompt.py): only a decode prompt one token longer lines up with it."""
        return self.fields.get(WHOLE_PROMPT_KEPT_KEY) is True

    @property
    def block_count(self) -> int:
        return sum(len(group) for group in self.block_groups)

    def fields_for_forced(self) -> dict[str, Any]:
        """These fields for a decode leg of the client's own prompt that is given the first token as output: a
        hybrid's whole-prompt handoff asks that engine to undo its recompute of the prompt's last token
        (pdserve_vllm/restore_last.py)."""
        return {**self.fields, RESTORE_LAST_KEY: True} if self.is_whole_prompt else dict(self.fields)

    def fields_for_prompt(self, prompt_tokens: int) -> dict[str, Any] | None:
        """These fields for a decode prompt of ``prompt_tokens``: the prefilled prompt plus tokens the
        decode engine computes itself (pd/first_token.py); None when the blocks cannot be mapped (an
        unknown block size, several KV cache groups, a prompt they do not fit).

        vLLM's NixlConnector asserts that it reads no more blocks than the prefill engine sent; where the
        extra token starts a block of its own, the last block is named twice, so the extra local block
        gets a copy whose only used slot the decode engine overwrites when it computes that token.

        A hybrid's whole-prompt handoff (``is_whole_prompt``) maps as it is onto a prompt one token longer: the decode
        engine loads all but its prompt's last token (``_get_remote_prefill_token_count``, vLLM 0.26 and 0.32), the
        whole prefilled prompt, in the blocks that hold it, and computes the token from the state after it.
        """
        if self.is_whole_prompt:
            prefilled = self.fields.get("remote_num_tokens")
            return dict(self.fields) if prefilled is not None and int(prefilled) == prompt_tokens - 1 else None
        groups = self.block_groups
        if self.block_size <= 0 or len(groups) != 1 or not groups[0]:
            return None
        (group,) = groups
        needed = -(-prompt_tokens // self.block_size)
        if needed not in (len(group), len(group) + 1):
            return None
        padded = group + [group[-1]] * (needed - len(group))
        return {**self.fields, "remote_block_ids": [padded] if self.is_grouped else padded}
