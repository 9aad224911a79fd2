"""Where this host's commands (``status``, ``scale``, ``verify``) find the running gateway, and the one
line they say when it does not answer.

``pdserve up`` records the address it serves at in its run folder (``gateway.json`` beside the engines'
members file, engines/members.py), so ``pdserve up --port 9000`` is found without the flag again. The
commands send the admin key there, so a record is followed only to this config's own gateway address or to
loopback, and is kept 0600. Reads files only; the commands do the network calls.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.config import DEFAULT_LOG_ROOT, Settings
from pdserve.errors import GatewayUnavailable
from pdserve.gateway.exposure import is_loopback, is_wildcard

GATEWAY_FILE = "gateway.json"
GATEWAY_URL_FLAG = "--gateway-url"


@dataclass(frozen=True, slots=True)
class GatewayTarget:
    url: str
    source: str  # how it was found, for messages


def configured_url(settings: Settings) -> str:
    """The gateway's configured address as a client on this host reaches it (loopback for a wildcard)."""
    spec = settings.gateway
    host = "127.0.0.1" if is_wildcard(spec.host) else f"[{spec.host}]" if ":" in spec.host else spec.host
    return f"{spec.scheme}://{host}:{spec.port}"


def record_gateway(run_dir: Path, *, url: str) -> None:
    """Note that this process (``pdserve up``) serves at ``url``, in a file only its user may read or write;
    removed by ``forget_gateway``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    aside = run_dir / f".{GATEWAY_FILE}.{os.getpid()}"
    aside.unlink(missing_ok=True)  # one a killed process of the same pid left
    with os.fdopen(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(json.dumps({"url": url, "pid": os.getpid()}))
    aside.replace(run_dir / GATEWAY_FILE)


def forget_gateway(run_dir: Path) -> None:
    (run_dir / GATEWAY_FILE).unlink(missing_ok=True)


def find_gateway(settings: Settings, *, gateway_url: str | None) -> GatewayTarget:
    """``gateway_url`` if given; else the gateway a running ``pdserve up`` of this config recorded; else the
    only one a running ``pdserve up`` recorded under .pdserve/logs (started with another --port); else the
    configured address. Raises GatewayUnavailable when several run and none is this config's, or when the record
    names neither this config's gateway address nor loopback."""
    if gateway_url:
        return GatewayTarget(gateway_url.rstrip("/"), f"from {GATEWAY_URL_FLAG}")
    own = _live_record(settings.run_dir / GATEWAY_FILE)
    if own is not None:
        return recorded_target(own, settings, path=settings.run_dir / GATEWAY_FILE)
    others = {path: url for path in sorted(DEFAULT_LOG_ROOT.glob(f"*/run/{GATEWAY_FILE}"))
              if (url := _live_record(path)) is not None}
    if len(others) > 1:
        raise GatewayUnavailable(f"several `pdserve up` gateways run from this folder ({', '.join(others.values())}) "
                                 f"and none at this config's run folder {settings.run_dir}: pick one with "
                                 f"{GATEWAY_URL_FLAG} URL")
    if others:
        path, url = next(iter(others.items()))
        return recorded_target(url, settings, path=path)
    return GatewayTarget(configured_url(settings), "gateway.host and gateway.port of the config")


def recorded_target(url: str, settings: Settings, *, path: Path) -> GatewayTarget:
    """The gateway the record at ``path`` names, where the admin key may go: this config's own gateway address
    (configured_url) or a loopback one. Raises GatewayUnavailable for any other."""
    named, own = urlsplit(url), urlsplit(configured_url(settings))
    is_own = (named.scheme, named.netloc) == (own.scheme, own.netloc)
    if is_own or (named.scheme in ("http", "https") and is_loopback(named.hostname or "")):
        return GatewayTarget(url, f"recorded by `pdserve up` in {path}")
    raise GatewayUnavailable(f"{path} names the gateway {url!r}, which is neither this config's ({own.geturl()}) nor "
                             f"on loopback: not sending it the admin key; if that gateway is yours, give "
                             f"{GATEWAY_URL_FLAG} URL")


def unreachable(target: GatewayTarget, reason: str) -> GatewayUnavailable:
    """The one-line error for a gateway that does not answer at ``target``."""
    return GatewayUnavailable(f"no gateway answers at {target.url} ({target.source}): {reason}; start it with "
                              f"`pdserve up`, or point at another with {GATEWAY_URL_FLAG} URL")


def _live_record(path: Path) -> str | None:
    """The URL in a gateway record whose ``pdserve up`` still runs; None otherwise. A record of this user's that
    others may read (an older pdserve's) is made 0600."""
    try:
        record = json.loads(path.read_text())
        url, pid = str(record["url"]), int(record["pid"])
        status = path.stat()
        if status.st_uid == os.getuid() and stat.S_IMODE(status.st_mode) & 0o077:
            path.chmod(0o600)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # runs, as another user
    return url
