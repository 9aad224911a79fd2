"""Tenants apart (gateway/tenants.py): each key's vLLM cache_salt on both legs, the same from every gateway given
the same keys; a client's own salt parts its tenant's cache only; X-PD-Mode for the admin only once keys are set;
cached_tokens kept from clients (the C relay's streams too) while the gateway still judges the handoff by them."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from pdserve.gateway.tenants import hide_cached_tokens
from pdserve.pd.native_relay import Handback
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, post, ready_gateway_over
from tests.gateway.test_auth import ADMIN_KEY, CLIENT_KEY, OTHER_CLIENT_KEY, bearer
from tests.gateway.test_faults import gateway_over
from tests.gateway.test_relay_paths import handbacks  # noqa: F401  # a fixture

COMPLETION = {"model": MODEL, "prompt": "hi there", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, f"{CLIENT_KEY},{OTHER_CLIENT_KEY}")
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)


async def salts_seen(sends: list[tuple[str, dict[str, Any]]], **access: Any) -> list[list[str | None]]:
    """Each request's ``cache_salt`` on its legs, as the engine got them, for ``(key, body)`` sent to a new gateway
    (key '': none)."""
    fake, seen = FakeEngine(), []
    async with ready_gateway_over(fake, access=access) as base:
        for key, body in sends:
            fake.bodies.clear()
            assert (await post(base, body, headers=bearer(key) if key else None))[0] == 200
            seen.append([leg.get("cache_salt") for leg in fake.bodies])
    return seen


@pytest.mark.usefixtures("keys")
async def test_each_key_gets_its_own_salt_on_both_legs_and_the_same_one_from_every_gateway() -> None:
    sends = [(CLIENT_KEY, COMPLETION), (OTHER_CLIENT_KEY, COMPLETION),
             (CLIENT_KEY, {**COMPLETION, "cache_salt": "user-7"}), (OTHER_CLIENT_KEY, {**COMPLETION, "cache_salt": "user-7"})]
    first = await salts_seen(sends)
    assert await salts_seen(sends) == first  # another gateway (process, replica) with the same keys: the same salts
    assert all(len(legs) == 2 and legs[0] == legs[1] for legs in first)  # prefill and decode legs alike
    salts = [legs[0] for legs in first]
    assert len(set(salts)) == 4 and "user-7" not in salts  # a client's own salt never reaches another tenant's
    assert all(salt is not None and re.fullmatch(r"[A-Za-z0-9_-]{43}", salt) for salt in salts)


async def test_with_salts_per_key_off_a_clients_salt_goes_as_sent_and_none_is_added() -> None:
    seen = await salts_seen([("", COMPLETION), ("", {**COMPLETION, "cache_salt": "user-7"})], cache_salt_per_key=False)
    assert seen == [[None, None], ["user-7", "user-7"]]


async def test_a_client_may_send_a_salt_but_not_one_vllm_would_refuse() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake) as base:
        accepted, _ = await post(base, {**COMPLETION, "cache_salt": "user-7"})
        status, payload = await post(base, {**COMPLETION, "cache_salt": "a/b"})
    assert accepted == 200 and status == 400 and json.loads(payload)["error"]["param"] == "cache_salt"


@pytest.mark.usefixtures("keys")
async def test_only_the_admin_may_choose_the_mode_once_keys_are_configured() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake) as base:
        fake.bodies.clear()
        status, payload = await post(base, COMPLETION, headers={**bearer(CLIENT_KEY), "X-PD-Mode": "local"})
        assert not fake.bodies
        admin_status, _ = await post(base, COMPLETION, headers={**bearer(ADMIN_KEY), "X-PD-Mode": "local"})
    error = json.loads(payload)["error"]
    assert status == 403 and error["param"] == "X-PD-Mode" and error["code"] == "permission_denied"
    assert admin_status == 200 and [("kv_transfer_params" in body) for body in fake.bodies] == [False]  # local


def usage_of(payload: bytes) -> dict[str, Any]:
    """The usage of a whole reply, or of a stream's usage event."""
    if payload.startswith(b"{"):
        usage: dict[str, Any] = json.loads(payload)["usage"]
        return usage
    event = next(event for event in payload.split(b"\n\n") if b'"usage":{' in event)
    usage = json.loads(event[len(b"data: "):])["usage"]
    return usage


@pytest.mark.parametrize("native_relay", [True, False])
async def test_cached_tokens_are_kept_from_clients_yet_judge_the_handoff(native_relay: bool,
                                                                         handbacks: list[Handback]) -> None:  # noqa: F811
    decode = FakeEngine(cached_tokens=2, token_delay_s=0.005, words=[f" w{index}" for index in range(40)])
    async with gateway_over([FakeEngine()], [decode], native_relay=native_relay) as base:
        replies = [await post(base, STREAM), await post(base, COMPLETION),
                   await post(base, STREAM, headers={"X-PD-Mode": "local"})]  # the relay thread's stream to its end
        async with aiohttp.ClientSession() as session, session.get(base + "/dashboard/state") as reply:
            requests = (await reply.json())["requests"]
    assert all(status == 200 and usage_of(payload)["prompt_tokens_details"] is None for status, payload in replies)
    assert [request["kv"] for request in requests[:3]] == [None, "pulled", "pulled"]  # newest first
    # The relay thread carried the streams, and gave their usage events back rather than send them on.
    assert bool(handbacks) == native_relay and not any(b'"usage":{' in back.payload for back in handbacks)
    async with gateway_over([FakeEngine()], [FakeEngine(cached_tokens=2)], native_relay=native_relay,
                            access={"show_cached_tokens": True}) as base:  # where configured, clients get them
        shown = [await post(base, STREAM), await post(base, COMPLETION)]
    assert all(usage_of(payload)["prompt_tokens_details"] == {"cached_tokens": 2} for _, payload in shown)


def test_only_the_usage_field_is_hidden_never_generated_text() -> None:
    text = '{"prompt_tokens_details":{"cached_tokens":9}}'  # a model may write anything
    reply = json.dumps({"choices": [{"text": text}], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {
        "cached_tokens": 2}}}).encode()
    hidden = json.loads(hide_cached_tokens(reply))
    assert hidden["choices"][0]["text"] == text and hidden["usage"] == {"prompt_tokens": 3, "prompt_tokens_details": None}
