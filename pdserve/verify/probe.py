"""Send probe requests through one prefill/decode pair and read what the engines measured.

I/O only; judging the numbers is checks.py's job. Prompts are token ids, so no tokenizer is
needed and the KV size is known exactly: prompt tokens x the model's KV bytes per token.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.access import admin_key_needed
from pdserve.errors import GatewayUnavailable
from pdserve.pd.engine_http import EngineClient
from pdserve.pd.pair import COMPLETIONS, send_through_pair
from pdserve.pd.transfer_stats import TransferCounters, fetch_counters
from pdserve.protocol import PD_MODE_HEADER
from pdserve.routing.decision import Mode


@dataclass(frozen=True, slots=True)
class HandoffProbe:
    prompt_tokens: int
    prefill_s: float  # prefill leg: request to KV ready
    decode_s: float  # decode leg with max_tokens=1: KV pull + one decode step
    engine: TransferCounters  # what the decode engine counted during the probe


def probe_token_ids(count: int, *, seed: int) -> list[int]:
    """A deterministic prompt of ``count`` token ids, valid for any vocabulary over 1,000. Seeds give
    prompts that share no prefix (an arithmetic sequence mod 990 had only 990 of them, so repeated
    runs of ``pdserve verify`` hit the decode engine's prefix cache and moved less KV)."""
    draw = random.Random(seed)
    return [draw.randrange(10, 1000) for _ in range(count)]


async def probe_handoff(
    session: aiohttp.ClientSession, client: EngineClient, *, prefill_url: str, decode_url: str, model: str, connector: str,
    prompt_tokens: int, seed: int, timeout_s: float,
) -> HandoffProbe:
    """One PD request of ``prompt_tokens`` tokens and one output token, timed leg by leg.

    Use a new ``seed`` per probe: a prompt the decode engine has cached would not be transferred.
    """
    body: dict[str, Any] = {"model": model, "prompt": probe_token_ids(prompt_tokens, seed=seed),
                            "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    request_id = f"pdserve-verify-{uuid.uuid4().hex}"
    before = await fetch_counters(session, decode_url, timeout_s=timeout_s)
    prefill_s, decode_s = await send_through_pair(client, prefill_url=prefill_url, decode_url=decode_url, body=body,
                                                  connector=connector, request_id=request_id, timeout_s=timeout_s)
    after = await fetch_counters(session, decode_url, timeout_s=timeout_s)
    return HandoffProbe(prompt_tokens=prompt_tokens, prefill_s=prefill_s, decode_s=decode_s, engine=after.since(before))


async def greedy_token_ids(
    session: aiohttp.ClientSession, gateway_url: str, *, model: str, mode: Mode, prompt_tokens: int,
    max_tokens: int, timeout_s: float,
) -> list[int]:
    """The token ids the gateway returns for a greedy request in ``mode``."""
    body = {"model": model, "prompt": probe_token_ids(prompt_tokens, seed=1), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with session.post(gateway_url + COMPLETIONS, json=body, headers={PD_MODE_HEADER: mode.value},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
        if reply.status == 401:  # API keys are set: the probe goes through with the admin key (`pdserve status`'s)
            raise GatewayUnavailable(admin_key_needed(gateway_url + COMPLETIONS))
        reply.raise_for_status()
        token_ids: list[int] = (await reply.json())["choices"][0]["token_ids"]
        return token_ids


async def pd_and_local_token_ids(
    session: aiohttp.ClientSession, gateway_url: str, *, model: str, timeout_s: float
) -> tuple[list[int], list[int]]:
    """Greedy output of one probe prompt through both legs, then through one engine alone: a correct
    KV handoff makes them token-identical."""
    pd, local = [await greedy_token_ids(session, gateway_url, model=model, mode=mode, prompt_tokens=100,
                                        max_tokens=16, timeout_s=timeout_s)
                 for mode in (Mode.PD, Mode.LOCAL)]
    return pd, local
