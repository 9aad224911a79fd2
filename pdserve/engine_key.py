"""The per-deployment key every engine pdserve launches requires (pdserve_vllm/engine_key.py, vLLM's /v1 guard):
where it comes from, the file `pdserve up` keeps it in, what carries it to engines. Never in Settings (shipped to
Ray, rendered into manifests), argv (``ps`` shows argv), a log, or anything sent to clients."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdserve.access import KEY_CHARS, MIN_KEY_CHARS
from pdserve.config import secret_env
from pdserve.errors import ConfigError
from pdserve.gateway_config import GatewaySpec
from pdserve_vllm import ENGINE_KEY_ENV

KEY_FILE = "engine.key"  # in the run folder (Settings.run_dir) while `pdserve up` runs, mode 0600
# vLLM's own API key (vllm/envs.py), which guards its /v1 routes (entrypoints/serve/middleware/register.py): given the
# same key, vLLM's guard and pdserve's agree, and no /v1 route is ever open.
VLLM_API_KEY_ENV = "VLLM_API_KEY"
GENERATED_KEY_BYTES = 32  # secrets.token_urlsafe(32): 256 random bits, 43 characters


@dataclass(frozen=True, slots=True)
class EngineKey:
    """The key, or '' for engines that require none (engines at ``urls`` started without one)."""

    value: str = field(default="", repr=False)

    def headers(self) -> dict[str, str]:
        """What every call pdserve makes to an engine carries."""
        return {"Authorization": f"Bearer {self.value}"} if self.value else {}

    def engine_env(self) -> dict[str, str]:
        """What an engine's environment gets: pdserve_vllm reads ENGINE_KEY_ENV, vLLM VLLM_API_KEY."""
        return {ENGINE_KEY_ENV: self.value, VLLM_API_KEY_ENV: self.value} if self.value else {}


NO_ENGINE_KEY = EngineKey()  # engines at ``urls`` started without a key


def given_engine_key(spec: GatewaySpec) -> EngineKey | None:
    """PDSERVE_ENGINE_KEY, else ``spec.engine_key_file``'s, else None. Raises ConfigError for an unreadable file
    or a malformed key, naming where it came from, never the key."""
    if value := secret_env(ENGINE_KEY_ENV).strip():
        return _checked(value, source=ENGINE_KEY_ENV)
    if spec.engine_key_file:
        source = f"gateway.engine_key_file ({spec.engine_key_file})"
        return _checked(_read(Path(spec.engine_key_file), source=source), source=source)
    return None


def load_engine_key(spec: GatewaySpec, *, run_dir: Path) -> EngineKey:
    """The key of engines already running, for the gateway and this host's tools: the given one, else the one a
    `pdserve up` of this configuration keeps in ``run_dir``, else none. Raises ConfigError as given_engine_key."""
    given = given_engine_key(spec)
    if given is not None:
        return given
    path = run_dir / KEY_FILE
    if not path.exists():
        return NO_ENGINE_KEY
    return _checked(_read(path, source=str(path)), source=str(path))


@contextlib.contextmanager
def deployment_engine_key(spec: GatewaySpec, *, run_dir: Path) -> Iterator[EngineKey]:
    """The key of the engines pdserve is about to launch: the given one, else a new one, written to ``run_dir``
    (mode 0600) for this host's tools (`pdserve verify`, `serve`) and removed when the block ends."""
    given = given_engine_key(spec)
    if given is not None:
        yield given
        return
    key, path = EngineKey(secrets.token_urlsafe(GENERATED_KEY_BYTES)), run_dir / KEY_FILE
    _write_private(path, key.value)
    try:
        yield key
    finally:
        path.unlink(missing_ok=True)


def engine_session(key: EngineKey) -> aiohttp.ClientSession:
    """An aiohttp session for pdserve's control-plane calls to engines (health, metrics, model cards): the key on
    every request, given once. No cookie jar: an engine's Set-Cookie must never ride along."""
    return aiohttp.ClientSession(headers=key.headers(), cookie_jar=aiohttp.DummyCookieJar())


def _checked(value: str, *, source: str) -> EngineKey:
    if not KEY_CHARS.fullmatch(value) or len(value) < MIN_KEY_CHARS:
        raise ConfigError(f"{source}: the engine key must be one line of at least {MIN_KEY_CHARS} visible ASCII "
                          f"characters")
    return EngineKey(value)


def _read(path: Path, *, source: str) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the engine key from {source}: {exc}") from exc


def _write_private(path: Path, text: str) -> None:
    """``text`` in ``path``, readable by this user alone from its first byte (created 0600, then moved in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.unlink(missing_ok=True)
    with os.fdopen(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="ascii") as file:
        file.write(text + "\n")
    aside.replace(path)
