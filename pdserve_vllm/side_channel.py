"""Runs inside every engine pdserve launches (installed by nixl_progress.py, its KV connector module): vLLM's NIXL
handshake side channel answers only a peer that holds the deployment's engine key, and outlives a malformed frame.

vLLM's listener (nixl/base_scheduler.py, ``NixlBaseConnectorScheduler._nixl_handshake_listener``) hands its
handshake, NIXL agent metadata with the KV cache's base addresses and block sizes, to whoever connects: enough to
read every registered KV block over NIXL. Its ZMQ ROUTER and the worker's REQ (base_worker.py,
``_nixl_handshake``) both come from ``zmq_ctx`` (nixl/utils.py), which each module looks up by name when it runs.
Here both modules' ``zmq_ctx`` is one that speaks CurveZMQ: the listener's keypair and the one client keypair are
derived from the engine key, so a peer without it can neither complete the handshake (it cannot know the server's
public key) nor pass the ZAP handler, which admits that client key alone. Everything else is vLLM's.

vLLM's listener decodes each frame with no guard (vLLM 0.32 base_scheduler.py:362, ``msgspec.msgpack.decode(msg)``,
and the unpacking at :356 and :362 and ``encoded_data[...]`` at :376): one malformed frame raises, its thread ends
and the engine never answers a handshake again. Here it is started again on the same address; requests queued on
the socket it closed are lost, and their peers' handshakes time out (5 s, base_worker.py:1044).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils as nixl_utils
from vllm.utils.network_utils import make_zmq_socket
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pdserve_vllm import ENGINE_KEY_ENV, read_engine_key

log = logging.getLogger(f"vllm.{__name__}")  # vLLM prints its own logger tree to the engine log

# What a frame from a peer can make vLLM's listener raise: DecodeError (a ValueError), a frame count or tuple of
# another length (ValueError), a non-tuple or unhashable rank (TypeError), a rank it has no metadata for (KeyError).
FRAME_ERRORS = (ValueError, TypeError, KeyError)
_SERVER_LABEL = b"pdserve nixl side channel: server\0"
_CLIENT_LABEL = b"pdserve nixl side channel: client\0"
Listener = Callable[[dict[tuple[int, int], Any], threading.Event, threading.Event, str, int], None]


class SideChannelNotKeyed(RuntimeError):
    """This vLLM or pyzmq is not what side_channel.py keys: the engine refuses to start with an open side channel."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded Curve25519 keypairs, derived from the engine key alone, so every engine of a deployment has them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(engine_key: str) -> CurveKeys:
    """The listener's and the client's keypairs: secrets are SHA-256 of the key under two labels (any 32 bytes are
    a Curve25519 secret key), publics follow from them (zmq.curve_public)."""
    server_secret = z85.encode(hashlib.sha256(_SERVER_LABEL + engine_key.encode()).digest())
    client_secret = z85.encode(hashlib.sha256(_CLIENT_LABEL + engine_key.encode()).digest())
    return CurveKeys(server_public=zmq.curve_public(server_secret), server_secret=server_secret,
                     client_public=zmq.curve_public(client_secret), client_secret=client_secret)


class _OneClient:
    """ZAP credentials provider (zmq.auth's ``configure_curve_callback``): the deployment's client key, no other."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._client_public)


@contextlib.contextmanager
def keyed_zmq_ctx(socket_type: Any, addr: str) -> Iterator[zmq.Socket[Any]]:
    """vLLM's ``zmq_ctx`` (a ROUTER bound at ``addr`` or a REQ connected to it, on a context of its own, destroyed
    after) with CurveZMQ from the engine key in ENGINE_KEY_ENV. Raises EngineKeyMissing without that key,
    SideChannelNotKeyed if the socket did not take CURVE."""
    if socket_type not in (zmq.ROUTER, zmq.REQ):
        raise ValueError(f"Unexpected socket type: {socket_type}")
    keys = curve_keys(read_engine_key(os.environ))
    is_server = socket_type == zmq.ROUTER
    ctx = zmq.Context()
    authenticator: ThreadAuthenticator | None = None
    try:
        _set_curve_defaults(ctx, keys, is_server=is_server)
        if is_server:  # ZAP: before the bind, so no connection is ever taken without it
            authenticator = ThreadAuthenticator(ctx)
            authenticator.start()
            authenticator.configure_curve_callback("*", credentials_provider=_OneClient(keys.client_public))
        sock: zmq.Socket[Any] = make_zmq_socket(ctx=ctx, path=addr, socket_type=socket_type, bind=is_server)
        if sock.getsockopt(zmq.MECHANISM) != zmq.CURVE:  # pyzmq drops a context default the socket refuses
            raise SideChannelNotKeyed(f"the NIXL side channel socket at {addr} did not take CURVE")
        yield sock
    finally:
        if authenticator is not None:
            authenticator.stop()
        ctx.destroy(linger=0)


def _set_curve_defaults(ctx: zmq.Context[Any], keys: CurveKeys, *, is_server: bool) -> None:
    """Socket options every socket of ``ctx`` starts with (set before vLLM's make_zmq_socket binds or connects)."""
    if is_server:
        ctx.setsockopt(zmq.CURVE_SERVER, 1)
        ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        return
    ctx.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def keep_listening(listener: Listener) -> Listener:
    """``listener`` (vLLM's, same arguments), started again at once whenever a peer's frame makes it raise."""

    @functools.wraps(listener)
    def listen(encoded_data: dict[tuple[int, int], Any], ready_event: threading.Event,
               stop_event: threading.Event, host: str, port: int) -> None:
        while True:
            try:
                return listener(encoded_data, ready_event, stop_event, host, port)
            except FRAME_ERRORS as exc:
                log.warning("NIXL side channel %s:%d: a malformed frame from a keyed peer (%s: %s); listening again "
                            "(pdserve)", host, port, type(exc).__name__, exc)

    return listen


# The vLLM names this module relies on, and the shape it expects of each (install() checks them all).
LISTENER_PARAMETERS = ["encoded_data", "ready_event", "stop_event", "host", "port"]
ZMQ_CTX = "zmq_ctx"  # the name base_scheduler.py and base_worker.py each import from nixl/utils.py
ZMQ_CTX_PARAMETERS = ["socket_type", "addr"]
MAKE_SOCKET_PARAMETERS = {"ctx", "path", "socket_type", "bind"}


def install() -> None:
    """Key this process's NIXL side channel: vLLM's listener and handshake take keyed_zmq_ctx, the listener is
    kept listening. Raises SideChannelNotKeyed, naming what differs, where vLLM or pyzmq is not as expected."""
    if all(vars(module)[ZMQ_CTX] is keyed_zmq_ctx for module in (base_scheduler, base_worker)):
        return
    listener = _vllm_listener()
    for module in (base_scheduler, base_worker):
        setattr(module, ZMQ_CTX, keyed_zmq_ctx)  # each module's own name, which its functions look up when they run
    scheduler: Any = base_scheduler.NixlBaseConnectorScheduler
    scheduler._nixl_handshake_listener = staticmethod(keep_listening(listener))
    log.info("NIXL side channel keyed: CurveZMQ with keys from %s, only peers holding it are answered; a malformed "
             "frame no longer stops it (pdserve)", ENGINE_KEY_ENV)


def _vllm_listener() -> Listener:
    """vLLM's listener function, once every name install() replaces is checked to be as this module expects."""
    _require(zmq.has("curve"), "pyzmq's libzmq has CURVE (zmq.has('curve'))")
    _require(_parameters(nixl_utils.zmq_ctx) == ZMQ_CTX_PARAMETERS,
             f"nixl.utils.zmq_ctx takes ({', '.join(ZMQ_CTX_PARAMETERS)})")
    _require(set(_parameters(make_zmq_socket)) >= MAKE_SOCKET_PARAMETERS,
             f"vllm.utils.network_utils.make_zmq_socket takes {sorted(MAKE_SOCKET_PARAMETERS)}")
    for module in (base_scheduler, base_worker):
        _require(vars(module).get(ZMQ_CTX) is nixl_utils.zmq_ctx, f"{module.__name__}.{ZMQ_CTX} is nixl.utils.zmq_ctx")
    listener = inspect.getattr_static(base_scheduler.NixlBaseConnectorScheduler, "_nixl_handshake_listener", None)
    _require(isinstance(listener, staticmethod) and _parameters(listener.__func__) == LISTENER_PARAMETERS
             and ZMQ_CTX in listener.__func__.__code__.co_names,
             f"NixlBaseConnectorScheduler._nixl_handshake_listener is a staticmethod "
             f"({', '.join(LISTENER_PARAMETERS)}) that opens its socket with zmq_ctx")
    handshake = getattr(base_worker.NixlBaseConnectorWorker, "_nixl_handshake", None)
    _require(inspect.isfunction(handshake) and ZMQ_CTX in handshake.__code__.co_names,
             "NixlBaseConnectorWorker._nixl_handshake opens its socket with zmq_ctx")
    assert isinstance(listener, staticmethod)  # for mypy: _require raised otherwise
    func: Listener = listener.__func__
    return func


def _parameters(function: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(function).parameters)


def _require(is_as_expected: bool, expectation: str) -> None:
    if not is_as_expected:
        raise SideChannelNotKeyed(f"pdserve: cannot key vLLM's NIXL side channel, which would answer anyone: "
                                  f"expected {expectation} (vLLM's connector changed?)")
