"""Run the gateway app under uvicorn inside the caller's event loop: in this process, or as
``gateway.workers`` processes on one port (gateway/workers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import uvicorn
import uvloop
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from pdserve.access_config import AccessSpec
from pdserve.config import Settings
from pdserve.engine_key import EngineKey, load_engine_key
from pdserve.engines.members import MembersFolder
from pdserve.errors import ConfigError, EngineStartFailed
from pdserve.gateway.app import build_app
from pdserve.gateway.client_reply import TRANSPORT_EXTENSION, OfferedConnection
from pdserve.gateway.connections import ClientConnections, ConnectionLimits, connection_limits, limits_of
from pdserve.gateway.exposure import gateway_keys
from pdserve.gateway.workers import SharedHealth, Worker, reuseport_socket
from pdserve.gateway_config import NODE_HOST, GatewaySpec
from pdserve.logs import logging_off_the_loop

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application


class GatewayServer(Protocol):
    """What ``pdserve up`` and ``serve`` need of a server: uvicorn.Server's shape."""

    started: bool
    should_exit: bool

    async def serve(self) -> None: ...


def make_gateway_server(settings: Settings, *, members: MembersFolder | None = None,
                        handle_signals: bool = False, engine_key: EngineKey | None = None) -> GatewayServer:
    """The configured gateway: one uvicorn server here, or ``gateway.workers`` processes.
    ``members``: the engines `pdserve up` launched, which `pdserve scale` resizes. ``engine_key``: the key those
    engines require; None = the one given, or kept by a `pdserve up` of ``settings`` (engine_key.py)."""
    spec = settings.gateway
    if engine_key is None:
        engine_key = load_engine_key(spec, run_dir=settings.run_dir)  # a bad key file fails here, before any worker
    if spec.host == NODE_HOST:
        raise ConfigError(f"gateway.host: {NODE_HOST} is for Ray, where each replica binds its node's address; here "
                          "give the address to bind (127.0.0.1, or 0.0.0.0 for every interface)")
    if spec.workers > 1:
        gateway_keys(settings)  # raises ConfigError here, before any worker starts (each checks again, quietly)
        return GatewayWorkers(settings, members=members, handle_signals=handle_signals, engine_key=engine_key)
    return make_server(build_app(settings, members=members, engine_key=engine_key), host=spec.host, port=spec.port,
                       tls=spec, limits=connection_limits(settings), handle_signals=handle_signals)


class TransportOffering(HttpToolsProtocol):
    """uvicorn's httptools protocol, also offering the app each request's client connection as the
    scope extension TRANSPORT_EXTENSION: its ``transport``, which the completion routes write relayed
    chunks to directly, and ``lost``, a future done once the connection is lost, which cancels their
    work with no watcher task per request (gateway/client_reply.py, gateway/disconnect.py). An app that
    ignores the extension sees plain uvicorn.

    Each connection is also held to the limits of gateway/connections.py (``connections``) before its
    request reaches the app. Those on the request line and headers act before httptools sees the bytes:
    uvicorn's ``data_received`` feeds every read whole to ``parser.feed_data`` (uvicorn 0.55,
    protocols/http/httptools_impl.py:169-183), and the size check in app.py runs only once the headers
    are complete, after ``on_url`` has grown ``self.url`` by one copy per read (``self.url += url``,
    :238-239): quadratic in a long line. uvicorn's keep-alive timer is armed only once a response
    ends (:343), so before the first request a connection had no deadline at all.
    """

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, connections: ClientConnections) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._client_connections = connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lost: asyncio.Future[None] = self.loop.create_future()
        self._offer: OfferedConnection = {"transport": transport, "lost": self._lost}
        self._connection = self._client_connections.watch(transport, self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connection.lost()
        if not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        while data and not self.transport.is_closing():
            part = self._connection.take(data)  # b"": the request head ran past its limit (431, closing)
            if not part:
                return
            super().data_received(part)
            data = data[len(part):]

    def on_headers_complete(self) -> None:
        refusal = self._connection.headers_complete(self.headers)
        if refusal is not None:  # the connection's last request: the refusal closes it
            self.app = cast("ASGI3Application", refusal)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._connection.message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle.response_complete:  # else a pipelined request started
            self._connection.response_complete()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {TRANSPORT_EXTENSION: cast("dict[object, object]", self._offer)}  # uvicorn's type


def make_server(app: ASGIApp, *, host: str, port: int, tls: GatewaySpec | None = None,
                limits: ConnectionLimits | None = None, handle_signals: bool = False) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve()`` runs it until ``should_exit``.
    ``tls``: HTTPS with its ssl_certfile and ssl_keyfile, where set. ``limits``: what a client connection
    may hold (gateway/connections.py; the gateway's: ``connection_limits``); default, the configuration's
    defaults with no open-file cap and no keys.

    httptools parses HTTP in C, and the app is offered each connection's transport (TransportOffering);
    access logs are off because the gateway logs one line per leg.
    uvicorn's own records (warnings and up) go to the root logger, so they come out in the chosen
    log format, written off the loop like the rest (logs.py).
    No X-Forwarded-* rewriting: the gateway never uses the client's address, so that layer would
    only cost time on every request. No WebSocket: the gateway has no such route, and an upgraded
    connection would leave this protocol, and its limits, behind (uvicorn's handle_websocket_upgrade
    hands the transport to another protocol, httptools_impl.py:185-203).
    Unless ``handle_signals``, signals stay with the caller (``pdserve up`` has engines to stop).
    """
    limits = limits or limits_of(GatewaySpec(), AccessSpec())
    protocol = functools.partial(TransportOffering, connections=ClientConnections(limits))
    config = uvicorn.Config(
        app, host=host, port=port, http=cast("type[asyncio.Protocol]", protocol), ws="none", loop="none", lifespan="on",
        access_log=False, log_level="warning", log_config=None, backlog=4096,
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  # a float: uvicorn hands it to call_later
        proxy_headers=False, server_header=False,
        ssl_certfile=tls.ssl_certfile if tls else None, ssl_keyfile=tls.ssl_keyfile if tls else None,
    )
    server = uvicorn.Server(config)
    if not handle_signals:
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    return server


class GatewayWorkers:
    """The parent of ``settings.gateway.workers`` gateway processes; shaped like uvicorn.Server
    (``serve()``, ``started``, ``should_exit``) so ``pdserve up`` and ``serve`` run either.

    ``serve()`` returns when ``should_exit`` is set (or, with ``handle_signals``, on SIGINT or
    SIGTERM) and raises EngineStartFailed when a worker exits on its own; it stops them all.
    """

    def __init__(self, settings: Settings, *, members: MembersFolder | None = None,
                 handle_signals: bool = False, engine_key: EngineKey) -> None:
        self._settings, self._members, self._handle_signals = settings, members, handle_signals
        self._engine_key = engine_key  # handed to each worker through multiprocessing's pipe, never argv or env
        self.started = False
        self._exit = asyncio.Event()  # set by should_exit, a signal, or a worker's exit: no polling while serving
        self._exited: multiprocessing.process.BaseProcess | None = None  # the worker that ended on its own

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()

    async def serve(self) -> None:
        spec = self._settings.gateway
        run_dir = Path(tempfile.mkdtemp(prefix="pdserve-gateway-"))
        health = SharedHealth(self._settings)
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=_worker_main, name=f"pdserve-gateway-{index}", daemon=True,
                                     args=(self._settings, Worker(index, spec.workers, run_dir, health), os.getpid(),
                                           self._members, self._engine_key))
                     for index in range(spec.workers)]
        loop = asyncio.get_running_loop()
        if self._handle_signals:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self._exit.set)
        watched: list[int] = []
        try:
            for process in processes:
                process.start()
                loop.add_reader(process.sentinel, self._on_exit, process)  # readable once the process ends
                watched.append(process.sentinel)
            while not self.started and not self.should_exit:
                self.started = all((run_dir / f"ready-{index}").exists() for index in range(spec.workers))
                await asyncio.sleep(0.1)
            await self._exit.wait()
            if (exited := self._exited) is not None:
                raise EngineStartFailed(f"gateway worker {exited.name} exited ({exited.exitcode}); "
                                        f"is {spec.host}:{spec.port} taken?")
        finally:
            for sentinel in watched:
                loop.remove_reader(sentinel)
            await asyncio.to_thread(_stop, processes)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _on_exit(self, process: multiprocessing.process.BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(process.sentinel)
        if not self.should_exit:  # not one we are stopping; the first such exit stops the rest
            self._exited = process
            self._exit.set()


def _stop(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()  # SIGTERM: uvicorn finishes the streams it can, then exits
    for process in processes:
        process.join(10.0)
        if process.is_alive():
            process.kill()
            process.join()


def _worker_main(settings: Settings, worker: Worker, parent_pid: int, members: MembersFolder | None,
                 engine_key: EngineKey) -> None:
    """One worker process: the gateway app under uvicorn on a SO_REUSEPORT socket."""
    with logging_off_the_loop(logging.INFO, log_format=settings.launch.log_format), \
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve_worker(settings, worker, parent_pid, members, engine_key))


async def _serve_worker(settings: Settings, worker: Worker, parent_pid: int, members: MembersFolder | None,
                        engine_key: EngineKey) -> None:
    spec = settings.gateway
    sock = reuseport_socket(spec.host, spec.port)
    app = build_app(settings, worker=worker, members=members, engine_key=engine_key)
    server = make_server(app, host=spec.host, port=spec.port, tls=spec, limits=connection_limits(settings))
    # The parent decides when to stop (SIGTERM); a terminal's Ctrl-C reaches it, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    def stop() -> None:
        server.should_exit = True

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    is_ready_said = False
    try:
        while not serving.done():
            if server.started and not is_ready_said:
                (worker.run_dir / f"ready-{worker.index}").touch()
                is_ready_said = True
            if os.getppid() != parent_pid:  # the parent was killed: do not linger on the port
                server.should_exit = True
            await asyncio.wait({serving}, timeout=0.5)
        serving.result()
    finally:
        sock.close()
