"""Pure: the environment of each kind of Ray container: the Ray token, the gateway's keys, the engine key, where an
engine is reached and how its KV moves, where weights are cached. Secrets only through ``secretKeyRef``. No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.cluster_config import KubernetesSpec
from pdserve.deploy.k8s_names import (
    API_KEYS_SECRET_KEYS,
    ENGINE_KEY_SECRET_KEY,
    HF_TOKEN_SECRET_KEY,
    RAY_TOKEN_SECRET_KEY,
    UCX_TCP_PORTS,
    api_keys_secret_name,
    engine_key_secret_name,
    hf_token_secret_name,
    ray_token_secret_name,
)
from pdserve.engine_config import PoolSpec
from pdserve_vllm import ENGINE_KEY_ENV

CACHE_MOUNT = "/mnt/pdserve-cache"
UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"


def secret_ref_env(variable: str, *, secret: str, key: str, is_optional: bool = False) -> dict[str, Any]:
    """``variable`` from ``key`` of Secret ``secret``; a required one keeps the container from starting
    (CreateContainerConfigError) until the Secret has that key."""
    reference: dict[str, Any] = {"name": secret, "key": key}
    if is_optional:
        reference["optional"] = True
    return {"name": variable, "valueFrom": {"secretKeyRef": reference}}


def ray_auth_env(spec: KubernetesSpec) -> list[dict[str, Any]]:
    """Ray's token auth: every Ray node's raylet and workers present it to the GCS, engine pods' included; set here
    too so KubeRay versions without authOptions carry it."""
    token = secret_ref_env("RAY_AUTH_TOKEN", secret=ray_token_secret_name(spec), key=RAY_TOKEN_SECRET_KEY)
    return [{"name": "RAY_AUTH_MODE", "value": "token"}, token]


def gateway_keys_env(spec: KubernetesSpec, *, is_open: bool) -> list[dict[str, Any]]:
    """The gateway's client and admin keys, from a required Secret; from an optional one with ``access.open``."""
    name = api_keys_secret_name(spec)
    return [secret_ref_env(variable, secret=name, key=key, is_optional=is_open)
            for variable, key in API_KEYS_SECRET_KEYS.items()]


def engine_key_env(spec: KubernetesSpec) -> list[dict[str, Any]]:
    """The engine key, for the pods that run engines (which require it) or a gateway (which presents it)."""
    return [secret_ref_env(ENGINE_KEY_ENV, secret=engine_key_secret_name(spec), key=ENGINE_KEY_SECRET_KEY)]


def hf_token_env(spec: KubernetesSpec) -> list[dict[str, Any]]:
    """A Hugging Face token for gated or private weights, from an optional Secret (absent: anonymous)."""
    return [secret_ref_env("HF_TOKEN", secret=hf_token_secret_name(spec), key=HF_TOKEN_SECRET_KEY, is_optional=True)]


def cache_env(spec: KubernetesSpec) -> list[dict[str, Any]]:
    """Weights on the node's disk, where a replaced pod finds them (the compile cache: ``launch.cache_dir``)."""
    if not spec.model_cache_path:
        return []
    return [{"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"}]


def engine_env(pool: PoolSpec, *, backends: Sequence[str]) -> list[dict[str, Any]]:
    """vLLM and NIXL reach this pod at its own IP; over EFA, libfabric must pick the efa provider; over UCX, its
    TCP transport listens in ``UCX_TCP_PORTS`` (a port the kernel picks could not be let in by a NetworkPolicy)."""
    env: list[dict[str, Any]] = [{"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if pool.placement.efa_devices:
        env.append({"name": "FI_PROVIDER", "value": "efa"})
    if "UCX" in backends:
        env.append({"name": UCX_PORT_RANGE_ENV, "value": "{}-{}".format(*UCX_TCP_PORTS)})
    return env
