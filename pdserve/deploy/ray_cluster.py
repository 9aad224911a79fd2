"""``pdserve ray up|down``: put the Serve config that ``pdserve render serve`` prints on a
running Ray cluster through its dashboard (as ``serve deploy`` does), wait with progress until
every replica runs, and send one request through both legs before saying ready.

Other applications on the cluster are kept: Serve's declarative API replaces the whole set,
so their deployed configs are sent back with ours.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

from pdserve.config import Settings
from pdserve.deploy.serve import serve_config
from pdserve.errors import DeployError, EngineStartFailed
from pdserve.gateway_config import NODE_HOST
from pdserve.up import ready_line, wait_ready

POLL_S = 2.0
PROGRESS_EVERY_S = 10.0
T = TypeVar("T")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


async def ray_up(settings: Settings, *, progress: Callable[[str], None]) -> None:
    """Deploy (or update) the application and return once it answers through both legs.

    Raises DeployError when the cluster refuses it, a deployment fails, or it is not
    serving within ``ray.deploy_timeout_s``.
    """
    started_s = time.monotonic()
    client = await _ask(ServeSubmissionClient, settings.ray.address)
    config = serve_config(settings)
    [ours] = config["applications"]
    config["applications"] = [*_other_app_configs(await _ask(client.get_serve_details), ours["name"]), ours]
    await _ask(client.deploy_applications, config)
    progress(f"serveapplication/{ours['name']} submitted to {settings.ray.address}")
    deadline_s = started_s + settings.ray.deploy_timeout_s
    await _until_running(client, ours["name"], deadline_s=deadline_s, progress=progress)
    base_url = gateway_url(settings)
    async with aiohttp.ClientSession() as session:
        await _ready_until(session, base_url, deadline_s=deadline_s, progress=progress)
    progress(ready_line(base_url, settings.model.served_name, time.monotonic() - started_s))


async def ray_down(settings: Settings, *, progress: Callable[[str], None]) -> None:
    """Remove the application (engines stop with their replicas); other applications stay."""
    client = await _ask(ServeSubmissionClient, settings.ray.address)
    name = settings.ray.app_name
    details = await _ask(client.get_serve_details)
    if name not in details.get("applications", {}):
        progress(f"serveapplication/{name} not found on {settings.ray.address}: nothing to do")
        return
    others = _other_app_configs(details, name)
    if others:
        await _ask(client.deploy_applications, {"applications": others})
    else:
        await _ask(client.delete_applications)
    deadline_s = time.monotonic() + settings.ray.deploy_timeout_s
    while name in (await _ask(client.get_serve_details)).get("applications", {}):
        if time.monotonic() > deadline_s:
            raise DeployError(f"serveapplication/{name} still present after {settings.ray.deploy_timeout_s:.0f} s")
        await asyncio.sleep(POLL_S)
    progress(f"serveapplication/{name} deleted")


def gateway_url(settings: Settings) -> str:
    """Where clients reach the gateway: its configured address, or the head's if it binds all or
    each replica its node's (``node``: then the replica on the head)."""
    host = settings.gateway.host
    if host in (*WILDCARD_HOSTS, NODE_HOST):
        host = urlsplit(settings.ray.address).hostname or "127.0.0.1"
    return f"http://{host}:{settings.gateway.port}"


def replica_summary(app: dict[str, Any]) -> str:
    """One line: each deployment's replica states, e.g. ``prefill 1 RUNNING  decode 1 STARTING``. Pure."""
    parts = []
    for name, deployment in sorted(app.get("deployments", {}).items()):
        states = Counter(replica.get("state", "?") for replica in deployment.get("replicas", []))
        described = ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "no replicas"
        parts.append(f"{name} {described}")
    return "  ".join(parts)


def deployment_problems(app: dict[str, Any]) -> str:
    """Each unhealthy or failed deployment's own message, one indented line each (empty if none). Pure."""
    return "".join(f"\n    {name}: {deployment.get('message', '').strip()}"
                   for name, deployment in sorted(app.get("deployments", {}).items())
                   if deployment.get("status") in ("UNHEALTHY", "DEPLOY_FAILED"))


async def _ask(call: Callable[..., T], *args: Any) -> T:
    """One blocking dashboard call off the loop; its failures become a DeployError that says so."""
    try:
        return await asyncio.to_thread(call, *args)
    except (OSError, RuntimeError, ValueError) as exc:  # requests' errors are OSErrors; the SDK raises the rest
        raise DeployError(f"the Ray dashboard refused or did not answer (ray.address): {exc}") from exc


def _other_app_configs(details: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The configs of the cluster's other applications, which a declarative deploy must resend."""
    others = []
    for other_name, app in details.get("applications", {}).items():
        if other_name == name:
            continue
        config = app.get("deployed_app_config")
        if not config:
            raise DeployError(f"application {other_name!r} was deployed without a config (serve.run); deploying "
                              f"pdserve declaratively would remove it. Deploy it from a config file first.")
        others.append(config)
    return others


async def _until_running(
    client: ServeSubmissionClient, name: str, *, deadline_s: float, progress: Callable[[str], None]
) -> None:
    last_line, last_report_s = "", 0.0
    while True:
        app = (await _ask(client.get_serve_details)).get("applications", {}).get(name, {})
        status = app.get("status", "NOT_STARTED")
        if status == "RUNNING":
            progress(f"  {status:<12} {replica_summary(app)}")
            return
        if status == "DEPLOY_FAILED":
            raise DeployError(f"serveapplication/{name} is {status}: {app.get('message', '')}{deployment_problems(app)}")
        line = f"  {status:<12} {replica_summary(app)}"
        if status == "UNHEALTHY":  # Serve replaces the replica that failed its health check; say why, wait on
            line += deployment_problems(app)
        if line != last_line or time.monotonic() - last_report_s >= PROGRESS_EVERY_S:
            progress(line)
            last_line, last_report_s = line, time.monotonic()
        if time.monotonic() > deadline_s:
            raise DeployError(f"serveapplication/{name} not running in time (ray.deploy_timeout_s); last: {line.strip()}")
        await asyncio.sleep(POLL_S)


async def _ready_until(
    session: aiohttp.ClientSession, base_url: str, *, deadline_s: float, progress: Callable[[str], None]
) -> None:
    """Engines register with the gateway on their first health check, so its first warm-ups may fail."""
    while True:
        try:
            await wait_ready(session, base_url, progress, timeout_s=max(deadline_s - time.monotonic(), 0.0))
            return
        except (EngineStartFailed, aiohttp.ClientError) as exc:
            if time.monotonic() > deadline_s:
                raise DeployError(f"gateway at {base_url} never became ready: {exc}") from exc
        await asyncio.sleep(POLL_S)
