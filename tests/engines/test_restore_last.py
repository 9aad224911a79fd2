"""pdserve_vllm/restore_last.py: which hybrid decode requests load the whole prompt and undo their recompute of its
last token, and the blocks that recompute writes."""

from __future__ import annotations

from pdserve_vllm import RESTORE_LAST_KEY
from pdserve_vllm.restore_last import asks_restore_last, kept_blocks, restores

DECODE = {"do_remote_prefill": True, RESTORE_LAST_KEY: True}


def test_only_a_hybrids_decode_leg_that_asks_and_still_has_its_prompt_to_pull_restores() -> None:
    assert asks_restore_last(DECODE, has_mamba=True)
    assert not asks_restore_last(DECODE, has_mamba=False)
    assert not asks_restore_last({**DECODE, "do_remote_prefill": False}, has_mamba=True)  # pulled already
    assert not asks_restore_last({"do_remote_decode": True, RESTORE_LAST_KEY: True}, has_mamba=True)  # a prefill
    assert not asks_restore_last({"do_remote_prefill": True}, has_mamba=True)
    assert not asks_restore_last(None, has_mamba=True)


def test_the_recompute_keeps_each_running_state_block_and_the_attention_block_of_the_last_token() -> None:
    # full attention (group 0, 4 tokens a block) and two recurrent groups; 0 is vLLM's null block
    blocks = ([4, 5, 8], [0, 6, 9], [7])
    assert kept_blocks(blocks, num_prompt_tokens=9, state_groups=[1, 2], attention_block_sizes={0: 4}) == [
        (1, 9), (2, 7), (0, 8)]
    assert kept_blocks(blocks, num_prompt_tokens=8, state_groups=[1, 2], attention_block_sizes={0: 4})[-1] == (0, 5)


def test_a_prompt_whose_last_token_ends_or_starts_a_cached_state_block_is_not_restored() -> None:
    assert restores(300, state_block_size=256) and restores(511, state_block_size=256)
    assert not restores(512, state_block_size=256) and not restores(513, state_block_size=256)
    assert restores(512, state_block_size=None)  # states not cached by block
