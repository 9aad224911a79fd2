from __future__ import annotations

from pdserve.pd import decode, prefill
from pdserve.pd.kv import KVTransferParams
from pdserve_vllm import RESTORE_LAST_KEY, WHOLE_PROMPT_KEPT_KEY, WHOLE_PROMPT_KEY


def test_prefill_body_is_one_unstreamed_token_that_keeps_kv_for_remote_decode() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 5, "max_completion_tokens": 50, "temperature": 0.3}
    shaped = prefill.make_body(body, connector="NixlConnector")
    assert shaped["max_tokens"] == 1 and shaped["stream"] is False and shaped["temperature"] == 0.3
    assert not {"stream_options", "max_completion_tokens"} & set(shaped)
    assert shaped["min_tokens"] == 1  # the one token may not end the reply where one engine's could not
    assert shaped["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # pure


def test_a_prefill_leg_asks_for_the_whole_prompt_only_when_told() -> None:
    body = {"model": "m", "prompt": "p", "stream": True}
    assert WHOLE_PROMPT_KEY not in prefill.make_body(body, connector="NixlConnector", wants_first_token=True)[
        "kv_transfer_params"]
    shaped = prefill.make_body(body, connector="NixlConnector", wants_first_token=True, wants_whole_prompt=True)
    assert shaped["kv_transfer_params"][WHOLE_PROMPT_KEY] is True
    assert WHOLE_PROMPT_KEY not in prefill.make_body(body, connector="NixlConnector")["kv_transfer_params"]  # pure


def test_a_prefill_for_a_decode_engine_given_the_token_as_output_asks_for_the_whole_prompt_to_be_restored() -> None:
    body = {"model": "m", "messages": [], "stream": True}
    assert RESTORE_LAST_KEY not in prefill.make_body(body, connector="NixlConnector", wants_whole_prompt=True)[
        "kv_transfer_params"]
    shaped = prefill.make_body(body, connector="NixlConnector", wants_first_token=True, wants_whole_prompt=True,
                               wants_restore_last=True)
    assert shaped["kv_transfer_params"][RESTORE_LAST_KEY] is shaped["kv_transfer_params"][WHOLE_PROMPT_KEY] is True
    assert "logprobs" not in shaped


def test_decode_body_is_the_original_plus_prefill_kv_params() -> None:
    kv = KVTransferParams(fields={"remote_block_ids": [[1, 2], [3]], "remote_engine_id": "e"}, prompt_tokens=9)
    body = {"model": "m", "prompt": "p", "stream": True}
    assert decode.make_body(body, kv) == {**body, "kv_transfer_params": dict(kv.fields)}
    assert kv.block_count == 3


def test_a_handoff_given_back_passes_vllms_request_validation_and_names_no_served_model() -> None:
    """vLLM frees the prefill engine's blocks only for a request its handler refuses: a body that
    fails validation first (an empty prompt did) never reaches the clean-up."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    kv = KVTransferParams(fields={"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e"},
                          prompt_tokens=9)
    request = CompletionRequest(**decode.make_release_body(kv))
    assert request.model == decode.RELEASE_MODEL and request.kv_transfer_params == dict(kv.fields)


def test_a_forced_decode_leg_asks_its_engine_to_undo_the_last_tokens_recompute_only_after_a_whole_prompt() -> None:
    fields = {"remote_block_ids": [[1, 2], [3]], "remote_num_tokens": 9}
    assert KVTransferParams(fields=fields, prompt_tokens=9).fields_for_forced() == fields
    whole = KVTransferParams(fields={**fields, WHOLE_PROMPT_KEPT_KEY: True}, prompt_tokens=9)
    assert whole.fields_for_forced() == {**whole.fields, RESTORE_LAST_KEY: True}
    assert RESTORE_LAST_KEY not in whole.fields  # pure
