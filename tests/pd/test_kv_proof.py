from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.pd import prefill
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.kv_proof import KvOutcome, RecomputeReason, judge, usage_of_events, usage_of_reply
from tests.conftest import free_port, serving


def test_cached_tokens_short_of_the_prefilled_ones_mean_the_prompt_was_computed_again() -> None:
    def usage(cached: int) -> dict[str, object]:
        return {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": cached}}

    assert judge(usage(40), prefilled_tokens=40) == (KvOutcome.PULLED, None)
    assert judge(usage(39), prefilled_tokens=40) == (KvOutcome.PULLED, None)  # its last token
    assert judge(usage(0), prefilled_tokens=40) == (KvOutcome.RECOMPUTED, RecomputeReason.PULL_FAILED)
    assert judge(usage(16), prefilled_tokens=40) == (KvOutcome.RECOMPUTED, RecomputeReason.PULL_SHORT)
    assert judge({"prompt_tokens": 40}, prefilled_tokens=40) == (KvOutcome.UNKNOWN, None)  # no details asked
    assert judge(None, prefilled_tokens=40) == (KvOutcome.UNKNOWN, None)


def test_usage_is_read_from_a_whole_reply_and_from_a_streams_usage_event() -> None:
    assert usage_of_reply(b'{"choices": [], "usage": {"prompt_tokens": 3}}') == {"prompt_tokens": 3}
    assert usage_of_reply(b"not json") is None
    chunk = b'data: {"choices":[{"text":"."}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n'
    assert usage_of_events(chunk) == {"prompt_tokens": 3}
    assert usage_of_events(b'data: {"choices":[{"text":"."}]}\n\n') is None


async def test_the_handoff_leaves_out_the_prefill_engines_cached_tokens() -> None:
    """vLLM 0.32 would report them as the decode engine's (v1/engine/output_processor.py), hiding a
    recompute; every decode body (with or without the prefill engine's token ahead) is built from the handoff."""
    reply = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 4},
             "kv_transfer_params": {"remote_block_ids": [1], "remote_prefill_cached_tokens": 0}}
    client = EngineClient(connect_timeout_s=1)
    async with serving(Starlette(routes=[Route("/v1/completions", lambda _request: JSONResponse(reply),
                                               methods=["POST"])]), free_port()) as url:
        kv = await prefill.run(client, url + "/v1/completions", {"model": "m", "prompt": "x"}, request_id="r",
                               timeout_s=5)
    client.close()
    assert dict(kv.fields) == {"remote_block_ids": [1]}
