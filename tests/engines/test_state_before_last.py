"""pdserve_vllm/state_before_last.py: which hybrid prefills sample after the whole prompt and hand over the state
before its last token, the step whose recurrent state the worker keeps, and the reply that says so."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_vllm import STATE_BEFORE_LAST_KEPT_KEY, STATE_BEFORE_LAST_KEY
from pdserve_vllm.state_before_last import Plan, asks_state_before_last, dropped_token_may_lead, mark_reply

PREFILL = {"do_remote_decode": True, STATE_BEFORE_LAST_KEY: True}
# Three groups as a Qwen3-Next has them: full attention (group 0) and two of recurrent state; 0 is vLLM's null block.
STEP_ONE = ([4, 5], [0, 6], [7])
STATE_GROUPS = [1, 2]


def test_only_a_hybrids_prefill_that_asks_and_whose_connector_drops_one_token_is_planned() -> None:
    assert asks_state_before_last(PREFILL, has_mamba=True, backoff=1)
    assert not asks_state_before_last({**PREFILL, STATE_BEFORE_LAST_KEY: False}, has_mamba=True, backoff=1)
    assert not asks_state_before_last({STATE_BEFORE_LAST_KEY: True}, has_mamba=True, backoff=1)  # no prefill
    assert not asks_state_before_last(PREFILL, has_mamba=False, backoff=0)
    assert not asks_state_before_last(PREFILL, has_mamba=True, backoff=3)  # a speculative lookahead kept off too
    assert not asks_state_before_last(PREFILL, has_mamba=True, backoff=None)


def test_a_dropped_token_that_would_stop_the_request_or_complete_a_cached_state_block_may_not_lead() -> None:
    assert dropped_token_may_lead(9, stop_token_ids={2}, num_prompt_tokens=300, state_block_size=256)
    assert not dropped_token_may_lead(2, stop_token_ids={2}, num_prompt_tokens=300, state_block_size=256)
    assert not dropped_token_may_lead(9, stop_token_ids=set(), num_prompt_tokens=512, state_block_size=256)
    assert dropped_token_may_lead(9, stop_token_ids=set(), num_prompt_tokens=512, state_block_size=None)


def planned(prompt_tokens: int = 300) -> Plan:
    plan = Plan(prompt_tokens=prompt_tokens, dropped_token=15)
    plan.allocated(STEP_ONE)
    return plan


def step(plan: Plan, computed: int, scheduled: int, *, new: Any = None, resumed: bool = False) -> list[tuple[int, int]]:
    return plan.scheduled(num_computed_tokens=computed, num_scheduled_tokens=scheduled, new_block_ids=new,
                          resumed=resumed, state_groups=STATE_GROUPS)


def test_the_step_after_the_prefill_keeps_the_running_state_blocks_of_step_one() -> None:
    plan = planned()
    assert step(plan, 0, 200) == []  # a first chunk
    assert step(plan, 200, 100, new=([8], [9], [])) == []  # the prefill's last chunk
    assert step(plan, 300, 1, new=([10], [11], [])) == [(1, 9), (2, 7)]  # step 2: the state after n - 1
    plan.finished([15, 42])
    assert plan.is_complete and plan.step_one_blocks == ([4, 5, 8], [0, 6, 9], [7])


@pytest.mark.parametrize("output", [[16, 42], [15]], ids=["not forced", "stopped after it"])
def test_an_output_that_does_not_start_with_the_dropped_token_and_one_more_breaks_the_plan(output: list[int]) -> None:
    plan = planned()
    step(plan, 0, 300)
    step(plan, 300, 1)
    plan.finished(output)
    assert not plan.is_complete


@pytest.mark.parametrize("after_prefill", [
    {"computed": 0, "scheduled": 301, "resumed": True},  # preempted: vLLM recomputes x inside a prefill
    {"computed": 301, "scheduled": 1, "resumed": False},  # a step after step 2's position
], ids=["recomputed", "other step"])
def test_steps_that_do_not_run_as_planned_break_the_plan_and_the_reply_says_so(after_prefill: dict[str, Any]) -> None:
    plan = planned()
    step(plan, 0, 300)
    assert step(plan, after_prefill["computed"], after_prefill["scheduled"], resumed=after_prefill["resumed"]) == []
    assert not plan.is_complete
    assert mark_reply(plan, {"remote_num_tokens": 301}, STEP_ONE) == {"remote_num_tokens": 301,
                                                                     STATE_BEFORE_LAST_KEPT_KEY: False}


def test_the_reply_of_a_completed_plan_names_step_ones_blocks_and_the_prompt_less_its_last_token() -> None:
    plan = planned()
    step(plan, 0, 300)
    step(plan, 300, 1, new=([10], [], []))
    plan.finished([15, 42])
    reply = mark_reply(plan, {"remote_block_ids": [[4, 5, 10], [6], [7]], "remote_num_tokens": 301,
                              "remote_engine_id": "p"}, ([4, 5], [6], [7]))
    assert reply == {"remote_block_ids": [[4, 5], [6], [7]], "remote_num_tokens": 300, "remote_engine_id": "p",
                     STATE_BEFORE_LAST_KEPT_KEY: True}


def test_a_request_aborted_before_its_prefill_ran_keeps_vllms_reply() -> None:
    assert mark_reply(planned(), {"remote_block_ids": []}, STEP_ONE) == {"remote_block_ids": []}
