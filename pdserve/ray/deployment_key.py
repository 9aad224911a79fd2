"""The engine key of one Serve application, the same in all its replicas: the one the node gives (KubeRay's
pods get PDSERVE_ENGINE_KEY from a Secret), else one made by the first replica to start and kept in the
cluster's GCS key-value store. Never in the Serve config, which the Ray dashboard shows to whoever opens it."""

from __future__ import annotations

import asyncio
import secrets
from typing import Protocol

from ray.experimental import internal_kv

from pdserve.config import Settings
from pdserve.engine_key import GENERATED_KEY_BYTES, EngineKey, given_engine_key

# Where Serve keeps its own checkpoints too (ray/serve/_private/storage/kv_store.py, RayInternalKVStore).
KV_NAMESPACE = "pdserve"


class KeyStore(Protocol):
    def put_if_absent(self, name: str, value: str) -> str:
        """Store ``value`` under ``name`` unless ``name`` has a value; return the value it has now."""


class GcsKeyStore:
    """The cluster's GCS key-value store: it lives as long as the cluster (the registry replica, which Serve
    may restart, would not), and is read only by processes that may run code on the cluster anyway."""

    def put_if_absent(self, name: str, value: str) -> str:
        # overwrite=False leaves a value already there (ray/experimental/internal_kv.py:68-100), so replicas
        # starting at once all read back the first one's key.
        internal_kv._internal_kv_put(name, value, overwrite=False, namespace=KV_NAMESPACE)
        stored: bytes = internal_kv._internal_kv_get(name, namespace=KV_NAMESPACE)
        return stored.decode()


def key_name(app_name: str) -> str:
    """One key per Serve application: two pdserve applications on one cluster do not share engines."""
    return f"engine-key/{app_name}"


async def application_engine_key(settings: Settings, *, app_name: str, store: KeyStore) -> EngineKey:
    """The key given on this node (PDSERVE_ENGINE_KEY or gateway.engine_key_file: then the same one must be
    given on every node), else application ``app_name``'s in ``store``, made there by whichever replica
    asks first. Raises ConfigError for a given key that is unreadable or malformed."""
    given = given_engine_key(settings.gateway)
    if given is not None:
        return given
    value = await asyncio.to_thread(store.put_if_absent, key_name(app_name), secrets.token_urlsafe(GENERATED_KEY_BYTES))
    return EngineKey(value)
