"""Whether a gateway may serve as configured: who can reach it (its bind address), who may use it (keys,
``access.open``) and its TLS files. Every way a gateway starts calls ``gateway_keys`` before it serves:
`pdserve up` and `serve` (gateway/server.py), each gateway worker and the Ray replica (gateway/app.py)."""

from __future__ import annotations

import ipaddress
import logging
import ssl
from urllib.parse import urlsplit

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV, AccessKeys, load_access_keys
from pdserve.config import Settings
from pdserve.errors import ConfigError
from pdserve.gateway_config import GatewaySpec

log = logging.getLogger(__name__)
LOOPBACK_NAME = "localhost"


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 with or without brackets) reaches this machine only: 127.0.0.0/8,
    ::1 or localhost. A wildcard (0.0.0.0, ::), any other name and ``node`` (Ray) are not. Pure."""
    name = host.strip("[]").rstrip(".").lower()
    if name == LOOPBACK_NAME:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """``host`` binds every interface (0.0.0.0, ::). Pure."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def names_gateway(host_header: str, *, bound_host: str) -> bool:
    """Whether a request's ``Host`` names the gateway bound to ``bound_host``: that name or address, a loopback
    one (on loopback, or through a port forward), or any IP address when bound to every interface. Never another
    domain: a page that DNS rebinding points at the gateway sends its own. Pure."""
    name = urlsplit(f"//{host_header}").hostname or ""
    if not name or name == bound_host.strip("[]").lower() or is_loopback(name):
        return bool(name)
    return is_wildcard(bound_host) and _is_address(name)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def gateway_keys(settings: Settings, *, say_open: bool = True) -> AccessKeys:
    """The gateway's access keys, once it is known the gateway may serve as configured.

    Raises ConfigError for unreadable or malformed keys, TLS files that do not load, and a gateway bound to
    anything but loopback with no key while ``access.open`` is false. ``say_open``: log the WARNING that a
    gateway open beyond loopback gets (once per deployment: gateway workers leave it to their parent).
    """
    spec = settings.gateway
    keys = load_access_keys(spec)
    check_tls_files(spec)
    if keys.is_open and not is_loopback(spec.host):
        if not settings.access.open:
            raise ConfigError(
                f"gateway.host {spec.host} is not loopback and no key is set: set {API_KEYS_ENV} (comma-separated) or "
                f"gateway.api_keys_file, and {ADMIN_KEY_ENV} or gateway.admin_key_file for the engine views; or set "
                "access.open: true, which lets anyone who reaches the gateway use every route with no key, "
                "engine listings, metrics and /admin/scale included")
        if say_open:
            log.warning("the gateway on %s:%d is open (access.open: true, no key set): anyone who reaches it may use "
                        "every route, engine listings, metrics and /admin/scale included", spec.host, spec.port)
    return keys


def check_tls_files(spec: GatewaySpec) -> None:
    """Raises ConfigError unless gateway.ssl_certfile and ssl_keyfile (when set) load as a certificate chain and
    its key; an encrypted key is refused (uvicorn would wait for its password on the terminal)."""
    if not spec.ssl_certfile:
        return
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(spec.ssl_certfile, spec.ssl_keyfile, password=_no_password)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"gateway.ssl_certfile {spec.ssl_certfile} with gateway.ssl_keyfile {spec.ssl_keyfile}: "
                          f"cannot load them ({exc}); give a readable PEM chain and its unencrypted key") from exc


def _no_password() -> bytes:
    return b""
