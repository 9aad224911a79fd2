"""Which decode requests of a hybrid model load the prefill engine's whole prompt and undo their own recompute of
its last token, and the blocks that recompute must leave as they were. Pure: no vLLM, no torch; hybrid_connector.py
applies it inside the engine.

A decode engine given the client's first token as output (pdserve's logits processor: a chat, or a completion whose
fields span the first two tokens) has the client's own n prompt tokens, and vLLM's connector has it load n - 1 and
compute the last, x, from the recurrent state after n - 1 (whole_prompt.py says why): its prefill engine samples
after n - 1 tokens, no first token. Here both legs ask (``RESTORE_LAST_KEY``): the prefill engine computes the whole
prompt and samples the first token T in one step (whole_prompt.py), and the decode engine loads all n tokens. vLLM,
the prompt wholly loaded, recomputes x (``_update_waiting_for_remote_kv``, 0.26 and 0.32), a forward that steps the
recurrent state past n and writes x's KV from it. Its worker keeps the request's running state blocks and the
attention blocks that hold x over that forward and writes them back after it: the engine then holds the prefill
engine's state after n and its KV of x, its output is T (forced, whatever that step's logits), and the next step
computes T from there, as one engine does. No step more on either engine than vLLM's own handoff takes.

Where recurrent states are cached by block (vLLM's align mode), a prompt whose last token ends a block or starts one
is left short on the prefill engine (``restores``; the gateway has the decode engine's first token): there the state
after n is not in the block the recompute reads and writes (a prompt that ends one, run on the tiny hybrid, lost it).
"""

from __future__ import annotations

from typing import Any

from pdserve_vllm import RESTORE_LAST_KEY

BlockIds = tuple[list[int], ...]  # one list of block ids per KV cache group, as vLLM's scheduler has them


def asks_restore_last(params: dict[str, Any] | None, *, has_mamba: bool) -> bool:
    """Whether a decode request with ``params`` (its kv_transfer_params) loads the whole prompt and undoes its
    recompute of the last token: it asks, its prompt is still to be pulled, and the model has recurrent layers."""
    return (params is not None and params.get(RESTORE_LAST_KEY) is True and bool(params.get("do_remote_prefill"))
            and has_mamba)


def restores(num_prompt_tokens: int, *, state_block_size: int | None) -> bool:
    """Whether a prompt of ``num_prompt_tokens`` (n) is restored where recurrent states are cached by blocks of
    ``state_block_size`` tokens (None: not cached by block): unless n ends a block or starts one."""
    return state_block_size is None or num_prompt_tokens % state_block_size not in (0, 1)


def kept_blocks(block_ids: BlockIds, *, num_prompt_tokens: int, state_groups: list[int],
                attention_block_sizes: dict[int, int]) -> list[tuple[int, int]]:
    """The (group, block) pairs the recompute of a prompt's last token (position ``num_prompt_tokens``) writes, of a
    request with ``block_ids``: each recurrent group's running state block and, in each attention group
    (``attention_block_sizes``: its tokens per block), the block of that token."""
    last = num_prompt_tokens - 1
    states = [(group, _running(block_ids[group])) for group in state_groups]
    return states + [(group, block_ids[group][last // size]) for group, size in attention_block_sizes.items()]


def _running(blocks: list[int]) -> int:
    """The block of a recurrent group that holds the running state: the last one that is not vLLM's null block (id 0,
    the placeholder of a state no longer kept)."""
    return next(block for block in reversed(blocks) if block != 0)
