"""The Secrets a deployment's pods require, with the one command that makes each, and the values `cloud up`
stores in those that do not exist yet. Pure: generating values is ``NewSecrets.generate``'s only effect."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pdserve.cluster_config import KubernetesSpec
from pdserve.config import Settings
from pdserve.deploy.k8s_names import (
    API_KEYS_SECRET_KEYS,
    ENGINE_KEY_SECRET_KEY,
    RAY_TOKEN_SECRET_KEY,
    api_keys_secret_name,
    engine_key_secret_name,
    ray_token_secret_name,
)

KEY_BYTES = 32  # secrets.token_urlsafe(32): 256 random bits, 43 characters, what access.py and engine_key.py accept
API_KEYS_KEY, ADMIN_KEY_KEY = API_KEYS_SECRET_KEYS.values()


@dataclass(frozen=True, slots=True)
class RequiredSecret:
    """A Secret the pods will not start without, its keys, and who reads it."""

    name: str
    keys: tuple[str, ...]
    read_by: str


def required_secrets(settings: Settings) -> list[RequiredSecret]:
    """The Ray token, the engine key and, unless ``access.open``, the gateway's client and admin keys."""
    spec = settings.kubernetes
    needed = [
        RequiredSecret(ray_token_secret_name(spec), (RAY_TOKEN_SECRET_KEY,), "every Ray pod and the KubeRay operator"),
        RequiredSecret(engine_key_secret_name(spec), (ENGINE_KEY_SECRET_KEY,),
                       "the engine and gateway pods, and Prometheus for the engines' /metrics"),
    ]
    if not settings.access.open:
        needed.append(RequiredSecret(api_keys_secret_name(spec), (API_KEYS_KEY, ADMIN_KEY_KEY),
                                     "the gateway pods, and Prometheus (the admin key) for the gateway's /metrics"))
    return needed


def create_command(spec: KubernetesSpec, secret: RequiredSecret) -> str:
    """The kubectl command that makes ``secret`` with a random value under each key."""
    literals = " ".join(f'--from-literal={key}="$(openssl rand -hex {KEY_BYTES})"' for key in secret.keys)
    return f"kubectl -n {spec.namespace} create secret generic {secret.name} {literals}"


def read_back_command(spec: KubernetesSpec, *, secret: str, key: str, kubectl: str = "kubectl") -> str:
    """The command that prints one key of a Secret (``kubectl``: the kubectl to run, with its options)."""
    return f"{kubectl} -n {spec.namespace} get secret {secret} -o jsonpath='{{.data.{key}}}' | base64 -d"


def secrets_note(settings: Settings) -> list[str]:
    """What must exist before the pods can start, and how to make it (``cloud up`` makes what is missing)."""
    spec = settings.kubernetes
    heading = (f"Secrets in namespace {spec.namespace} that the pods require (`pdserve cloud up` creates the missing "
               "ones; else create them after the Namespace, before the rest):")
    lines = [heading]
    for secret in required_secrets(settings):
        lines += [f"  {secret.name} ({', '.join(secret.keys)}), read by {secret.read_by}:",
                  f"    {create_command(spec, secret)}"]
    return lines


@dataclass(frozen=True, slots=True)
class NewSecrets:
    """Values for the Secrets ``cloud up`` creates where none exists yet; never shown but the API key, once."""

    ray_token: str = field(repr=False)
    engine_key: str = field(repr=False)
    api_key: str = field(repr=False)
    admin_key: str = field(repr=False)

    @classmethod
    def generate(cls) -> NewSecrets:
        return cls(*(secrets.token_urlsafe(KEY_BYTES) for _ in range(4)))

    def api_keys_env_file(self) -> str:
        """The gateway's keys as ``kubectl create secret --from-env-file`` reads them (KEY=VALUE lines)."""
        return f"{API_KEYS_KEY}={self.api_key}\n{ADMIN_KEY_KEY}={self.admin_key}\n"
