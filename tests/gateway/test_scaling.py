"""`pdserve scale`'s gateway side: POST/GET /admin/scale, its checks, and the pool following the
engines `pdserve up` publishes (engines/members.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.access import ADMIN_KEY_ENV
from pdserve.config import parse_settings
from pdserve.engines.members import EngineState, Member, Members, MembersFolder
from pdserve.errors import BadRequest
from pdserve.gateway.app import build_app
from pdserve.gateway.scaling import wanted_pools
from pdserve.role import Role
from pdserve.routing.pool import Pool
from pdserve.routing.sources import LaunchedEngines
from pdserve.scale import parse_pools
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import gateway_settings, until_ready

ADMIN_KEY = "sk-admin-0123456789abcdef"
NOW = {Role.PREFILL: 1, Role.DECODE: 1}


def members(*engines: tuple[str, Role, str, EngineState]) -> Members:
    return Members(engines=tuple(Member(name, role, url, state, log_path="/nonexistent.log")
                                 for name, role, url, state in engines),
                   wanted={role: sum(e[1] is role for e in engines) for role in Role})


@pytest.mark.parametrize(("body", "wanted"), [
    ({"decode": 3}, {Role.PREFILL: 1, Role.DECODE: 3}),
    ({"prefill": 0, "decode": 2}, {Role.PREFILL: 0, Role.DECODE: 2}),
    ({}, NOW),
])
def test_a_scale_request_sets_the_pools_it_names(body: dict[str, Any], wanted: dict[Role, int]) -> None:
    assert wanted_pools(body, current=NOW, settings=parse_settings({}, source="test")) == wanted


@pytest.mark.parametrize(("body", "param"), [
    ({"decode": 0}, "decode"), ({"decode": -1}, "decode"), ({"decode": True}, "decode"), ({"decode": "2"}, "decode"),
    ({"decode": 2.0}, "decode"), ({"prefill": 17}, "prefill"), ({"gpus": 1}, "gpus"),
])
def test_a_bad_scale_request_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        wanted_pools(body, current=NOW, settings=parse_settings({}, source="test"))
    assert raised.value.status == 400 and raised.value.param == param


def test_a_gpu_pool_grows_only_onto_the_gpus_it_lists() -> None:
    settings = parse_settings({"decode": {"device": "cuda", "gpu_ids": [0, 1], "tensor_parallel_size": 2}}, source="test")
    with pytest.raises(BadRequest, match="need 4 GPUs"):
        wanted_pools({"decode": 2}, current=NOW, settings=settings)


async def test_the_pool_follows_the_members_file_an_engine_leaves_as_it_drains(tmp_path: Path) -> None:
    folder, pool = MembersFolder(tmp_path), Pool()
    follower = asyncio.create_task(LaunchedEngines(folder, external={Role.DECODE: ["http://10.0.0.9:8000"]},
                                                   look_interval_s=0.01).follow(pool))
    try:
        folder.write(members(("prefill-0", Role.PREFILL, "http://127.0.0.1:1", EngineState.SERVING),
                             ("decode-0", Role.DECODE, "http://127.0.0.1:2", EngineState.SERVING),
                             ("decode-1", Role.DECODE, "http://127.0.0.1:3", EngineState.STARTING)))
        await asyncio.sleep(0.1)
        assert [e.url for e in pool.all(Role.DECODE)] == ["http://127.0.0.1:2", "http://10.0.0.9:8000"]
        folder.write(members(("prefill-0", Role.PREFILL, "http://127.0.0.1:1", EngineState.SERVING),
                             ("decode-0", Role.DECODE, "http://127.0.0.1:2", EngineState.DRAINING),
                             ("decode-1", Role.DECODE, "http://127.0.0.1:3", EngineState.SERVING)))
        await asyncio.sleep(0.1)
        assert [e.url for e in pool.all(Role.DECODE)] == ["http://127.0.0.1:3", "http://10.0.0.9:8000"]
        assert [e.url for e in pool.all(Role.PREFILL)] == ["http://127.0.0.1:1"]
    finally:
        follower.cancel()


async def call(base: str, method: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, \
            session.request(method, base + "/admin/scale", json=body, headers=headers) as reply:
        return reply.status, json.loads(await reply.read())


@pytest.fixture
async def launched(tmp_path: Path) -> AsyncIterator[tuple[str, MembersFolder]]:
    """A ready gateway whose engines (one fake serving both roles) `pdserve up` would have published."""
    folder = MembersFolder(tmp_path)
    async with serving(FakeEngine().app(), free_port()) as url:
        folder.write(members(("prefill-0", Role.PREFILL, url, EngineState.SERVING),
                             ("decode-0", Role.DECODE, url, EngineState.SERVING)))
        settings = gateway_settings(prefill=[], decode=[])
        async with serving(build_app(settings, members=folder), settings.gateway.port) as base:
            await until_ready(base)
            yield base, folder


async def test_post_admin_scale_hands_the_request_to_pdserve_up_and_get_lists_the_engines(
        launched: tuple[str, MembersFolder]) -> None:
    base, folder = launched
    status, body = await call(base, "POST", {"decode": 2})
    assert status == 202 and body["wanted"] == {"prefill": 1, "decode": 2}
    assert folder.take_request() == {Role.PREFILL: 1, Role.DECODE: 2}
    status, body = await call(base, "GET")
    assert status == 200 and [engine["state"] for engine in body["engines"]] == ["serving", "serving"]


@pytest.mark.parametrize("body", [{"decode": 0}, {"decode": "x"}, [1], {"gpus": 2}])
async def test_a_bad_scale_request_is_refused_and_nothing_is_asked(launched: tuple[str, MembersFolder],
                                                                   body: Any) -> None:
    base, folder = launched
    status, reply = await call(base, "POST", body)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert folder.take_request() is None


async def test_admin_scale_needs_the_admin_key(launched: tuple[str, MembersFolder],
                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, folder = launched
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    settings = gateway_settings(prefill=[], decode=[])
    async with serving(build_app(settings, members=folder), settings.gateway.port) as base:
        assert (await call(base, "POST", {"decode": 2}))[0] == 401
        assert folder.take_request() is None
        assert (await call(base, "POST", {"decode": 2}, {"Authorization": f"Bearer {ADMIN_KEY}"}))[0] == 202


async def test_a_gateway_over_engines_it_did_not_launch_cannot_scale_them() -> None:
    async with serving(FakeEngine().app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            status, body = await call(base, "POST", {"decode": 2})
    assert status == 409 and body["error"]["code"] == "scaling_unavailable"


def test_pdserve_scale_reads_pool_equals_count() -> None:
    assert parse_pools(["prefill=0", "decode=3"]) == {"prefill": 0, "decode": 3}
    for bad in ("decode", "decode=-1", "gpus=2", "decode=two"):
        with pytest.raises(ValueError, match="POOL=COUNT"):
            parse_pools([bad])


@pytest.mark.parametrize(("content_type", "data"), [
    ("application/x-www-form-urlencoded", b'{"decode": 2}'),  # what a cross-site <form> may send unasked
    ("text/plain", b'{"decode": 2}'),
    (None, b'{"decode": 2}'),
])
async def test_a_scale_request_not_declared_json_is_refused_with_415_even_with_no_key(
        launched: tuple[str, MembersFolder], content_type: str | None, data: bytes) -> None:
    base, folder = launched
    headers = {"Content-Type": content_type} if content_type else {}
    async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session, \
            session.post(base + "/admin/scale", data=data, headers=headers) as reply:
        status, body = reply.status, json.loads(await reply.read())
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"
    assert folder.take_request() is None


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", ""])
async def test_a_scale_request_whose_host_is_not_the_gateway_is_refused_with_421(
        launched: tuple[str, MembersFolder], host: str) -> None:
    """DNS rebinding: the attacker's page, its name now pointing at 127.0.0.1, sends its own name as Host."""
    base, folder = launched
    status, body = await call(base, "POST", {"decode": 2}, {"Host": host})
    assert status == 421 and body["error"]["code"] == "misdirected_request"
    assert folder.take_request() is None
    port = base.rsplit(":", 1)[1]
    assert (await call(base, "POST", {"decode": 2}, {"Host": f"localhost:{port}"}))[0] == 202
