"""pdserve_vllm/side_channel.py on the installed vLLM's own handshake listener
(nixl/base_scheduler.py, ``_nixl_handshake_listener``) over real ZMQ sockets on loopback: only a peer holding the
engine key gets the NIXL handshake, and a malformed frame from one leaves the listener answering."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils as nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG, NixlHandshakePayload
from vllm.utils.network_utils import make_zmq_path
from zmq.utils.monitor import recv_monitor_message

from pdserve_vllm import ENGINE_KEY_ENV, EngineKeyMissing, side_channel
from pdserve_vllm.side_channel import SideChannelNotKeyed, curve_keys, keyed_zmq_ctx
from tests.conftest import free_port

KEY = "k" * 43
DEADLINE_S = 60.0  # for what the tests wait on: CI shares 2 cores
PAYLOAD = msgspec.msgpack.encode(NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"kv addresses"))
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@pytest.fixture
def as_shipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's names as vLLM ships them (an earlier import of nixl_progress may have keyed them), put back after."""
    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    for module in (base_scheduler, base_worker):
        monkeypatch.setattr(module, "zmq_ctx", nixl_utils.zmq_ctx)
    installed = inspect.getattr_static(base_scheduler.NixlBaseConnectorScheduler, "_nixl_handshake_listener")
    monkeypatch.setattr(base_scheduler.NixlBaseConnectorScheduler, "_nixl_handshake_listener",
                        staticmethod(inspect.unwrap(installed.__func__)))


@dataclass
class Listening:
    path: str
    thread: threading.Thread


@pytest.fixture
def listening(as_shipped: None) -> Iterator[Listening]:
    """vLLM's listener, keyed by side_channel.install(), serving PAYLOAD for (pp 0, tp 0) as its scheduler starts it."""
    side_channel.install()
    ready, stop, port = threading.Event(), threading.Event(), free_port()
    thread = threading.Thread(target=base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener,
                              args=({(0, 0): PAYLOAD}, ready, stop, "127.0.0.1", port), daemon=True)
    thread.start()
    assert ready.wait(DEADLINE_S)
    yield Listening(make_zmq_path("tcp", "127.0.0.1", port), thread)
    stop.set()
    thread.join(DEADLINE_S)


def worker_zmq_ctx() -> Callable[[int, str], AbstractContextManager[zmq.Socket[Any]]]:
    """The ``zmq_ctx`` vLLM's worker calls for its handshake (base_worker.py), keyed by install()."""
    found: Callable[[int, str], AbstractContextManager[zmq.Socket[Any]]] = vars(base_worker)["zmq_ctx"]
    return found


def ask(sock: zmq.Socket[Any], frame: bytes | None = None, *, wait_s: float = 2.0) -> list[bytes] | None:
    """Send vLLM's worker's query (or ``frame``); the reply's frames, or None if none came within ``wait_s``."""
    sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)) if frame is None else frame)
    return sock.recv_multipart() if sock.poll(int(wait_s * 1000)) else None


def keyed_answer(path: str) -> list[bytes]:
    """A keyed peer's reply, asking afresh until one comes: a listener started again drops what its old socket held."""
    deadline_s = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline_s:
        with worker_zmq_ctx()(zmq.REQ, path) as sock:
            if (reply := ask(sock)) is not None:
                return reply
    raise AssertionError(f"no reply from {path} in {DEADLINE_S} s")


def handshake_event(make: Callable[[zmq.Context[Any]], zmq.Socket[Any]]) -> tuple[int, list[bytes] | None]:
    """The first handshake event of a socket ``make`` connects (libzmq reconnects, so one comes however late the
    monitor starts), and what the socket read by then."""
    ctx = zmq.Context()
    try:
        sock = make(ctx)
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        assert monitor.poll(int(DEADLINE_S * 1000)), "no handshake event"
        event = recv_monitor_message(monitor)["event"]
        return event, sock.recv_multipart() if sock.poll(0) else None
    finally:
        ctx.destroy(linger=0)


def test_a_keyed_peer_gets_the_handshake_vllms_worker_decodes(listening: Listening) -> None:
    handshake, clock = keyed_answer(listening.path)
    assert handshake == PAYLOAD
    assert msgspec.msgpack.Decoder(NixlHandshakePayload).decode(handshake).agent_metadata_bytes == b"kv addresses"
    assert isinstance(msgspec.msgpack.decode(clock), float)  # the listener's perf_counter, as vLLM sends it


def test_an_anonymous_peer_fails_the_handshake_and_reads_nothing(listening: Listening) -> None:
    """What vLLM's own worker, and an attacker with pyzmq, connect with: no CURVE."""
    def anonymous(ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = ctx.socket(zmq.REQ)
        sock.connect(listening.path)
        return sock

    event, read = handshake_event(anonymous)  # the listener drops it at the mechanism mismatch: no detail here
    assert event & HANDSHAKE_FAILED and read is None


def test_a_peer_that_knows_the_servers_public_key_but_not_the_client_key_is_refused_by_zap(
        listening: Listening) -> None:
    def own_keys(ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        public, secret = zmq.curve_keypair()
        sock: zmq.Socket[Any] = ctx.socket(zmq.REQ)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_keys(KEY).server_public, public, secret
        sock.connect(listening.path)
        return sock

    assert handshake_event(own_keys) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, None)


def test_a_peer_keyed_from_another_engine_key_fails_the_handshake(listening: Listening) -> None:
    def other_deployment(ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        keys = curve_keys("another deployment's key")
        sock: zmq.Socket[Any] = ctx.socket(zmq.REQ)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            keys.server_public, keys.client_public, keys.client_secret)
        sock.connect(listening.path)
        return sock

    event, read = handshake_event(other_deployment)
    assert event & HANDSHAKE_FAILED and read is None


@pytest.mark.parametrize("frame", [b"\xc1", msgspec.msgpack.encode(7), msgspec.msgpack.encode([GET_META_MSG, 0]),
                                   msgspec.msgpack.encode([GET_META_MSG, [0], 0]),
                                   msgspec.msgpack.encode([GET_META_MSG, 5, 5])],
                         ids=["not msgpack", "not a tuple", "two items", "unhashable rank", "unknown rank"])
def test_a_malformed_frame_from_a_keyed_peer_leaves_the_listener_answering(
        listening: Listening, frame: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with worker_zmq_ctx()(zmq.REQ, listening.path) as sock:
        assert ask(sock, frame, wait_s=0) is None
        deadline_s = time.monotonic() + DEADLINE_S
        while "malformed frame from a keyed peer" not in caplog.text and time.monotonic() < deadline_s:
            time.sleep(0.05)
    assert "malformed frame from a keyed peer" in caplog.text
    assert keyed_answer(listening.path)[0] == PAYLOAD
    assert listening.thread.is_alive()


def test_without_the_engine_key_no_side_channel_socket_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    with pytest.raises(EngineKeyMissing, match=ENGINE_KEY_ENV), keyed_zmq_ctx(zmq.REQ, "tcp://127.0.0.1:1"):
        pass


def test_the_connector_refuses_to_be_made_without_the_engine_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before vLLM's constructor runs (the arguments here would fail it): its listener thread would fail instead,
    and vLLM's scheduler waits on that thread's ready event with no timeout."""
    from pdserve_vllm.nixl_progress import NixlConnector

    monkeypatch.setenv(ENGINE_KEY_ENV, "short")
    with pytest.raises(EngineKeyMissing, match=f"{ENGINE_KEY_ENV} is too short"):
        NixlConnector(None, None, None)


@pytest.mark.parametrize("name", ["base_scheduler.zmq_ctx", "base_worker.zmq_ctx", "_nixl_handshake_listener"])
def test_install_refuses_a_vllm_whose_names_differ_and_keys_nothing(as_shipped: None, name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def other(*_args: Any) -> None:
        raise AssertionError("not called")

    if name == "_nixl_handshake_listener":
        monkeypatch.setattr(base_scheduler.NixlBaseConnectorScheduler, name, staticmethod(other))
    else:
        monkeypatch.setattr(base_scheduler if name.startswith("base_scheduler") else base_worker, "zmq_ctx", other)
    with pytest.raises(SideChannelNotKeyed, match=name):
        side_channel.install()
    assert vars(base_scheduler)["zmq_ctx"] is not keyed_zmq_ctx


def test_keys_follow_from_the_engine_key_alone() -> None:
    assert curve_keys(KEY) == curve_keys(KEY)
    assert curve_keys(KEY).server_public != curve_keys(KEY + "x").server_public
    assert curve_keys(KEY).server_public != curve_keys(KEY).client_public
