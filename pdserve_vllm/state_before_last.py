"""Which prefill requests of a hybrid model sample the client's first token after the whole prompt and still hand
over the recurrent state after all but its last token, and the steps that takes. Pure: no vLLM, no torch;
hybrid_connector.py applies it inside the engine.

A chat's decode engine renders its prompt itself (n tokens), loads n - 1 of them with the state after n - 1 and
computes the last (whole_prompt.py says why vLLM has it so). Its prefill engine, where the request asks
(``STATE_BEFORE_LAST_KEY``), lets vLLM drop the last prompt token x as it does, then

1. computes the n - 1 tokens and outputs x (pdserve's logits processor forces it: ``FIRST_TOKEN_ARG``);
2. computes x at position n from the state after n - 1, as the decode engine will, and samples the first token T.

The worker keeps the recurrent state blocks of step 1 (``Plan.state_blocks``) over step 2's forward: copied
before it, written back after, so the blocks the decode engine pulls hold the state after n - 1. The reply names
the blocks of step 1 only (``Plan.step_one_blocks``): an attention block that step 2 added for position n would
be read where the decode engine has none. Its token ids are x and T, and ``STATE_BEFORE_LAST_KEPT_KEY`` says so;
a request that did not run these two steps as planned (preempted between them, so vLLM recomputed x inside a
prefill; or its output is not x and one more) says it false, and the gateway uses none of its handoff.

Engines that cannot plan it (no pdserve logits processor to force x, sliding-window or speculative state groups),
and prompts whose x may not lead (``dropped_token_may_lead``), get vLLM's own truncation and no key: the gateway
then has the decode engine's token first, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve_vllm import STATE_BEFORE_LAST_KEPT_KEY, STATE_BEFORE_LAST_KEY

BlockIds = tuple[list[int], ...]  # one list of block ids per KV cache group, as vLLM's scheduler has them


def asks_state_before_last(params: dict[str, Any] | None, *, has_mamba: bool, backoff: int | None) -> bool:
    """Whether a request with ``params`` (its kv_transfer_params) asks for the two steps and this engine can give
    them: a prefill for a remote decode engine of a model with recurrent layers, whose connector keeps exactly
    one prompt token off this engine (``backoff``, prefill_backoff in hybrid_connector.py)."""
    return (params is not None and params.get(STATE_BEFORE_LAST_KEY) is True and bool(params.get("do_remote_decode"))
            and has_mamba and backoff == 1)


def dropped_token_may_lead(token: int, *, stop_token_ids: set[int], num_prompt_tokens: int,
                           state_block_size: int | None) -> bool:
    """Whether the dropped prompt token may be this engine's first output: not one that would stop the request
    (``stop_token_ids``: EOS unless ignored, and the request's own), and, where recurrent states are cached by
    block (``state_block_size``, vLLM's align mode; None: not cached), not a prompt of ``num_prompt_tokens`` (the
    whole, n) that ends a block: step 2 would complete that block, vLLM would cache its state as the state after
    n, and writing back the state after n - 1 would poison the cache."""
    if token in stop_token_ids:
        return False
    return state_block_size is None or num_prompt_tokens % state_block_size != 0


@dataclass(slots=True)
class Plan:
    """One planned request, on the scheduler side. ``prompt_tokens``: n - 1, what vLLM left of the prompt."""

    prompt_tokens: int
    dropped_token: int  # x, the prompt's last token, to be the first output
    step_one_blocks: BlockIds = ()
    prefill_done: bool = False  # step 1 has been scheduled
    state_blocks: list[tuple[int, int]] = field(default_factory=list)  # (group, block) sent for step 2
    broken: bool = False  # the steps did not run as planned

    def allocated(self, block_ids: BlockIds) -> None:
        """The request's blocks when vLLM first allocated them (its first scheduled step)."""
        self.step_one_blocks = tuple(list(group) for group in block_ids)

    def scheduled(self, *, num_computed_tokens: int, num_scheduled_tokens: int, new_block_ids: BlockIds | None,
                  resumed: bool, state_groups: list[int]) -> list[tuple[int, int]]:
        """One scheduled step of the request (vLLM's figures before it runs); returns the (group, block) pairs
        whose recurrent state the worker keeps over this step's forward: step 2's, else none."""
        if self.broken:
            return []
        if self.prefill_done:
            if self.state_blocks or resumed or num_computed_tokens != self.prompt_tokens:
                self.broken = True  # recomputed after a preemption, or a third step
                return []
            self.state_blocks = [(group, _running(self.step_one_blocks[group])) for group in state_groups]
            return self.state_blocks
        if resumed and new_block_ids is not None:
            self.step_one_blocks = tuple(list(group) for group in new_block_ids)
        elif new_block_ids is not None:
            self.step_one_blocks = tuple([*old, *new] for old, new in zip(self.step_one_blocks, new_block_ids,
                                                                          strict=True))
        self.prefill_done = num_computed_tokens + num_scheduled_tokens >= self.prompt_tokens
        return []

    def finished(self, output_token_ids: list[int]) -> None:
        """The request's output when it finished: x then the first token, or the plan broke (an engine that did not
        force x, a stop after it)."""
        if len(output_token_ids) != 2 or output_token_ids[0] != self.dropped_token:
            self.broken = True

    @property
    def is_complete(self) -> bool:
        """Whether both steps ran as planned."""
        return bool(self.state_blocks) and not self.broken


def _running(blocks: list[int]) -> int:
    """The block of a recurrent group that holds the running state: the last one that is not vLLM's null block
    (id 0, the placeholder of a state no longer kept); speculative scratch slots are refused before this."""
    return next(block for block in reversed(blocks) if block != 0)


def mark_reply(plan: Plan, reply_params: dict[str, Any] | None,
               clipped_step_one_blocks: BlockIds) -> dict[str, Any] | None:
    """A finished planned request's reply kv_transfer_params: step 1's blocks (``clipped_step_one_blocks``,
    clipped as vLLM clips what it exchanges), n - 1 tokens, and ``STATE_BEFORE_LAST_KEPT_KEY``; where the steps
    did not run as planned that key is false (the gateway then uses none of it: pdserve/pd/prefill.py)."""
    if reply_params is None or not plan.prefill_done:
        return reply_params  # aborted before it ran: vLLM's reply of no handoff
    if not plan.is_complete:
        return {**reply_params, STATE_BEFORE_LAST_KEPT_KEY: False}
    return {**reply_params, "remote_block_ids": [list(group) for group in clipped_step_one_blocks],
            "remote_num_tokens": plan.prompt_tokens, STATE_BEFORE_LAST_KEPT_KEY: True}
