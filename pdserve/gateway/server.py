"""Run the gateway app under uvicorn inside the caller's event loop: in this process, or as
``gateway.workers`` processes on one port (gateway/workers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

import uvicorn
import uvloop
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.access import load_access_keys
from pdserve.config import Settings
from pdserve.engines.members import MembersFolder
from pdserve.errors import ConfigError, EngineStartFailed
from pdserve.gateway.app import build_app
from pdserve.gateway.client_reply import TRANSPORT_EXTENSION, OfferedConnection
from pdserve.gateway.workers import SharedHealth, Worker, reuseport_socket
from pdserve.gateway_config import NODE_HOST
from pdserve.logs import logging_off_the_loop


class GatewayServer(Protocol):
    """What ``pdserve up`` and ``serve`` need of a server: uvicorn.Server's shape."""

    started: bool
    should_exit: bool

    async def serve(self) -> None: ...


def make_gateway_server(settings: Settings, *, members: MembersFolder | None = None,
                        handle_signals: bool = False) -> GatewayServer:
    """The configured gateway: one uvicorn server here, or ``gateway.workers`` processes.
    ``members``: the engines `pdserve up` launched, which `pdserve scale` resizes."""
    spec = settings.gateway
    if spec.host == NODE_HOST:
        raise ConfigError(f"gateway.host: {NODE_HOST} is for Ray, where each replica binds its node's address; here "
                          "give the address to bind (127.0.0.1, or 0.0.0.0 for every interface)")
    if spec.workers > 1:
        load_access_keys(spec)  # raises ConfigError here, before any worker starts, on bad access keys
        return GatewayWorkers(settings, members=members, handle_signals=handle_signals)
    return make_server(build_app(settings, members=members), host=spec.host, port=spec.port,
                       handle_signals=handle_signals)


class TransportOffering(HttpToolsProtocol):
    """uvicorn's httptools protocol, also offering the app each request's client connection as the
    scope extension TRANSPORT_EXTENSION: its ``transport``, which the completion routes write relayed
    chunks to directly, and ``lost``, a future done once the connection is lost, which cancels their
    work with no watcher task per request (gateway/client_reply.py, gateway/disconnect.py). An app that
    ignores the extension sees plain uvicorn."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lost: asyncio.Future[None] = self.loop.create_future()
        self._offer: OfferedConnection = {"transport": transport, "lost": self._lost}

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self._lost.done():
            self._lost.set_result(None)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {TRANSPORT_EXTENSION: cast("dict[object, object]", self._offer)}  # uvicorn's type


def make_server(app: ASGIApp, *, host: str, port: int, handle_signals: bool = False) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``await server.serve()`` runs it until ``should_exit``.

    httptools parses HTTP in C, and the app is offered each connection's transport (TransportOffering);
    access logs are off because the gateway logs one line per leg.
    uvicorn's own records (warnings and up) go to the root logger, so they come out in the chosen
    log format, written off the loop like the rest (logs.py).
    No X-Forwarded-* rewriting: the gateway never uses the client's address, so that layer would
    only cost time on every request.
    Unless ``handle_signals``, signals stay with the caller (``pdserve up`` has engines to stop).
    """
    config = uvicorn.Config(
        app, host=host, port=port, http=TransportOffering, loop="none", lifespan="on",
        access_log=False, log_level="warning", log_config=None, timeout_keep_alive=30, backlog=4096,
        proxy_headers=False, server_header=False,
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
                 handle_signals: bool = False) -> None:
        self._settings, self._members, self._handle_signals = settings, members, handle_signals
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
                                           self._members))
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


def _worker_main(settings: Settings, worker: Worker, parent_pid: int, members: MembersFolder | None) -> None:
    """One worker process: the gateway app under uvicorn on a SO_REUSEPORT socket."""
    with logging_off_the_loop(logging.INFO, log_format=settings.launch.log_format), \
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve_worker(settings, worker, parent_pid, members))


async def _serve_worker(settings: Settings, worker: Worker, parent_pid: int, members: MembersFolder | None) -> None:
    spec = settings.gateway
    sock = reuseport_socket(spec.host, spec.port)
    server = make_server(build_app(settings, worker=worker, members=members), host=spec.host, port=spec.port)
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
