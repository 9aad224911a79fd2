"""Where this host's commands (``status``, ``scale``, ``verify``) find the running gateway, and the one
line they say when it does not answer.

``pdserve up`` records the address it serves at in its run folder (``gateway.json`` beside the engines'
members file, engines/members.py), so ``pdserve up --port 9000`` is found without the flag again. Reads
files only; the commands do the network calls.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import DEFAULT_LOG_ROOT, Settings
from pdserve.errors import GatewayUnavailable

GATEWAY_FILE = "gateway.json"
GATEWAY_URL_FLAG = "--gateway-url"


@dataclass(frozen=True, slots=True)
class GatewayTarget:
    url: str
    source: str  # how it was found, for messages


def configured_url(settings: Settings) -> str:
    """The gateway's configured address as a client on this host reaches it (loopback for a wildcard)."""
    host = "127.0.0.1" if settings.gateway.host in ("0.0.0.0", "::") else settings.gateway.host
    return f"http://{host}:{settings.gateway.port}"


def record_gateway(run_dir: Path, *, url: str) -> None:
    """Note that this process (``pdserve up``) serves at ``url``; removed by ``forget_gateway``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    aside = run_dir / f".{GATEWAY_FILE}.{os.getpid()}"
    aside.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    aside.replace(run_dir / GATEWAY_FILE)


def forget_gateway(run_dir: Path) -> None:
    (run_dir / GATEWAY_FILE).unlink(missing_ok=True)


def find_gateway(settings: Settings, *, gateway_url: str | None) -> GatewayTarget:
    """``gateway_url`` if given; else the gateway a running ``pdserve up`` of this config recorded; else the
    only one a running ``pdserve up`` recorded under .pdserve/logs (started with another --port); else the
    configured address. Raises GatewayUnavailable when several run and none is this config's."""
    if gateway_url:
        return GatewayTarget(gateway_url.rstrip("/"), f"from {GATEWAY_URL_FLAG}")
    own = _live_record(settings.run_dir / GATEWAY_FILE)
    if own is not None:
        return GatewayTarget(own, f"recorded by `pdserve up` in {settings.run_dir / GATEWAY_FILE}")
    others = {path: url for path in sorted(DEFAULT_LOG_ROOT.glob(f"*/run/{GATEWAY_FILE}"))
              if (url := _live_record(path)) is not None}
    if len(others) > 1:
        raise GatewayUnavailable(f"several `pdserve up` gateways run from this folder ({', '.join(others.values())}) "
                                 f"and none at this config's run folder {settings.run_dir}: pick one with "
                                 f"{GATEWAY_URL_FLAG} URL")
    if others:
        path, url = next(iter(others.items()))
        return GatewayTarget(url, f"recorded by `pdserve up` in {path}")
    return GatewayTarget(configured_url(settings), "gateway.host and gateway.port of the config")


def unreachable(target: GatewayTarget, reason: str) -> GatewayUnavailable:
    """The one-line error for a gateway that does not answer at ``target``."""
    return GatewayUnavailable(f"no gateway answers at {target.url} ({target.source}): {reason}; start it with "
                              f"`pdserve up`, or point at another with {GATEWAY_URL_FLAG} URL")


def _live_record(path: Path) -> str | None:
    """The URL in a gateway record whose ``pdserve up`` still runs; None otherwise."""
    try:
        record = json.loads(path.read_text())
        url, pid = str(record["url"]), int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # runs, as another user
    return url
