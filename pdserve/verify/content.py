"""The content check of one prefill/decode pair: one handoff through both engines, and what the decode engine's KV
integrity check (pdserve_vllm/kv_integrity.py) made of it, read as the gateway reads it (pd/kv_proof.py). I/O only."""

from __future__ import annotations

from typing import Any

from pdserve.pd import decode, kv_proof, prefill
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.kv_proof import IntegrityResult
from pdserve.pd.pair import COMPLETIONS
from pdserve.verify.probe import probe_token_ids

CONTENT_PROMPT_TOKENS = 200  # a few blocks at any block size: every one is digested and checked


async def check_content(client: EngineClient, *, prefill_url: str, decode_url: str, model: str, connector: str,
                        seed: int, timeout_s: float) -> IntegrityResult:
    """One greedy handoff of a new prompt (``seed``) from ``prefill_url`` to ``decode_url``: ``ok`` where the prefill
    engine sent digests and the decode engine used the KV it checked against them, ``recomputed`` where it computed
    the prompt instead (a mismatch, or a failed pull), ``unchecked`` where no digests came. Raises LegFailed."""
    body: dict[str, Any] = {"model": model, "prompt": probe_token_ids(CONTENT_PROMPT_TOKENS, seed=seed),
                            "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    request_id = f"pdserve-verify-content-{seed}"
    kv = await prefill.run(client, prefill_url + COMPLETIONS, prefill.make_body(body, connector=connector),
                           request_id=request_id, timeout_s=timeout_s)
    reply = await decode.open_stream(client, decode_url + COMPLETIONS, decode.make_body(body, kv),
                                     request_id=request_id, timeout_s=timeout_s)
    try:
        payload = await reply.read(idle_timeout_s=timeout_s)
    finally:
        reply.close()
    outcome, _ = kv_proof.judge(kv_proof.usage_of_reply(payload), prefilled_tokens=kv.prompt_tokens)
    return kv_proof.integrity(kv.fields, outcome)
