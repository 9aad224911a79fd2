"""Whether a PD request's prompt reached its decode engine over the KV transfer or was computed
there again, judged from that engine's own usage for the request, and what that says of the handoff's KV integrity
check (pdserve_vllm/kv_integrity.py). Pure; no I/O.

Why the usage's ``prompt_tokens_details.cached_tokens`` (engines run with
``--enable-prompt-tokens-details``, engines/command.py): it is per request, in the reply the gateway
relays anyway, and vLLM counts there the prompt tokens the request did not compute: its prefix-cache
hits plus the tokens its KV connector loaded (vLLM 0.32 v1/metrics/stats.py, PrefillStats:
num_cached_tokens = local + external; the same field in 0.26's OpenAI usage). A pull that fails under
``kv_load_failure_policy: recompute`` sets the request's computed tokens back to 0 and the engine
computes the prompt (v1/core/sched/scheduler.py, _handle_failed_recving): cached_tokens then holds
local hits only, fewer than the prefill engine computed. The other candidates name no request:
``vllm:prompt_tokens_by_source`` (v1/metrics/loggers.py) splits the same counts by source summed
over all requests, and the engine's log lines are not ours to parse. 0.32 reports the prefill
engine's hits instead when the decode leg carries ``remote_prefill_cached_tokens``
(v1/engine/output_processor.py): ``DROPPED_FIELD``, which pd/prefill.py leaves out of the handoff.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from pdserve_vllm import KV_DIGEST_KEY

DROPPED_FIELD = "remote_prefill_cached_tokens"


class KvOutcome(enum.Enum):
    PULLED = "pulled"  # the decode engine had the prompt without computing it
    RECOMPUTED = "recomputed"  # it computed prompt tokens the prefill engine had computed
    UNKNOWN = "unknown"  # no usage with prompt_tokens_details came back (the engine runs without it)


class RecomputeReason(enum.Enum):
    """The ``reason`` label of pdserve_kv_recomputed_total."""

    PULL_FAILED = "pull_failed"  # none of the prefilled prompt came over
    PULL_TIMEOUT = "pull_timeout"  # no first token within gateway.kv_pull_timeout_s: the gateway gave up on it
    PULL_SHORT = "pull_short"  # fewer came than were prefilled (blocks lost mid-pull, or a failed pull with local hits)


class IntegrityResult(enum.Enum):
    """The ``result`` label of pdserve_kv_integrity_total: what the decode engine's check of the KV it pulled came to,
    as the gateway can tell it per request. The check runs in the engines (pdserve_vllm/kv_integrity.py): a decode
    engine whose pulled blocks differ from the prefill engine's digests reports the pull failed and computes the
    prompt itself before any token, which its usage shows as a recompute."""

    OK = "ok"  # the handoff carried digests and the decode engine used the KV it pulled: they matched
    RECOMPUTED = "recomputed"  # it carried digests and the engine computed the prompt: a mismatch or a failed pull
    UNCHECKED = "unchecked"  # no digests came with it (an engine whose KV layout or vLLM the check does not cover)
    UNKNOWN = "unknown"  # no usage said whether the KV was used


def integrity(fields: Mapping[str, Any], outcome: KvOutcome) -> IntegrityResult:
    """The integrity result of a handoff with kv_transfer_params ``fields`` whose decode leg came to ``outcome``."""
    if KV_DIGEST_KEY not in fields:
        return IntegrityResult.UNCHECKED
    return {KvOutcome.PULLED: IntegrityResult.OK, KvOutcome.RECOMPUTED: IntegrityResult.RECOMPUTED}.get(
        outcome, IntegrityResult.UNKNOWN)


def judge(usage: Mapping[str, Any] | None, *, prefilled_tokens: int) -> tuple[KvOutcome, RecomputeReason | None]:
    """The outcome of one decode leg from its ``usage`` object (an OpenAI usage, or None) and the
    prompt tokens its prefill engine computed; the reason when RECOMPUTED. One token short is still a
    pull: an engine may compute a prompt's last token itself."""
    details = (usage or {}).get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if not isinstance(cached, int) or prefilled_tokens <= 0:
        return KvOutcome.UNKNOWN, None
    if cached >= prefilled_tokens - 1:
        return KvOutcome.PULLED, None
    return KvOutcome.RECOMPUTED, RecomputeReason.PULL_FAILED if cached == 0 else RecomputeReason.PULL_SHORT


def usage_of_reply(payload: bytes) -> Mapping[str, Any] | None:
    """The usage object of a whole (non-streamed) reply; None if it has none or is not JSON."""
    try:
        body = json.loads(payload)
    except ValueError:
        return None
    usage = body.get("usage") if isinstance(body, dict) else None
    return usage if isinstance(usage, dict) else None


def usage_of_events(chunk: bytes) -> Mapping[str, Any] | None:
    """The usage object of the SSE event in ``chunk`` that carries one (a stream with
    ``stream_options.include_usage`` ends with it); None if none does."""
    for event in chunk.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            usage = usage_of_reply(event[len(b"data: "):])
            if usage is not None:
                return usage
    return None
