"""Who may call the gateway: API keys for the OpenAI routes, one admin key for the views that
name engines. Keys are read once at start-up from files and env vars, never from Settings (those
are shipped to Ray and rendered into manifests); they are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

from pdserve.config import secret_env
from pdserve.errors import BadRequest, ConfigError
from pdserve.gateway_config import GatewaySpec

API_KEYS_ENV = "PDSERVE_API_KEYS"
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
MIN_KEY_CHARS = 16  # shorter keys can be guessed
KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what fits in `Authorization: Bearer <key>`


class Access(IntEnum):
    """What a request may see; each level includes the ones below it."""

    NONE = 0
    CLIENT = 1  # the OpenAI routes
    ADMIN = 2  # also engine listings


@dataclass(frozen=True, slots=True)
class AccessKeys:
    """The configured keys; none at all means everything is open (a gateway on loopback, or ``access.open``:
    gateway/exposure.py); any key closes every route but the probes to a request without one."""

    api_keys: tuple[bytes, ...] = field(default=(), repr=False)
    admin_key: bytes | None = field(default=None, repr=False)

    @property
    def is_open(self) -> bool:
        """No key at all: every request is granted everything."""
        return self.admin_key is None and not self.api_keys

    def grant(self, authorization: bytes | None) -> Access:
        """What an ``Authorization`` header's value grants. Every key is compared, each in constant
        time, so the time taken tells nothing about which key came close. An admin key alone opens
        nothing to others: only the admin may then use the gateway."""
        presented = _bearer_token(authorization)
        is_admin = self.admin_key is not None and hmac.compare_digest(presented, self.admin_key)
        matches = [hmac.compare_digest(presented, key) for key in self.api_keys]
        if is_admin or self.is_open:
            return Access.ADMIN
        return Access.CLIENT if any(matches) else Access.NONE

    def require(self, authorization: bytes | None, needed: Access) -> None:
        """Raises BadRequest (401) unless ``authorization`` grants ``needed``; the key is never echoed."""
        if self.grant(authorization) < needed:
            message = "Incorrect API key provided." if authorization else (
                "You didn't provide an API key: send it as `Authorization: Bearer <key>`.")
            raise BadRequest(message, status=401, code="invalid_api_key")

    def tenant(self, authorization: bytes | None) -> str:
        """Who a request speaks for, for per-key limits and cache salts: a digest of the API key it presents
        (never the key), or '' for a request with no valid API key (the admin key, an open gateway)."""
        presented = _bearer_token(authorization)
        matches = [hmac.compare_digest(presented, key) for key in self.api_keys]
        return hashlib.sha256(presented).hexdigest()[:16] if any(matches) else ""

    def headers(self) -> dict[str, str]:
        """What a pdserve tool (verify, ray up) sends the gateway: the admin key, else an API key."""
        key = self.admin_key or (self.api_keys[0] if self.api_keys else None)
        return {"Authorization": f"Bearer {key.decode()}"} if key else {}


def admin_key_needed(url: str) -> str:
    """What a command says when the gateway at ``url`` refused it for want of the admin key."""
    return f"{url} wants the admin key: set {ADMIN_KEY_ENV} or gateway.admin_key_file"


def load_access_keys(spec: GatewaySpec) -> AccessKeys:
    """The keys from ``spec``'s files and the PDSERVE_API_KEYS / PDSERVE_ADMIN_KEY env vars.

    Raises ConfigError for an unreadable file, a malformed or short key, or more than one admin key;
    the message names where the key came from, never the key.
    """
    api_keys = _keys(secret_env(API_KEYS_ENV).replace(",", "\n"), source=API_KEYS_ENV)
    admin_keys = _keys(secret_env(ADMIN_KEY_ENV), source=ADMIN_KEY_ENV)
    if spec.api_keys_file:
        api_keys += _keys(_read(spec.api_keys_file), source=f"gateway.api_keys_file ({spec.api_keys_file})")
    if spec.admin_key_file:
        admin_keys += _keys(_read(spec.admin_key_file), source=f"gateway.admin_key_file ({spec.admin_key_file})")
    if len(admin_keys) > 1:
        raise ConfigError(f"one admin key, not {len(admin_keys)} ({ADMIN_KEY_ENV} and gateway.admin_key_file)")
    return AccessKeys(api_keys=tuple(api_keys), admin_key=admin_keys[0] if admin_keys else None)


def _bearer_token(authorization: bytes | None) -> bytes:
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read key file {path}: {exc}") from exc


def _keys(text: str, *, source: str) -> list[bytes]:
    """One key per non-blank line; ``#`` starts a comment line."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not KEY_CHARS.fullmatch(key) or len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{source}: key {number} must be at least {MIN_KEY_CHARS} visible ASCII characters")
        keys.append(key.encode("ascii"))
    return keys
