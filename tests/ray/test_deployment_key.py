"""The engine key of a Serve application: the one the node gives, else one made once per application in
the cluster's store, so every replica, started in any order, gets the same."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.config import parse_settings
from pdserve.deploy.serve import serve_config_yaml
from pdserve.engine_key import GENERATED_KEY_BYTES
from pdserve.ray.deployment_key import application_engine_key
from pdserve_vllm import ENGINE_KEY_ENV

SETTINGS = parse_settings({}, source="t")


class InternalKV:
    """Ray's GCS key-value store as GcsKeyStore uses it: ``_internal_kv_put(overwrite=False)`` keeps a value
    already there (ray/experimental/internal_kv.py:68-100, "Whether to overwrite an existing value"), and
    ``_internal_kv_get`` returns what the name holds (same file, 33-44)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def put_if_absent(self, name: str, value: str) -> str:
        self.values.setdefault(name, value)
        return self.values[name]


async def test_every_replica_of_an_application_gets_the_key_the_first_one_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    store = InternalKV()
    keys = await asyncio.gather(*(application_engine_key(SETTINGS, app_name="pdserve", store=store)
                                  for _ in range(4)))
    assert len({key.value for key in keys}) == 1
    assert len(keys[0].value) >= GENERATED_KEY_BYTES  # token_urlsafe: 43 characters for 32 bytes
    other = await application_engine_key(SETTINGS, app_name="other", store=store)
    assert other.value != keys[0].value, "two applications on one cluster share no engines"


async def test_a_key_the_node_gives_wins_and_nothing_is_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """KubeRay's engine and gateway pods get PDSERVE_ENGINE_KEY from a Secret."""
    monkeypatch.setenv(ENGINE_KEY_ENV, "k" * 43)
    store = InternalKV()
    assert (await application_engine_key(SETTINGS, app_name="pdserve", store=store)).value == "k" * 43
    assert store.values == {}
    assert "k" * 43 not in serve_config_yaml(SETTINGS)
