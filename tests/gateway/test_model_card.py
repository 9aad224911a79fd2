"""``/v1/models`` lists the model as the engines do (vLLM's card: root, max_model_len, ...), read once."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest

from pdserve.config import parse_settings
from pdserve.gateway.model_card import config_card, pick_card
from tests.fake_engine import MODEL_CARD, FakeEngine
from tests.gateway.test_app import MODEL, ready_gateway_over


async def get_models(base: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as reply:
        assert reply.status == 200
        listing: dict[str, Any] = await reply.json()
        return listing


async def test_models_carries_the_engines_card_and_asks_the_engine_once() -> None:
    fake = FakeEngine()
    async with ready_gateway_over(fake) as base:
        first, second = await get_models(base), await get_models(base)
    assert first == second == {"object": "list", "data": [MODEL_CARD]}
    assert fake.models_requests == 1


async def test_models_falls_back_to_the_configured_model_until_an_engine_lists_one() -> None:
    fake = FakeEngine(model_card=None)
    async with ready_gateway_over(fake) as base:
        (card,) = (await get_models(base))["data"]
        fake.model_card = {**MODEL_CARD, "root": "/later"}
        (later,) = (await get_models(base))["data"]
    assert card["id"] == MODEL and card["root"] == "/tmp/demo-model" and card["max_model_len"] == 2048
    assert later["root"] == "/later", "a failed fetch is not cached"


async def test_an_engine_without_a_card_is_said_once_while_the_gateway_keeps_asking(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeEngine(model_card=None)
    with caplog.at_level(logging.INFO, logger="pdserve.gateway.model_card"):
        async with ready_gateway_over(fake) as base:
            for _ in range(3):
                await get_models(base)
    assert fake.models_requests >= 3
    assert sum("gave no model card" in record.getMessage() for record in caplog.records) == 1


def test_pick_card_takes_the_served_models_card_and_names_it_as_clients_do() -> None:
    listing = {"object": "list", "data": [{"id": "other", "root": "/a"}, {"id": MODEL, "root": "/b"}]}
    assert pick_card(listing, MODEL) == {"id": MODEL, "root": "/b"}
    assert pick_card({"data": [{"id": "engine-name", "root": "/a"}]}, MODEL) == {"id": MODEL, "root": "/a"}


def test_pick_card_finds_nothing_in_a_reply_without_cards() -> None:
    for listing in ({}, {"data": []}, {"data": "x"}, ["x"], {"data": [1, "a"]}):
        assert pick_card(listing, MODEL) is None


def test_config_card_names_the_configured_model_folder_as_root() -> None:
    settings = parse_settings({"model": {"path": "/models/qwen", "served_name": "qwen", "max_model_len": 8192},
                               "cache_dir": "/tmp"}, source="test")
    card = config_card(settings)
    assert (card["id"], card["root"], card["max_model_len"], card["owned_by"]) == ("qwen", "/models/qwen", 8192, "vllm")
