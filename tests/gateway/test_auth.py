"""API keys on the OpenAI routes, the admin key on metrics and engine listings (an admin key alone opens
nothing to others), no path on disk in /v1/models but the admin's; keys never reach a log."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from tests.fake_engine import MODEL_CARD, FakeEngine
from tests.gateway.test_app import MODEL, ready_gateway_over

CLIENT_KEY, OTHER_CLIENT_KEY, ADMIN_KEY = "sk-client-0123456789abcdef", "sk-client-fedcba9876543210", "sk-admin-0123456789abcdef"
ALL_KEYS = (CLIENT_KEY, OTHER_CLIENT_KEY, ADMIN_KEY)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> AsyncIterator[str]:
    """Client keys from a file and the env, the admin key from the env; every log record captured."""
    (tmp_path / "keys").write_text(f"# clients\n{CLIENT_KEY}\n\n")
    monkeypatch.setenv(API_KEYS_ENV, OTHER_CLIENT_KEY)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    caplog.set_level(logging.DEBUG)
    async with ready_gateway_over(FakeEngine(), api_keys_file=str(tmp_path / "keys")) as base:
        yield base
    logged = caplog.text + "".join(str(record.args) for record in caplog.records)
    assert not [key for key in ALL_KEYS if key in logged], "a key reached the log"


async def request(base: str, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object], str | None]:
    body = {"model": MODEL, "prompt": "hi"} if method == "POST" else None
    async with aiohttp.ClientSession() as session, session.request(method, base + path, json=body, headers=headers) as reply:
        return reply.status, json.loads(await reply.read()), reply.headers.get("WWW-Authenticate")


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                              ("GET", "/v1/models")])
@pytest.mark.parametrize("headers", [None, bearer("sk-wrong-0123456789abcdef"), {"Authorization": CLIENT_KEY},
                                     {"Authorization": f"Basic {CLIENT_KEY}"}, bearer(CLIENT_KEY[:-1])])
async def test_no_key_or_a_wrong_key_is_an_openai_401(gateway: str, method: str, path: str,
                                                      headers: dict[str, str] | None) -> None:
    status, body, challenge = await request(gateway, method, path, headers)
    error = body["error"]
    assert status == 401 and challenge == "Bearer"
    assert isinstance(error, dict) and error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert not [key for key in ALL_KEYS if key[:12] in json.dumps(body)]


@pytest.mark.parametrize("key", ALL_KEYS)
async def test_every_client_key_and_the_admin_key_are_served(gateway: str, key: str) -> None:
    status, body, _ = await request(gateway, "POST", "/v1/completions", bearer(key))
    assert status == 200 and body["choices"]
    status, _, _ = await request(gateway, "GET", "/v1/models", {"Authorization": f"bearer  {key} "})
    assert status == 200


async def test_the_engine_listing_needs_the_admin_key(gateway: str) -> None:
    for headers in (None, bearer(CLIENT_KEY)):
        status, body, _ = await request(gateway, "GET", "/health", headers)
        assert status == 200 and body["healthy_engines"] == {"prefill": 1, "decode": 1} and "engines" not in body
    status, body, _ = await request(gateway, "GET", "/health", bearer(ADMIN_KEY))
    engines = body["engines"]
    assert status == 200 and isinstance(engines, dict) and len(engines["prefill"]) == 1


async def test_probes_need_no_key(gateway: str) -> None:
    assert (await request(gateway, "GET", "/health/live"))[0] == 200
    assert (await request(gateway, "GET", "/health/ready"))[0] == 200


async def test_without_keys_everything_is_open_as_before() -> None:
    async with ready_gateway_over(FakeEngine()) as base:
        assert (await request(base, "POST", "/v1/completions"))[0] == 200
        status, body, _ = await request(base, "GET", "/health")
    assert status == 200 and "engines" in body


async def test_an_admin_key_alone_closes_the_openai_routes_to_everyone_but_the_admin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    async with ready_gateway_over(FakeEngine()) as base:
        for headers in (None, bearer(CLIENT_KEY)):
            assert (await request(base, "POST", "/v1/completions", headers))[0] == 401
            assert (await request(base, "GET", "/v1/models", headers))[0] == 401
        assert (await request(base, "POST", "/v1/completions", bearer(ADMIN_KEY)))[0] == 200


ADMIN_VIEWS = ["/metrics", "/admin/engines", "/dashboard/state"]


async def test_metrics_and_every_view_naming_engines_need_the_admin_key(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        for path in ADMIN_VIEWS:
            for headers in (None, bearer(CLIENT_KEY)):
                async with session.get(gateway + path, headers=headers) as reply:
                    text = await reply.text()
                    assert reply.status == 401, (path, reply.status)
                    assert "127.0.0.1" not in text, f"{path} named an engine"
            async with session.get(gateway + path, headers=bearer(ADMIN_KEY)) as reply:
                assert reply.status == 200, path
        async with session.get(gateway + "/metrics", headers=bearer(ADMIN_KEY)) as reply:
            assert 'endpoint="http://127.0.0.1:' in await reply.text()  # what the key guards


async def test_models_gives_clients_the_model_s_id_for_its_path_on_disk_and_the_admin_the_path(gateway: str) -> None:
    _, client_view, _ = await request(gateway, "GET", "/v1/models", bearer(CLIENT_KEY))
    _, admin_view, _ = await request(gateway, "GET", "/v1/models", bearer(ADMIN_KEY))
    client_card, admin_card = (view["data"][0] for view in (client_view, admin_view))  # type: ignore[index]
    assert admin_card["root"] == MODEL_CARD["root"] and "/models/" not in json.dumps(client_view)
    # vLLM's card (ModelCard, vllm/entrypoints/serve/engine/protocol.py) field for field: OpenAI's id, object,
    # created, owned_by, then root (what `vllm bench serve` loads a tokenizer by), parent, max_model_len.
    assert client_card == {**MODEL_CARD, "root": MODEL}


async def test_a_hugging_face_model_id_as_root_is_no_path_and_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, CLIENT_KEY)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    for root, shown in (("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"), ("/home/me/models/qwen", MODEL),
                        ("../models/qwen", MODEL), ("C:\\models\\qwen", MODEL)):
        fake = FakeEngine(model_card={**MODEL_CARD, "root": root})
        async with ready_gateway_over(fake) as base:
            _, listing, _ = await request(base, "GET", "/v1/models", bearer(CLIENT_KEY))
        assert listing["data"][0]["root"] == shown, root  # type: ignore[index]
